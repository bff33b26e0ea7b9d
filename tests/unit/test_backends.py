"""Backend registry: names, shorthands, automatic choice, install hints."""

import pytest

import umakit
from umakit import backends
from umakit.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedModelError


def test_shorthands_and_explicit_choices(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    assert backends.resolve("cuda") == ("torch", "cuda")
    assert backends.resolve("torch", "cpu") == ("torch", "cpu")
    assert backends.resolve("mlx") == ("mlx", "cpu")
    with pytest.raises(InvalidArgumentError, match="backend mlx runs on metal or cpu, not 'cuda'"):
        backends.resolve("mlx", "cuda")
    with pytest.raises(InvalidArgumentError, match="--backend cuda runs on device cuda, not cpu"):
        backends.resolve("cuda", "cpu")


def test_auto_prefers_metal_then_cuda_then_the_faster_cpu_engine(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: True)
    assert backends.resolve("auto") == ("mlx", "metal")
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    assert backends.resolve("auto") == ("torch", "cuda")
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_installed", lambda m: True)
    assert backends.resolve("auto") == ("torch", "cpu")  # benchmarks/cpu_engines.py: torch is faster on CPU
    monkeypatch.setattr(backends, "_installed", lambda m: m != "torch")
    assert backends.resolve("auto") == ("mlx", "cpu")


def test_which_loads_read_a_ggufs_q6_k_layers_exactly(monkeypatch):
    """Only the torch engine on a CPU in its packed form: a first use's import leaves the 8-bit copies out there."""
    monkeypatch.setattr(backends, "_installed", lambda m: True)
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    assert backends.reads_exact_groups() and backends.reads_exact_groups("torch", "cpu", "bfloat16")
    assert not backends.reads_exact_groups("torch", "cpu", "float32")
    assert not backends.reads_exact_groups("mlx") and not backends.reads_exact_groups("transformers")
    assert not backends.reads_exact_groups(model_type="qwen3_5_moe_text")  # auto: the transformers engine's
    assert not backends.reads_exact_groups("mlx", "cuda")  # no such engine: the load says why
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    assert not backends.reads_exact_groups()  # torch on CUDA: the copies
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: True)
    assert not backends.reads_exact_groups()  # MLX on Metal


def test_missing_torch_gives_the_install_command(monkeypatch):
    monkeypatch.setattr(backends, "_installed", lambda m: m != "torch")
    with pytest.raises(BackendUnavailableError, match=r"the torch backend needs torch: pip install 'umakit\[cuda\]'"):
        backends.engine_class("torch")


def test_auto_respects_needed_features(monkeypatch):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_installed", lambda m: True)
    assert backends.resolve("auto", needs=frozenset({"kv_bits", "batch"})) == ("torch", "cpu")
    _without_quantized_kv(monkeypatch, "torch")
    assert backends.resolve("auto", needs=frozenset({"kv_bits"})) == ("mlx", "cpu")
    assert backends.resolve("auto", needs=frozenset({"batch"})) == ("torch", "cpu")
    with pytest.raises(InvalidArgumentError, match="torch backend does not support --kv-bits yet; use --backend mlx"):
        backends.resolve("torch", needs=frozenset({"kv_bits"}))


def _without_quantized_kv(monkeypatch, engine: str) -> None:
    """Take the quantized KV cache from ``engine``'s declared features (both engines have one today)."""
    import dataclasses

    spec = backends.ENGINES[engine]
    monkeypatch.setitem(backends.ENGINES, engine, dataclasses.replace(spec, features=spec.features - {"kv_bits"}))


def _cpu_only(monkeypatch, installed=lambda m: True):
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_installed", installed)


def test_engines_declare_their_architectures_without_importing_them():
    import sys

    torch_spec, mlx_spec = backends.ENGINES["torch"], backends.ENGINES["mlx"]
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen3_moe"):
        assert torch_spec.runs(arch)
    assert not torch_spec.runs("phi3") and torch_spec.runs(None)
    if backends._installed("mlx_lm"):
        assert mlx_spec.runs("phi3") and mlx_spec.runs("mistral")  # mistral through mlx-lm's remapping (llama)
        assert not mlx_spec.runs("no_such_architecture")


