"""Chat sessions: the KV cache is kept across turns and only new tokens are prefilled."""

import copy
import json
import re

import pytest

from umakit.generate.chat import CUT_MARK, ChatSession, ChatSettings, common_prefix
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import SamplingParams
from umakit.checkpoint.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0)

TEMPLATES = {
    "chatml": None,  # the tiny model's own
    # re-renders earlier assistant turns differently: only the last reply keeps its text
    "drops_old_replies": (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last and loop.index < messages|length - 1 %}"
        "<|im_start|>assistant\n(earlier reply)<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # numbers every turn from the end, so the whole history changes every turn
    "counts_from_end": (
        "{% for m in messages %}[{{ messages|length - loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    ),
}


def with_template(model, name):
    if TEMPLATES[name] is None:
        return model
    m = copy.copy(model)
    m.tokenizer = Tokenizer(model.info.path)
    m.tokenizer.chat_template = TEMPLATES[name]
    return m


def session(model, **kw):
    return ChatSession(model, ChatSettings(**{"max_tokens": 6, "sampling": GREEDY, **kw}))


def turn(s, text):
    infos = []
    reply = "".join(c.text for c in s.send(text, on_ready=infos.append))
    return reply, infos[0]


def fresh_reply(model, messages):
    """The same turn computed from scratch, with an empty cache."""
    s = session(model)
    s.messages = messages[:-1]
    return turn(s, messages[-1]["content"])[0]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_cached_turns_equal_fresh_turns(tiny_model, template):
    model = with_template(tiny_model, template)
    s = session(model)
    for i, text in enumerate(["The quick brown", "fox jumps over", "the lazy dog"]):
        before = list(s.cached_ids)
        reply, info = turn(s, text)
        ids = model.tokenizer.encode_chat(s.messages[:-1])
        # only the tokens after the shared prefix were prefilled ...
        assert info.reused_tokens == min(common_prefix(before, ids), len(ids) - 1)
        assert info.new_tokens == len(ids) - info.reused_tokens
        assert s.cache.offset == len(s.cached_ids)
        # ... and the reply is exactly what a from-scratch run gives
        assert reply == fresh_reply(model, s.messages[:-1])
        if i and template == "chatml":
            assert info.reused_tokens > len(before) // 2  # stable template: most of the history is reused


def test_reset_empties_cache(tiny_model):
    s = session(tiny_model)
    turn(s, "The quick brown")
    assert s.cache.offset > 0 and s.cache_bytes > 0
    s.reset()
    assert s.cache.offset == 0 and s.messages == [] and s.cached_ids == []


def test_interrupted_reply_is_kept_and_marked(tiny_model):
    s = session(tiny_model)
    chunks = 0

    def stop():
        return chunks >= 2

    for _ in s.send("The quick brown", should_stop=stop):
        chunks += 1
    assert s.messages[-1]["role"] == "assistant" and s.messages[-1]["content"].endswith(CUT_MARK)
    assert s.cache.offset == len(s.cached_ids)
    reply, _ = turn(s, "again")  # the session goes on
    assert reply == fresh_reply(tiny_model, s.messages[:-1])


def test_context_limit_drops_oldest_turns_keeps_system(tiny_model):
    s = session(tiny_model, max_context=80, system="be brief")
    dropped = []
    for text in ["The quick brown fox", "jumps over the lazy", "dog and Paris is", "the capital of France"]:
        _, info = turn(s, text)
        dropped.append(info.dropped_turns)
        assert s.cache.offset <= 80  # prompt and reply never outgrow the context
    assert sum(dropped) > 0
    assert s._conversation()[0] == {"role": "system", "content": "be brief"}
    assert s.messages[-2]["content"] == "the capital of France"


def test_message_longer_than_context_is_refused(tiny_model):
    s = session(tiny_model, max_context=32)
    with pytest.raises(InvalidArgumentError, match="more than the context limit of 32"):
        list(s.send("The quick brown fox jumps over the lazy dog " * 5))
    assert s.messages == []


def test_save_and_load_reproduce_history(tiny_model, tmp_path):
    s = session(tiny_model, system="be brief")
    turn(s, "The quick brown")
    turn(s, "fox jumps")
    path = tmp_path / "t.json"
    s.save(path)
    data = json.loads(path.read_text())
    assert data["messages"] == s.messages and data["settings"]["system"] == "be brief"
    t = session(tiny_model)
    n = t.load(path)
    assert t.messages == s.messages and t.settings.system == "be brief"
    assert n == t.cache.offset > 0
    # the next turn continues from the restored cache and matches the original session
    a, info = turn(t, "over the dog")
    b, _ = turn(s, "over the dog")
    assert a == b and info.reused_tokens >= n - 1


def test_load_bad_transcript(tiny_model, tmp_path):
    s = session(tiny_model)
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "user"}]}')
    with pytest.raises(InvalidArgumentError, match="not a umakit transcript"):
        s.load(bad)
    bad.write_text('{"messages": [], "settings": {"max_tokenz": 3}}')
    with pytest.raises(InvalidArgumentError, match="not a umakit transcript: unknown setting.*max_tokenz"):
        s.load(bad)
    with pytest.raises(InvalidArgumentError, match="no such transcript"):
        s.load(tmp_path / "missing.json")


