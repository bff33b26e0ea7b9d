"""Prompt lookup in a batch (`Lookup`: the torch engine, on its fused CPU step and off it, and the MLX engine):
greedy rows speculate and keep the tokens plain decoding gives; the other rows decode as before; what cannot
speculate is refused clearly."""

import asyncio

import pytest

import umakit
from umakit.backends.base import BatchRow, Lookup
from umakit.errors import InvalidArgumentError
from umakit.generate.batch import generate_batch
from umakit.generate.sampling import SamplingParams
from umakit.serve.scheduler import Scheduler
from umakit.serve.types import GenerationRequest, SchedulerSettings
from support.markers import requires_default_model
from support.oracle import PROMPTS
from support.serve_helpers import answers

GREEDY = SamplingParams(temperature=0)
# text that repeats, so that lookups find candidates; and the oracle's mixed prompts
REPEATS = ["one two three four five six one two three four five six one two three",
           "The lazy dog. The lazy dog. The lazy dog. The lazy", *(p for p in PROMPTS[:6] if isinstance(p, str))]


@pytest.fixture(scope="module")
def model(quantized):
    m = umakit.load(quantized("llama", 4), backend="torch", device="cpu", dtype="bfloat16")
    assert m.engine._fused is not None  # the CPU default for a quantized checkpoint: the fused step
    return m


@pytest.fixture(scope="module")
def mlx_model(tiny_dir):
    return umakit.load(tiny_dir("llama"), backend="mlx", device="cpu")


def lone(model, prompt, n, **kw):
    return model.generate(prompt, raw=True, max_tokens=n, **kw)


class Oracle:
    """Proposals from the rows' lone greedy continuations (``wrong``: every third one corrupted), standing in for
    prompt lookup, which finds little to copy in a random model's text: the verification is what is checked."""

    def __init__(self, model, prompts, n, wrong=False):
        self.next = {tuple(model.encode(p, raw=True)): lone(model, p, n, temperature=0).tokens for p in prompts}
        self.wrong, self.made = wrong, []

    def row(self, text, ngram, most, proposer=None):
        oracle = self

        class Row:
            def __init__(self):
                self.text, self.done, self.k = list(text), [], most

            def propose(self, room):
                # proposals for the tokens after the one the row feeds next (its last returned)
                want = oracle.next[tuple(self.text)][len(self.done):len(self.done) + min(self.k, room)]
                # a wrong one stays in the vocabulary (t ^ 1 < an even size)
                plan = [t ^ 1 if oracle.wrong and (len(self.done) + i) % 3 == 2 else t for i, t in enumerate(want)]
                oracle.made.append(len(plan))
                return plan

            def commit(self, emitted, proposed):
                self.done += emitted

        return Row()


@pytest.mark.parametrize("engine", ["torch", "torch-eager", "mlx"])
@pytest.mark.parametrize("wrong", [False, True])
def test_greedy_rows_keep_their_lone_tokens_in_fewer_steps(request, monkeypatch, engine, wrong):
    """On the fused CPU step, off it (as on CUDA: the rows of one eager forward pass), and on MLX."""
    import contextlib

    from umakit.backends.mlx import batch_decoder as mlx_decoder
    from umakit.backends.torch import batch_decoder

    model = request.getfixturevalue("mlx_model" if engine == "mlx" else "model")
    with model.engine.eager() if engine == "torch-eager" else contextlib.nullcontext():
        want = [lone(model, p, 30, temperature=0) for p in REPEATS]
        oracle = Oracle(model, REPEATS, 30, wrong)
        monkeypatch.setattr(mlx_decoder if engine == "mlx" else batch_decoder, "RowLookup", oracle.row)
        for size in (1, 3):
            run = generate_batch(model, REPEATS, max_tokens=30, sampling=GREEDY, batch_size=size, raw=True,
                                 prompt_lookup=True, ngram=2, draft_tokens=4)
            for i, (w, got) in enumerate(zip(want, run)):
                assert got.tokens == w.tokens, f"batch {size} prompt {i}"
                assert got.text == w.text and got.finish_reason == w.finish_reason
            assert run.stats.steps < run.stats.generated_tokens / (1.5 if wrong else 2.5) / size
    assert sum(oracle.made) > 0


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_model_off_the_fused_step_speculates_with_a_float_or_quantized_cache(monkeypatch, tmp_path, kv_bits):
    """gpt-oss (sliding layers, attention sinks, experts: no fused step) with gpt-oss's own head size, so that an
    8-bit cache takes it: greedy rows keep their lone tokens, with that cache, in fewer steps."""
    from support import mxfp4
    from umakit.backends.torch import batch_decoder

    model = umakit.load(mxfp4.write(tmp_path / "m", head_dim=64), backend="torch", device="cpu", dtype="float32")
    assert model.engine._fused is None
    speculates_as_lone(model, batch_decoder, monkeypatch, kv_bits)