def test_auto_passes_over_an_engine_that_cannot_run_the_architecture_and_says_why(monkeypatch):
    _cpu_only(monkeypatch)
    import dataclasses

    mlx = dataclasses.replace(backends.ENGINES["mlx"], finds_architecture=lambda t: t in ("phi3", "llama"))
    monkeypatch.setitem(backends.ENGINES, "mlx", mlx)
    assert backends.choose("auto", model_type="llama") == ("torch", "cpu", None)
    # off Apple Silicon transformers' model classes come before MLX's single-threaded CPU backend
    assert backends.choose("auto", model_type="phi3") == (
        "transformers", "cpu", "running on transformers (cpu): torch does not run phi3")
    assert backends.choose("auto", model_type="mamba") == (
        "transformers", "cpu", "running on transformers (cpu): torch does not run mamba")
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: True)  # there, MLX's CPU backend first
    assert backends.choose("auto", "cpu", model_type="phi3") == (
        "mlx", "cpu", "running on mlx (cpu): torch does not run phi3")
    assert backends.choose("auto", "cpu", model_type="mamba") == (
        "transformers", "cpu", "running on transformers (cpu): torch does not run mamba; mlx does not run mamba")
    monkeypatch.setattr(backends, "is_apple_silicon", lambda: False)
    with pytest.raises(UnsupportedModelError, match=r"model_type 'no_such_model' is not supported by any engine: "
                       r"torch runs llama, .*gpt_oss; transformers runs any architecture the installed transformers "
                       r"has model code for; mlx runs any architecture mlx-lm has a model file for"):
        backends.choose("auto", model_type="no_such_model")
    assert backends.choose("torch", model_type="no_such_model") == ("torch", "cpu", None)  # its error lists its own
    with pytest.raises(UnsupportedModelError, match="the torch backend does not run model_type 'mamba'; "
                                                    "use --backend transformers"):
        backends.choose("torch", model_type="mamba")
    with pytest.raises(UnsupportedModelError, match="the torch backend does not run model_type 'phi3'; "
                                                    "use --backend mlx"):
        backends.choose("torch", model_type="phi3")


def test_auto_passes_over_an_engine_that_does_not_apply_the_rope_scaling_and_says_why(monkeypatch):
    """A Llama checkpoint with `mrope` RoPE scaling (Qwen-VL's): the torch engine computes default, linear, llama3,
    yarn, dynamic and longrope only, so "auto" runs it on transformers' model classes (MLX's on Apple Silicon),
    whose code applies it, and `--backend torch` names the first engine that does."""
    _cpu_only(monkeypatch)
    for kind in ("yarn", "default", "dynamic", "longrope"):
        assert backends.choose("auto", model_type="llama", rope_kind=kind) == ("torch", "cpu", None)
    assert backends.choose("auto", model_type="llama", rope_kind="mrope") == (
        "transformers", "cpu", "running on transformers (cpu): torch does not apply mrope RoPE scaling")
    with pytest.raises(UnsupportedModelError, match="the torch backend does not apply 'mrope' RoPE scaling, "
                                                    "which this checkpoint sets; use --backend mlx"):
        backends.choose("torch", model_type="llama", rope_kind="mrope")


def test_a_dynamic_rope_checkpoint_runs_on_torch_over_its_stretched_context(tmp_path, monkeypatch):
    _cpu_only(monkeypatch)
    from support.tiny import make_tiny_model

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    m = umakit.load(make_tiny_model("llama", tmp_path, rope_parameters=rope), dtype="float32")
    assert m.info.backend == "torch" and not m.info.warnings
    assert m.info.context_length == 2 * m.engine.config["max_position_embeddings"]


