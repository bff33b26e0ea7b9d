"""`umakit plan`: memory anatomy from config shapes, device fits and offload splits, the CLI."""

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner

import umakit.cli.main
from umakit.plan import planner as P
from umakit.errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from umakit.hardware import GiB, DeviceInfo, lookup_device
from umakit.plan.placement import RING_SLOTS, ROUTED_EXPERTS, WHOLE_LAYERS, reserved_bytes
from umakit.plan.roofline import offload_ceiling_tps
from umakit.plan.shapes import KV_RESERVE_TOKENS

PRESETS = ["deepseek-v3", "gemma-3-12b", "gemma-3-1b", "gemma-3-27b", "gemma-3-4b", "llama-2-13b", "llama-2-70b",
           "llama-2-7b", "llama-3-70b", "llama-3-8b", "llama-3.1-405b", "llama-3.1-70b", "llama-3.1-8b",
           "llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b", "mistral-7b", "mistral-large", "mixtral-8x22b",
           "mixtral-8x7b", "qwen2.5-72b", "qwen2.5-7b", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-8b",
           "smollm2-135m"]


def plan(preset, **kwargs):
    return P.plan_model(P.load_preset(preset), name=preset, **kwargs)


def cat(p, name):
    return next(c for c in p.categories if c.name == name)


def test_llama2_7b_kv_cache_worked_examples():
    assert plan("llama-2-7b").kv_bytes == 4 * GiB  # default context 8192
    assert plan("llama-2-7b", context=32768).kv_bytes == 16 * GiB
    assert plan("llama-2-7b", context=32768, batch=4).kv_bytes == 64 * GiB
    assert plan("llama-2-7b").kv_bytes_per_token == 512 * 1024


def test_llama3_8b_weights_fp16_and_4bit():
    fp16 = plan("llama-3-8b")
    assert fp16.params == 8_030_261_248
    assert 16.0e9 < fp16.weight_bytes < 16.1e9  # about 16 GB
    assert 4.0e9 < fp16.params * 4 / 8 < 4.1e9  # about 4 GB at 4 bits before group overhead
    q4 = plan("llama-3-8b", bits=4, recipe="uniform")
    norms = cat(q4, "norms").params
    # every matrix at 4.5 bits (4-bit, group 64, fp16 scale and bias), norms at 16 bits
    assert q4.weight_bytes == pytest.approx((q4.params - norms) * 4.5 / 8 + norms * 2, abs=8)
    assert cat(q4, "mlp").bits_per_weight == 4.5
    mixed = plan("llama-3-8b", bits=4, embed_bits=8)
    assert cat(mixed, "embedding").bits_per_weight == cat(mixed, "head").bits_per_weight == 8.5
    assert cat(mixed, "attention").bits_per_weight == 4.5


def test_bits_follow_the_quantize_recipes():
    # `umakit quantize --bits 4` keeps embeddings and head at 8 bits: 5.04 GB for Llama-3-8B, not 4.52
    q4 = plan("llama-3-8b", bits=4)
    assert (q4.recipe, q4.embed_bits) == ("default", 8)
    assert q4.weight_bytes == plan("llama-3-8b", bits=4, embed_bits=8).weight_bytes == 5_042_741_248
    assert cat(q4, "embedding").bits_per_weight == cat(q4, "head").bits_per_weight == 8.5
    # mixed: v_proj and down_proj of the first and last two blocks at 8 bits too
    mixed = plan("llama-3-8b", bits=4, recipe="mixed")
    v, down = 4096 * 1024, 14336 * 4096
    assert mixed.weight_bytes - q4.weight_bytes == 4 * (v + down) * (8.5 - 4.5) / 8
    assert mixed.layers[0].total > mixed.layers[2].total == mixed.layers[29].total < mixed.layers[31].total
    assert 4.5 < cat(mixed, "mlp").bits_per_weight < 8.5
    with pytest.raises(InvalidArgumentError, match="recipe"):
        plan("llama-3-8b", bits=4, recipe="nope")


