"""Every architecture of the GGUF import list runs on the default engine (torch on this CPU), as transformers
runs the same GGUF file."""

import itertools

import numpy as np
import pytest

import umakit
from support.gguf_files import EXACT_LAYERS, IDS, LLAMA_FTYPES, hf_forward, llama_quantize, write_gguf
from support.markers import LLAMA_PYTHON, requires_llama_quantizer
from umakit.backends.torch.cpu import affine_kernel as affine
from umakit.generate.sampling import SamplingParams
from gguf import GGMLQuantizationType as T
from umakit.checkpoint.gguf import import_gguf
from umakit.checkpoint.gguf.arch import SPECS


# transformers' GGUF reader, the oracle here, does not read smollm3 (tests/formats/test_gguf_smollm3.py has its own)
OWN_FILES = {"smollm3", "gpt-oss", "gemma4", "qwen35", "qwen35moe", "qwen3next"}  # in test_gguf_<arch>.py


@pytest.mark.parametrize("arch", sorted(set(SPECS) - OWN_FILES))
def test_imported_gguf_runs_on_the_default_engine(arch, tmp_path, monkeypatch):
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    layers = EXACT_LAYERS * (3 if arch == "gemma3" else 1)  # gemma3: 5 sliding layers and a global one
    src = write_gguf(tmp_path / f"{arch}.gguf", arch, layers=layers, tied=arch != "llama", output=T.Q4_K)
    import_gguf(src, tmp_path / "out")
    model = umakit.load(tmp_path / "out", dtype="float32")
    assert (model.info.backend, model.info.device) == ("torch", "cpu")
    ours, ref = model.logits(IDS), hf_forward(src, IDS)
    assert np.abs(ours - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()


FLOAT_LAYER = dict(attn_q=T.F16, attn_k=T.F16, attn_v=T.F16, attn_output=T.F16, ffn_gate=T.F16, ffn_up=T.F16,
                   ffn_down=T.F16)


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    """A tiny qwen2 (biases, a tied table) in float16, rows multiples of 256 so K-quants apply."""
    return write_gguf(tmp_path_factory.mktemp("f16") / "tiny.F16.gguf", "qwen2", layers=[FLOAT_LAYER] * 2,
                      tied=True, embed=T.F16)


@requires_llama_quantizer
@pytest.mark.parametrize("ftype", sorted(LLAMA_FTYPES))
def test_files_quantized_by_llama_cpp_run_packed_as_transformers_reads_them(ftype, float_gguf, tmp_path,
                                                                            monkeypatch):
    """Each common type as llama.cpp's quantizer makes it (K-quant mixes with Q6_K and Q8_0 tensors among them):
    imported, run on the default engine's packed kernels, against transformers' float32 reading of the file.
    Tolerance: exact types differ by float16 scales (K-quants) and the kernel's inputs (below); Q6_K tensors are
    re-quantized to 8 bits (an eighth of a Q6_K step)."""
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    src = llama_quantize(LLAMA_PYTHON, float_gguf, tmp_path / f"tiny.{ftype}.gguf", ftype)
    report = import_gguf(src, tmp_path / "out")
    lossy = {t.from_type for t in report.lossy_tensors}
    assert lossy <= {"Q6_K"}, lossy
    model = umakit.load(tmp_path / "out")
    kinds = {type(m).__name__ for m in model.engine.model.modules()}
    if affine.available():
        assert "AffineLinear" in kinds and "Linear" not in kinds, kinds  # every layer packed, none dequantized
    # float32 inputs: float16 scales and float32 sums; int8 inputs in one pass round x to 8 bits, which these
    # 2-layer random models carry to 1-3% of a logit; in two (the CPU default where the kernel has them), 15
    form = affine.inputs() if affine.available() else affine.FLOAT32
    tolerance = {affine.FLOAT32: 2e-3, affine.INT8: 0.04, affine.INT8X2: 2e-3}[form] + (0.02 if lossy else 0)
    ours, ref = model.logits(IDS), hf_forward(src, IDS)
    assert np.abs(ours - ref).max() <= tolerance * np.abs(ref).max()
    # greedy tokens: each one transformers' argmax too, wherever its top two are further apart than the tolerance
    stream = model.engine.generate_tokens(IDS, model.engine.make_cache(), SamplingParams(temperature=0))
    tokens = list(itertools.islice(stream, 6))
    ref = hf_forward(src, IDS + tokens[:-1])[len(IDS) - 1:]
    for token, row in zip(tokens, ref, strict=True):
        top2 = np.sort(row)[-2:]
        assert token == row.argmax() or top2[1] - top2[0] <= 2 * tolerance * np.abs(row).max()


Q6K_LAYERS = [dict(EXACT_LAYERS[0], attn_q=T.Q6_K, ffn_down=T.Q6_K), EXACT_LAYERS[1]]


def test_q6_k_tensors_are_imported_exactly_in_groups_of_16_beside_the_8_bit_ones(tmp_path):
    """MLX cannot hold groups of 16: the weights keep Q6_K re-quantized to 8 bits, and exact/groups16 the GGUF's
    own codes and scales, whose products are the gguf package's dequantization exactly."""
    import gguf
    from gguf import quants as gguf_quants
    from safetensors.numpy import load_file

    from support.gguf_files import SHAPES, hf_name_of, reverse_permute
    from umakit.checkpoint.gguf.finished import EXACT16_FILE
    from umakit.backends.torch.quant.layout import dequantize
    import json
    import torch

    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    import_gguf(src, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "config.json").read_text())["umakit"]["exact_groups"]
    assert meta["file"] == EXACT16_FILE
    assert meta["layers"] == {name: {"bits": 6, "group_size": 16, "from": "Q6_K"} for name in (
        "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head")}
    held = load_file(str(tmp_path / "out" / EXACT16_FILE))
    heads = SHAPES["llama"][0]
    for t in gguf.GGUFReader(src).tensors:
        if t.tensor_type != T.Q6_K:
            continue
        module = hf_name_of(t.name, "llama").removesuffix(".weight")
        want = gguf_quants.dequantize(np.asarray(t.data), t.tensor_type)
        if ".attn_q." in t.name:
            want = reverse_permute(want, heads)
        scales = torch.from_numpy(held[f"{module}.scales"])
        got = dequantize(torch.from_numpy(held[f"{module}.weight"]), scales, scales * -32, 6, 16)
        assert np.array_equal(got.numpy(), want), module