def test_auto_honours_features_on_cuda_too(monkeypatch):
    """`eval --kv-bits 8` on a CUDA machine whose torch engine had no quantized cache: MLX on the CPU runs it."""
    _cpu_only(monkeypatch)
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    assert backends.choose("auto", needs=frozenset({"kv_bits"})) == ("torch", "cuda", None)
    _without_quantized_kv(monkeypatch, "torch")
    assert backends.choose("auto") == ("torch", "cuda", None)
    assert backends.choose("auto", needs=frozenset({"kv_bits"})) == (
        "mlx", "cpu", "running on mlx (cpu): torch does not support --kv-bits; transformers does not support --kv-bits")
    with pytest.raises(InvalidArgumentError, match="no backend supports --kv-bits on cuda"):
        backends.choose("auto", "cuda", needs=frozenset({"kv_bits"}))


def test_load_notes_the_choice_in_the_warnings(tiny_dir, tmp_path, monkeypatch):
    import json
    import shutil

    _cpu_only(monkeypatch)
    path = tmp_path / "renamed"
    shutil.copytree(tiny_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    # A type neither torch nor transformers runs, served by mlx-lm with llama's code.
    (path / "config.json").write_text(json.dumps({**config, "model_type": "xverse"}))
    m = umakit.load(path, dtype="float32")
    assert m.info.backend == "mlx" and m.info.warnings[0] == ("running on mlx (cpu): torch does not run xverse; "
                                                              "transformers does not run xverse")
    assert umakit.load(tiny_dir("gemma3"), dtype="float32").info.backend == "torch"


def test_finding_mlx_lm_architectures_imports_neither_mlx_nor_mlx_lm():
    import subprocess
    import sys

    code = ("import sys; from umakit.backends import ENGINES; ENGINES['mlx'].runs('gemma3_text'); "
            "assert not {'mlx', 'mlx_lm', 'torch'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_takes_the_next_engine_when_its_pick_cannot_load_the_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """transformers refusing a checkpoint it has model code for (an MLX-quantized one whose experts it fuses,
    say): "auto" loads it on the next engine that runs it, and says why; an explicit backend does not move."""
    import json
    import shutil

    from umakit.backends.transformers.engine import TransformersEngine
    from umakit.backends.mlx.engine import MLXEngine

    _cpu_only(monkeypatch)
    path = tmp_path / "renamed"
    shutil.copytree(tiny_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "iquestcoder"}))  # both run it

    def refuse(cls, ckpt, **options):
        raise UnsupportedModelError("its experts are stacked where transformers fuses them")

    monkeypatch.setattr(TransformersEngine, "from_checkpoint", classmethod(refuse))
    m = umakit.load(path, dtype="float32")
    assert m.info.backend == "mlx" and m.info.warnings[0] == (
        "running on mlx (cpu): transformers cannot load it (its experts are stacked where transformers fuses them)")
    with pytest.raises(UnsupportedModelError, match="stacked where transformers fuses them"):
        umakit.load(path, backend="transformers", dtype="float32")
    def refuse_too(cls, ckpt, **options):
        raise UnsupportedModelError("MLX's reason")

    monkeypatch.setattr(MLXEngine, "from_checkpoint", classmethod(refuse_too))
    with pytest.raises(UnsupportedModelError, match="stacked where transformers fuses them"):  # the first reason
        umakit.load(path, dtype="float32")


def test_a_model_some_engine_runs_but_not_with_the_features_asked_is_not_called_unsupported(monkeypatch):
    """qwen3_5_moe_text with --deterministic: transformers runs it, without the feature; the error says that,
    where it once said no engine supports the model at all."""
    _cpu_only(monkeypatch)
    with pytest.raises(InvalidArgumentError, match=r"no backend here runs qwen3_5_moe_text with --deterministic: "
                                                   r"torch does not run qwen3_5_moe_text; transformers does not "
                                                   r"support --deterministic"):
        backends.choose("auto", needs=frozenset({"deterministic"}), model_type="qwen3_5_moe_text")