def test_categories_of_an_untied_and_a_tied_model():
    p = plan("llama-3-8b")
    assert cat(p, "embedding").params == cat(p, "head").params == 128256 * 4096
    assert cat(p, "embedding").read_bytes_per_step == 4096 * 2  # one row per token
    assert cat(p, "head").read_bytes_per_step == cat(p, "head").bytes
    s = plan("smollm2-135m")
    assert s.params == 134_515_008
    assert cat(s, "head").params == 0 and cat(s, "head").bytes == 0
    assert cat(s, "head").read_bytes_per_step == cat(s, "embedding").bytes  # tied: reads the whole table
    assert s.step_read_bytes == s.weight_read_bytes_per_step + s.kv_bytes
    assert s.total_bytes == s.weight_bytes + s.kv_bytes + s.working_bytes


def test_moe_reads_only_the_routed_experts():
    p = plan("mixtral-8x7b")
    assert 46.6e9 < p.params < 46.8e9
    mlp = cat(p, "mlp")
    router = 32 * 4096 * 8 * 2
    assert mlp.read_bytes_per_step == pytest.approx((mlp.bytes - router) * 2 / 8 + router, rel=1e-9)
    assert p.weight_read_bytes_per_step < 0.3 * p.weight_bytes
    wide = plan("mixtral-8x7b", batch=8)
    assert cat(wide, "mlp").read_bytes_per_step > mlp.read_bytes_per_step  # more tokens, more experts
    assert any("MoE" in n for n in p.notes)


def test_sliding_window_layers_cap_their_cache():
    g = plan("gemma-3-27b")
    per_layer = 2 * 16 * 128 * 2
    assert g.kv_bytes == per_layer * (10 * 8192 + 52 * 1024)
    assert plan("gemma-3-27b", context=512).kv_bytes == per_layer * 62 * 512
    assert any("window" in n for n in g.notes)
    # Qwen2.5 declares a window but does not use it
    assert plan("qwen2.5-7b").kv_bytes == 2 * 28 * 4 * 128 * 2 * 8192


def test_qwen_biases_counted():
    assert plan("qwen2.5-7b").params == 7_615_616_512


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize("cls, extra", [
    ("LlamaConfig", dict(tie_word_embeddings=False)),
    ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    ("Qwen2Config", dict(tie_word_embeddings=True)),
    ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16)),
    ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    ("Qwen3MoeConfig", dict(tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)),
    ("DeepseekV3Config", dict(tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                              q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=2,
                              topk_group=1, num_key_value_heads=4)),
    # gemma4: global heads of their own size and count, values from keys, shared layers, per-layer inputs, experts
    ("Gemma4TextConfig", dict(head_dim=16, sliding_window=8, hidden_size_per_layer_input=0)),
    ("Gemma4TextConfig", dict(head_dim=16, sliding_window=8, num_hidden_layers=6, global_head_dim=32,
                              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                              use_double_wide_mlp=True, hidden_size_per_layer_input=16,
                              layer_types=["sliding_attention", "full_attention"] * 3)),
    ("Gemma4TextConfig", dict(head_dim=16, sliding_window=8, hidden_size_per_layer_input=0, enable_moe_block=True,
                              num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
])
def test_parameter_count_matches_transformers(cls, extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, cls)(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    # DeepSeek's router score correction bias is a buffer to torch but a tensor of the checkpoint
    expected += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    expected += sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))  # gemma4's, saved
    assert P.plan_model(config.to_dict()).params == expected


@pytest.mark.parametrize("kwargs, flag", [(dict(bits=5), "--bits"), (dict(kv_bits=2), "--kv-bits"),
                                          (dict(embed_bits=3), "--embed-bits"), (dict(group_size=48), "--group-size"),
                                          (dict(context=0), "--context"), (dict(batch=0), "--batch")])
def test_bad_arguments(kwargs, flag):
    with pytest.raises(InvalidArgumentError, match=flag):
        plan("llama-3-8b", **kwargs)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        P.plan_model({"num_hidden_layers": 2})
    with pytest.raises(ModelNotFoundError, match="llama-3-8b"):
        P.load_preset("llama-9")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError):
        P.load_config(tmp_path)
    with pytest.raises(ModelNotFoundError):
        P.load_config(tmp_path / "missing")


def test_presets_all_load_and_plan():
    assert P.list_presets() == PRESETS
    for name in PRESETS:
        assert plan(name, bits=4).total_bytes > 0
    s = P.load_preset("smollm2-135m")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "tie_word_embeddings", "rope_theta", "max_position_embeddings", "model_type")
    assert tuple(s[k] for k in keys) == (576, 30, 9, 3, 1536, 49152, True, 100000.0, 8192, "llama")