def speculates_as_lone(model, decoder_module, monkeypatch, kv_bits=None) -> None:
    """Greedy batch rows of ``model`` speculating on `Oracle` proposals (every third wrong; ``decoder_module``'s
    `RowLookup` replaced) keep their lone runs' tokens, in fewer steps."""
    want = [lone(model, p, 30, temperature=0, kv_bits=kv_bits) for p in REPEATS]
    oracle = Oracle(model, REPEATS, 30, wrong=True)
    oracle.next = {tuple(model.encode(p, raw=True)): w.tokens for p, w in zip(REPEATS, want)}
    monkeypatch.setattr(decoder_module, "RowLookup", oracle.row)
    run = generate_batch(model, REPEATS, max_tokens=30, sampling=GREEDY, batch_size=3, raw=True, kv_bits=kv_bits,
                         prompt_lookup=True, ngram=2, draft_tokens=4)
    assert [r.tokens for r in run] == [w.tokens for w in want]
    assert run.stats.steps < run.stats.generated_tokens / 1.5 / 3 and sum(oracle.made) > 0


@requires_default_model
def test_prompt_lookup_finds_what_a_copying_reply_copies():
    model = umakit.load(backend="torch")
    text = ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis. "
            "Copy: apples, pears,")
    want = lone(model, text, 40, temperature=0)
    run = generate_batch(model, [text], max_tokens=40, sampling=GREEDY, raw=True, prompt_lookup=True)
    assert run[0].tokens == want.tokens
    assert run.stats.steps < 0.8 * run.stats.generated_tokens


def test_sampled_and_logprob_rows_decode_beside_speculating_ones(model):
    engine = model.engine
    ids = [model.encode(p, raw=True) for p in REPEATS[:3]]
    sampled = SamplingParams(temperature=0.8, top_k=20)
    rows = [BatchRow(0, ids[0], GREEDY), BatchRow(1, ids[1], sampled, seed=7), BatchRow(2, ids[2], GREEDY, logprobs=2)]
    decoder = engine.batch_decoder(lookup=Lookup(ngram=2, tokens=4))
    decoder.add(rows)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    steps = 0
    while min(len(v) for v in got.values()) < 24:
        steps += 1
        out = decoder.step()
        counts = {r: sum(1 for i, _ in out if i == r) for r in got}
        assert counts[1] == 1 and counts[2] == 1  # the sampled row and the one asking for log-probabilities
        assert set(decoder.logprobs()) == {2}
        for r, t in out:
            got[r].append(t)
    assert got[0][:24] == lone(model, REPEATS[0], 24, temperature=0).tokens[:24]
    assert got[1][:24] == lone(model, REPEATS[1], 24, temperature=0.8, top_k=20, seed=7).tokens[:24]
    assert got[2][:24] == lone(model, REPEATS[2], 24, temperature=0).tokens[:24]
    # the exported cache holds the prompt and every returned token but the last, as without speculation
    assert decoder.export(0).offset == len(ids[0]) + len(got[0]) - 1


