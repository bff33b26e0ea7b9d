"""Every command under bad input and disk faults: one `Error:` line, no traceback, nothing left behind.

Table-driven: each case builds its inputs in a fresh directory, runs one command through click's
runner (a handful as real processes), and checks the exit status, that the output holds exactly
one line starting with "Error:", no "Traceback", that the command raised nothing but its exit, and
that the output place gained no file or directory (temporaries and locks included).

Disk-full and read-only places come from fault_places.py: small tmpfs mounts where the machine
allows it (root, as in CI), else fault injection (UMAKIT_TEST_FAULTS=inject forces it);
`FAULT_MODE` says which ran, and each such test prints it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from support.fault_places import FAULT_MODE, fault_places, inject  # noqa: F401 (fault_places is a fixture)
from umakit.cli.main import COMMANDS, main

# -- inputs ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
    from support.gguf_files import write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf")


@dataclass
class Ctx:
    """What a case may use: a fresh directory, the output place, a tiny model and a GGUF."""

    tmp: Path
    out: Path  # where the command writes; checked for leftovers
    model: Path  # the shared tiny llama (never damaged)
    gguf: Path
    places: dict
    monkeypatch: object
    cleanup: list = field(default_factory=list)

    def ckpt(self, config: dict | None = None, drop: tuple = (), edit: Callable | None = None) -> Path:
        """A damaged copy of the tiny llama: config fields replaced (None removes), files dropped."""
        dst = shutil.copytree(self.model, self.tmp / "ckpt")
        if config is not None:
            cfg = json.loads((dst / "config.json").read_text())
            for k, v in config.items():
                if v is None:
                    cfg.pop(k, None)
                else:
                    cfg[k] = v
            (dst / "config.json").write_text(json.dumps(cfg))
        for name in drop:
            (dst / name).unlink()
        if edit is not None:
            edit(dst)
        return dst

    def file(self, name: str, data: bytes | str) -> Path:
        p = self.tmp / name
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p

    def jsonl(self, name: str, rows) -> Path:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def place(self, kind: str) -> Path:
        """The full or read-only place; with injection, its faults are switched on here."""
        path = self.places[kind]
        if FAULT_MODE[kind] == "injected":
            inject(self.monkeypatch, path, kind)
        print(f"{kind} place: {FAULT_MODE[kind]}")
        self.out = path
        return path


def header_edit(change: Callable[[dict], None]):
    """An edit of model.safetensors' JSON header (the data is kept as it is)."""
    def edit(dst: Path):
        f = dst / "model.safetensors"
        data = f.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        change(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return edit


def set_dtype(name: str, dtype: str):
    def change(h):
        h[name]["dtype"] = dtype
    return change


def truncate(name: str, keep: int):
    def edit(dst: Path):
        f = dst / name
        f.write_bytes(f.read_bytes()[:keep])
    return edit


def gguf_variant(ctx: Ctx, name: str, data: bytes) -> Path:
    return ctx.file(name, data)


def gguf_with_version(ctx: Ctx, version: int) -> Path:
    data = bytearray(ctx.gguf.read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    return ctx.file("v.gguf", bytes(data))


def hold_lock(ctx: Ctx, path: Path) -> Path:
    """Hold ``path``'s writer lock as another process would (flock is per open file, so this conflicts)."""
    import fcntl

    lock = path.with_name(f".{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242")
    ctx.cleanup.append(lambda: os.close(fd))
    return path


# -- the table ----------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    args: Callable[[Ctx], list]
    match: str  # a substring of the Error line
    code: int = 1  # 1: a library error; 2: click's usage error
    stdin: bytes | None = None
    env: dict = field(default_factory=dict)
    leaves: tuple = ()  # what the command writes on purpose into the output place, even when it fails


G = ["generate", "--max-tokens", "2", "--backend", "mlx"]  # fast to fail, one engine
T64 = 2**63


def gen(*extra):
    return lambda c: [*G, "-m", str(c.model), "-p", "hi", *extra]


def gen_ckpt(**kw):
    return lambda c: [*G, "-m", str(c.ckpt(**kw)), "-p", "hi"]


CASES = {
    "generate": [
        Case("temp nan", gen("--temp", "nan"), "temperature must be a finite number", 2),
        Case("temp inf", gen("--temp", "inf"), "temperature must be a finite number", 2),
        Case("temp negative", gen("--temp", "-1"), "--temp", 2),
        Case("temp not a number", gen("--temp", "warm"), "--temp", 2),
        Case("top-p zero", gen("--top-p", "0"), "--top-p", 2),
        Case("top-p above 1", gen("--top-p", "1.5"), "--top-p", 2),
        Case("top-p nan", gen("--top-p", "nan"), "top_p must be a finite number", 2),
        Case("min-p one", gen("--min-p", "1"), "--min-p", 2),
        Case("min-p nan", gen("--min-p", "nan"), "min_p must be a finite number", 2),
        Case("top-k negative", gen("--top-k", "-1"), "--top-k", 2),
        Case("repetition-penalty zero", gen("--repetition-penalty", "0"), "--repetition-penalty", 2),
        Case("repetition-penalty nan", gen("--repetition-penalty", "nan"), "repetition_penalty must be a finite", 2),
        Case("seed 2**63", gen("--seed", str(T64)), "seed must be in", 2),
        Case("seed below -2**63", gen("--seed", str(-T64 - 1)), "seed must be in", 2),
        Case("seed not an integer", gen("--seed", "1.5"), "--seed", 2),
        Case("max-tokens zero", gen("--max-tokens", "0"), "--max-tokens", 2),
        Case("stdin not UTF-8", lambda c: [*G, "-m", str(c.model), "-p", "-"], "stdin is not UTF-8 text: byte 0xff at offset 3",
             stdin=b"abc\xffdef"),
        Case("stdin cut mid-character", lambda c: [*G, "-m", str(c.model), "-p", "-"],
             "byte 0xc3 at offset 1 (unexpected end of data)", stdin="hé".encode()[:-1]),
        Case("prompt argv not UTF-8", lambda c: [*G, "-m", str(c.model), "-p", "ok\udcfe"], "--prompt is not UTF-8 text"),
        Case("system argv not UTF-8", gen("--system", "\udcc3("), "--system is not UTF-8 text"),
        Case("stop argv not UTF-8", gen("--stop", "\udcff"), "--stop is not UTF-8 text"),
        Case("model missing", lambda c: [*G, "-m", str(c.tmp / "nope"), "-p", "hi"], "model not found"),
        Case("model is a text file", lambda c: [*G, "-m", str(c.file("m.txt", "x")), "-p", "hi"], "is a file"),
        Case("unknown backend", lambda c: [*G[:3], "--backend", "tpu", "-m", str(c.model), "-p", "hi"], "unknown backend"),
        Case("unknown dtype", gen("--dtype", "float8"), "unknown dtype 'float8'"),
        Case("kv-bits 3", gen("--kv-bits", "3"), "--kv-bits", 2),
        Case("gpu-layers negative", gen("--gpu-layers", "-1"), "--gpu-layers", 2),
        Case("quantize 5", gen("--quantize", "5"), "--quantize", 2),
        Case("draft tokens zero", gen("--prompt-lookup", "--draft-tokens", "0"), "--draft-tokens", 2),
    ],
    "checkpoint": [
        Case("no config.json", gen_ckpt(drop=("config.json",)), "has no config.json"),
        Case("config not JSON", gen_ckpt(edit=lambda d: (d / "config.json").write_text("{nope")), "not valid JSON"),
        Case("config a list", gen_ckpt(edit=lambda d: (d / "config.json").write_text("[1]")), "must hold a JSON object"),
        Case("config without model_type", gen_ckpt(config={"model_type": None}), "lacks required field(s): model_type"),
        Case("negative context length", gen_ckpt(config={"max_position_embeddings": -8}),
             "max_position_embeddings must be a positive integer, got -8"),
        Case("hidden size as a string", gen_ckpt(config={"hidden_size": "64"}),
             'hidden_size must be a positive integer, got "64"'),
        Case("zero layers", gen_ckpt(config={"num_hidden_layers": 0}), "num_hidden_layers must be a positive integer"),
        Case("float head count", gen_ckpt(config={"num_attention_heads": 4.0}),
             "num_attention_heads must be a positive integer, got 4.0"),
        Case("boolean vocab", gen_ckpt(config={"vocab_size": True}), "vocab_size must be a positive integer, got true"),
        Case("negative rms eps", gen_ckpt(config={"rms_norm_eps": -1e-6}), "rms_norm_eps must be a positive number"),
        Case("rope theta as a string", gen_ckpt(config={"rope_theta": "10000"}), "rope_theta must be a positive number"),
        Case("heads not a multiple of kv heads", gen_ckpt(config={"num_key_value_heads": 3}), "must be a multiple of"),
        Case("unsupported model_type", gen_ckpt(config={"model_type": "not-a-model"}), "model_type 'not-a-model'"),
        Case("no weights", gen_ckpt(drop=("model.safetensors",)), "has no *.safetensors weight files"),
        Case("truncated weights", gen_ckpt(edit=truncate("model.safetensors", -1000)),
             "model.safetensors is truncated: tensor"),
        Case("weights of 5 bytes", gen_ckpt(edit=truncate("model.safetensors", 5)), "truncated or not a safetensors file"),
        Case("header length garbage", gen_ckpt(edit=lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64)),
             "bad header length"),
        Case("float weight claims I32", gen_ckpt(edit=header_edit(set_dtype("model.norm.weight", "I32"))),
             "tensor model.norm.weight is I32 but must be a float tensor"),
        Case("unknown dtype in header", gen_ckpt(edit=header_edit(set_dtype("model.norm.weight", "F8_E4M3"))),
             "unsupported dtype F8_E4M3"),
        Case("shape disagrees with data", gen_ckpt(edit=header_edit(
            lambda h: h["model.norm.weight"].__setitem__("shape", [32]))), "inconsistent size for shape [32]"),
        Case("index names a missing shard", gen_ckpt(edit=lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))), "are missing"),
        Case("index not JSON", gen_ckpt(edit=lambda d: (d / "model.safetensors.index.json").write_text("{")),
             "not a valid safetensors index"),
        Case("no tokenizer", gen_ckpt(drop=("tokenizer.json",)), "has no tokenizer.json"),
        Case("broken tokenizer", gen_ckpt(edit=lambda d: (d / "tokenizer.json").write_text("{}")), "tokenizer.json"),
    ],
    "import": [
        Case("not a GGUF", lambda c: ["import", str(c.file("x.gguf", "PK\x03\x04 zip")), "-o", str(c.out / "m")],
             "is not a GGUF file"),
        Case("missing GGUF", lambda c: ["import", str(c.tmp / "none.gguf"), "-o", str(c.out / "m")], "does not exist"),
        Case("a float checkpoint", lambda c: ["import", str(c.ckpt()), "-o", str(c.out / "m")],
             "is not a GPTQ, AWQ or compressed-tensors checkpoint"),
        Case("GPTQ in marlin layout", lambda c: ["import", str(c.ckpt({"quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}})), "-o",
            str(c.out / "m")], "checkpoint_format 'marlin' is not supported"),
        Case("truncated GGUF", lambda c: ["import", str(c.file("t.gguf", c.gguf.read_bytes()[:4000])), "-o",
                                          str(c.out / "m")], "truncated"),
        Case("GGUF version 99", lambda c: ["import", str(gguf_with_version(c, 99)), "-o", str(c.out / "m")],
             "GGUF version 99"),
        Case("output exists", lambda c: ["import", str(c.gguf), "-o", str(c.out)], "already exists"),
        Case("output holds the GGUF", lambda c: ["import", str(shutil.copy(c.gguf, c.out / "m.gguf")), "-o",
                                                 str(c.out), "--force"], "holds the input"),
        Case("output parent is a file", lambda c: ["import", str(c.gguf), "-o", str(c.file("f", "x") / "m")],
             "cannot write"),
        Case("output on a full disk", lambda c: ["import", str(c.gguf), "-o", str(c.place("full") / "m")],
             "No space left on device"),
        Case("output read-only", lambda c: ["import", str(c.gguf), "-o", str(c.place("ro") / "m")],
             "Read-only file system"),
    ],
    "quantize": [
        Case("source missing", lambda c: ["quantize", str(c.tmp / "nope"), "-o", str(c.out / "q")], "model not found"),
        Case("bits 7", lambda c: ["quantize", str(c.model), "-o", str(c.out / "q"), "--bits", "7"], "--bits", 2),
        Case("group size 48", lambda c: ["quantize", str(c.model), "-o", str(c.out / "q"), "--group-size", "48"],
             "--group-size", 2),
        Case("output is the source", lambda c: ["quantize", str(c.model), "-o", str(c.model), "--force"],
             "is the source checkpoint"),
        Case("output holds the source", lambda c: ["quantize", str(c.ckpt()), "-o", str(c.tmp), "--force"],
             "holds the input"),
        Case("output exists", lambda c: ["quantize", str(c.model), "-o", str(c.out)], "already exists"),
        Case("source already quantized", lambda c: ["quantize", str(c.ckpt(config={"quantization": {
            "bits": 4, "group_size": 64}})), "-o", str(c.out / "q")], "already quantized"),
        Case("eval text not UTF-8", lambda c: ["quantize", str(c.model), "-o", str(c.out / "q"), "--eval",
                                               str(c.file("e.txt", b"ok \xc3\x28"))], "is not UTF-8 text: byte 0xc3 at offset 3"),
        Case("output on a full disk", lambda c: ["quantize", str(c.model), "-o", str(c.place("full") / "q")],
             "No space left on device"),
        Case("output read-only", lambda c: ["quantize", str(c.model), "-o", str(c.place("ro") / "q")],
             "Read-only file system"),
    ],
    "batch": [
        Case("output is the input", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [{"id": 1, "prompt": "x"}])),
                                              "-o", str(c.tmp / "in.jsonl")], "is the input file"),
        Case("errors file is the input", lambda c: ["batch", str(c.model), "-i", str(c.jsonl(
            "r.errors.jsonl", [{"id": 1, "prompt": "x"}])), "-o", str(c.tmp / "r.jsonl")], "is the input file"),
        Case("duplicate ids", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "x"}, {"id": 1, "prompt": "y"}])), "-o", str(c.out / "o.jsonl")], "ids must be unique"),
        Case("output is a directory", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "x"}])), "-o", str(c.out)], "directory", 2),
        Case("output parent is a file", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "x"}])), "-o", str(c.file("f", "x") / "o.jsonl")], "cannot write"),
        Case("input missing", lambda c: ["batch", str(c.model), "-i", str(c.tmp / "none.jsonl"), "-o",
                                         str(c.out / "o.jsonl")], "does not exist", 2),
        Case("input line not UTF-8", lambda c: ["batch", str(c.model), "-i", str(c.file("in.jsonl", b"\xff\xfe\n")),
                                                "-o", str(c.out / "o.jsonl")], "1 input line(s) skipped",
             leaves=("o.errors.jsonl",)),
        Case("temp nan flag", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [{"id": 1, "prompt": "x"}])),
                                         "-o", str(c.out / "o.jsonl"), "--temp", "nan"], "finite number", 2),
        Case("output on a full disk", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "The fox"}])), "-o", str(c.place("full") / "o.jsonl"), "--max-tokens", "2",
            "--backend", "mlx"], "No space left on device"),
        Case("output read-only", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "x"}])), "-o", str(c.place("ro") / "o.jsonl")], "Read-only file system"),
        Case("output locked by another run", lambda c: ["batch", str(c.model), "-i", str(c.jsonl("in.jsonl", [
            {"id": 1, "prompt": "x"}])), "-o", str(hold_lock(c, c.out / "o.jsonl"))], "being written by another umakit process (pid 4242)"),
    ],
    "records": [
        Case("compare a non-JSON record", lambda c: ["compare", str(c.file("r.json", "{"))], "is not a umakit bench record"),
        Case("compare a record without fields", lambda c: ["compare", str(c.file("r.json", "{}"))], "is not a umakit bench record"),
        Case("compare a non-UTF-8 record", lambda c: ["compare", str(c.file("r.json", b"\xff{}"))], "is not a umakit bench record"),
        Case("bench --compare a missing record", lambda c: ["bench", "--compare", str(c.tmp / "none.json")], "does not exist", 2),
        Case("bench --json read-only", lambda c: ["bench", str(c.model), "--json", str(c.place("ro") / "b.json")],
             "Read-only file system"),
        Case("bench --json under a file", lambda c: ["bench", str(c.model), "--json", str(c.file("f", "x") / "b.json")],
             "is a file, not a directory"),
        Case("eval text not UTF-8", lambda c: ["eval", str(c.model), "--text", str(c.file("e.txt", b"\x80abc"))],
             "at offset 0"),
        Case("eval text and corpus", lambda c: ["eval", str(c.model), "--text", str(c.file("e.txt", "x")), "--corpus",
                                                "wiki"], "exactly one of --text", 2),
    ],
    "environment": [
        Case("UMAKIT_HOME is a file", lambda c: [*G, "-m", str(c.gguf), "-p", "hi"], "set UMAKIT_HOME to a writable",
             env={"UMAKIT_HOME": "{tmp}/homefile"}),
        Case("UMAKIT_HOME read-only", lambda c: [*G, "-m", str(c.gguf), "-p", "hi"], "Read-only file system",
             env={"UMAKIT_HOME": "{ro}/home"}),
        Case("UMAKIT_HOME on a full disk", lambda c: [*G, "-m", str(c.gguf), "-p", "hi"], "No space left on device",
             env={"UMAKIT_HOME": "{full}"}, leaves=("models", "models/gguf")),
        Case("hardware.json under a file", lambda c: [*G, "-m", str(c.model), "-p", "hi"], "hardware.json: File exists",
             env={"UMAKIT_HOME": "{tmp}/homefile"}),
        Case("hardware.json read-only", lambda c: [*G, "-m", str(c.model), "-p", "hi"], "Read-only file system",
             env={"UMAKIT_HOME": "{ro}"}),
        Case("Hub id offline, not cached", lambda c: [*G, "-m", "someone/some-model", "-p", "hi"],
             "HF_HUB_OFFLINE is set", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{tmp}/hub"}),
    ],
}

