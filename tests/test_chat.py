"""Chat sessions: the KV cache is kept across turns and only new tokens are prefilled."""

import copy
import json

import pytest

from umakit.chat import CUT_MARK, ChatSession, ChatSettings, common_prefix
from umakit.errors import InvalidArgumentError
from umakit.sampling import SamplingParams
from umakit.tokenizer import Tokenizer

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
    return ChatSession(model, ChatSettings(max_tokens=6, sampling=GREEDY, **kw))


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