# -- stopping a turn at any moment (Ctrl-C), on both engines ----------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens: a dozen prefill chunks


@pytest.fixture(scope="module", params=["mlx", "torch"])
def engine_model(request, tiny_dir, tiny_model):
    if request.param == "mlx":
        return tiny_model
    import umakit

    return umakit.load(tiny_dir("llama"), backend="torch")


class Polls:
    """A ``should_stop`` that turns true on its ``n``-th call (counting every call)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self):
        self.calls += 1
        return self.calls >= self.n


def assert_consistent(s):
    """The cache holds exactly ``cached_ids`` (the next turn's reply, compared with a fresh run, checks
    that they are the right tokens)."""
    assert s.cache.offset == len(s.cached_ids)


@pytest.mark.parametrize("polls", [1, 4])  # 1: right after Enter, before any chunk; 4: in the middle of the prefill
def test_stop_during_prefill_takes_the_message_back(engine_model, polls):
    s = session(engine_model)
    turn(s, "The quick brown")
    before, cached = copy.deepcopy(s.messages), len(s.cached_ids)
    infos, stop = [], Polls(polls)
    assert list(s.send(LONG, on_ready=infos.append, should_stop=stop)) == []  # no reply began
    assert infos[0].cancelled and s.messages == before
    assert_consistent(s)
    if polls > 1:  # the chunks prefilled before the stop stay in the cache, for the next turn
        assert cached < len(s.cached_ids) < cached + infos[0].new_tokens
    # the next turn sees the earlier history and replies exactly as a from-scratch run does
    reply, _ = turn(s, "fox jumps")
    assert s.messages[0]["content"] == "The quick brown" and len(s.messages) == 4
    assert reply == fresh_reply(engine_model, s.messages[:-1])


def test_stop_during_reply_keeps_it_cut(engine_model):
    s = session(engine_model, max_tokens=20)
    stop, n = Polls(10**9), 0
    for _ in s.send(LONG, should_stop=stop):
        n += 1
        if n == 3:
            stop.n = stop.calls + 1  # Ctrl-C after the third piece of the reply
    assert n == 3 and s.messages[-1]["content"].endswith(CUT_MARK)
    assert_consistent(s)
    reply, info = turn(s, "again")
    assert info.reused_tokens > len(LONG.split())  # the long message stayed in the cache
    assert reply == fresh_reply(engine_model, s.messages[:-1])


def test_long_turn_stats_count_the_whole_prefill(engine_model):
    s = session(engine_model)
    turn(s, "The quick brown")
    infos, stats = [], []
    for c in s.send(LONG, on_ready=infos.append):
        if c.stats is not None:
            stats.append(c.stats)
    st, info = stats[0], infos[0]
    assert (st.prompt_tokens, st.cached_tokens) == (info.new_tokens, info.reused_tokens)
    assert st.ttft_s > 0 and st.prefill_tps == pytest.approx(st.prompt_tokens / st.ttft_s)


def test_error_in_prefill_takes_the_message_back(engine_model, monkeypatch):
    s = session(engine_model)
    turn(s, "The quick brown")
    before = copy.deepcopy(s.messages)
    real, calls = engine_model.engine.prefill, []

    def failing(tokens, cache):
        calls.append(len(tokens))
        if len(calls) == 3:
            raise RuntimeError("device lost")
        real(tokens, cache)

    monkeypatch.setattr(engine_model.engine, "prefill", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        list(s.send(LONG))
    monkeypatch.undo()
    assert s.messages == before
    assert_consistent(s)
    reply, _ = turn(s, "fox jumps")
    assert reply == fresh_reply(engine_model, s.messages[:-1])


def test_stopped_load_keeps_the_conversation(engine_model, tmp_path):
    from umakit.generate.chat import Stopped

    src = session(engine_model)
    turn(src, LONG)
    src.save(tmp_path / "t.json")
    s = session(engine_model)
    turn(s, "The quick brown")
    before = copy.deepcopy(s.messages)
    with pytest.raises(Stopped):
        s.load(tmp_path / "t.json", should_stop=Polls(3))
    assert s.messages == before
    assert_consistent(s)
    reply, _ = turn(s, "fox jumps")
    assert reply == fresh_reply(engine_model, s.messages[:-1])


class ClockEngine:
    """Records prefill chunk sizes; each chunk 'takes' ``seconds`` on a fake clock."""

    def __init__(self, seconds, clock):
        self.seconds, self.clock, self.chunks = seconds, clock, []

    def prefill(self, tokens, cache):
        self.chunks.append(len(tokens))
        self.clock[0] += self.seconds


@pytest.mark.parametrize("seconds, expected", [
    (0.001, [16, 32, 64, 128, 256, 512, 512, 46]),  # a fast device soon prefills at full size
    (0.2, [16] * 97 + [14]),  # a slow one keeps chunks small, so Ctrl-C never waits long
    (0.5, [16, 8, 4, 2] + [1] * 1536),  # a very slow one shrinks them to single tokens
])
def test_prefill_chunks_grow_only_on_fast_devices(monkeypatch, seconds, expected):
    from umakit.generate import chat

    clock = [0.0]
    monkeypatch.setattr(chat.time, "perf_counter", lambda: clock[0])
    engine = ClockEngine(seconds, clock)
    assert chat.prefill_interruptibly(engine, list(range(1566)), None) == 1566
    assert engine.chunks == expected
    engine.chunks = []
    stopped = chat.prefill_interruptibly(engine, list(range(1566)), None, should_stop=Polls(3))
    assert stopped == sum(expected[:2])  # two chunks, then the third poll stops it


@pytest.mark.parametrize("settings, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": "5"}, "max_tokens must be an integer"),
    ({"seed": 2**70}, "seed must be in"),
    ({"kv_bits": 3}, "kv_bits must be 4, 8 or null"),
    ({"max_context": 4}, "max_context must be >= 16"),
    ({"sampling": {"temperature": float("nan")}}, "temperature must be a finite number"),
    ({"sampling": {"top_p": 3}}, "top_p must be in"),
    ({"sampling": {"temprature": 1}}, "unknown setting.*temprature"),
    ({"sampling": [1]}, "settings must be an object"),
    ({"system": 5}, "system must be a string"),
])
def test_bad_transcript_settings_are_refused(tiny_model, tmp_path, settings, message):
    s = session(tiny_model)
    turn(s, "The quick brown")
    before = copy.deepcopy(s.messages)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"messages": [], "settings": settings}))
    with pytest.raises(InvalidArgumentError, match="not a umakit transcript: " + message):
        s.load(path)
    assert s.messages == before


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\xff junk", "not UTF-8 text"),
    (b"[1, 2]", "not an object with messages"),
    (b"{", "not a umakit transcript"),
    (b'{"messages": 5}', "messages must be a list"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "string content"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "a role of system, user, assistant"),
    (b'{"messages": [], "settings": {"max_context": 100000000}}', "exceeds the model"),
])
def test_bad_transcript_files_are_refused(tiny_model, tmp_path, content, message):
    s = session(tiny_model)
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(InvalidArgumentError, match=message):
        s.load(path)
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        s.load(tmp_path)


def test_save_to_a_directory_or_unwritable_place(tiny_model, tmp_path):
    from umakit.errors import UmakitError

    s = session(tiny_model)
    turn(s, "The quick brown")
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        s.save(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UmakitError, match="cannot write"):
        s.save(tmp_path / "file" / "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing partial left


def test_rescue_saves_under_umakit_home(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    s = session(tiny_model)
    turn(s, "The quick brown")
    path = s.rescue()
    assert path.parent == tmp_path / "home" / "sessions"
    t = session(tiny_model)
    assert t.load(path) > 0 and t.messages == s.messages


# -- a reasoning model's thinking: dimmed, and switched with /think ------------------------------------------
THINKING = (  # Qwen3's switch, written for this test: the prompt opens the thinking unless it is off
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


def test_thinking_shows_dimmed_and_think_off_skips_it(tiny_model, monkeypatch):
    import click

    from umakit.cli.chat_ui import Repl

    m = copy.copy(tiny_model)
    m.tokenizer = Tokenizer(tiny_model.info.path)
    m.tokenizer.chat_template = THINKING
    s = session(m)
    assert s.thinking_switch and s.thinking_markers == ("<think>", "</think>", ())
    printed = []  # what reaches the terminal, styles kept (click drops them on a pipe)
    monkeypatch.setattr(click, "echo", lambda message="", nl=True, err=False, **_: printed.append(str(message)))
    repl = Repl(s, color=True, show_stats=False)
    repl.reply("hi")
    out = "".join(printed)
    dimmed = "".join(re.findall(r"\x1b\[2m(.*?)\x1b\[0m", out, re.S))
    assert s.opens_thinking and s.messages[-1]["content"] and dimmed == s.messages[-1]["content"]  # all thinking
    repl.command("/think off")
    assert s.settings.thinking is False and printed[-1] == "(thinking off)"
    printed.clear()
    repl.reply("again")
    assert not s.opens_thinking and s.settings.to_dict()["thinking"] is False
    out = "".join(printed)
    assert s.messages[-1]["content"] in out and "\x1b[2m" not in out  # no thinking: plain content


def test_think_needs_a_template_with_a_switch(tiny_model):
    from umakit.cli.chat_ui import Repl

    repl = Repl(session(tiny_model), color=False)
    with pytest.raises(InvalidArgumentError, match="no thinking switch"):
        repl.command("/think on")
    with pytest.raises(InvalidArgumentError, match="usage: /think on"):
        repl.command("/think maybe")


HARMONY = (  # gpt-oss's harmony format, written for this test: past replies in their final channel
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m['content'] }}<|end|>{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_a_harmony_reply_shows_its_analysis_dimmed_and_the_history_keeps_its_final_text(tiny_model, monkeypatch):
    """gpt-oss answers in channels: the chat shows the analysis as thinking and the final channel as the reply,
    and the next turn's prompt holds the final text alone (no channel markers as content)."""
    import click

    from umakit.cli.chat_ui import Repl
    from umakit.generate.chat import HARMONY_END, HARMONY_START
    from umakit.generate.stream import Chunk

    m = copy.copy(tiny_model)
    m.tokenizer = Tokenizer(tiny_model.info.path)
    m.tokenizer.chat_template = HARMONY
    pieces = [HARMONY_START[:9], HARMONY_START[9:] + "They greet", " me.", HARMONY_END[:5], HARMONY_END[5:] + "Hel", "lo."]

    def scripted(ids, cache, **kw):  # the model's reply, a piece a token
        for i, p in enumerate(pieces):
            yield Chunk(p, token=3 + i)

    monkeypatch.setattr(m, "stream_tokens", scripted)
    s = session(m)
    printed = []
    monkeypatch.setattr(click, "echo", lambda message="", nl=True, err=False, **_: printed.append(str(message)))
    Repl(s, color=True, show_stats=False).reply("hi")
    out = "".join(printed)
    assert "".join(re.findall(r"\x1b\[2m(.*?)\x1b\[0m", out, re.S)) == "They greet me."
    assert "Hello." in out and "<|" not in out
    assert s.messages[-1] == {"role": "assistant", "content": "Hello.", "thinking": "They greet me."}
    rendered = m.tokenizer.render_chat(s.messages, add_generation_prompt=True)
    assert rendered.count("<|channel|>") == 1 and "final<|message|>Hello.<|end|>" in rendered
