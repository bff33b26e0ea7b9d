"""A reply's text as each API returns it: reasoning, content and tool calls split out of the model's one stream.

`ReplyParser` on recorded outputs, fed whole and one character at a time (so every marker is split across
chunks somewhere); then the app in process over a scheduler that replays a scripted reply, for OpenAI's chat
completions, Anthropic's messages and OpenAI's responses, streamed and not: no marker leaks into content,
the calls come back whole, a call cut by max_tokens is plain content.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from umakit.generate.chat import HARMONY_END, HARMONY_LEAD, HARMONY_START, THINK_END, THINK_START, thinking_markers
from umakit.serve.replies import ReplyParser, Thinking, parse_reply
from umakit.serve.toolcalls import GenericFormat, HarmonyFormat, HermesFormat
from support.tiny import make_tiny_model, write_tokenizer

THINKING = Thinking(THINK_START, THINK_END)
# A Qwen3-like template, written for these tests: ChatML, Hermes tool calls, thinking that a switch turns off.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    "</tools>\nCall a function as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
SPECIALS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def _split(parser: ReplyParser, text: str, step: int):
    pieces = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i:i + step])
    pieces += parser.finish()
    return pieces, parser.reply


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_thinking_content_and_a_call_split_anywhere(step):
    text = "<think>I should look it up.</think>\n\nLet me check." + CALL
    pieces, reply = _split(ReplyParser(THINKING, HermesFormat()), text, step)
    assert reply.reasoning == "I should look it up." and reply.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("weather", {"city": "Paris", "days": 2})]
    streamed = "".join(p.text for p in pieces if p.kind == "content")
    assert streamed == "Let me check." and "<" not in streamed  # no marker ever leaked into content


def test_a_prompt_that_opened_thinking_and_markers_that_are_only_prefixes():
    reply = parse_reply("still thinking </thi no </think>Answer <tool_ca", Thinking(THINK_START, THINK_END, open=True),
                        HermesFormat())
    assert reply.reasoning == "still thinking </thi no " and reply.content == "Answer <tool_ca" and not reply.calls


def test_a_call_cut_by_max_tokens_or_not_json_stays_content():
    cut = parse_reply("Sure. <tool_call>\n{\"name\": \"weather\", \"argu", None, HermesFormat())
    assert cut.calls == [] and cut.content == 'Sure. <tool_call>\n{"name": "weather", "argu'
    bad = parse_reply("<tool_call>\nnot json\n</tool_call>", None, HermesFormat())
    assert bad.calls == [] and "not json" in bad.content


def test_parallel_calls_and_the_generic_form():
    reply = parse_reply(CALL + "\n" + CALL.replace("Paris", "Rome"), None, HermesFormat())
    assert [json.loads(c.arguments)["city"] for c in reply.calls] == ["Paris", "Rome"]
    assert len({c.id for c in reply.calls}) == 2
    generic = parse_reply('{"tool_call": {"name": "f", "arguments": {"x": 1}}}', None, GenericFormat())
    assert generic.calls[0].name == "f" and generic.content == ""
    assert parse_reply('{"response": "Hello"}', None, GenericFormat()).content == "Hello"


def test_no_thinking_markers_means_plain_content():
    assert parse_reply("<think>x</think>y").content == "<think>x</think>y"


# -- the app in process, over a scripted reply ---------------------------------------------------------
class Scripted:
    """A scheduler that answers every request with ``text``, cut into ``step``-character tokens."""

    healthy = True

    def __init__(self):
        self.text, self.step, self.finish, self.stop = "", 3, "stop", None
        self.requests = []

    def check_room(self):
        pass

    def submit(self, request, loop):
        from umakit.serve.jobs import Handle
        from umakit.serve.types import FinalEvent, TokenEvent, Usage

        self.requests.append(request)
        handle = Handle(request.id, loop, lambda: None)
        pieces = [self.text[i:i + self.step] for i in range(0, len(self.text), self.step)]
        for p in pieces:
            handle.queue.put_nowait(TokenEvent(p, 5))
        handle.queue.put_nowait(FinalEvent(self.finish, Usage(len(request.prompt), len(pieces)), "", self.stop))
        return handle

    def metrics(self):
        return {}


def scripted_app(tmp_path_factory, name: str, template: str, specials: tuple[str, ...], **config):
    """(the app, its scripted scheduler, the model's name) of a tiny model with ``template``."""
    import umakit
    from umakit.serve.app import make_app

    path = make_tiny_model("qwen2", tmp_path_factory.mktemp(name), **config)
    write_tokenizer(path, template, extra_specials=specials)
    model = umakit.load(path, backend="torch", dtype="float32")
    scripted = Scripted()
    scripted.tokenizer, scripted.path, scripted.model = model.tokenizer, path, model
    return make_app(model, scripted), scripted, model.info.name


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return scripted_app(tmp_path_factory, "thinking", TEMPLATE, SPECIALS)


def _post(app, path, payload, stream=False):
    import asyncio

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=30) as c:
            r = await c.post(path, json=payload)
            return r.status_code, r.text

    status, text = asyncio.run(go())
    assert status == 200, text
    if not stream:
        return json.loads(text)
    events = []
    for block in text.strip().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            events.append(json.loads(data[0]))
    return events


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
REPLY = "<think>Look it up.</think>\n\nChecking." + CALL


