"""Safe writes: atomic files and directories, appends cut back on failure, locks, stale-temp sweeping.

Every writer in umakit goes through here, so each reports a failed write the
same way: one `WriteError` naming the path and the OS's reason (full disk,
read-only filesystem, a parent that is missing or not a directory), with
nothing partial left behind. Temporary names carry the writer's pid
(``.NAME.<pid>-<random>.tmp``), so the next write to the same place removes
what a killed process left, and never what a live one is still writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from umakit.errors import BusyError, InvalidArgumentError, WriteError

TEMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"
# A temp without a pid (older umakit) or whose pid may have been reused is stale after this long.
STALE_AFTER_S = 3600.0
# A temp whose pid is alive this long after its last change belongs to another process that reused the pid.
PID_REUSE_AFTER_S = 24 * STALE_AFTER_S
_TEMP_TAIL = re.compile(r"^(?:(\d+)-)?[\w-]+$")
_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EROFS: "write to a writable place",
    errno.EACCES: "check the permissions or write elsewhere",
    errno.EPERM: "check the permissions or write elsewhere",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENOENT: "the parent directory does not exist",
    errno.EEXIST: "a file is in the way of a directory",
}


def write_error(path: str | os.PathLike, e: OSError) -> WriteError:
    """One line for a failed write of ``path``: the OS's reason, the path it hit, and what to do."""
    reason = e.strerror or str(e)
    hit = os.fspath(e.filename) if e.filename else ""
    ours = Path(hit).name.startswith(f".{Path(path).name}.")  # our own temp or lock: the path says it all
    where = f" ({hit})" if hit and hit != os.fspath(path) and not ours else ""
    hint = _HINTS.get(e.errno)
    return WriteError(f"cannot write {path}: {reason}{where}" + (f"; {hint}" if hint else ""))


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn any `OSError` raised inside into a `WriteError` about ``path`` (one already raised stays as it is)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise write_error(path, e) from e


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _is_stale(entry: Path, tail: str) -> bool:
    m = _TEMP_TAIL.match(tail)
    if m is None:
        return False
    try:
        age = time.time() - entry.lstat().st_mtime
    except FileNotFoundError:
        return False
    if m.group(1) is None:
        return age > STALE_AFTER_S
    return not _pid_alive(int(m.group(1))) or age > PID_REUSE_AFTER_S


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()


def sweep_temps(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries a dead process left beside ``path``; returns what was removed.

    Matches ``.NAME.*.tmp`` (files and directories) and the ``.NAME.old-<pid>``
    a replaced directory passes through; a live writer's are kept.
    """
    path = Path(path)
    prefix = f".{path.name}."
    removed = []
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return removed  # nothing to sweep where nothing can be listed; the write itself will report
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        tail = name[len(prefix):]
        if tail.endswith(TEMP_SUFFIX):
            stale = _is_stale(entry, tail[: -len(TEMP_SUFFIX)])
        elif tail.startswith("old-") and tail[4:].isdigit():
            stale = not _pid_alive(int(tail[4:]))
        else:
            continue
        if stale:
            _remove(entry)
            removed.append(entry)
    return removed


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}-"


def new_temp_dir(path: str | os.PathLike) -> Path:
    """A fresh ``.NAME.<pid>-<random>.tmp`` directory beside ``path``, after sweeping what dead writers left.

    For writers that install the directory themselves (the GGUF cache's racing rename).
    """
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep_temps(path)
        return Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent))


@contextlib.contextmanager
def locked(path: str | os.PathLike) -> Iterator[None]:
    """Hold ``path``'s writer lock (``.NAME.lock`` beside it, removed after); refuse if another process holds it.

    Two umakit processes writing one place at once would interleave or replace
    each other's work; the second is refused with the holder's pid instead.
    """
    path = Path(path)
    lock = path.with_name(f".{path.name}{LOCK_SUFFIX}")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # name the place, not the lock file beside it
                raise write_error(path, OSError(e.errno, e.strerror)) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise BusyError(f"{path} is being written by another umakit process (pid {holder}); "
                                 "wait for it to finish or write elsewhere") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed this lock file as we opened it: take the new one
        with contextlib.suppress(OSError):  # the pid only names the holder; a full disk may refuse it
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of the file at ``offset`` to the disk, without waiting (Linux's
    sync_file_range): a large file's final fsync then waits only for what was written last. Elsewhere, or
    where the call fails, nothing happens (the fsync does all of it, as before)."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure is the fsync's to report


@functools.cache
def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator:
    """Open a temporary file beside ``path``; rename it over ``path`` on success.

    Any OS failure becomes a `WriteError` and removes the temporary file.
    """
    path = Path(path)
    tmp = None
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            sweep_temps(path)
            fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
            with os.fdopen(fd, mode, **kwargs) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``, renamed to ``path`` on success.

    An existing ``path`` is an error unless ``force``; then it is replaced only
    after the new directory is complete. The place is locked while it is built,
    and any OS failure becomes a `WriteError` that leaves nothing behind.
    """
    path = check_destination(path, force)
    with locked(path):
        tmp = None
        try:
            tmp = new_temp_dir(path)
            with writing(path):
                yield tmp
                check_destination(path, force)  # another writer may have made it meanwhile
                if path.exists():
                    old = path.with_name(f".{path.name}.old-{os.getpid()}")
                    os.replace(path, old)
                    os.replace(tmp, path)
                    _remove(old)
                else:
                    os.replace(tmp, path)
        except BaseException:
            if tmp is not None:
                _remove(tmp)
            raise


class AppendFile:
    """Appends whole records to a file; each is synced before the next, and a failed one is cut back.

    A full disk mid-record leaves the file as it was before that record; a
    file this object created and never wrote to is removed on close.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with writing(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._good = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._good)
            raise write_error(self.path, e) from e
        self._good += len(data)

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self._created and self._good == 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def check_writable(path: str | os.PathLike) -> Path:
    """Refuse, before any slow work, a ``path`` that cannot be written: its nearest existing ancestor is a
    file, read-only or not writable. Creates nothing (a full disk shows only when writing)."""
    path = Path(path)
    anc = path.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise write_error(path, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(anc)))
    if not os.access(anc, os.W_OK):
        code = errno.EROFS if os.statvfs(anc).f_flag & os.ST_RDONLY else errno.EACCES
        raise write_error(path, OSError(code, os.strerror(code), str(anc)))
    return path


def check_destination(dst: str | os.PathLike, force: bool = False) -> Path:
    """Refuse an existing ``dst`` unless ``force``: callers check before any slow work, the writer again."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise InvalidArgumentError(f"{dst} already exists (use --force to overwrite)")
    return dst


def check_not_inside(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Refuse writing ``dst`` when it is ``src`` or holds it: replacing it would destroy the input."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if s == d or d in s.parents:
        raise InvalidArgumentError(f"{dst} holds the input {src}; write the output elsewhere")
