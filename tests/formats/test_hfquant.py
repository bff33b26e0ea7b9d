"""GPTQ, AWQ and compressed-tensors checkpoints (checkpoint/hfquant) against their float twins.

A tiny model's linear layers are put on a grid of integer codes (w = scale * (q - zero), groups along the input),
written once as the float twin (the grid's values, float32) and once packed in a format. compressed-tensors packs
with its own compressor, which is also the oracle of the dequantized weights; GPTQ's and AWQ's libraries do not
install on a CPU-only machine (CUDA builds), so their layouts are packed here after their packers (GPTQModel's
`pack_original`, AutoAWQ's `WQLinear_GEMM.from_linear`): the bit streams, GPTQ's zeros stored less one, AWQ's
interleaved order. The import must give the grid's weights exactly, and the engines the twin's greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import umakit
from umakit.checkpoint.gguf.quants import pack
from umakit.checkpoint.hfquant import layouts
from umakit.errors import CheckpointError, UnsupportedModelError
from support.tiny import make_tiny_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", ".w1", ".w2", ".w3")


def grid(w: torch.Tensor, bits: int, group: int, symmetric: bool, seed: int, dtype=torch.float16):
    """(codes (out, in), scales (out, groups) in ``dtype``, zeros (out, groups) int): a min-max grid of ``w``."""
    out, cols = w.shape
    g = w.reshape(out, cols // group, group)
    top = 2 ** bits - 1
    if symmetric:
        scales = (g.abs().amax(-1) / (top // 2)).to(dtype).float()
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / top).to(dtype).float()
        zeros = torch.round(-lo / scales).clamp(1, top).long()  # GPTQ's zeros less one: 0 has no form
        zeros[0, 0] = torch.randint(1, top + 1, (), generator=torch.Generator().manual_seed(seed))  # any zero
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, top).long().reshape(out, cols)
    return q, scales.to(dtype), zeros


def dequantized(q, scales, zeros, group):
    rep = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    return (q.float() - rep(zeros)) * rep(scales)


def bitstream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, n) codes -> (rows, n * bits / 32) int32: each row a little-endian bit stream (GPTQ's 2, 3, 4 and
    8 bits: a 3-bit code may straddle two words)."""
    rows, n = q.shape
    bit = ((q.numpy()[..., None] >> np.arange(bits)) & 1).astype(np.uint64).reshape(rows, n * bits // 32, 32)
    words = (bit << np.arange(32, dtype=np.uint64)).sum(-1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def pack_gptq(q, scales, zeros, group, bits):
    return {"qweight": bitstream(q, bits).T.contiguous(),  # (in * bits / 32, out): along the input
            "qzeros": bitstream((zeros - 1).T.contiguous(), bits),  # (groups, out * bits / 32), less one
            "scales": scales.T.contiguous(), "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // group}


def pack_awq(q, scales, zeros):
    def words(t):  # (rows, out) -> (rows, out / 8), nibble i holding output 8c + AWQ_ORDER[i]
        t = t.reshape(len(t), -1, 8)[..., AWQ_ORDER]
        return ((t << (torch.arange(8) * 4)).sum(-1)).to(torch.uint32).view(torch.int32)
    return {"qweight": words(q.T.contiguous()), "qzeros": words(zeros.T.contiguous()), "scales": scales.T.contiguous()}


def pack_ct(w_grid, scales, zeros, bits, group, symmetric):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, group_size=group, strategy="group")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": w_grid, "weight_scale": scales}
    if not symmetric:
        state["weight_zero_point"] = (zeros - 2 ** (bits - 1)).to(torch.int8)
    packed = dict(PackedQuantizationCompressor.compress(state, scheme))
    oracle = PackedQuantizationCompressor.decompress({**packed, "weight_scale": scales.float()}, scheme)["weight"]
    assert torch.equal(oracle, w_grid)  # compressed-tensors reads back the grid we mean
    return packed, args


def foreign(tmp: Path, method: str, bits: int = 4, group: int = 32, symmetric: bool = False, family: str = "qwen2"):
    """(the packed checkpoint, its float twin, {module: grid weights}) of a tiny ``family``: qwen2's q/k/v biases
    random (transformers makes them zero); a llama's linears given a zero bias each, as AutoGPTQ writes them."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(family, tmp / "float")
    twin, packed_dir = tmp / "twin", tmp / method
    for d in (twin, packed_dir):
        shutil.copytree(src, d)
    state = load_file(src / "model.safetensors")
    float_state, packed_state, grids, args = {}, {}, {}, None
    for i, (name, w) in enumerate(sorted(state.items())):
        module = name.rsplit(".", 1)[0]
        if module.endswith(LINEARS) and name.endswith(".bias"):
            w = torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) * 0.1
        if not module.endswith(LINEARS) or not name.endswith(".weight"):
            float_state[name] = packed_state[name] = w
            continue
        if family == "llama":
            packed_state[f"{module}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        # compressed-tensors' checkpoints of bfloat16 models keep bfloat16 scales
        dtype = torch.bfloat16 if method == "compressed-tensors" and family == "llama" else torch.float16
        q, scales, zeros = grid(w.float(), bits, group, symmetric, seed=i, dtype=dtype)
        w_grid = dequantized(q, scales, zeros, group)
        grids[module] = float_state[name] = w_grid
        if method == "gptq":
            parts = pack_gptq(q, scales, zeros, group, bits)
        elif method == "awq":
            parts = pack_awq(q, scales, zeros)
        else:
            parts, args = pack_ct(w_grid, scales, zeros, bits, group, symmetric)
        packed_state.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
    save_file(float_state, twin / "model.safetensors")
    save_file(packed_state, packed_dir / "model.safetensors")
    config = json.loads((packed_dir / "config.json").read_text())
    if method == "gptq":
        q = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
             "checkpoint_format": "gptq"}
    elif method == "awq":
        q = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                           "input_activations": None}}, "ignore": ["lm_head"]}
    config["quantization_config"] = q
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, twin, grids


CASES = [("gptq", 4, 32, False, "llama"), ("gptq", 8, 64, True, "qwen2"), ("gptq", 3, 32, False, "qwen2"),
         ("awq", 4, 32, False, "qwen2"), ("compressed-tensors", 4, 32, True, "qwen2"),
         ("compressed-tensors", 4, 64, False, "llama"), ("compressed-tensors", 8, 32, True, "qwen2")]


@pytest.mark.parametrize("method,bits,group,symmetric,family", CASES)
def test_the_import_holds_the_checkpoints_weights_exactly(tmp_path, method, bits, group, symmetric, family):
    from safetensors.numpy import load_file

    from umakit.backends.torch.quant import layout
    from umakit.checkpoint.hfquant import import_checkpoint

    packed, _, grids = foreign(tmp_path, method, bits, group, symmetric, family)
    report = import_checkpoint(packed, tmp_path / "out")
    assert (report.method, report.layers, report.bits, report.group) == (method, len(grids), bits, group)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["umakit"]["source"] == method
    weights = load_file(tmp_path / "out" / "model.safetensors")
    for module, want in grids.items():
        w, s, b = (torch.from_numpy(weights[f"{module}.{k}"].astype(np.float32) if k != "weight" else
                                    weights[f"{module}.{k}"].view(np.int32)) for k in ("weight", "scales", "biases"))
        got = layout.dequantize(w.view(torch.uint32), s, b, bits, group)
        assert torch.equal(got, want), module
        if symmetric:  # the kernel then reads the scales alone
            assert torch.equal(b, s * -(2 ** (bits - 1)))


@pytest.mark.parametrize("method,bits,group,symmetric,family", [c for c in CASES if c[1] != 3])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_packed_checkpoint_runs_as_its_float_twin(tmp_path, method, bits, group, symmetric, family, backend):
    """Loaded by its directory, as a user gives it: imported once into umakit's cache, then the same logits and
    greedy tokens as the float model holding the same weights."""
    packed, twin, _ = foreign(tmp_path, method, bits, group, symmetric, family)
    model = umakit.load(packed, backend=backend, device="cpu", dtype="float32")
    ref = umakit.load(twin, backend=backend, device="cpu", dtype="float32")
    ids = [3, 17, 99, 250, 7, 401, 12]
    ours, want = model.logits(ids), ref.logits(ids)
    assert np.abs(ours - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    options = dict(max_tokens=12, temperature=0.0)
    assert model.generate("The quick brown fox", **options).tokens == ref.generate("The quick brown fox", **options).tokens
    again = umakit.load(packed, backend=backend, device="cpu", dtype="float32")  # the cached import, not redone
    assert again.info.path == model.info.path != packed


def test_act_order_and_unsupported_schemes_are_refused_by_name(tmp_path):
    from umakit.checkpoint.hfquant import import_checkpoint

    packed, _, _ = foreign(tmp_path, "gptq", 4, 32, False)
    from safetensors.torch import load_file, save_file

    state = load_file(packed / "model.safetensors")
    name = next(n for n in state if n.endswith("q_proj.g_idx"))
    state[name] = state[name].flip(0).contiguous()  # act-order: inputs of one group apart
    save_file(state, packed / "model.safetensors")
    with pytest.raises(CheckpointError, match="act-order"):
        import_checkpoint(packed, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    config = json.loads((packed / "config.json").read_text())
    for q, words in [({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "gemv"),
                     ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {}}},
                      "float-quantized"),
                     ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                         "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                         "input_activations": {"num_bits": 8, "type": "int"}}}}, "activations are quantized"),
                     ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                         "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}},
                       "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme")]:
        (packed / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
        with pytest.raises(UnsupportedModelError, match=words):
            import_checkpoint(packed, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_umakit_import_writes_the_directory(tmp_path):
    from click.testing import CliRunner

    from umakit.cli.main import main

    run_cli = lambda *args: CliRunner().invoke(main, list(args))  # noqa: E731
    packed, _, grids = foreign(tmp_path, "awq")
    result = run_cli("import", str(packed), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert f"{len(grids)} layers" in result.output and "AWQ" in result.output
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    again = run_cli("import", str(packed), "-o", str(tmp_path / "out"))
    assert again.exit_code != 0 and again.output.startswith("Error:") and "--force" in again.output


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_a_first_use_reports_the_imports_progress(tmp_path, monkeypatch, method):
    """A packed checkpoint given by its path hears its import as a GGUF's does: to the checkpoint's tensor bytes,
    on its first use only."""
    import umakit
    from umakit.checkpoint.files import read_safetensors_header, weight_files

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    packed, _, _ = foreign(tmp_path, method)
    total = sum(t.nbytes for f in weight_files(packed) for t in read_safetensors_header(f).values())
    seen = []
    first = umakit.resolve_model(packed, progress=lambda done, all_: seen.append((done, all_)))
    done = [d for d, _ in seen]
    assert len(seen) > 2 and done == sorted(done) and {t for _, t in seen} == {total} and done[-1] == total
    assert umakit.resolve_model(packed, progress=lambda *a: pytest.fail("reported again")) == first


def test_bit_streams_round_trip_at_every_width():
    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 5, 6, 8):
        q = rng.integers(0, 2 ** bits, size=(5, 96)).astype(np.uint8)
        words = pack(q, bits)
        assert words.shape == (5, 96 * bits // 32)
        assert np.array_equal(layouts.codes(words, bits, 96), q)
        assert np.array_equal(words.view(np.int32), bitstream(torch.from_numpy(q.astype(np.int64)), bits).numpy())


def test_plan_and_ls_read_the_packed_checkpoint_before_it_is_imported(tmp_path):
    from umakit.checkpoint.hfquant.detect import foreign_block
    from umakit.checkpoint.inventory import _describe
    from umakit.plan.planner import plan_model

    packed, twin, _ = foreign(tmp_path, "compressed-tensors", 4, 64, False, "llama")
    config = json.loads((packed / "config.json").read_text())
    assert foreign_block(config)["bits"] == 4 and foreign_block(config)["group_size"] == 64
    assert _describe(packed) == ("llama", "compressed-tensors 4-bit g64")
    ours = plan_model(config, bits=None)
    float_plan = plan_model(json.loads((twin / "config.json").read_text()), bits=None)
    four_bit = plan_model(json.loads((twin / "config.json").read_text()), bits=4, group_size=64)
    assert ours.weight_bytes < float_plan.weight_bytes  # not planned as float
    assert ours.weight_bytes > four_bit.weight_bytes  # the embedding and head stay float


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_moe_whose_experts_are_quantized_one_by_one_runs_on_both_engines(tmp_path, family):
    """GPTQ and AWQ MoE checkpoints quantize each routed expert's projections as their own layers: the torch engine
    takes them so, MLX stacks their scales and biases as mlx-lm stacks their codes; transformers, which fuses the
    experts into one tensor, refuses them by name."""
    packed, twin, grids = foreign(tmp_path, "gptq", 4, 32, False, family)
    assert any(".experts." in m for m in grids)
    ids = [3, 17, 99, 250, 7]
    for backend in ("torch", "mlx"):
        model = umakit.load(packed, backend=backend, device="cpu", dtype="float32")
        ref = umakit.load(twin, backend=backend, device="cpu", dtype="float32")
        want = ref.logits(ids)
        assert np.abs(model.logits(ids) - want).max() < 1e-4 * max(1.0, np.abs(want).max()), backend
    with pytest.raises(UnsupportedModelError, match="experts stored one by one"):
        umakit.load(packed, backend="transformers", device="cpu", dtype="float32")


@pytest.mark.parametrize("method,side", [("gptq", "quantize_config.json"), ("awq", "quant_config.json")])
def test_an_older_checkpoint_with_its_quantization_beside_config_json(tmp_path, method, side):
    """AutoGPTQ and AutoAWQ wrote their settings to a file of their own before transformers read them from
    config.json: such a checkpoint imports as well, by its directory."""
    packed, twin, _ = foreign(tmp_path, method, 4, 32, False)
    config = json.loads((packed / "config.json").read_text())
    q = config.pop("quantization_config")
    q.pop("quant_method")
    if method == "awq":  # AutoAWQ's own names
        q = {"w_bit": q["bits"], "q_group_size": q["group_size"], "zero_point": True, "version": "GEMM"}
    (packed / side).write_text(json.dumps(q))
    (packed / "config.json").write_text(json.dumps(config))
    model = umakit.load(packed, backend="torch", device="cpu", dtype="float32")
    ids = [3, 17, 99, 250, 7]
    want = umakit.load(twin, backend="torch", device="cpu", dtype="float32").logits(ids)
    assert np.abs(model.logits(ids) - want).max() < 1e-4 * max(1.0, np.abs(want).max())
