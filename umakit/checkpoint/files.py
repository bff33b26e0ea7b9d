"""Finding and validating a checkpoint before any tensor is read.

A checkpoint is a Hugging Face-style directory: config.json, one or more
*.safetensors files (optionally sharded with model.safetensors.index.json) and
tokenizer files. Everything here is framework-free: the safetensors headers are
parsed by hand so that a truncated or corrupt file is reported by name before a
backend tries to map it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from umakit.checkpoint import config as config_compat
from umakit.errors import CheckpointError, ConfigError, ModelNotFoundError

# Bytes per element of the safetensors dtypes we accept.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
REQUIRED_CONFIG_FIELDS = ("model_type",)
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    nbytes: int
    offset: int = -1  # where its data starts in the file


@dataclass
class Checkpoint:
    """What a model directory holds, validated but not loaded."""

    path: Path
    config: dict
    files: list[Path]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    # hears what `complete` writes, (bytes done, bytes in all), as an import's progress does
    progress: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def complete(self) -> "Checkpoint":
        """This checkpoint with every tensor its config names. A GGUF import holds its Q6_K layers exactly in
        groups of 16 and leaves their 8-bit copies for MLX's groups to the first load that reads them
        (`gguf.requantized`), and a first run's import on a CPU leaves its quantized layers in the GGUF
        (`gguf.left_layers`): an engine that reads those layers in MLX's layout calls this first."""
        from umakit.checkpoint.gguf import finished, left_layers

        extras = [(f, kind) for f, kind in ((finished.deferred_file(self.path, self.config), "requantized"),
                                           (left_layers.deferred_file(self.path, self.config), "left_layers"))
                  if f is not None and f not in self.files]
        if not extras:
            return self
        tensors = dict(self.tensors)
        for extra, kind in extras:
            if not extra.is_file():
                from umakit.checkpoint.gguf import requantized

                (requantized if kind == "requantized" else left_layers).write(self.path, self.config, self.progress)
            tensors.update(read_safetensors_header(extra))
        return validate_checkpoint(replace(self, files=[*self.files, *(f for f, _ in extras)], tensors=tensors))

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def name(self) -> str:
        return self.path.name


def resolve(model: str | os.PathLike | None, progress: Callable[[int, int], None] | None = None,
            defer_copies: bool | Callable[[str | None], bool] = False,
            leave_layers: bool | Callable[[str | None], bool] = False) -> Path:
    """Turn a model argument into a local directory.

    None means the built-in default model; an existing directory is used as is;
    a ``.gguf`` file, or a directory of GPTQ, AWQ or compressed-tensors weights, is
    imported once into umakit's cache; ``org/name`` is a
    Hugging Face Hub repo id (downloaded, or taken from the local Hub cache when
    ``HF_HUB_OFFLINE`` is set). ``progress(done, total)`` hears the import of a GGUF or of GPTQ, AWQ or
    compressed-tensors weights, in tensor bytes converted, where this call makes it (a first run: later ones find
    the import). ``defer_copies``: a GGUF's import leaves the 8-bit copies of its Q6_K layers to the first load
    that reads them (`Checkpoint.complete`), for a caller whose load reads the layers exactly (True, or a test of
    the model's architecture: `gguf.convert.write_import`'s); ``leave_layers`` (the same kinds of value): it leaves
    the layers its CPU kernel packs from the GGUF's blocks in the GGUF (`gguf.left_layers`).
    """
    if model is None:
        from umakit.checkpoint.default import default_model_dir

        return default_model_dir()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return _imported(path, progress)
    if path.is_file():
        if path.suffix == ".gguf":
            from umakit.core.fsutil import writing
            from umakit.checkpoint.gguf import cached_import
            from umakit.core.home import home_dir

            cache = home_dir("models", "gguf")  # an unusable $UMAKIT_HOME is one clear error
            with writing(cache):  # so is a full disk or a read-only cache mid-import
                return cached_import(path, progress, defer_copies, leave_layers)
        raise ModelNotFoundError(
            f"{path} is a file; give the model's directory (with config.json) or a .gguf file"
        )
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return _imported(_from_hub(text), progress)
    if os.sep not in text and "/" not in text:
        from umakit.checkpoint.inventory import find

        alias = find(text)  # an import's short name, as `umakit ls` lists it
        if alias is not None:
            return alias.path
        raise ModelNotFoundError(f"model not found: {text} (no such directory, file, Hub repo id or name that "
                                 "`umakit ls` lists)")
    raise ModelNotFoundError(f"model not found: {text} (no such directory, file or Hub repo id)")