ALL = [(cmd, case) for cmd, cases in CASES.items() for case in cases]


def _listing(place: Path) -> set[str]:
    return {str(p.relative_to(place)) for p in place.rglob("*")} if place.exists() else set()


def check_result(result, case: Case, before: set, place: Path) -> None:
    out = result.output
    assert "Traceback" not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == case.code, f"exit {result.exit_code}: {out}"
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out
    assert case.match in errors[0], errors[0]
    assert _listing(place) == before | set(case.leaves), f"left behind in {place}: {_listing(place) - before}"


@pytest.fixture
def ctx(tmp_path, tiny_dir, gguf_file, fault_places, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setitem(COMMANDS, "batch", "umakit.cli.batch_cmd:batch_cmd")
    c = Ctx(tmp_path, out, tiny_dir("llama"), gguf_file, fault_places, monkeypatch)
    yield c
    for undo in c.cleanup:
        undo()


@pytest.mark.parametrize("command,case", ALL, ids=[f"{cmd}: {case.name}" for cmd, case in ALL])
def test_bad_input_is_one_error_line(ctx, command, case, monkeypatch):
    (ctx.tmp / "homefile").write_text("not a directory")
    for k, v in case.env.items():
        if "{ro}" in v or "{full}" in v:
            kind = "ro" if "{ro}" in v else "full"
            ctx.place(kind)
            v = v.format(ro=ctx.places["ro"], full=ctx.places["full"])
        monkeypatch.setenv(k, v.format(tmp=ctx.tmp))
    args = case.args(ctx)
    place = ctx.out
    before = _listing(place)
    result = CliRunner().invoke(main, [str(a) for a in args], input=case.stdin)
    check_result(result, case, before, place)
    assert not [p for p in ctx.tmp.rglob(".*") if p.name.endswith((".tmp", ".lock")) and p.name != ".o.jsonl.lock"]


# -- batch lines: each bad item fails alone ------------------------------------------------------

BAD_LINES = [  # (line as written, a substring of its error)
    ('{"id": 1, "prompt": "x", "temperature": NaN}', "temperature must be a finite number"),
    ('{"id": 2, "prompt": "x", "temperature": Infinity}', "temperature must be a finite number"),
    ('{"id": 3, "prompt": "x", "temperature": "0.5"}', "temperature must be a number"),
    ('{"id": 4, "prompt": "x", "seed": 18446744073709551616}', "seed must be in"),
    ('{"id": 5, "prompt": "x", "seed": -9223372036854775809}', "seed must be in"),
    ('{"id": 6, "prompt": "x", "seed": 1.5}', "seed must be an integer"),
    ('{"id": 7, "prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1"),
    ('{"id": 8, "prompt": "x", "max_tokens": "3"}', "max_tokens must be an integer"),
    ('{"id": 9, "prompt": "x", "top_p": 2}', "top_p must be in (0, 1]"),
    ('{"id": 10, "prompt": "x", "top_k": -1}', "top_k must be >= 0"),
    ('{"id": 11, "prompt": "x", "repetition_penalty": 0}', "repetition_penalty must be > 0"),
    ('{"id": 12, "prompt": "x", "min_p": NaN}', "min_p must be a finite number"),
    ('{"id": 13, "prompt": "x", "stop": [1]}', "stop must be a string or a list of strings"),
    ('{"id": 14, "prompt": "x\\udcff"}', "prompt is not UTF-8 text"),
    ('{"id": 15, "prompt": "x", "system": 5}', "system must be a string"),
    ('{"id": 16, "messages": "hi"}', "messages must be a list"),
    ('{"id": 17, "messages": [{"role": "user", "content": "\\ud800"}]}', "unpaired surrogate"),
    ('{"id": 18, "prompt": "x", "tempreature": 1}', "unknown setting(s) tempreature"),
    ('{"id": 19, "prompt": ""}', "the prompt is empty"),
    ('{"id": 20, "prompt": "x", "top_k": true}', "top_k must be an integer"),
    ('{"id": 21, "prompt": "x", "stop": ["\\udc80"]}', "stop is not UTF-8 text"),
    ('{"id": 22, "prompt": "x"', "not valid JSON"),
    ('{"prompt": "x"}', "missing 'id'"),
    ('{"id": [1], "prompt": "x"}', "'id' must be a string or an integer"),
    ('{"id": 25}', "needs 'prompt' or 'messages'"),
    ('"just a string"', "expected a JSON object"),
    (b'{"id": 27, "prompt": "\xff"}', "not UTF-8 text"),
]


def test_each_bad_batch_line_fails_alone(ctx):
    lines = [raw if isinstance(raw, bytes) else raw.encode() for raw, _ in BAD_LINES]
    inp = ctx.file("in.jsonl", b"\n".join([b'{"id": "good", "prompt": "The fox"}', *lines]) + b"\n")
    out = ctx.out / "o.jsonl"
    result = CliRunner().invoke(main, ["batch", str(ctx.model), "-i", str(inp), "-o", str(out), "--max-tokens", "2",
                                       "--backend", "mlx", "--raw"])
    case = Case("bad lines", lambda c: [], f"{len(BAD_LINES)} input line(s) skipped")
    check_result(result, case, {"o.jsonl", "o.errors.jsonl"}, ctx.out)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["good"]
    errors = [json.loads(line) for line in (ctx.out / "o.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == list(range(2, len(BAD_LINES) + 2))
    for e, (_, want) in zip(errors, BAD_LINES):
        assert want in e["error"], (e, want)


# -- a few end to end, as real processes ----------------------------------------------------------

PROCESS_CASES = [
    ("generate", "stdin not UTF-8"),
    ("checkpoint", "negative context length"),
    ("batch", "output on a full disk"),
    ("import", "output read-only"),
    ("environment", "UMAKIT_HOME is a file"),
]


@pytest.mark.parametrize("command,name", PROCESS_CASES, ids=[f"{c}: {n}" for c, n in PROCESS_CASES])
def test_as_a_real_process(ctx, command, name):
    case = next(c for c in CASES[command] if c.name == name)
    uses_fault = name.endswith(("full disk", "read-only"))
    if uses_fault and any(FAULT_MODE.get(k) == "injected" for k in ("full", "ro")):
        pytest.skip("injected faults patch this process only; a child process needs the tmpfs mounts")
    (ctx.tmp / "homefile").write_text("not a directory")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.update({k: v.format(tmp=ctx.tmp) for k, v in case.env.items()})
    args = case.args(ctx)
    place = ctx.out
    before = _listing(place)
    register = "from umakit.cli.main import COMMANDS, main; COMMANDS.setdefault('batch', 'umakit.cli.batch_cmd:batch_cmd'); main()"
    p = subprocess.run([sys.executable, "-c", register, *map(str, args)], input=case.stdin, capture_output=True,
                       timeout=120, env=env)
    out = (p.stdout + p.stderr).decode("utf-8", "replace")
    assert "Traceback" not in out, out
    assert p.returncode == case.code, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and case.match in errors[0], out
    assert _listing(place) == before | set(case.leaves)


# -- the counts the suite covers ----------------------------------------------------------------


def coverage() -> dict[str, int]:
    """Distinct bad inputs and faults by command (batch lines counted apart from batch's flags and files)."""
    counts = {cmd: len(cases) for cmd, cases in CASES.items()}
    counts["batch lines"] = len(BAD_LINES)
    return counts


def test_the_suite_covers_at_least_60_distinct_bad_inputs():
    names = [(cmd, case.name) for cmd, case in ALL]
    assert len(names) == len(set(names)), "a case name is repeated"
    counts = coverage()
    print("distinct bad inputs by command:", counts, "total", sum(counts.values()), "faults:", FAULT_MODE)
    assert sum(counts.values()) >= 60


if __name__ == "__main__":
    print(json.dumps(coverage(), indent=2), sum(coverage().values()))
