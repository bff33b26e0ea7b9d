"""config.json as transformers v4 and v5 write it, mapped onto the names both engines read."""

import pytest

from umakit.checkpoint import config as cc
from umakit.errors import UnsupportedModelError

S, F = cc.SLIDING, cc.FULL


def test_rope_parameters_become_the_v4_fields():
    c = cc.normalize({"model_type": "qwen2", "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert c["rope_theta"] == 5e5 and "rope_scaling" not in c
    c = cc.normalize({"model_type": "llama", "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3",
                                                                  "factor": 8.0}})
    assert c["rope_scaling"] == {"factor": 8.0, "rope_type": "llama3", "type": "llama3"}


def test_gemma3_rope_per_layer_type_and_layer_types_to_the_pattern():
    c = cc.normalize({
        "model_type": "gemma3_text", "num_hidden_layers": 6, "layer_types": [S, S, F, S, S, F],
        "rope_parameters": {F: {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
                            S: {"rope_theta": 1e4, "rope_type": "default"}},
    })
    assert (c["rope_theta"], c["rope_local_base_freq"], c["sliding_window_pattern"]) == (1e6, 1e4, 3)
    assert c["rope_scaling"]["factor"] == 8.0


def test_a_pattern_alone_becomes_layer_types_in_a_nested_text_config():
    c = cc.normalize({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 4,
                                                              "sliding_window_pattern": 2}})
    assert c["text_config"]["layer_types"] == [S, F, S, F] and cc.architecture(c) == "gemma3_text"


def test_stated_fields_are_never_overwritten_and_the_copy_leaves_the_original():
    original = {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": 4}
    assert cc.normalized(original)["num_experts"] == 4
    original = {"model_type": "qwen3_moe", "num_local_experts": 8}
    assert cc.normalized(original)["num_experts"] == 8 and "num_experts" not in original


@pytest.mark.parametrize("types, pattern", [([S, F], 2), ([F, F], 1), ([S, S, F, S], 3), ([S, S, S], None),
                                            ([F, S], None)])
def test_sliding_pattern(types, pattern):
    assert cc.sliding_pattern(types) == pattern


def test_mlx_refuses_what_mlx_lm_would_misread():
    cc.check_mlx(cc.normalize({"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": [S, F]}))
    with pytest.raises(UnsupportedModelError, match="layer_types sss .* have no such pattern: use --backend torch"):
        cc.check_mlx(cc.normalize({"model_type": "gemma3_text", "num_hidden_layers": 3, "layer_types": [S, S, S]}))
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        cc.check_mlx({"model_type": "gemma3_text", "final_logit_softcapping": 30.0})