# Parameter counts the model cards publish (billions, as rounded there), text model only.
PUBLISHED_PARAMS = {"deepseek-v3": 671, "llama-3.1-405b": 405, "llama-3.2-1b": 1.23, "llama-3.2-3b": 3.21,
                    "llama-3.3-70b": 70.6, "qwen3-8b": 8.2, "qwen3-32b": 32.8, "qwen3-30b-a3b": 30.5,
                    "qwen3-235b-a22b": 235, "mixtral-8x22b": 141, "mistral-large": 123, "gemma-3-1b": 1.0}


@pytest.mark.parametrize("name, billions", sorted(PUBLISHED_PARAMS.items()))
def test_presets_have_the_published_sizes(name, billions):
    assert plan(name).params / 1e9 == pytest.approx(billions, rel=0.01)


def test_moe_active_parameters_match_the_names():
    # activated parameters, embedding and head included (model cards): Qwen3-30B-A3B 3.3 B, Qwen3-235B-A22B 22 B,
    # DeepSeek-V3 37 B, Mixtral-8x7B 12.9 B, Mixtral-8x22B 39 B
    for name, active in (("qwen3-30b-a3b", 3.3e9), ("qwen3-235b-a22b", 22e9), ("deepseek-v3", 37e9),
                         ("mixtral-8x7b", 12.9e9), ("mixtral-8x22b", 39e9)):
        p = plan(name)  # 16-bit: two bytes per parameter read
        embed, head = cat(p, "embedding"), cat(p, "head")
        layers = p.weight_read_bytes_per_step - head.read_bytes_per_step - embed.read_bytes_per_step
        assert layers / 2 + embed.params + head.params == pytest.approx(active, rel=0.02), name


def test_deepseek_latent_attention_caches_its_compressed_vector():
    p = plan("deepseek-v3")
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, 16-bit
    assert plan("deepseek-v3", kv_bits=8).kv_bytes_per_token == 61 * (576 + 576 // 64 * 2 * 2)
    assert any("latent" in n for n in p.notes)
    s = P.ModelShape.from_config(P.load_preset("deepseek-v3"))
    assert (s.num_experts, s.experts_per_token, s.dense_layers, s.shared_expert_intermediate_size) == (256, 8, 3, 2048)


def test_resolve_config_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))  # the built-in model not imported: its preset
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(P.load_preset("llama-2-7b")))
    assert P.resolve_config(str(model_dir))[0] == "my-model"
    assert P.resolve_config(config=str(model_dir / "config.json"))[0] == "my-model"
    assert P.resolve_config("llama-3-8b") == ("llama-3-8b", P.load_preset("llama-3-8b"))
    assert P.resolve_config()[0] == P.DEFAULT_PRESET
    with pytest.raises(InvalidArgumentError):
        P.resolve_config("llama-3-8b", preset="mistral-7b")


def test_device_fit_and_ceiling():
    p = plan("llama-3-8b", devices=[lookup_device("RTX 4090 24GB"), lookup_device("M2 Ultra 192GB")])
    rtx, m2u = p.devices
    assert rtx.fits and rtx.offload is None and rtx.budget_bytes == 23 * GiB
    assert rtx.ceiling_tps == pytest.approx(1008e9 / p.step_read_bytes)
    assert m2u.fits and m2u.budget_bytes == 144 * GiB
    assert m2u.ceiling_tps == pytest.approx(800e9 / p.step_read_bytes)


def test_apple_beyond_its_working_set_does_not_fit_and_has_no_offload():
    p = plan("llama-3.1-70b", context=131072, devices=[lookup_device("M2 Ultra 192GB")])
    (m2u,) = p.devices
    assert p.total_bytes > 144 * GiB and not m2u.fits and m2u.offload is None


