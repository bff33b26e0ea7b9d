"""Places where writing fails, for the fault suite: a full and a read-only filesystem.

Small tmpfs mounts where the machine allows it (root, as in CI); elsewhere, or with
UMAKIT_TEST_FAULTS=inject, the OS calls that write there are patched to fail with ENOSPC / EROFS.
`FAULT_MODE` records which was used for each kind.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FAULT_MODE: dict[str, str] = {}  # "full"/"ro" -> "tmpfs" or "injected"
MOUNT_SIZE = "1m"


# -- the places that fail ------------------------------------------------------------------------


def _mount(path: Path, readonly: bool) -> bool:
    if os.environ.get("UMAKIT_TEST_FAULTS") == "inject" or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={MOUNT_SIZE}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0
    if ok and readonly:
        if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
            return False
    return ok


def _fill(path: Path) -> None:
    """Fill a mounted filesystem to the last block."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


@pytest.fixture(scope="session")
def fault_places(tmp_path_factory):
    """{"full": dir, "ro": dir}: real tmpfs mounts when possible, else plain dirs for injection."""
    base = tmp_path_factory.mktemp("faults")
    places = {}
    mounted = []
    try:
        for kind in ("full", "ro"):
            path = base / kind
            if _mount(path, readonly=kind == "ro"):
                mounted.append(path)
                FAULT_MODE[kind] = "tmpfs"
                if kind == "full":
                    _fill(path)
            else:
                path.mkdir(parents=True, exist_ok=True)
                FAULT_MODE[kind] = "injected"
            places[kind] = path
        yield places
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], capture_output=True)


def inject(monkeypatch, root: Path, kind: str) -> None:
    """Make every write under ``root`` fail as a full (ENOSPC) or read-only (EROFS) filesystem would."""
    code = errno.ENOSPC if kind == "full" else errno.EROFS
    root_s = str(root)

    def under(p) -> bool:
        try:
            return os.path.abspath(os.fsdecode(p)).startswith(root_s)
        except TypeError:
            return False  # a file descriptor

    def fail(p):
        raise OSError(code, os.strerror(code), os.fsdecode(p))

    real_open, real_os_open, real_mkdir, real_access = builtins.open, os.open, os.mkdir, os.access
    real_statvfs = os.statvfs

    def open_(file, mode="r", *a, **k):
        if under(file) and any(c in mode for c in "wax+"):
            fail(file)
        return real_open(file, mode, *a, **k)

    def os_open(path, flags, *a, **k):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            fail(path)
        return real_os_open(path, flags, *a, **k)

    def mkdir(path, *a, **k):
        if under(path) and kind == "ro":
            fail(path)
        return real_mkdir(path, *a, **k)

    def access(path, mode, *a, **k):
        return False if under(path) and kind == "ro" and mode & os.W_OK else real_access(path, mode, *a, **k)

    def statvfs(path):
        st = real_statvfs(path)
        if under(path) and kind == "ro":
            return os.statvfs_result((*st[:8], st.f_flag | os.ST_RDONLY, st.f_namemax))
        return st

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "statvfs", statvfs)