def _imported(path: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """``path``, or where it holds a GPTQ, AWQ or compressed-tensors checkpoint, its MLX-layout import in
    umakit's cache (made on first use, ``progress`` hearing it)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return path  # read_config says what is wrong with it
    from umakit.checkpoint.hfquant.detect import method_of, with_side_file

    if not isinstance(config, dict) or method_of(with_side_file(path, config)) is None:
        return path
    from umakit.checkpoint.hfquant import cached_import

    return cached_import(path, progress)


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - declared dependency
        raise ModelNotFoundError("huggingface_hub is not installed: pip install huggingface_hub") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as e:  # huggingface_hub raises many unrelated types here
        if offline:
            raise ModelNotFoundError(
                f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it on a connected machine or pass a local directory"
            ) from e
        raise ModelNotFoundError(
            f"could not fetch {repo_id} from the Hugging Face Hub ({type(e).__name__}); "
            "check the repo id and network, or pass a local directory"
        ) from e


def read_config(path: Path) -> dict:
    """Read config.json and check the fields every architecture needs."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face-style model directory?")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{cfg_path} must hold a JSON object")
    if "text_config" in config and "model_type" in config["text_config"]:
        # Multimodal wrappers (e.g. gemma3): the language model's config is nested.
        config.setdefault("model_type", config["text_config"]["model_type"])
    missing = [k for k in REQUIRED_CONFIG_FIELDS if k not in config]
    if missing:
        raise ConfigError(f"{cfg_path} lacks required field(s): {', '.join(missing)}")
    return config_compat.normalize(config)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, shards in index order."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    return files


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header without reading tensor data."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file.name} is truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{file.name} is not a valid safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file.name} has a corrupt safetensors header: {e}") from e
    data_size = size - 8 - n
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file.name}: tensor {name} has a malformed header entry") from e
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{file.name}: tensor {name} has unsupported dtype {dtype}")
        expected = DTYPE_BYTES[dtype]
        for d in shape:
            expected *= d
        if end - start != expected or start < 0:
            raise CheckpointError(f"{file.name}: tensor {name} has inconsistent size for shape {list(shape)}")
        if end > data_size:
            raise CheckpointError(
                f"{file.name} is truncated: tensor {name} needs bytes up to {end} but the file holds {data_size}"
            )
        tensors[name] = TensorInfo(name, dtype, shape, file, expected, 8 + n + start)
    return tensors


def open_checkpoint(path: Path, progress: Callable[[int, int], None] | None = None) -> Checkpoint:
    """Validate a model directory: config, weight files and every tensor header; ``progress``: `Checkpoint`'s.
    What it leaves to be made on first use is not there yet: `Checkpoint.complete` makes it."""
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory not found: {path}")
    config = read_config(path)
    files = weight_files(path)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(read_safetensors_header(f))
    return validate_checkpoint(Checkpoint(path=path, config=config, files=files, tensors=tensors, progress=progress))


# Config fields every engine reads as sizes: positive integers when present (None means "derive it").
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")


def _check_config_values(config: dict, where: str) -> None:
    for key in POSITIVE_INT_FIELDS:
        v = config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{where}: {key} must be a positive integer, got {json.dumps(v)}")
    for key in POSITIVE_FLOAT_FIELDS:
        v = config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ConfigError(f"{where}: {key} must be a positive number, got {json.dumps(v)}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")


def validate_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """The checks both engines run on a checkpoint before building a model, so both say the same thing.

    Config sizes must be positive integers and scales positive finite numbers
    (not strings, not negative); each tensor's dtype must fit its role: packed
    quantized weights are U32, everything else a float (a header claiming I32
    for a float weight has data of the right size but the wrong meaning).
    """
    where = str(ckpt.path / "config.json")
    _check_config_values(ckpt.config, where)
    if isinstance(ckpt.config.get("text_config"), dict):
        _check_config_values(ckpt.config["text_config"], where + " (text_config)")
    for name, t in ckpt.tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and f"{module}.scales" in ckpt.tensors:
            if t.dtype != "U32":
                raise CheckpointError(f"{t.file.name}: tensor {name} is {t.dtype} but a quantized weight (it has "
                                      "scales) must be U32 packed words")
        elif leaf in ("weight", "bias", "scales", "biases") and t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.file.name}: tensor {name} is {t.dtype} but must be a float tensor "
                                  f"({', '.join(sorted(FLOAT_DTYPES))})")
    return ckpt


def size_on_disk(path: Path) -> int:
    """Bytes of a model directory's weight files, and of the layers a GGUF import left in its GGUF
    (`gguf.left_layers`)."""
    from umakit.checkpoint.gguf.left_layers import left

    try:
        own = sum(f.stat().st_size for f in weight_files(path))
    except CheckpointError:
        return 0
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return own
    return own + sum(e["bytes"] for e in left(config).values()) if isinstance(config, dict) else own


def generation_eos_ids(path: Path, config: dict) -> set[int]:
    """EOS ids named by config.json and generation_config.json (either may hold a list)."""
    ids: set[int] = set()
    sources = [config]
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()))
        except json.JSONDecodeError:
            pass  # generation_config.json is optional; a broken one only loses EOS hints
    for src in sources:
        value = src.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def display_name(path: Path) -> str:
    """A checkpoint's name: the repo id of a Hub snapshot (.../models--org--name/snapshots/<hash>), else the folder's."""
    path = Path(path)
    for parent in path.parents:
        if parent.name.startswith("models--"):
            return parent.name[len("models--"):].replace("--", "/")
    return path.name