def test_openai_chat_streamed_and_whole(app):
    app, scripted, name = app
    scripted.text = REPLY
    body = {"model": name, "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    whole = _post(app, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    m = choice["message"]
    assert m["content"] == "Checking." and m["reasoning_content"] == m["reasoning"] == "Look it up."
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    chunks = _post(app, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Look it up."
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_anthropic_messages_blocks_and_events(app):
    app, scripted, name = app
    scripted.text = REPLY
    tools = [{"name": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    body = {"model": name, "max_tokens": 50, "messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    whole = _post(app, "/v1/messages", body)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "Paris", "days": 2} and whole["stop_reason"] == "tool_use"
    events = _post(app, "/v1/messages", {**body, "stream": True}, stream=True)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "Checking."
    scripted.text, scripted.stop = "Hi", "STOP"
    stopped = _post(app, "/v1/messages", {**body, "stop_sequences": ["STOP"]})
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "STOP"
    scripted.stop = None


def test_openai_responses_items_and_events(app):
    app, scripted, name = app
    scripted.text = REPLY
    tools = [{"type": "function", "name": "weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    whole = _post(app, "/v1/responses", {"model": name, "input": "Weather?", "tools": tools})
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call"]
    assert whole["output"][1]["content"][0]["text"] == "Checking." and whole["status"] == "completed"
    assert json.loads(whole["output"][2]["arguments"])["city"] == "Paris"
    events = _post(app, "/v1/responses", {"model": name, "input": "Weather?", "tools": tools, "stream": True},
                   stream=True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."


def test_thinking_off_and_reasoning_effort_reach_the_template(app):
    app, scripted, name = app
    scripted.text = "Plain."
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}]}
    _post(app, "/v1/chat/completions", body)
    _post(app, "/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}})
    _post(app, "/v1/chat/completions", {**body, "reasoning_effort": "none"})
    on, off, effort = (scripted.tokenizer.decode(r.prompt) for r in scripted.requests[-3:])
    assert off.endswith("<think>\n\n</think>") and effort == off and "</think>" not in on


# -- gpt-oss's harmony format -------------------------------------------------------------------------
# A harmony template written for these tests from the format's description: each message a <|start|>role ...
# <|end|> block, an assistant's past reply in its final channel, the reasoning effort in the system block.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
HARMONY = Thinking(*thinking_markers(HARMONY_TEMPLATE))


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_harmony_channels_split_anywhere(step):
    text = HARMONY_START + "The user greets; answer briefly." + HARMONY_END + "Hello!"
    pieces, reply = _split(ReplyParser(HARMONY), text, step)
    assert reply.reasoning == "The user greets; answer briefly." and reply.content == "Hello!"
    assert "".join(p.text for p in pieces if p.kind == "content") == "Hello!"
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == "The user greets; answer briefly."
    _, direct = _split(ReplyParser(HARMONY), HARMONY_LEAD + "Straight to it.", step)  # no analysis at all
    assert direct.reasoning is None or direct.reasoning == ""
    assert direct.content == "Straight to it."


def test_think_tags_are_not_harmony_and_a_template_with_neither_has_no_markers():
    assert thinking_markers(TEMPLATE)[:2] == (THINK_START, THINK_END)
    assert thinking_markers("{{ messages }}") is None
    assert parse_reply("<|channel|>final<|message|>x").content == "<|channel|>final<|message|>x"  # no markers given


@pytest.fixture(scope="module")
def harmony_app(tmp_path_factory):
    return scripted_app(tmp_path_factory, "harmony", HARMONY_TEMPLATE, HARMONY_SPECIALS)


def test_a_harmony_reply_reaches_clients_as_reasoning_and_content(harmony_app):
    app, scripted, name = harmony_app
    scripted.text = HARMONY_START + "Greeting; be brief." + HARMONY_END + "Hello there."
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low"}
    whole = _post(app, "/v1/chat/completions", body)["choices"][0]["message"]
    assert whole["content"] == "Hello there." and whole["reasoning_content"] == "Greeting; be brief."
    events = _post(app, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Greeting; be brief."
    assert "Reasoning: low" in scripted.tokenizer.decode(scripted.requests[-1].prompt)


# -- harmony's tool calls, with gpt-oss's own template (tests/support/fixtures/templates) -------------------
GPT_OSS_TEMPLATE = (Path(__file__).resolve().parent.parent / "support" / "fixtures" / "templates" /
                    "openai-gpt-oss-120b.jinja").read_text()
GPT_OSS_SPECIALS = HARMONY_SPECIALS + ("<|constrain|>",)
HARMONY_CALL = ('<|end|><|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 2}')  # <|call|> ends the reply as an end token: not in the text


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("analysis", [True, False])
def test_a_harmony_call_splits_from_its_analysis_anywhere(step, analysis):
    text = (HARMONY_START + "The user wants the weather; call the tool." + HARMONY_CALL if analysis
            else ' to=functions.weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}')
    pieces, reply = _split(ReplyParser(Thinking(*thinking_markers(GPT_OSS_TEMPLATE)), HarmonyFormat()), text, step)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [("weather", {"city": "Paris", "days": 2})]
    assert reply.reasoning == ("The user wants the weather; call the tool." if analysis else "")
    assert reply.content == "" and not any(p.kind == "content" for p in pieces)
    assert all("<|" not in p.text for p in pieces)  # no marker reached a client


@pytest.fixture(scope="module")
def gpt_oss_app(tmp_path_factory):
    # gpt-oss's system and developer blocks alone take ~500 of the tiny tokenizer's tokens
    return scripted_app(tmp_path_factory, "gpt_oss_tools", GPT_OSS_TEMPLATE, GPT_OSS_SPECIALS,
                        max_position_embeddings=4096)


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}, "days": {"type": "integer"}},
                                                      "required": ["city"]}}}


def test_a_harmony_call_reaches_every_api_and_its_result_goes_back_as_the_template_writes_it(gpt_oss_app):
    app, scripted, name = gpt_oss_app
    scripted.text, scripted.finish = HARMONY_START + "Look it up." + HARMONY_CALL, "stop"
    body = {"model": name, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}
    choice = _post(app, "/v1/chat/completions", body)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Look it up."
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris",
                                                                                                    "days": 2}
    assert not choice["message"]["content"]
    prompt = scripted.tokenizer.decode(scripted.requests[-1].prompt)
    assert "namespace functions {" in prompt and "type weather = (_: {" in prompt  # the tools, as gpt-oss reads them
    events = _post(app, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or [] if c.get("function", {}).get(
        "name")] == ["weather"]
    blocks = _post(app, "/v1/messages", {"model": name, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Weather in Paris?"}], "tools": [{
            "name": "weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]})["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[1]["input"] == {"city": "Paris",
                                                                                            "days": 2}
    # the next turn: the call, its reasoning and its result rendered back as gpt-oss's template writes them
    scripted.text = HARMONY_START + "Done." + HARMONY_END + "Sunny."
    history = [*body["messages"], {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
                                   "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'}]
    assert _post(app, "/v1/chat/completions", {**body, "messages": history})["choices"][0]["message"]["content"] == \
        "Sunny."
    prompt = scripted.tokenizer.decode(scripted.requests[-1].prompt)
    assert ('<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.weather'
            '<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|><|start|>functions.weather '
            'to=assistant<|channel|>commentary<|message|>"{\\"sky\\": \\"clear\\"}"<|end|><|start|>assistant') in prompt


def test_harmony_constraints_start_where_gpt_oss_writes_what_they_govern(tmp_path):
    """response_format governs the final channel (with or without an analysis before it); a forced call is the
    reply's first message, so its grammar starts with the reply."""
    import umakit
    from umakit.generate.constrain import Constraint
    from umakit.serve.conversation import ChatCall, prepare

    path = make_tiny_model("qwen2", tmp_path / "m", max_position_embeddings=4096)
    write_tokenizer(path, GPT_OSS_TEMPLATE, extra_specials=GPT_OSS_SPECIALS)
    model = umakit.load(path, backend="torch", dtype="float32")
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    schema = prepare(model, ChatCall(asked, response=Constraint.json_schema({"type": "object"})))
    assert schema.constraint.after == HARMONY_LEAD and schema.tools is None
    forced = prepare(model, ChatCall(asked, tools=[WEATHER_TOOL], tool_choice="required"))
    assert forced.constraint.after is None and isinstance(forced.tools, HarmonyFormat)
    assert "commentary to=functions.weather " in forced.constraint.value
    free = prepare(model, ChatCall(asked, tools=[WEATHER_TOOL]))
    assert free.constraint is None  # auto: the model chooses, and the reply is parsed


# -- Gemma 4's thought channel ---------------------------------------------------------------------------------
# Gemma 4's real template: turns in <|turn>role ... <turn|>, thinking switched on by a <|think|> token in the system
# turn, and with it off the model's turn opening with an empty thought channel.
GEMMA4_TEMPLATE = (Path(__file__).resolve().parent.parent / "support" / "fixtures" / "templates" /
                   "google-gemma-4.jinja").read_text()
GEMMA4_SPECIALS = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>")


@pytest.fixture(scope="module")
def gemma4_app(tmp_path_factory):
    return scripted_app(tmp_path_factory, "gemma4", GEMMA4_TEMPLATE, GEMMA4_SPECIALS)


def test_gemma4_thinking_reaches_clients_as_reasoning_and_content(gemma4_app):
    from umakit.generate.chat import GEMMA4_END, GEMMA4_START

    app, scripted, name = gemma4_app
    assert thinking_markers(GEMMA4_TEMPLATE)[:2] == (GEMMA4_START, GEMMA4_END)
    scripted.text = GEMMA4_START + "\nThe user greets; be brief." + GEMMA4_END + "Hello there."
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "high"}
    whole = _post(app, "/v1/chat/completions", body)["choices"][0]["message"]
    assert whole["content"] == "Hello there." and whole["reasoning_content"].strip() == "The user greets; be brief."
    prompt = scripted.tokenizer.decode(scripted.requests[-1].prompt)
    assert "<|think|>" in prompt and prompt.rstrip().endswith("<|turn>model")  # thinking on: the turn left open
    events = _post(app, "/v1/chat/completions", {**body, "stream": True}, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there."
    assert not any(GEMMA4_START in (d.get("content") or "") for d in deltas)
    # thinking off (the default): the prompt closes an empty thought, and the reply is all content
    scripted.text = "Hello."
    plain = _post(app, "/v1/chat/completions", {**body, "reasoning_effort": "none"})["choices"][0]["message"]
    assert plain["content"] == "Hello." and not plain.get("reasoning_content")
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt).endswith("<|channel>thought\n<channel|>")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    from umakit.generate.constrain import Constraint
    from umakit.serve.conversation import ChatCall, prepare

    asked = [{"role": "user", "content": "Hi"}]
    closed = prepare(scripted.model, ChatCall(asked, response=Constraint.json_schema(schema)))
    assert closed.constraint.after is None  # the prompt closed the thought: the schema governs the reply's start
    thinking = prepare(scripted.model, ChatCall(asked, response=Constraint.json_schema(schema),
                                                reasoning_effort="high"))
    assert thinking.constraint.after == GEMMA4_END  # ... or, thinking on, what follows the thought


# -- a final assistant message continued (Anthropic's prefill, vLLM's continue_final_message) ------------------
QWEN25_TEMPLATE = (Path(__file__).resolve().parent.parent / "support" / "fixtures" / "templates" /
                   "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
PREFILLED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
             {"role": "assistant", "content": "Striped bananas are"}]


@pytest.fixture(scope="module", params=["thinking", "qwen25", "gpt_oss"])
def any_app(request, tmp_path_factory):
    template, specials, config = {"thinking": (TEMPLATE, SPECIALS, {}),
                                  "qwen25": (QWEN25_TEMPLATE, ("<tool_call>", "</tool_call>"), {}),
                                  "gpt_oss": (GPT_OSS_TEMPLATE, GPT_OSS_SPECIALS, {"max_position_embeddings": 4096})
                                  }[request.param]
    app, scripted, name = scripted_app(tmp_path_factory, f"prefill_{request.param}", template, specials, **config)
    from transformers import AutoTokenizer  # the oracle: transformers' own rendering of a continued message

    return app, scripted, name, AutoTokenizer.from_pretrained(str(scripted.path))


def test_a_prefill_is_continued_as_transformers_renders_it_and_the_reply_is_what_follows(any_app):
    app, scripted, name, oracle = any_app
    scripted.text = " yellow."
    want = oracle.apply_chat_template(PREFILLED, continue_final_message=True, tokenize=False)
    assert want.endswith("Striped bananas are")
    system, *turns = PREFILLED
    reply = _post(app, "/v1/messages", {"model": name, "max_tokens": 8, "system": system["content"],
                                        "messages": turns})
    assert reply["content"] == [{"type": "text", "text": " yellow."}]  # only what follows the prefill
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == want
    streamed = _post(app, "/v1/messages", {"model": name, "max_tokens": 8, "system": system["content"],
                                           "messages": turns, "stream": True}, stream=True)
    assert "".join(e["delta"]["text"] for e in streamed if e.get("type") == "content_block_delta") == " yellow."
    chat = _post(app, "/v1/chat/completions", {"model": name, "messages": PREFILLED,
                                               "continue_final_message": True, "add_generation_prompt": False})
    assert chat["choices"][0]["message"]["content"] == " yellow."
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == want
    # Mistral's and DeepSeek's way of asking the same: the message marked as a prefix
    prefixed = _post(app, "/v1/chat/completions", {"model": name, "messages": [
        *PREFILLED[:2], {**PREFILLED[2], "prefix": True}]})
    assert prefixed["choices"][0]["message"]["content"] == " yellow."
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == want
    # OpenAI's own meaning without the flag: the assistant message is a past turn, and a new one is opened
    _post(app, "/v1/chat/completions", {"model": name, "messages": PREFILLED})
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == oracle.apply_chat_template(
        PREFILLED, add_generation_prompt=True, tokenize=False)
    # an empty prefill starts the reply where no prefill would
    _post(app, "/v1/messages", {"model": name, "max_tokens": 8, "messages": [*turns[:1],
                                                                             {"role": "assistant", "content": ""}]})
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == oracle.apply_chat_template(
        turns[:1], add_generation_prompt=True, tokenize=False)
    if not any(switch in scripted.tokenizer.chat_template for switch in ("enable_thinking", "reasoning_effort")):
        # reasoning asked of a template without a switch: the refusal names the field the request used
        assert _refused(app, "/v1/messages", {"model": name, "max_tokens": 8, "messages": turns[:1], "thinking": {
            "type": "enabled", "budget_tokens": 1024}}).startswith("thinking: ")
        assert _refused(app, "/v1/responses", {"model": name, "input": "Hi", "reasoning": {"effort": "low"}}
                        ).startswith("reasoning.effort: ")


def test_add_generation_prompt_false_ends_the_prompt_after_the_messages(app):
    from transformers import AutoTokenizer

    app, scripted, name = app
    _post(app, "/v1/chat/completions", {"model": name, "messages": PREFILLED[:2], "add_generation_prompt": False})
    oracle = AutoTokenizer.from_pretrained(str(scripted.path))
    assert scripted.tokenizer.decode(scripted.requests[-1].prompt) == oracle.apply_chat_template(
        PREFILLED[:2], add_generation_prompt=False, tokenize=False)


def _refused(app, path, body) -> str:
    import asyncio

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await c.post(path, json=body)

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_what_a_continued_message_cannot_be_combined_with_is_refused_by_name(app):
    app, scripted, name = app
    asked = {"model": name, "max_tokens": 8, "messages": PREFILLED[1:]}
    assert "may not end in whitespace" in _refused(app, "/v1/messages", {**asked, "messages": [
        PREFILLED[1], {"role": "assistant", "content": "Striped "}]})
    assert "combined with reasoning" in _refused(app, "/v1/messages", {**asked, "thinking": {
        "type": "enabled", "budget_tokens": 1024}})
    assert "response format" in _refused(app, "/v1/messages", {**asked, "output_config": {
        "format": {"type": "json_schema", "schema": {"type": "object"}}}})
    tools = [{"name": "weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    assert "constrained tool call" in _refused(app, "/v1/messages", {**asked, "tools": tools,
                                                                     "tool_choice": {"type": "any"}})
    chat = {"model": name, "messages": PREFILLED, "continue_final_message": True}
    assert "add_generation_prompt must not be true" in _refused(app, "/v1/chat/completions", {
        **chat, "add_generation_prompt": True})
    assert "must be the last one, an assistant's text" in _refused(app, "/v1/chat/completions", {
        **chat, "messages": PREFILLED[:2]})
    assert "may be a prefix" in _refused(app, "/v1/chat/completions", {"model": name, "messages": [
        PREFILLED[0], {**PREFILLED[1], "prefix": True}]})
