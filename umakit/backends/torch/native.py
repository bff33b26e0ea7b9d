"""The fused CPU decode step's C++ library (csrc/fused_decode.cpp, and light.cpp: its C entry points): built once per machine.

The library is compiled with the system's C++ compiler against the installed
torch (about 14 s here, both sources) into ``$UMAKIT_HOME/native/<key>/``, where the key
hashes the sources, torch's version and the compile command, so a new umakit
or torch builds afresh and never loads a stale library. The first engine that
needs it builds it, once (`make setup` does it ahead); a second process that
finds the build under way waits for it. The build is synchronous on purpose:
a step that switched from eager to fused mid-run would change the last bits
of the logits, and with them a seeded sample. Without a compiler, with
``UMAKIT_NO_NATIVE=1``, or when the build fails (its log is kept beside the
library, and no later start compiles again until the log is removed), umakit
runs the eager step: slower, never wrong.
``UMAKIT_NATIVE_DIR`` moves the cache (the test suite shares one across runs).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

from ...errors import BusyError, WriteError
from ...fsutil import atomic_dir, atomic_file
from .light import SOURCES, native_base, record_library, sources_digest

LIBRARY = "umakit_fused.so"
BUILD_TIMEOUT_S = 600.0  # also how long a process waits for another one's build
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-w")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")  # for the loops, where torch itself found AVX2 (or AVX-512)

_lock = threading.Lock()
_state: dict = {"ready": None, "reason": ""}  # ready: None until tried, then True or False


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else c++, g++ or clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def command(cxx: str, out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    x86 = platform.machine() in ("x86_64", "AMD64")
    arch = _AVX2_FLAGS if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ()
    return [cxx, *FLAGS, *arch, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", *map(str, SOURCES), "-o", str(out),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def library_dir(cxx: str) -> Path:
    """Where the build of this source, torch and compile command lives."""
    key = hashlib.sha256(sources_digest().encode())
    key.update(torch.__version__.encode())
    key.update(" ".join(command(cxx, Path(LIBRARY))).encode())
    return native_base() / key.hexdigest()[:16]


def ensure() -> bool:
    """Load the library, building it first where this machine has none; False (see `reason`) where it cannot."""
    with _lock:
        if _state["ready"] is None:
            _state["ready"], _state["reason"] = _ensure()
        return _state["ready"]


def reason() -> str:
    """Why the library is not in use (empty when it is, or before `ensure` ran)."""
    return _state["reason"]


def _ensure() -> tuple[bool, str]:
    if os.environ.get("UMAKIT_NO_NATIVE"):
        return False, "UMAKIT_NO_NATIVE is set"
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler: set CXX, or install g++ or clang++"
    try:
        where = library_dir(cxx)
        if not (where / LIBRARY).exists():
            if build_log(where).exists():  # failed before: not 8 s of compiling again on every start
                return False, (f"the C++ build failed earlier; its output is in {build_log(where)} "
                               "(remove that file to try again)")
            failed = _build(cxx, where)
            if failed:
                return False, failed
    except WriteError as e:
        return False, f"cannot keep the build: {e}"
    try:
        torch.ops.load_library(str(where / LIBRARY))
    except (OSError, RuntimeError) as e:
        return False, f"cannot load {where / LIBRARY}: {e}"
    record_library(where / LIBRARY, torch.__version__)  # for a later start without torch (light.py)
    return True, ""


def build_log(where: Path) -> Path:
    """Where a failed build of ``where`` left the compiler's output."""
    return where.with_name(where.name + ".log")


def _build(cxx: str, where: Path) -> str:
    """Compile into a temporary directory renamed into place, or wait for another process's build;
    returns why it failed, or ""."""
    log = build_log(where)
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not (where / LIBRARY).exists():
        try:
            with atomic_dir(where) as tmp:
                run = subprocess.run(command(cxx, tmp / LIBRARY), capture_output=True, text=True,
                                     timeout=BUILD_TIMEOUT_S)
                if run.returncode != 0:
                    with atomic_file(log) as f:
                        f.write(f"$ {' '.join(run.args)}\n{run.stdout}{run.stderr}")
                    raise _BuildFailed(f"the C++ build failed (exit status {run.returncode}); its output is in {log}")
        except _BuildFailed as e:
            return str(e)
        except BusyError:  # another process is building it: wait for its library
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        except (subprocess.TimeoutExpired, FileNotFoundError, PermissionError) as e:
            return f"the C++ build did not run: {e}"
    return ""


class _BuildFailed(Exception):
    pass
