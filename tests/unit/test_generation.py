"""The decode loop above the backend: text streaming, stops, finish reasons, stats."""

import pytest

from umakit.generate.stream import FINISH_LENGTH, FINISH_STOP, FINISH_STOP_STRING, StopStringFilter
from umakit.checkpoint.tokenizer import StreamingDetokenizer

TEXT = "The quick brown fox 🚀 jumps\nover 東京 — Ünïcödé ✓\n\n  indented\tand tabbed  "


def test_streaming_detokenizer_rebuilds_text_exactly(tiny_model):
    tok = tiny_model.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 20
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # never half a character


@pytest.mark.parametrize(
    "stream, stops, expected",
    [
        (["Hel", "lo ", "wor", "ld"], ["lo w"], ("Hel", True)),
        (["ab", "c<", "/s", ">tail"], ["</s>"], ("abc", True)),
        (["a<", "b"], ["</s>"], ("a<b", False)),
        (["xyz"], [], ("xyz", False)),
        (["STOP"], ["STOP", "ST"], ("", True)),
    ],
)
def test_stop_string_filter(stream, stops, expected):
    f = StopStringFilter(stops)
    out, hit = "", False
    for piece in stream:
        text, hit = f.feed(piece)
        out += text
        if hit:
            break
    if not hit:
        out += f.flush()
    assert (out, hit) == expected


def greedy(model, **kw):
    return model.generate("The quick brown", temperature=0, raw=True, **kw)


def test_max_tokens_and_stats(tiny_model):
    r = greedy(tiny_model, max_tokens=12)
    assert r.finish_reason == FINISH_LENGTH
    assert len(r.tokens) == r.stats.generated_tokens == 12
    assert r.text == tiny_model.tokenizer.decode(r.tokens)
    s = r.stats
    assert s.prompt_tokens == len(tiny_model.encode("The quick brown", raw=True))
    assert s.ttft_s > 0 and s.prefill_tps > 0 and s.decode_tps > 0 and s.peak_memory_bytes > 0
    # roofline: bytes per token covers the weights read plus the cache, and the arithmetic holds
    w = tiny_model.info.weights
    assert s.bytes_per_token > w.bytes_per_token
    assert s.achieved_gbps == pytest.approx(s.bytes_per_token * s.decode_tps / 1e9)
    assert s.mbu == pytest.approx(s.achieved_gbps / s.peak_gbps)


def test_stream_equals_generate(tiny_model):
    chunks = list(tiny_model.stream("The quick brown", temperature=0, raw=True, max_tokens=10))
    assert "".join(c.text for c in chunks) == greedy(tiny_model, max_tokens=10).text
    assert chunks[-1].finish_reason == FINISH_LENGTH and chunks[-1].stats is not None


def test_eos_stops_without_emitting_it(tiny_model, monkeypatch):
    tokens = greedy(tiny_model, max_tokens=8).tokens
    monkeypatch.setattr(tiny_model.tokenizer, "eos_ids", frozenset({tokens[3]}) - set(tokens[:3]))
    r = greedy(tiny_model, max_tokens=8)
    assert r.finish_reason == FINISH_STOP
    assert r.tokens == tokens[:3]


def test_stop_string_is_not_emitted(tiny_model):
    full = greedy(tiny_model, max_tokens=16).text
    stop = full[5:9]
    r = greedy(tiny_model, max_tokens=16, stop=[stop])
    assert r.finish_reason == FINISH_STOP_STRING
    assert r.text == full[: full.index(stop)]


def test_seed_makes_sampling_reproducible(tiny_model):
    a = tiny_model.generate("The quick", temperature=1.0, seed=7, max_tokens=16, raw=True)
    b = tiny_model.generate("The quick", temperature=1.0, seed=7, max_tokens=16, raw=True)
    others = {tuple(tiny_model.generate("The quick", temperature=1.0, seed=s, max_tokens=16, raw=True).tokens)
              for s in range(4)}
    assert a.tokens == b.tokens
    assert len(others) > 1


def test_chat_template_is_applied(tiny_model):
    ids = tiny_model.encode("hi", system="be brief")
    text = tiny_model.tokenizer.decode(ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny_model.encode(messages=msgs, system="be brief") == ids


def test_unknown_option_is_an_error(tiny_model):
    # The options are declared parameters: a misspelt one is refused by name.
    with pytest.raises(TypeError, match="temprature"):
        tiny_model.generate("x", temprature=0.1)


def test_stats_are_composed_and_their_json_is_flat():
    from umakit.generate.stream import STATS_KEYS, GenerationStats
    from umakit.plan.roofline import OffloadStats, RooflineStats

    s = GenerationStats(prompt_tokens=3, generated_tokens=5, decode_tps=50.0)
    flat = s.to_dict()
    assert tuple(flat) == STATS_KEYS and len(STATS_KEYS) == 20
    assert {k: flat[k] for k in ("bytes_per_token", "mbu", "pcie_gbps", "overlap_efficiency")} == dict.fromkeys(
        ("bytes_per_token", "mbu", "pcie_gbps", "overlap_efficiency"), 0.0)
    assert (flat["device_name"], flat["bandwidth_source"]) == ("", "")
    r = RooflineStats(2e9, 100.0, 50.0, 80.0, 0.8, "dev", "measured")
    o = OffloadStats(ceiling_tps=60.0, pcie_gbps=25.0, achieved_pcie_gbps=12.5, efficiency=0.75, streamed_bytes=5e8)
    s.fill(r, o)
    assert s.roofline is r and s.offload is o
    flat = s.to_dict()
    assert (flat["bytes_per_token"], flat["ceiling_tps"], flat["achieved_gbps"], flat["peak_gbps"], flat["mbu"]) == (
        2e9, 50.0, 80.0, 100.0, 0.8)
    assert (flat["device_name"], flat["bandwidth_source"]) == ("dev", "measured")
    assert (flat["pcie_bytes_per_token"], flat["pcie_gbps"], flat["pcie_peak_gbps"], flat["offload_ceiling_tps"],
            flat["overlap_efficiency"]) == (5e8, 12.5, 25.0, 60.0, 0.75)
    assert (flat["prompt_tokens"], flat["generated_tokens"], flat["decode_tps"]) == (3, 5, 50.0)
    s.fill(r)  # every layer resident: the offload figures go back to zero
    assert s.pcie_bytes_per_token == 0.0 and s.offload is None


def test_memory_warning_names_the_fix():
    import os

    from umakit.hardware import memory_warnings

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory_warnings(ram // 10, "cpu") == []
    (warning,) = memory_warnings(int(ram * 0.95), "cpu")
    assert "95% of RAM" in warning and "umakit quantize --bits 4" in warning
