"""config.json as any transformers version writes it, mapped onto the names the engines read.

transformers v5 renamed fields that model code elsewhere (mlx-lm's ModelArgs,
umakit's torch engine) still reads by their v4 names: ``rope_parameters``
replaced ``rope_theta``/``rope_scaling`` (one dict per layer type for gemma3),
``layer_types`` replaced gemma3's ``sliding_window_pattern``, and qwen3_moe's
expert count is written as ``num_local_experts``. Every such mapping lives
here, applied once when a checkpoint's config is read (umakit/checkpoint/files.py),
so both engines and `plan` see the same fields. A mapping only adds missing
names; what a config states itself is never overwritten.
"""

from __future__ import annotations

from umakit.errors import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types values
GEMMA3 = ("gemma3", "gemma3_text")
# Families whose v5 configs name the expert count num_local_experts but whose mlx-lm ModelArgs read num_experts.
NUM_EXPERTS_FAMILIES = ("qwen3_moe", "qwen2_moe")


def normalize(config: dict) -> dict:
    """Add the v4 names of ``config``'s v5 fields, in place (and in its ``text_config``); returns it."""
    for c in (config, config.get("text_config")):
        if isinstance(c, dict):
            _rope(c)
            _layer_types(c)
            _experts(c)
            _gemma4(c)
    return config


def normalized(config: dict) -> dict:
    """A normalized copy of ``config`` (which stays as it was)."""
    copy = dict(config)
    if isinstance(copy.get("text_config"), dict):
        copy["text_config"] = dict(copy["text_config"])
    return normalize(copy)


def text_config(config: dict) -> dict:
    """The language model's config: multimodal wrappers (e.g. gemma3) nest it under ``text_config``."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "model_type" in nested else config


def architecture(config: dict) -> str | None:
    """The model_type that decides which code runs the language model (``gemma3_text`` inside a gemma3)."""
    return text_config(config).get("model_type") or config.get("model_type")


def rope_kind(config: dict) -> str:
    """The language model's RoPE scaling kind ("default" where it sets none): which engines can run it as trained."""
    scaling = text_config(config).get("rope_scaling") or {}
    return str(scaling.get("rope_type", scaling.get("type", "default"))) if isinstance(scaling, dict) else "default"


def context_length(config: dict) -> int:
    """The tokens a sequence may hold (0: unknown): ``max_position_embeddings``, times the factor of dynamic NTK
    RoPE, which states the original context there and stretches its frequencies past it as a sequence grows."""
    cfg = text_config(normalized(config))
    limit = int(cfg.get("max_position_embeddings") or 0)
    scaling = cfg.get("rope_scaling") or {}
    if rope_kind(cfg) == "dynamic" and isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 1:
        return int(limit * scaling["factor"])
    return limit


def _rope(config: dict) -> None:
    """``rope_parameters`` ({"rope_theta", "rope_type", ...}, or one such dict per layer type) -> v4 fields."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if FULL in params or SLIDING in params:
        local = params.get(SLIDING) or {}
        params = params.get(FULL) or local
        if "rope_theta" in local:
            config.setdefault("rope_local_base_freq", local["rope_theta"])
    if "rope_theta" in params:
        config.setdefault("rope_theta", params["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and not config.get("rope_scaling"):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        config["rope_scaling"] = scaling | {"rope_type": kind, "type": kind}


def sliding_pattern(layer_types: list[str]) -> int | None:
    """The p with layer i global iff (i + 1) % p == 0 (gemma3's and mlx-lm's rule), None if there is none.

    p = 1 is every layer global; no p fits layers that are all sliding or out of that rhythm.
    """
    n = len(layer_types)
    for p in range(1, n + 1):
        if all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(layer_types)):
            return p
    return None


def _layer_types(config: dict) -> None:
    """gemma3: ``layer_types`` <-> ``sliding_window_pattern``, whichever the config lacks."""
    if config.get("model_type") not in GEMMA3 or "num_hidden_layers" not in config:
        return
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        # v5 keeps a given pattern as _sliding_window_pattern; v4 and GGUF imports write sliding_window_pattern.
        p = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        config["layer_types"] = [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]
        config.setdefault("sliding_window_pattern", p)
    elif "sliding_window_pattern" not in config and (p := sliding_pattern(types)) is not None:
        config["sliding_window_pattern"] = p


def _experts(config: dict) -> None:
    if config.get("model_type") in NUM_EXPERTS_FAMILIES and "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])


def _gemma4(config: dict) -> None:
    """gemma4: transformers v5 writes its global layers' head size and count into ``per_layer_config`` only; mlx-lm
    reads ``global_head_dim`` (512 when absent) and ``num_global_key_value_heads``."""
    per, types = config.get("per_layer_config"), config.get("layer_types") or []
    if config.get("model_type") != "gemma4_text" or not isinstance(per, dict) or FULL not in types:
        return
    glob = per.get(str(types.index(FULL))) or per.get(types.index(FULL)) or {}
    if "head_dim" in glob:
        config.setdefault("global_head_dim", glob["head_dim"])
    if "num_key_value_heads" in glob:
        config.setdefault("num_global_key_value_heads", glob["num_key_value_heads"])


def check_mlx(config: dict) -> None:
    """Refuse a config mlx-lm's model code would misread (it raises IndexError or computes something else)."""
    c = text_config(config)
    if c.get("model_type") in GEMMA3:
        types = c.get("layer_types") or []
        p = c.get("sliding_window_pattern")
        if types and (p is None or sliding_pattern(types) != p):
            raise UnsupportedModelError(
                "mlx-lm runs gemma3 only with a global layer every sliding_window_pattern layers; this checkpoint's "
                f"layer_types {_short(types)} have no such pattern: use --backend torch"
            )
        if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
            raise UnsupportedModelError("mlx-lm's gemma3 ignores logit softcapping, which this checkpoint sets: "
                                        "use --backend torch")


def _short(types: list[str]) -> str:
    letters = "".join("g" if t == FULL else "s" for t in types)
    return f"{letters[:24]}{'...' if len(letters) > 24 else ''} (s: sliding, g: global)"