def test_a_rows_lookup_reads_every_token_it_returned(model):
    """Steps without proposals (none found, or paused) still add the row's tokens to what it may copy."""
    ids = model.encode(REPEATS[2], raw=True)
    decoder = model.engine.batch_decoder(lookup=Lookup(ngram=2, tokens=4))
    decoder.add([BatchRow(0, ids, GREEDY)])
    got = []
    for _ in range(20):
        got += [t for _, t in decoder.step()]
    assert decoder._lookups[0].lookup.tokens == ids + got


def test_a_stop_inside_a_speculated_run_ends_the_row_there(model, monkeypatch):
    """Tokens a row returned past its stop string or its max_tokens in the same step are not emitted."""
    from umakit.backends.torch import batch_decoder

    full = [lone(model, p, 30, temperature=0) for p in REPEATS[:3]]
    stops = [r.text[8:11] for r in full]  # a string from the middle of each reply
    want = [lone(model, p, 30, temperature=0, stop=[s]) for p, s in zip(REPEATS[:3], stops)]
    assert all(s for s in stops) and any(w.finish_reason == "stop_string" for w in want)
    monkeypatch.setattr(batch_decoder, "RowLookup", Oracle(model, REPEATS[:3], 30).row)
    for i, (p, s) in enumerate(zip(REPEATS[:3], stops)):
        run = generate_batch(model, [p], max_tokens=30, sampling=GREEDY, raw=True, stop=[s], prompt_lookup=True)
        assert (run[0].text, run[0].finish_reason) == (want[i].text, want[i].finish_reason), i
    run = generate_batch(model, REPEATS[:3], max_tokens=7, sampling=GREEDY, raw=True, prompt_lookup=True)
    assert [r.tokens for r in run] == [r.tokens[:7] for r in full]


def test_rows_leave_and_join_while_others_speculate(model):
    want = [lone(model, p, 30, temperature=0).tokens for p in REPEATS]
    run = generate_batch(model, REPEATS, max_tokens=30, sampling=GREEDY, batch_size=2, raw=True, prompt_lookup=True)
    assert [r.tokens for r in run] == want


def test_batch_from_the_cli_with_prompt_lookup(model, quantized, tmp_path):
    import json

    from click.testing import CliRunner

    from umakit.cli.main import main

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                                               for i, p in enumerate(REPEATS[:3])))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["batch", str(quantized("llama", 4)), "-i", str(tmp_path / "in.jsonl"), "-o",
                                  str(out), "--raw", "--temp", "0", "--max-tokens", "12", "--prompt-lookup", "--ngram",
                                  "2", "--device", "cpu", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row["text"] for row in map(json.loads, out.read_text().splitlines())}
    assert rows == {i: lone(model, p, 12, temperature=0).text for i, p in enumerate(REPEATS[:3])}
    r = CliRunner().invoke(main, ["batch", str(quantized("llama", 4)), "-i", str(tmp_path / "in.jsonl"), "-o",
                                  str(tmp_path / "other.jsonl"), "--prompt-lookup", "--backend", "mlx",
                                  "--kv-bits", "8"])
    assert r.exit_code != 0 and "--kv-bits" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "other.jsonl").exists()


def test_what_cannot_speculate_is_refused(model, tiny_dir):
    mlx = umakit.load(tiny_dir("llama"), backend="mlx", device="cpu")
    with pytest.raises(InvalidArgumentError, match="mlx backend does not support --kv-bits in a batch"):
        mlx.engine.batch_decoder(8, Lookup())
    with pytest.raises(InvalidArgumentError, match="need --draft MODEL or --prompt-lookup"):
        generate_batch(model, ["x"], ngram=2)
    with pytest.raises(InvalidArgumentError, match="ngram must be"):
        generate_batch(model, ["x"], prompt_lookup=True, ngram=0)


