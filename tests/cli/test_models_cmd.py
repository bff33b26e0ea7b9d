"""`umakit ls`, `rm` and `ps` on a populated $UMAKIT_HOME and Hugging Face cache, and a real server for `ps`."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
from click.testing import CliRunner

from umakit.cli.main import main
from support.serve_helpers import ServerProcess


@pytest.fixture
def populated(tmp_path, monkeypatch, tiny_dir):
    """$UMAKIT_HOME with two imports (one a GGUF import), and a Hub cache with one model and one dataset."""
    home, hub = tmp_path / "home", tmp_path / "hub"
    monkeypatch.setenv("UMAKIT_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    import huggingface_hub.constants  # read at import: a process that imported it already needs this too

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    shutil.copytree(tiny_dir("llama"), home / "models" / "tiny-llama")
    shutil.copytree(tiny_dir("qwen3"), home / "models" / "gguf" / "tiny-qwen3-0123456789ab")
    snapshot = hub / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_dir("llama"), snapshot)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    (hub / "models--org--tiny" / "blobs").mkdir()
    data = hub / "datasets--org--text" / "snapshots" / ("b" * 40)
    data.mkdir(parents=True)
    (data / "train.txt").write_text("x")
    (hub / "datasets--org--text" / "refs").mkdir()
    (hub / "datasets--org--text" / "blobs").mkdir()
    return home, hub


def cli(*args):
    return CliRunner().invoke(main, list(args))


def test_ls_lists_imports_and_hub_models(populated):
    r = cli("ls")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "ARCH", "QUANTIZATION", "FROM"]
    names = {line.split()[0]: line for line in lines[1:]}
    assert set(names) == {"tiny-llama", "tiny-qwen3-0123456789ab", "org/tiny"}  # no dataset
    assert "llama" in names["tiny-llama"] and "import" in names["tiny-llama"]
    assert "qwen3" in names["tiny-qwen3-0123456789ab"] and "hub cache" in names["org/tiny"]


def test_names_a_server_lists_are_the_built_in_model_then_what_ls_lists(populated, monkeypatch):
    from umakit.checkpoint import default, inventory

    local = [m.name for m in inventory.local_models()]
    assert set(local) == {"tiny-llama", "tiny-qwen3-0123456789ab", "org/tiny"}
    try:
        default.packaged_gguf()
        built_in = [default.DEFAULT_MODEL_NAME]
    except default.ModelNotFoundError:
        built_in = []
    assert inventory.names() == built_in + local  # the built-in model's name before its first import too

    def absent():
        raise default.ModelNotFoundError("not installed")

    monkeypatch.setattr(default, "packaged_gguf", absent)
    assert inventory.names() == local


def test_an_import_is_loaded_by_its_short_name(populated):
    import umakit

    model = umakit.load("tiny-llama", backend="torch")
    assert model.info.path == populated[0] / "models" / "tiny-llama"
    r = cli("generate", "-m", "no-such-model", "-p", "x")
    assert r.exit_code == 1 and r.output.strip() == (
        "Error: model not found: no-such-model (no such directory, file, Hub repo id or name that `umakit ls` lists)")


def test_rm_removes_an_import_and_a_hub_repo(populated):
    home, hub = populated
    r = cli("rm", "tiny-qwen3-0123456789ab", "--server", "http://127.0.0.1:9")  # no server there
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Removed tiny-qwen3-0123456789ab (") and not (home / "models" / "gguf" /
                                                                              "tiny-qwen3-0123456789ab").exists()
    assert list((home / "models" / "gguf").iterdir()) == []  # nothing half-removed left behind
    r = cli("rm", "org/tiny", "--server", "http://127.0.0.1:9")
    assert r.exit_code == 0, r.output
    assert "org/tiny" not in cli("ls").output and not (hub / "models--org--tiny").exists()
    r = cli("rm", "nope", "--server", "http://127.0.0.1:9")
    assert r.exit_code == 1 and r.output.strip() == "Error: no local model named 'nope'; `umakit ls` lists them"


def test_an_imports_size_counts_what_removing_it_frees_and_rm_frees_it(populated):
    """The exact groups beside an import's weights, their 8-bit copies, and the CPU packings kept for it under
    $UMAKIT_HOME/packed (named by the import's path, as a load names them) are its; `rm` takes them too."""
    import torch

    from umakit.backends.torch.load.packed import packed_path

    home, _ = populated
    path = home / "models" / "gguf" / "tiny-qwen3-0123456789ab"
    before = {m.name: m.bytes for m in inventory_models()}
    (path / "exact").mkdir()
    (path / "exact" / "groups16.safetensors").write_bytes(b"x" * 3000)
    packing = packed_path(path, [path / "model.safetensors"], torch.__version__)
    packing.write_bytes(b"x" * 5000)
    other = packed_path(home / "models" / "tiny-llama", [home / "models" / "tiny-llama" / "model.safetensors"],
                        torch.__version__)
    other.write_bytes(b"x" * 7000)
    after = {m.name: m.bytes for m in inventory_models()}
    assert after["tiny-qwen3-0123456789ab"] == before["tiny-qwen3-0123456789ab"] + 8000
    assert after["tiny-llama"] == before["tiny-llama"] + 7000
    r = cli("rm", "tiny-qwen3-0123456789ab", "--server", "http://127.0.0.1:9")
    assert r.exit_code == 0, r.output
    assert not packing.exists() and other.exists()  # another model's packing stays


def inventory_models():
    from umakit.checkpoint.inventory import local_models

    return local_models()


@pytest.mark.slow
def test_ps_and_rm_of_a_model_a_server_holds(populated, tmp_path):
    home, _ = populated
    srv = ServerProcess(None, ["--backend", "torch", "--peak-bandwidth", "100", "--keep-alive", "-1"],
                        tmp_path / "host.log", env={"UMAKIT_HOME": str(home)})
    try:
        srv.wait_healthy()
        r = cli("ps", "--server", srv.url)
        assert r.exit_code == 0 and r.output.strip() == f"No model loaded at {srv.url}."
        reply = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny-llama", "prompt": "The", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        r = cli("ps", "--server", srv.url)
        assert r.exit_code == 0, r.output
        row = r.output.splitlines()[1].split()
        assert row[0] == "tiny-llama" and row[-1] == "never"
        r = cli("rm", "tiny-llama", "--server", srv.url)
        assert r.exit_code == 1 and "has tiny-llama loaded" in r.output
        assert (home / "models" / "tiny-llama" / "config.json").is_file()
    finally:
        srv.stop()
    r = cli("ps", "--server", srv.url)
    assert r.exit_code == 1 and "no umakit server answers" in r.output


# -- umakit pull, against a local server posing as the Hub --------------------------------------------------
@pytest.fixture
def hub(tmp_path):
    from support.fake_hub import FakeHub
    from support.gguf_files import write_gguf
    from support.tiny import make_tiny_model

    # wide enough that its weights (27 MB) pass the Hub library's 10 MiB write chunk: a cut after one is resumable
    wide = make_tiny_model("llama", tmp_path / "wide", hidden_size=512, intermediate_size=1536)
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    write_gguf(ggufs / "tiny.Q8_0.gguf")
    fake = FakeHub({"org/tiny": wide, "org/tiny-gguf": ggufs})
    yield fake
    fake.close()


def pull(hub, tmp_path, *args):
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"),
           "UMAKIT_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run([sys.executable, "-m", "umakit.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
def test_pull_a_repo_and_a_gguf_file_resuming_a_cut_transfer(hub, tmp_path):
    # cut past the first 10 MiB (kept), then at once on every retry: the pull gives up with a partial file
    hub.cut_after["model.safetensors"] = [12 << 20] + [1] * 30
    first = pull(hub, tmp_path, "pull", "org/tiny")
    assert first.returncode == 1 and first.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert "Traceback" not in first.stderr
    assert "org/tiny" not in pull(hub, tmp_path, "ls").stdout  # nothing half-downloaded is listed
    hub.cut_after["model.safetensors"] = []  # whole now: this pull resumes what the last one kept
    again = pull(hub, tmp_path, "pull", "org/tiny")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("Pulled org/tiny: ") and "umakit run org/tiny" in again.stdout
    starts = [int(r.split("=")[1].split("-")[0]) for name, r in hub.ranges if name == "model.safetensors"]
    assert starts and starts[-1] >= 10 << 20  # the last transfer resumed past what the earlier ones had kept
    listed = pull(hub, tmp_path, "ls").stdout
    assert "org/tiny" in listed and "hub cache" in listed
    done = pull(hub, tmp_path, "pull", "org/tiny-gguf:tiny.Q8_0.gguf")
    assert done.returncode == 0, done.stderr
    name = done.stdout.split("umakit run ")[1].strip()
    assert name.startswith("tiny.Q8_0-") and name in pull(hub, tmp_path, "ls").stdout
    missing = pull(hub, tmp_path, "pull", "org/nope")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1


def test_a_failed_gguf_pull_is_one_error_without_the_hub_librarys_retry_warnings(monkeypatch):
    """The Hub library warns on each retry (`'[Errno 111] Connection refused' thrown while requesting HEAD ...`,
    `Retrying in 1s`); a pull keeps those off the terminal while it downloads, and leaves the level as it was."""
    import logging

    import huggingface_hub

    from umakit.checkpoint.pull import pull as pull_file
    from umakit.errors import ModelNotFoundError

    hub_logger = logging.getLogger("huggingface_hub")
    before, seen = hub_logger.getEffectiveLevel(), []

    def offline(repo_id, filename):
        seen.append(hub_logger.getEffectiveLevel())
        raise OSError("[Errno 111] Connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ModelNotFoundError, match=r"could not download org/x:y.gguf \(OSError: "):
        pull_file("org/x", "y.gguf")
    assert seen == [logging.ERROR] and hub_logger.getEffectiveLevel() == before
