"""umakit's CPU C++ (csrc/: the fused decode step, the affine kernel), built once per machine by torch.utils.cpp_extension.

`torch.utils.cpp_extension.load` compiles it with ninja against the installed
torch (about 13 s here) into ``$UMAKIT_HOME/native/<key>/``, the key hashing
the sources, torch's version, the compiler and the flags, so a new umakit or
torch builds afresh and never loads a stale library. A second process waits
for a build under way (on a lock the kernel drops if the builder dies); a
library already built is loaded as it is. The first engine that needs it builds it (`make setup` does it ahead).
The build is synchronous on purpose: a step that switched from eager to fused
mid-run would change the last bits of the logits, and with them a seeded
sample. Without a compiler or ninja, with ``UMAKIT_NO_NATIVE=1``, or when the
build fails (its output is kept in ``build.log`` there, where it can be
written, and no later start compiles again until that file is removed),
umakit runs the eager step:
slower, never wrong. ``UMAKIT_NATIVE_DIR`` moves the cache (the test suite
shares one across runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from umakit.errors import WriteError
from umakit.core.fsutil import atomic_file
from umakit.core.home import home_dir

NAME = "umakit_fused"  # the library cpp_extension builds (its ops register as torch.ops.umakit)
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("fused_decode.cpp", "attention.cpp", "affine_mm.cpp", "gemm.cpp", "amx.cpp",
                                         "experts.cpp", "norm.cpp", "delta.cpp", "scale_codes.cpp",
                                         "gguf_blocks.cpp"))
FLAGS = ("-O3", "-w", "-fopenmp")  # OpenMP: at::parallel_for is inline, so threads only where it is compiled so
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")  # for the loops, where torch itself found AVX2 (or AVX-512)
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")  # the affine kernel's, where torch found them
LOG = "build.log"
BATON = "lock"  # cpp_extension's lock file in the build directory

_lock = threading.Lock()
_state: dict = {"ready": None, "reason": ""}  # ready: None until tried, then True or False


def compiler() -> str | None:
    """The C++ compiler cpp_extension will run: ``$CXX``, else c++, g++ or clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def flags() -> list[str]:
    x86 = platform.machine() in ("x86_64", "AMD64")
    capability = torch.backends.cpu.get_cpu_capability() if x86 else ""
    arch = _AVX2_FLAGS if capability in ("AVX2", "AVX512") else ()
    wide = _AVX512_FLAGS if capability == "AVX512" else ()
    # the affine kernel's dot products, and the GEMMs' bfloat16 rounding in one instruction, where this CPU has them
    dots = [f"-m{f.replace('_', '')}" for f in ("avx512_vnni", "avx512_bf16") if wide and f in _cpu_flags()]
    # a prompt slice's bfloat16 GEMMs on AMX tiles (csrc/amx.cpp), where this CPU has them
    tiles = ["-mamx-tile", "-mamx-bf16"] if wide and {"amx_tile", "amx_bf16"} <= _cpu_flags() else []
    return [*FLAGS, *arch, *wide, *dots, *tiles]


def _cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def build_dir(cxx: str) -> Path:
    """Where the build of this source, torch, compiler and flags lives."""
    key = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        key.update(source.name.encode() + source.read_bytes())
    key.update(f"{torch.__version__} {cxx} {' '.join(flags())}".encode())
    base = os.environ.get("UMAKIT_NATIVE_DIR")
    return (Path(base) if base else home_dir("native")) / key.hexdigest()[:16]


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
    ninja = _ninja_dir()
    if ninja is None:
        return False, "ninja is missing: pip install ninja"
    try:
        where = build_dir(cxx)
        where.mkdir(parents=True, exist_ok=True)
    except (OSError, WriteError) as e:
        return False, f"cannot keep the build: {e}"
    log, library = where / LOG, where / f"{NAME}.so"
    if log.exists():  # failed before: not 15 s of compiling again on every start
        return False, f"the C++ build failed earlier; its output is in {log} (remove that file to try again)"
    if library.exists() and not (where / BATON).exists():  # built, and no build under way: load it as is
        with contextlib.suppress(OSError, RuntimeError):  # (importing cpp_extension costs 0.1 s of setuptools)
            torch.ops.load_library(str(library))
            return True, ""
    try:
        with _only_builder(where):
            return _build(cxx, ninja, where, log)
    except OSError as e:
        return False, f"cannot keep the build: {e}"


def _build(cxx: str, ninja: str, where: Path, log: Path) -> tuple[bool, str]:
    from torch.utils import cpp_extension

    try:
        with _building(cxx, ninja):
            cpp_extension.load(NAME, [str(s) for s in SOURCES], extra_cflags=flags(), extra_ldflags=["-fopenmp"],
                               build_directory=str(where),
                               is_python_module=False, verbose=False)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as e:
        output = [getattr(e, k, None) for k in ("output", "stderr")]  # a compiler check's own words
        words = "\n".join([str(e), *(o.decode(errors="replace") if isinstance(o, bytes) else o for o in output if o)])
        try:
            with atomic_file(log) as f:
                f.write(words + "\n")
        except WriteError:  # nowhere to keep it (a full disk): say it here, and try again next time
            return False, f"the C++ build failed: {words.strip().splitlines()[-1]}"
        return False, f"the C++ build failed; its output is in {log}"
    return True, ""


@contextlib.contextmanager
def _only_builder(where: Path):
    """One process of this machine builds at a time: the others wait here, and the kernel lets go of the lock
    of a process that dies. So cpp_extension's own lock file (which it waits on for ever) is never contended,
    and one a killed build left behind is stale: it goes."""
    with open(where / "umakit.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (where / BATON).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_dir() -> str | None:
    """The folder of the ninja that cpp_extension runs: the `ninja` package's, else one on PATH."""
    try:
        import ninja
    except ImportError:
        found = shutil.which("ninja")
        return os.path.dirname(found) if found else None
    return ninja.BIN_DIR


@contextlib.contextmanager
def _building(cxx: str, ninja: str):
    """cpp_extension reads the compiler from ``$CXX`` and runs ninja from PATH: both set for the build only,
    and its notes on compilers (logged, or warned) kept quiet: the library never prints."""
    old = {k: os.environ.get(k) for k in ("CXX", "PATH")}
    os.environ["CXX"] = cxx
    os.environ["PATH"] = os.pathsep.join(filter(None, (ninja, old["PATH"])))
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