def test_offload_split_arithmetic():
    p = plan("llama-2-70b", bits=4, devices=[lookup_device("RTX 4090 24GB")])
    (d,) = p.devices
    o = d.offload
    assert not d.fits and o is not None
    budget = 23 * GiB
    # three layers' worth of VRAM is the ring the streamed layers pass through
    assert o.layers_resident == (budget - p.fixed_bytes - RING_SLOTS * p.layer_bytes) // p.layer_bytes
    assert 0 < o.layers_resident < o.layers_total == 80
    assert p.fixed_bytes + (o.layers_resident + RING_SLOTS) * p.layer_bytes <= budget
    assert o.streamed_bytes == (80 - o.layers_resident) * p.layer_read_bytes
    assert (o.pcie_gbps, o.pcie_source) == (25.0, "PCIe 4.0 x16 typical")
    resident = p.fixed_read_bytes + o.layers_resident * p.layer_read_bytes
    assert o.ceiling_tps == pytest.approx(offload_ceiling_tps(resident, o.streamed_bytes, 1008, 25))
    assert o.ceiling_tps < d.ceiling_tps
    # whole model = fixed parts + layers, so the split accounts for every weight
    layers_and_fixed = p.weight_bytes + p.kv_bytes + p.working_bytes
    assert p.fixed_bytes + 80 * p.layer_bytes == pytest.approx(layers_and_fixed, abs=200)


def test_offload_uses_measured_pcie_and_reports_impossible_splits():
    gpu = DeviceInfo("Test GPU", "nvidia", 500.0, "published", 12 * GiB, pcie_h2d_gbps=10.0, pcie_gen=4)
    o = plan("llama-3-8b", devices=[gpu]).devices[0].offload
    assert (o.pcie_gbps, o.pcie_source) == (10.0, "measured") and o.ceiling_tps > 0
    huge = plan("llama-3-8b", context=131072, batch=8, devices=[gpu]).devices[0].offload
    assert huge.layers_resident == 0 and huge.ceiling_tps is None


@pytest.mark.parametrize("preset", ["llama-3-8b", "gemma-3-27b"])
def test_the_offload_reserve_is_what_plan_counts_besides_weights(preset):
    # the torch engine reserves reserved_bytes() in its VRAM budget; plan must predict the same
    for context in (100, 4096):
        p = plan(preset, bits=4, context=context)
        assert reserved_bytes(P.load_preset(preset), context) == p.kv_bytes + p.working_bytes > 0
    with pytest.raises(InvalidArgumentError):
        reserved_bytes(P.load_preset(preset), 0)

def test_a_split_reserves_what_the_engine_reserves_or_more():
    # below KV_RESERVE_TOKENS the engine still reserves that much when it splits by budget
    config = P.load_preset("llama-2-70b")
    short = plan("llama-2-70b", bits=4, context=512)
    assert short.reserve_tokens == KV_RESERVE_TOKENS
    assert short.reserve_bytes == reserved_bytes(config, KV_RESERVE_TOKENS) > short.kv_bytes + short.working_bytes
    assert short.offload_fixed_bytes == short.fixed_bytes - short.kv_bytes - short.working_bytes + short.reserve_bytes
    long = plan("llama-2-70b", bits=4, context=32768)
    assert long.reserve_bytes == long.kv_bytes + long.working_bytes > reserved_bytes(config)
    # a model whose whole context is shorter reserves only that
    assert reserved_bytes({**config, "max_position_embeddings": 1024}) == reserved_bytes(config, 1024)


def test_plan_to_dict_is_json():
    p = plan("mixtral-8x7b", bits=4, devices=[lookup_device("H100 80GB")])
    d = json.loads(json.dumps(P.plan_to_dict(p)))
    assert d["params"] == p.params and d["devices"][0]["device"]["name"] == "NVIDIA H100 SXM 80GB"
    assert {c["name"] for c in d["categories"]} == {"embedding", "attention", "mlp", "head", "norms"}


def test_peak_bandwidth_needs_the_local_device(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="--device local"):
        P.resolve_devices(["H100 80GB"], override_gbps=100)
    (local,) = P.resolve_devices(["local"], override_gbps=100)
    assert (local.peak_bandwidth_gbps, local.bandwidth_source) == (100, "user")


# -- the command ------------------------------------------------------------------

@pytest.fixture
def run(monkeypatch):
    monkeypatch.setitem(umakit.cli.main.COMMANDS, "plan", "umakit.cli.plan_cmd:plan")
    return lambda *args: CliRunner().invoke(umakit.cli.main.main, ["plan", *args])


