"""Hybrid models on the MLX engine (qwen3_next: gated delta-net linear attention beside full attention; lfm2:
convolution layers): their recurrent and convolution states (mlx-lm's ArraysCache) batch with attention rows, so
`batch` and `serve` take them. Tiny random checkpoints written by mlx-lm's own model classes (its layout, as
mlx-community's files are): each batch row's tokens are its lone run's, rows joining, leaving and exported."""

from __future__ import annotations

import pytest

import umakit
from support.chats import chat_turns
from support.mlx_models import CONFIGS, make
from umakit.backends.base import BatchRow
from umakit.generate.sampling import SamplingParams

mx = pytest.importorskip("mlx.core")

GREEDY = SamplingParams(temperature=0)
PROMPTS = {0: [(7 * i) % 400 + 3 for i in range(30)], 1: [5, 9, 11], 2: [40, 41, 42, 43, 44, 45, 46, 47, 48], 3: [8]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hybrid(request, tmp_path_factory):
    path = make(request.param, tmp_path_factory.mktemp(request.param) / "model")
    return umakit.load(path, backend="mlx", dtype="float32")


def lone(engine, prompt, n):
    stream = engine.generate_tokens(prompt, engine.make_cache(), GREEDY)
    return [next(stream) for _ in range(n)]


def test_batch_rows_of_a_hybrid_model_are_their_lone_runs(hybrid):
    engine = hybrid.engine
    decoder = engine.batch_decoder()
    decoder.add([BatchRow(i, PROMPTS[i], GREEDY) for i in (0, 1)])
    got = {i: [] for i in PROMPTS}
    for step in range(8):
        if step == 2:  # rows joining a running batch, a one-token prompt among them
            decoder.add([BatchRow(i, PROMPTS[i], GREEDY) for i in (2, 3)])
        if step == 5:
            exported = decoder.export(1)
            decoder.remove([1])
        for row, token in decoder.step():
            got[row].append(token)
    # the row's positions, as the protocol says: the prompt and the returned tokens, the latest fed or not yet
    assert exported.offset in (len(PROMPTS[1]) + len(got[1]) - 1, len(PROMPTS[1]) + len(got[1]))
    for i, prompt in PROMPTS.items():
        assert got[i] == lone(engine, prompt, len(got[i])), i


def test_batch_command_api_takes_a_hybrid_model(hybrid):
    texts = ["The quick brown fox", "Paris is", "Unified memory"]
    run = hybrid.generate_batch(texts, max_tokens=6, temperature=0, raw=True)
    for text, result in zip(texts, run.results):
        assert result.tokens == hybrid.generate(text, max_tokens=6, temperature=0, raw=True).tokens


@pytest.mark.slow
def test_serve_answers_concurrent_requests_on_a_hybrid_model(tmp_path, tmp_path_factory):
    """`umakit serve --backend mlx` on qwen3_next: concurrent greedy chats in one batch, each its lone reply, and a
    second round with the same answers."""
    from support.serve_helpers import concurrent_chats

    (first, second), want = concurrent_chats(make("qwen3_next", tmp_path / "qwen3_next"), "mlx", tmp_path_factory,
                                             "mlx-hybrid", rounds=2)
    assert first == want and second == want


def test_a_chat_goes_back_to_its_last_prompt_instead_of_prefilling_all_again(hybrid):
    """A recurrent state cannot be trimmed: the chat marks it at each prompt and the next turn rewinds there, so it
    prefills the reply and the new message only, with the replies of a chat that prefills everything again."""
    turns, fresh = chat_turns(hybrid, ["The quick brown fox", "Paris is the capital", "again"])
    assert turns[0][0] == 0 and all(reused > 0 for reused, _ in turns[1:]), turns
    assert [reply for _, reply in turns] == fresh