@pytest.mark.parametrize("engine,rows", [("torch", 1), ("torch", 4), ("mlx", 4)])
def test_the_server_speculates_greedy_requests_and_keeps_their_tokens(request, monkeypatch, engine, rows):
    from umakit.backends.mlx import batch_decoder as mlx_decoder
    from umakit.backends.torch import batch_decoder

    model = request.getfixturevalue("model" if engine == "torch" else "mlx_model")
    monkeypatch.setattr(batch_decoder if engine == "torch" else mlx_decoder, "RowLookup",
                        Oracle(model, REPEATS, 30).row)
    m = serve_all(model, Lookup(ngram=2, tokens=4), rows)
    assert m["decode_steps_total"] < m["generated_tokens_total"] / 2 / rows


def serve_all(model, lookup, rows):
    """Every prompt of REPEATS through a scheduler speculating with ``lookup``; checks each reply against a lone
    run and returns the scheduler's metrics."""
    s = Scheduler(model, SchedulerSettings(max_concurrency=rows, step_tokens=16, lookup=lookup))
    loop = asyncio.new_event_loop()
    s.start()
    try:
        results = answers(s, loop, [GenerationRequest(model.encode(p, raw=True), 30, GREEDY) for p in REPEATS], 60)
        m = s.metrics()
    finally:
        s.stop()
        loop.close()
    for p, (tokens, final) in zip(REPEATS, results):
        want = lone(model, p, 30, temperature=0)
        assert tokens == want.tokens and final.usage.completion_tokens == len(want.tokens)
    return m


# -- the MLX engine ----------------------------------------------------------------------------------------------
# Its rows' positions are computed together (not each as its own one-token step), so its tokens are checked
# against lone runs on prompts whose greedy replies have no near-tie to break.

def test_mlx_sampled_and_logprob_rows_decode_beside_speculating_ones(mlx_model, monkeypatch):
    from umakit.backends.mlx import batch_decoder

    monkeypatch.setattr(batch_decoder, "RowLookup", Oracle(mlx_model, REPEATS[:1], 30).row)
    ids = [mlx_model.encode(p, raw=True) for p in REPEATS[:3]]
    sampled = SamplingParams(temperature=0.8, top_k=20)
    rows = [BatchRow(0, ids[0], GREEDY), BatchRow(1, ids[1], sampled, seed=7),
            BatchRow(2, ids[2], GREEDY, logprobs=2)]
    decoder = mlx_model.engine.batch_decoder(lookup=Lookup(ngram=2, tokens=4))
    decoder.add(rows)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while min(len(v) for v in got.values()) < 16:
        out = decoder.step()
        counts = {r: sum(1 for i, _ in out if i == r) for r in got}
        assert counts[1] <= 1 and counts[2] <= 1  # one token a step at most, one step late, as without lookup
        assert set(decoder.logprobs()) == ({2} if counts[2] else set())
        for r, t in out:
            got[r].append(t)
    assert len(got[0]) > 20  # the speculating row ran ahead
    assert got[0][:16] == lone(mlx_model, REPEATS[0], 16, temperature=0).tokens
    assert got[1][:16] == lone(mlx_model, REPEATS[1], 16, temperature=0.8, top_k=20, seed=7).tokens
    assert got[2][:16] == lone(mlx_model, REPEATS[2], 16, temperature=0).tokens
    # the exported cache holds the prompt and every returned token but the last, as without speculation
    assert decoder.export(0).offset == len(ids[0]) + len(got[0]) - 1
    decoder.remove([1])
    more = decoder.step()
    assert {r for r, _ in more} <= {0, 2}


def test_mlx_refuses_lookup_where_a_row_cannot_give_back_positions(tmp_path):
    from support.mlx_models import make

    hybrid = umakit.load(make("qwen3_next", tmp_path / "qwen3_next"), backend="mlx", device="cpu")
    with pytest.raises(InvalidArgumentError, match="--prompt-lookup.*ArraysCache.*qwen3_next"):
        hybrid.engine.batch_decoder(lookup=Lookup())
    with pytest.raises(InvalidArgumentError, match="--draft in a batch.*leave out --draft"):
        hybrid.engine.batch_decoder(lookup=Lookup(draft=lambda: None))
    hybrid.engine.batch_decoder()  # without lookup it batches