def test_cli_text(run):
    r = run("--preset", "llama-2-70b", "--bits", "4", "--device", "RTX 4090 24GB", "--device", "M2 Ultra 192GB")
    assert r.exit_code == 0, r.output
    out = r.output
    for word in ("embedding", "attention", "mlp", "head", "norms", "KV cache", "working memory", "GiB",
                 "NVIDIA RTX 4090 24GB", "Apple M2 Ultra 192GB", "published", "tok/s", "layers resident", "PCIe"):
        assert word in out, word
    assert "320.00 KiB/token x 8192 tokens x 1 = 2.50 GiB" in out


def test_cli_default_devices_include_the_local_machine(run, tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))  # the built-in model not imported: its preset
    r = run("--peak-bandwidth", "42")
    assert r.exit_code == 0, r.output
    assert P.DEFAULT_PRESET in r.output and "42 GB/s user" in r.output
    assert all(name in r.output for name in ("M2 Ultra", "M4 Max", "RTX 4090", "H100"))


def test_cli_json(run, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(P.load_preset("llama-2-7b")))
    r = run(str(tmp_path), "--context", "32768", "--batch", "4", "--json", "--device", "H100 80GB")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["kv_bytes"] == 64 * GiB and d["batch"] == 4 and len(d["devices"]) == 1
    assert math.isclose(d["devices"][0]["ceiling_tps"], 4 * 3350e9 / d["step_read_bytes"])


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "Error: unknown preset 'nope'; choose from "),
    (["--preset", "llama-3-8b", "--bits", "5"], "Error: --bits must be 16, 8 or 4 (got 5)"),
    (["--preset", "llama-3-8b", "--device", "Voodoo 5"], "Error: unknown device 'Voodoo 5'"),
    (["llama-3-8b", "--config", "x.json"], "Error: give only one of MODEL, --preset and --config"),
])
def test_cli_errors_are_one_line(run, args, message):
    r = run(*args)
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), r.output


def test_a_vram_budget_caps_the_gpu_and_plans_the_split_the_engine_uses():
    from umakit.plan.placement import plan_layers

    budget = 3 * 2**30  # "3GB" on the command line: memory sizes are binary, as cards are sold
    p = plan("llama-3-8b", bits=4, context=4096, devices=[lookup_device("RTX 4090 24GB")], vram_budget=budget)
    (d,) = p.devices
    assert d.budget_bytes == budget and not d.fits
    reserve = p.kv_bytes + p.working_bytes
    split = plan_layers([p.layer_bytes] * 32, p.fixed_bytes - reserve, vram_budget=budget, reserved_bytes=reserve)
    assert d.offload.layers_resident == split.gpu_layers and 0 < split.gpu_layers < 32
    out = CliRunner().invoke(umakit.cli.main.main, ["plan", "llama-3-8b", "--bits", "4", "--context", "4096",
                                             "--device", "RTX 4090 24GB", "--vram-budget", "3GB"])
    assert out.exit_code == 0, out.output
    assert f"--gpu-layers {split.gpu_layers}" in out.output
    bad = CliRunner().invoke(umakit.cli.main.main, ["plan", "llama-3-8b", "--vram-budget", "3XB"])
    assert bad.exit_code != 0 and "as a size" in bad.output


def test_cli_states_its_units_and_the_budget_in_them(run):
    r = run("llama-3-8b", "--bits", "4", "--context", "4096", "--device", "RTX 4090 24GB", "--vram-budget", "3GB")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "sizes in GiB/MiB/KiB (2^30/2^20/2^10 bytes), bandwidths in GB/s (10^9 bytes/s)" in out
    assert "size (KiB-GiB)" in out and "usable / memory (GiB)" in out and "peak bandwidth (GB/s)" in out
    assert "--vram-budget 3GB = 3.00 GiB" in out and "3.00 GiB / 24.00 GiB" in out  # "GB" as the card is sold: 2^30
    assert "(--bits 4, default recipe)" in out