@pytest.mark.skipif(not affine.available(), reason="umakit's CPU kernel is not built here")
@pytest.mark.parametrize("backend", ["auto", "transformers"])
def test_q6_k_layers_run_exactly_on_the_cpu_kernel(tmp_path, monkeypatch, backend):
    """The default engine, and the transformers engine (which the families without compact code take), load the
    exact groups for the kernel (scales as codes: the GGUF's 6.5625 bits a weight, not 8.5) and agree with
    transformers' reading of the file as closely as the exact types do."""
    from umakit import backends

    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    import_gguf(src, tmp_path / "out")
    model = umakit.load(tmp_path / "out", backend=backend)
    net = model.engine.model
    for layer in (net.lm_head, net.model.layers[0].mlp.down_proj):
        assert (layer.bits, layer.groups, layer.sb0.dtype) == ([6], [16], torch_uint8())
        assert (layer.codes0.numel() + layer.sb0.numel()) * 8 / (layer.codes0.shape[0] * layer.in_features) == 6.5625
    tolerance = {affine.FLOAT32: 2e-3, affine.INT8: 0.04, affine.INT8X2: 2e-3}[affine.inputs()]
    ours, ref = model.logits(IDS), hf_forward(src, IDS)
    assert np.abs(ours - ref).max() <= tolerance * np.abs(ref).max()


def torch_uint8():
    import torch

    return torch.uint8


def test_the_re_quantized_tensors_the_exact_groups_replace_are_never_read(tmp_path, monkeypatch):
    """The 8-bit Q6_K tensors stay for MLX; the torch engine's CPU kernel loads the exact ones and reads nothing
    of the others."""
    from safetensors import safe_open

    from umakit.backends.torch.load import exact
    from umakit.checkpoint.files import open_checkpoint
    from umakit.backends.torch.load.loader import stream_checkpoint

    src = write_gguf(tmp_path / "q6k.gguf", "llama", layers=Q6K_LAYERS, tied=False, output=T.Q6_K)
    import_gguf(src, tmp_path / "out")
    ckpt = open_checkpoint(tmp_path / "out")
    shapes = {k: t.shape for k, t in ckpt.tensors.items()}
    read = []
    real = safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr("safetensors.safe_open", Spy)
    config, shapes, source = exact.substitute(ckpt, ckpt.config, shapes,
                                              lambda skip=frozenset(): stream_checkpoint(ckpt, "cpu", None, skip))
    names = [name for name, _ in source()]
    assert sorted(names) == sorted(shapes)  # every tensor the model needs, once
    replaced = {f"{m}.{p}" for m in exact.layers(ckpt) for p in ("weight", "scales", "biases")}
    assert len(read) == len(ckpt.tensors) - len(replaced) + 2 * len(exact.layers(ckpt))
    assert config["quantization"]["lm_head"] == {"bits": 6, "group_size": 16}