# -- a draft model's proposals, each row on a draft cache of its own ---------------------------------------------

@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_greedy_rows_draft_with_a_smaller_model_and_keep_their_lone_tokens(request, quantized, engine):
    from umakit.generate.speculative import batch_lookup

    model = request.getfixturevalue("model" if engine == "torch" else "mlx_model")
    # the same tiny model at 8 bits: it agrees with the target often, not always
    draft = umakit.load(quantized("llama", 8), backend=engine, device="cpu", dtype="float32")
    want = [lone(model, p, 24, temperature=0) for p in REPEATS[:4]]
    for size in (1, 3):
        run = generate_batch(model, REPEATS[:4], max_tokens=24, sampling=GREEDY, batch_size=size, raw=True,
                             draft=draft, draft_tokens=3)
        assert [r.tokens for r in run] == [w.tokens for w in want], f"batch {size}"
        assert run.stats.steps < 0.8 * run.stats.generated_tokens / size
    lookup = batch_lookup(draft=draft, target=model)
    assert lookup.tokens == 4 and lookup.draft is not None
    m = serve_all(model, lookup, 4)  # the server's rows draft too
    assert m["decode_steps_total"] < 0.8 * m["generated_tokens_total"] / 4
    with pytest.raises(InvalidArgumentError, match="not both"):
        generate_batch(model, ["x"], draft=draft, prompt_lookup=True)
    with pytest.raises(InvalidArgumentError, match="--ngram applies to --prompt-lookup"):
        generate_batch(model, ["x"], draft=draft, ngram=2)


def test_batch_and_serve_take_a_draft_from_the_cli(model, quantized, tmp_path):
    import json

    from click.testing import CliRunner

    from umakit.cli.main import main

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                                               for i, p in enumerate(REPEATS[:3])))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["batch", str(quantized("llama", 4)), "-i", str(tmp_path / "in.jsonl"), "-o",
                                  str(out), "--raw", "--temp", "0", "--max-tokens", "12", "--draft",
                                  str(quantized("llama", 8)), "--device", "cpu", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row["text"] for row in map(json.loads, out.read_text().splitlines())}
    assert rows == {i: lone(model, p, 12, temperature=0).text for i, p in enumerate(REPEATS[:3])}
    for args, says in ((["--draft", "x", "--prompt-lookup"], "not both"), (["--draft", "x", "--ngram", "2"],
                                                                           "--ngram applies to --prompt-lookup")):
        r = CliRunner().invoke(main, ["batch", "m", "-i", str(tmp_path / "in.jsonl"), "-o",
                                      str(tmp_path / "no.jsonl"), *args])
        assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["serve", "a", "b", "--draft", "x"])
    assert r.exit_code != 0 and "--draft serves one model" in r.output


@pytest.mark.slow
def test_a_real_server_with_a_draft_keeps_its_replies(model, quantized, tmp_path_factory):
    import httpx

    from support.serve_helpers import read_metrics, start_server

    srv = start_server(quantized("llama", 4), ["--backend", "torch", "--device", "cpu", "--dtype", "bfloat16",
                                               "--draft", str(quantized("llama", 8))], tmp_path_factory, "draft")
    try:
        name = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        for text in REPEATS[:2]:
            messages = [{"role": "user", "content": text}]
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
                "model": name, "messages": messages, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            want = model.generate(messages=messages, max_tokens=16, temperature=0).text
            assert r.json()["choices"][0]["message"]["content"] == want
        m = read_metrics(httpx.get(f"{srv.url}/metrics").text)
        assert m["umakit_decode_steps_total"] < 0.8 * m["umakit_generated_tokens_total"]
    finally:
        srv.stop()