def test_cli_offload_names_the_engine_and_each_placement(run):
    r = run("mixtral-8x7b", "--bits", "4", "--device", "RTX 4090 24GB")
    assert r.exit_code == 0, r.output
    # MoE: the engine streams routed experts; whole layers are shown for comparison only
    (d,) = plan("mixtral-8x7b", bits=4, devices=[lookup_device("RTX 4090 24GB")]).devices
    engine, whole = d.offload, d.whole_layers
    assert (engine.placement, whole.placement) == (ROUTED_EXPERTS, WHOLE_LAYERS)
    assert (f"routed experts (torch engine): {engine.layers_resident}/32 layers' experts resident" in r.output)
    assert f"whole layers (for comparison: no engine streams MoE layers whole): {whole.layers_resident}/32" in r.output
    assert r.output.index("routed experts (torch") < r.output.index("whole layers (for comparison")
    assert (f"--gpu-layers {engine.layers_resident} (layers whose experts stay resident)" in r.output
            and engine.layers_resident != whole.layers_resident)
    r = run("llama-3-8b", "--bits", "4", "--device", "RTX 4090 24GB", "--vram-budget", "3GB")
    (d,) = plan("llama-3-8b", bits=4, devices=[lookup_device("RTX 4090 24GB")], vram_budget=3 * 2**30).devices
    kept = d.offload.layers_resident  # a dense model streams whole layers
    assert f"whole layers (torch engine): {kept}/32 layers resident" in r.output and "for comparison" not in r.output
    assert f"--gpu-layers {kept}\n" in r.output and kept < 32
    # no engine offloads DeepSeek's latent attention: plan recommends none
    r = run("deepseek-v3", "--bits", "4", "--device", "RTX 4090 24GB")
    assert r.exit_code == 0, r.output
    assert "--gpu-layers" not in r.output and "no engine streams deepseek_v3 layers" in r.output
    assert "routed experts (no engine yet)" in r.output
    assert P.offload_engines("deepseek_v3") == () and "torch" in P.offload_engines("llama")


def test_plan_recommends_only_engines_that_run_the_architecture(monkeypatch):
    """The offload split names the engines whose spec runs the language model's architecture."""
    from umakit import backends
    from umakit.checkpoint.config import architecture

    config = P.load_preset("gemma-3-4b")
    p = plan("gemma-3-4b", devices=[lookup_device("RTX 3060 8GB")])
    assert p.architecture == architecture(config) == "gemma3_text" != config["model_type"]
    (d,) = p.devices
    assert d.offload.engines == ("torch",) and d.whole_layers is None
    torch_spec = backends.ENGINES["torch"]
    narrowed = dataclasses.replace(torch_spec, architectures=tuple(a for a in torch_spec.architectures
                                                                   if a != "gemma3_text"))
    monkeypatch.setitem(backends.ENGINES, "torch", narrowed)
    (d,) = plan("gemma-3-4b", devices=[lookup_device("RTX 3060 8GB")]).devices
    assert d.offload.engines == () and d.offload.ceiling_tps


def test_no_model_plans_the_built_in_model_as_imported(run, tmp_path, monkeypatch):
    from umakit.checkpoint.default import DEFAULT_MODEL_NAME

    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    assert P.resolve_config()[0] == P.DEFAULT_PRESET  # not imported yet: the preset's shapes
    block = {"group_size": 32, "bits": 4, "mode": "affine", "model.embed_tokens": {"group_size": 32, "bits": 8}}
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({**P.load_preset("smollm2-135m"), "quantization": block}))
    name, config = P.resolve_config()
    assert name == DEFAULT_MODEL_NAME and P.plan_model(config).weight_bytes == 98_275_968
    r = run("--device", "H100 80GB")
    assert r.exit_code == 0 and "93.72 MiB" in r.output and "checkpoint: 4-bit g32" in r.output


def test_cli_reads_a_quantized_checkpoint_and_takes_a_recipe(run, tmp_path):
    block = {"group_size": 32, "bits": 4, "mode": "affine", "model.embed_tokens": {"group_size": 32, "bits": 8}}
    (tmp_path / "config.json").write_text(json.dumps({**P.load_preset("smollm2-135m"), "quantization": block}))
    d = json.loads(run(str(tmp_path), "--json", "--device", "H100 80GB").output)
    assert (d["bits"], d["embed_bits"], d["group_size"], d["weight_bytes"]) == (4, 8, 32, 98_275_968)
    assert d["quantization"] == "checkpoint: 4-bit g32, some layers 8-bit"
    mixed = json.loads(run("llama-3-8b", "--bits", "4", "--recipe", "mixed", "--json", "--device", "H100 80GB").output)
    assert mixed["recipe"] == "mixed" and mixed["weight_bytes"] == plan("llama-3-8b", bits=4, recipe="mixed").weight_bytes
    bad = run("llama-3-8b", "--bits", "4", "--recipe", "nope")
    assert bad.exit_code == 1 and "Error: unknown recipe 'nope'" in bad.output
