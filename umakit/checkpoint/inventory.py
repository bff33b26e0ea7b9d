"""The models on this machine umakit can load without a download: what `umakit ls` lists and `umakit rm` removes.

Two places hold them. ``$UMAKIT_HOME/models`` holds umakit's own imports: the
built-in model, `umakit import` outputs, and GGUF files imported on first use
(``models/gguf/<file stem>-<key>``) and GPTQ, AWQ or compressed-tensors checkpoints
(``models/imported/<name>-<key>``). The Hugging Face cache holds the Hub
snapshots `umakit.load("org/name")` downloaded; those with a config.json are
listed. An import is named by its directory's name, which `umakit.load` and a
server's ``model`` field take as a short alias (`find`); a Hub snapshot by
its repo id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from umakit.core.home import packings, umakit_home
from umakit.core import affine
from umakit.checkpoint.hfquant.detect import foreign_block, native_block
from umakit.errors import ModelNotFoundError

IMPORTS, HUB = "import", "hub"


@dataclass(frozen=True)
class LocalModel:
    name: str  # what `umakit run NAME` and a request's "model" take
    kind: str  # IMPORTS or HUB
    path: Path  # the directory umakit loads
    bytes: int  # on disk (a Hub repo: all its cached revisions)
    architecture: str  # config.json's model_type ("?" when unreadable)
    quantization: str  # "4-bit g64", "float16", ...
    revisions: tuple[str, ...] = ()  # a Hub repo's cached commit hashes


def _describe(path: Path) -> tuple[str, str]:
    """(architecture, quantization) from a model directory's config.json, without parsing weights."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "?", "?"
    text = config.get("text_config") or {}
    arch = config.get("model_type") or text.get("model_type") or "?"
    q = config.get("quantization") or foreign_block(config) or config.get("quantization_config")
    if native := native_block(config):  # gpt-oss's MXFP4
        return arch, affine.describe(native)
    if isinstance(q, dict) and "bits" in q:
        method = f"{q['quant_method']} " if isinstance(q.get("quant_method"), str) else ""  # gptq, awq
        return arch, f"{method}{q['bits']}-bit g{q.get('group_size', '?')}"
    return arch, str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "?")


def _weights_bytes(path: Path) -> int:
    """The bytes an import holds on disk: its weights, the exact groups beside them and their 8-bit copies, the
    layers left in a GGUF as made for MLX's layout, and the CPU packings kept for it (all of which `remove` frees)."""
    files = [*path.glob("*.safetensors"), *path.glob("exact/*.safetensors"), *path.glob("gguf/*.safetensors"),
             *packings(path)]
    return sum(f.stat().st_size for f in files)


def _imports() -> list[LocalModel]:
    root = umakit_home() / "models"
    found = []
    for folder in (root, root / "gguf", root / "imported"):
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if (path / "config.json").is_file():
                found.append(LocalModel(path.name, IMPORTS, path, _weights_bytes(path), *_describe(path)))
    return found


def _hub() -> list[LocalModel]:
    try:
        from huggingface_hub.errors import CacheNotFound
    except ImportError:  # pragma: no cover - a declared dependency
        return []
    try:
        cache = _scan()
    except (CacheNotFound, OSError, ValueError):
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        latest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        if latest is None or not _complete(Path(latest.snapshot_path)):
            continue
        path = Path(latest.snapshot_path)
        packed = sum(f.stat().st_size for r in repo.revisions for f in packings(r.snapshot_path))
        found.append(LocalModel(repo.repo_id, HUB, path, repo.size_on_disk + packed, *_describe(path),
                                tuple(r.commit_hash for r in repo.revisions)))
    return found


def _complete(path: Path) -> bool:
    """Whether a snapshot holds a loadable model: config.json and every weight file (a download cut short does
    not)."""
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all((path / shard).is_file() for shard in shards)
    return (path / "model.safetensors").is_file()


def local_models() -> list[LocalModel]:
    """Every model umakit can load from this machine's disks, imports first."""
    return _imports() + _hub()


def names() -> list[str]:
    """Every name a request's "model" or `umakit run NAME` may give for a model on this machine: the built-in
    model's where it is installed (imported or not yet), then `local_models`'."""
    from umakit.checkpoint.default import DEFAULT_MODEL_NAME, packaged_gguf

    found = [m.name for m in local_models()]
    try:
        packaged_gguf()
    except ModelNotFoundError:
        return found
    return [DEFAULT_MODEL_NAME] + [n for n in found if n != DEFAULT_MODEL_NAME]


def find(name: str) -> LocalModel | None:
    """The local model ``name`` names: an import's directory name, or (with a slash) a cached Hub repo id."""
    for m in _imports() + (_hub() if "/" in name else []):
        if m.name == name:
            return m
    return None


def remove(name: str) -> LocalModel:
    """Delete the local model ``name`` (an import's directory, or a Hub repo's cached revisions); returns what it
    was. An import is renamed away first, so a half-deleted directory is never listed or loaded."""
    model = find(name)
    if model is None:
        raise ModelNotFoundError(f"no local model named {name!r}; `umakit ls` lists them")
    held = [model.path] if model.kind == IMPORTS else [model.path.parent / r for r in model.revisions]
    kept = [f for path in held for f in packings(path)]  # named by the paths: found before they go
    if model.kind == IMPORTS:
        doomed = model.path.with_name(f".{model.path.name}.removing-{os.getpid()}")
        os.replace(model.path, doomed)
        shutil.rmtree(doomed)
    else:
        _scan().delete_revisions(*model.revisions).execute()
    for f in kept:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    return model


def _scan():
    """The Hugging Face cache, where the Hub library puts it now (its `constants.HF_HUB_CACHE`)."""
    from huggingface_hub import constants, scan_cache_dir

    return scan_cache_dir(constants.HF_HUB_CACHE)
