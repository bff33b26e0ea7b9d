"""`kill -9` in the middle of a write, then the same command again: a complete result, no leftovers.

Each command runs as a real process whose writer is slowed by a wrapper (the weights file is
written half, or a result line half, and then the process waits), so the kill lands mid-write
every time; the test polls for that moment, kills, and runs the command again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from umakit.cli.main import COMMANDS, main

from support import proc_helpers

# Runs the CLI with its writers stopping half-way, as a crash during a write would leave them.
STALL = """
import os, sys, time
import umakit.checkpoint.writer as writer, umakit.core.fsutil as fsutil
from umakit.cli.main import COMMANDS, main

real_save, real_write = writer._save, fsutil.AppendFile.write
lines = []

def half_save(file, arrays):
    real_save(file, arrays)
    os.truncate(file, os.path.getsize(file) // 2)
    time.sleep(600)

real_set = writer.StreamedSafetensors.__setitem__

def half_set(self, name, array):  # a weights file written a tensor at a time (a GGUF import): three, then a stall
    real_set(self, name, array)
    if len(self) == 3:
        self._f.flush()
        time.sleep(600)

def half_line(self, data):
    if lines:
        os.write(self._fd, data[: len(data) // 2])
        time.sleep(600)
    lines.append(data)
    real_write(self, data)

writer._save = half_save
writer.StreamedSafetensors.__setitem__ = half_set
fsutil.AppendFile.write = half_line
COMMANDS.setdefault("batch", "umakit.cli.batch_cmd:batch_cmd")
main()
"""


def kill_when(args: list, ready) -> None:
    """Run the CLI stalling mid-write, wait until ``ready()``, then SIGKILL it."""
    proc_helpers.kill_when([sys.executable, "-c", STALL, *map(str, args)], ready, "the write")


def temps(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def half_written_dir(out: Path):
    """A temp dir beside ``out`` that holds part of a weights file."""
    def ready():
        return any((t / "model.safetensors").is_file() and (t / "config.json").exists() is False
                   and (t / "model.safetensors").stat().st_size > 0 for t in temps(out) if t.is_dir())
    return ready


def rerun(args: list):
    result = CliRunner().invoke(main, list(map(str, args)))
    assert result.exit_code == 0, result.output
    return result


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(autouse=True)
def _batch_registered(monkeypatch):
    monkeypatch.setitem(COMMANDS, "batch", "umakit.cli.batch_cmd:batch_cmd")


def test_import_killed_mid_write_then_again(tmp_path):
    from support.gguf_files import write_gguf
    from umakit.checkpoint.gguf import import_gguf

    src = write_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    kill_when(["import", src, "-o", out], half_written_dir(out))
    assert not out.exists() and temps(out), "the kill should leave the half-written temp behind"
    rerun(["import", src, "-o", out])
    assert temps(out) == []
    import_gguf(src, tmp_path / "reference")
    same_files(out, tmp_path / "reference")


def test_quantize_killed_mid_write_then_again(tiny_dir, tmp_path):
    out = tmp_path / "q"
    kill_when(["quantize", tiny_dir("llama"), "-o", out], half_written_dir(out))
    assert not out.exists() and temps(out)
    rerun(["quantize", tiny_dir("llama"), "-o", out])
    assert temps(out) == []
    rerun(["quantize", tiny_dir("llama"), "-o", tmp_path / "reference"])
    same_files(out, tmp_path / "reference")


def test_batch_killed_mid_line_then_again(tiny_dir, tmp_path):
    n = 6
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"The fox {i}"}) + "\n" for i in range(n)))
    out = tmp_path / "o.jsonl"
    args = ["batch", tiny_dir("llama"), "-i", inp, "-o", out, "--temp", "0", "--max-tokens", "3", "--raw", "-b", "1",
            "--backend", "mlx"]

    def torn():  # one whole line and part of the next
        data = out.read_bytes() if out.exists() else b""
        return data.count(b"\n") == 1 and not data.endswith(b"\n")

    kill_when(args, torn)
    assert torn() and temps(out), "the kill should leave a torn line and the writer's lock"
    result = rerun(args)
    assert "1 of 6 items already in" in result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(n))  # each exactly once, the torn one again
    assert temps(out) == [] and not (tmp_path / "o.errors.jsonl").exists()


def test_sweep_removes_only_what_dead_writers_left(tmp_path):
    """A live pid's temp is kept (it may be mid-write); a dead pid's, and a pid-less one past its age, go."""
    from umakit.core import fsutil

    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = tmp_path / f".out.{os.getpid()}-abc.tmp"
    gone = tmp_path / f".out.{dead.pid}-abc.tmp"
    old = tmp_path / ".out.k3j2_x9q.tmp"  # an older umakit's name, without a pid
    fresh = tmp_path / ".out.zz9_abc1.tmp"
    other = tmp_path / f".other.{dead.pid}-abc.tmp"
    for p in (live, gone, old, fresh):
        p.mkdir()
    other.write_text("not ours")
    (gone / "model.safetensors").write_bytes(b"half")
    past = time.time() - 2 * fsutil.STALE_AFTER_S
    os.utime(old, (past, past))
    removed = fsutil.sweep_temps(out)
    assert sorted(removed) == sorted([gone, old])
    assert live.exists() and fresh.exists() and other.exists()


def test_a_second_writer_of_one_place_is_refused(tmp_path):
    from umakit.core import fsutil
    from umakit.errors import WriteError

    out = tmp_path / "o.jsonl"
    with fsutil.locked(out):
        with pytest.raises(WriteError, match=rf"{out} is being written by another umakit process \(pid {os.getpid()}\)"):
            with fsutil.locked(out):
                pass
    assert not (tmp_path / ".o.jsonl.lock").exists()
    with fsutil.locked(out):  # free again once released
        pass
