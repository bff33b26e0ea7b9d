"""Tool-call formats: detected from real chat templates, rendered as transformers renders them, parsed
back from model text, and forced by grammars that llguidance compiles. Offline: the templates are
fixtures (tests/support/fixtures/templates/README.md), the tokenizer a tiny BPE trained here."""

import copy
import json
import re
from pathlib import Path

import llguidance as lg
import pytest

from umakit.checkpoint.tokenizer import Tokenizer
from umakit.errors import InvalidArgumentError
from umakit.serve import toolcalls as tc

TEMPLATES = Path(__file__).resolve().parent.parent / "support" / "fixtures" / "templates"
BOS, EOS = "<s>", "</s>"
# Markers as real tokenizers hold them: the [..] ones are special tokens, <tool_call> an added token
# (llguidance treats every added <...> token as special, so a string literal never matches it).
SPECIALS = [BOS, EOS, "<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>",
            # gpt-oss's harmony
            "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>",
            # DeepSeek V3.1's
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
            # Kimi K2's, then LFM2's (both end a call with <|tool_call_end|>)
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_call_start|>"]
ADDED = ["<tool_call>", "</tool_call>", "<|tool_call>", "<tool_call|>", '<|"|>']
TRAIN_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}} <parameter=city> Lyon Zürich 東京 ' * 10

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "description": "c or f", "enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
CALL_ID = "call_0123456789abcdef01234567"
# An OpenAI conversation; the reply after the tool result keeps user/assistant alternating, which
# Mistral's templates insist on.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "And the time?"},
]
MISTRAL_ID = tc.MistralFormat()._template_id(CALL_ID)
ARGS = {"city": "Paris", "unit": "c"}

DS_OPEN, DS_CLOSE = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
KIMI_OPEN, KIMI_CLOSE = "<|tool_calls_section_begin|><|tool_call_begin|>", "<|tool_call_end|><|tool_calls_section_end|>"
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
# fixture -> (format name, the text its template writes for the conversation's call)
FIXTURES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", HERMES_CALL),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", HERMES_CALL),
    "Qwen3-Coder": ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                 "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", LLAMA_CALL),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", LLAMA_CALL),
    "meta-llama-Llama-4-Scout-17B-16E-Instruct": ("llama3", "<|python_start|><|python_end|>" + LLAMA_CALL),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        "mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
                   f'"id": "{MISTRAL_ID}"}}]'),
    "Mistral-Small-3.2-24B-Instruct-2506": (
        "mistral", f'[TOOL_CALLS]get_weather[CALL_ID]{MISTRAL_ID}[ARGS]{{"city": "Paris", "unit": "c"}}'),
    "openai-gpt-oss-120b": (
        "harmony", 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "c"}'
                   "<|call|>"),
    "zai-org-GLM-4.6": ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                                 "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>"),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v3", DS_OPEN + 'get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "c"}'
                                                + DS_CLOSE),
    "google-gemma-4": ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|>'),
    "moonshotai-Kimi-K2-Thinking": ("kimi_k2", KIMI_OPEN + 'functions.get_weather:0<|tool_call_argument_begin|>'
                                               '{"city": "Paris", "unit": "c"}' + KIMI_CLOSE),
    # llama.cpp's shortened Kimi K2 template writes no past calls: the format puts them in the message's text
    "moonshotai-Kimi-K2": ("kimi_k2", KIMI_OPEN + 'functions.get_weather:0<|tool_call_argument_begin|>'
                                      '{"city": "Paris", "unit": "c"}' + KIMI_CLOSE),
    "LiquidAI-LFM2.5-8B-A1B": ("pythonic", "<|tool_call_start|>[get_weather(city='Paris', unit='c')]<|tool_call_end|>"),
    "HuggingFaceTB-SmolLM2-135M-Instruct": (
        "generic", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}'),
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    tok.add_tokens([AddedToken(t, special=False) for t in ADDED])
    return tok.to_str()


# -- detection -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_detect_reads_the_format_from_the_template(name):
    fmt = tc.detect(template(name))
    assert fmt.name == FIXTURES[name][0]
    if fmt.name == "mistral":  # the newer [ARGS] syntax only where the template writes it
        assert fmt.args_form == ("Small-3.2" in name)
    if fmt.name == "kimi_k2":
        assert fmt.calls_in_content == (name == "moonshotai-Kimi-K2")
    # DeepSeek's template reads no tools: its format describes them in the system prompt, as the generic one does
    assert tc.template_supports_tools(template(name)) == (fmt.name not in ("generic", "deepseek_v3"))


def test_no_template_is_generic():
    assert tc.detect(None).name == "generic"
    assert not tc.template_supports_tools(None)
    assert not tc.template_supports_tools("{{ 'tools' }} tools")  # text, not the variable


# -- rendering: umakit's template engine against transformers' own -----------------


def umakit_render(tmp_path, chat_template, messages, tools):
    """What umakit's Tokenizer renders (its bos and eos from tmp_path's tokenizer_config.json)."""
    tok = Tokenizer(tmp_path)
    tok.chat_template = chat_template
    return tok.render_chat(messages, add_generation_prompt=True, tools=tools)


def transformers_render(tokenizer_json, chat_template, messages, tools):
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tokenizer_json), bos_token=BOS, eos_token=EOS)
    tok.chat_template = chat_template
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def undated(text: str) -> str:
    return re.sub(r"(Today Date|Current date|Today's date): [^\n]*", r"\1: -", text)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_rendering_matches_transformers_and_teaches_what_parse_reads(name, tmp_path, tokenizer_json):
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    fmt = tc.detect(template(name))
    before = copy.deepcopy(CONVERSATION)
    messages, tools = fmt.template_messages(CONVERSATION, TOOLS)
    assert CONVERSATION == before  # the request's messages are not changed

    ours = undated(umakit_render(tmp_path, template(name), messages, tools))
    # (a call's content None is "": transformers 5 drops a key whose value is None, and Llama 4's and DeepSeek V3.1's
    # templates cannot take a content left out)
    theirs = undated(transformers_render(tokenizer_json, template(name), messages, tools))
    assert ours == theirs
    call_text = FIXTURES[name][1]
    assert call_text in ours  # the past call as the template writes it ...
    content, calls = fmt.parse(call_text)  # ... is what parse reads back
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    assert "get_time" in ours  # the tools reach the prompt


def test_gemma4_results_are_read_from_the_calling_message_and_render_as_transformers_renders_them(
        tmp_path, tokenizer_json):
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    gemma4 = template("google-gemma-4")
    fmt = tc.detect(gemma4)
    asked = CONVERSATION[:4]  # the call and its result: the model's turn goes on after it
    messages, tools = fmt.template_messages(asked, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[2]["tool_responses"] == [{"name": "get_weather", "response": {"temp": 21}}]
    ours = umakit_render(tmp_path, gemma4, messages, tools)
    assert ours == transformers_render(tokenizer_json, gemma4, messages, tools)
    call = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}c{Q}}}<tool_call|>"
    # (and its thinking off, the turn goes on with an empty thought)
    assert ours.endswith(call + "<|tool_response>response:get_weather{temp:21}<tool_response|>"
                         "<|channel>thought\n<channel|>")
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse(call)[1]] == [("get_weather", ARGS)]
    # a result that is not a JSON object is passed as its text; a later answer is a turn of its own
    plain = [*asked[:3], {**asked[3], "content": "sunny"}, *CONVERSATION[4:]]
    messages, tools = fmt.template_messages(plain, TOOLS)
    assert messages[2]["tool_responses"] == [{"name": "get_weather", "response": "sunny"}]
    rendered = umakit_render(tmp_path, gemma4, messages, tools)
    assert rendered == transformers_render(tokenizer_json, gemma4, messages, tools)
    assert f"response:get_weather{{value:{Q}sunny{Q}}}<tool_response|><|turn>model" in rendered


def test_kimi_ids_name_the_function_and_count_the_conversations_calls(tmp_path, tokenizer_json):
    """Kimi K2 knows a call, and its result, by ``functions.NAME:N``: the client's ids are replaced in order."""
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    conversation = CONVERSATION[:4] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Lyon"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "b", "content": "rain"}, {"role": "tool", "tool_call_id": "a", "content": "9"}]
    messages, tools = tc.KimiK2Format().template_messages(conversation, TOOLS)
    assert [m.get("tool_call_id") for m in messages[3:]] == ["functions.get_weather:0", None,
                                                             "functions.get_weather:2", "functions.get_time:1"]
    assert [c["id"] for c in messages[4]["tool_calls"]] == ["functions.get_time:1", "functions.get_weather:2"]
    text = umakit_render(tmp_path, template("moonshotai-Kimi-K2-Thinking"), messages, tools)
    assert text == transformers_render(tokenizer_json, template("moonshotai-Kimi-K2-Thinking"), messages, tools)
    assert "## Return of functions.get_weather:2\nrain" in text and "## Return of functions.get_time:1\n9" in text
    assert conversation[4]["tool_calls"][0]["id"] == "a"  # the request's messages are not changed


def test_lfm2_keeps_the_turns_reasoning_before_its_calls(tmp_path, tokenizer_json):
    """LFM2.5's template writes an assistant's ``thinking`` within the current turn (a tool loop): a client's
    ``reasoning_content`` reaches it under that name."""
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    name = "LiquidAI-LFM2.5-8B-A1B"
    looping = CONVERSATION[:2] + [{**CONVERSATION[2], "reasoning_content": "Paris, in Celsius."}, CONVERSATION[3]]
    messages, tools = tc.detect(template(name)).template_messages(looping, TOOLS)
    ours = undated(umakit_render(tmp_path, template(name), messages, tools))
    assert ours == undated(transformers_render(tokenizer_json, template(name), messages, tools))
    assert "<think>Paris, in Celsius.</think><|tool_call_start|>[get_weather(" in ours


def test_template_messages_parse_arguments_and_shorten_ids_for_mistral():
    messages, tools = tc.HermesFormat().template_messages(CONVERSATION, TOOLS)
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == ARGS
    assert messages[3]["tool_call_id"] == CALL_ID and tools == TOOLS
    assert "tool_calls" not in messages[4]  # Llama's template tests `'tool_calls' in message`
    assert tc.HermesFormat().template_messages(CONVERSATION, [])[1] is None

    messages, _ = tc.MistralFormat().template_messages(CONVERSATION, TOOLS)
    short = messages[2]["tool_calls"][0]["id"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", short) and messages[3]["tool_call_id"] == short


def test_llama_gets_one_call_per_message(tmp_path, tokenizer_json, llg):
    """Llama 3.x's templates refuse a message with two calls: parallel calls become one message each. Llama 4's
    take them in one message, one after another, and a forced pair is written that way too."""
    parallel = copy.deepcopy(CONVERSATION)
    second = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}
    parallel[2]["tool_calls"].append(second)
    parallel.insert(4, {"role": "tool", "tool_call_id": "call_2", "content": "noon"})
    messages, tools = tc.Llama3Format().template_messages(parallel, TOOLS)
    assert [len(m.get("tool_calls", [])) for m in messages] == [0, 0, 1, 1, 0, 0, 0, 0]
    name = "meta-llama-Llama-3.1-8B-Instruct"
    text = transformers_render(tokenizer_json, template(name), messages, tools)
    assert LLAMA_CALL in text and '{"name": "get_time", "parameters": {"city": "Paris"}}' in text
    # Llama 4's template takes them in one message, one after another
    name = "meta-llama-Llama-4-Scout-17B-16E-Instruct"
    fmt = tc.detect(template(name))
    messages, tools = fmt.template_messages(parallel, TOOLS)
    assert not fmt.single_call and [len(m.get("tool_calls", [])) for m in messages] == [0, 0, 2, 0, 0, 0, 0]
    text = transformers_render(tokenizer_json, template(name), messages, tools)
    assert "<|python_end|>" + LLAMA_CALL + '{"name": "get_time", "parameters": {"city": "Paris"}}<|eot|>' in text
    assert [c.name for c in fmt.parse(text.split("assistant<|header_end|>\n\n")[1].split("<|eot|>")[0])[1]] == [
        "get_weather", "get_time"]
    two = LLAMA_CALL + '{"name": "get_time", "parameters": {"city": "Paris"}}'  # forced, they follow one another too
    assert accepts(llg, fmt.grammar(TOOLS, None, special_tokens=llg[1]), two)
    assert not accepts(llg, tc.Llama3Format().grammar(TOOLS, None, special_tokens=llg[1]), two)


def test_harmony_gets_one_call_per_message_each_followed_by_its_result(tmp_path, tokenizer_json):
    """gpt-oss's template holds one call a message and names a result's function after the call just before it:
    parallel calls become call, result, call, result (a call's reasoning, rendered as its analysis while no final
    answer follows it, is checked in tests/serve/test_replies.py)."""
    parallel = copy.deepcopy(CONVERSATION)
    second = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}
    parallel[2]["tool_calls"].append(second)
    parallel[2]["reasoning_content"] = "Both are needed."
    parallel.insert(4, {"role": "tool", "tool_call_id": "call_2", "content": "noon"})
    messages, tools = tc.HarmonyFormat().template_messages(parallel, TOOLS)
    assert [(m["role"], len(m.get("tool_calls", []))) for m in messages[2:6]] == [
        ("assistant", 1), ("tool", 0), ("assistant", 1), ("tool", 0)]
    assert messages[3]["tool_call_id"] == CALL_ID and messages[5]["tool_call_id"] == "call_2"
    name = "openai-gpt-oss-120b"
    text = transformers_render(tokenizer_json, template(name), messages, tools)
    assert undated(umakit_render_with(tmp_path, tokenizer_json, template(name), messages, tools)) == undated(text)
    assert "Both are needed." not in text  # a final answer follows the calls: the template drops their analysis
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "c"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>') in text


def umakit_render_with(tmp_path, tokenizer_json, chat_template, messages, tools):
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return umakit_render(tmp_path, chat_template, messages, tools)


def test_generic_describes_tools_in_the_system_message():
    messages, tools = tc.GenericFormat().template_messages(CONVERSATION, TOOLS)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("You are terse.\n\n") and '"get_time"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": ARGS}}
    assert "get_weather" in messages[3]["content"] and CALL_ID in messages[3]["content"]
    assert messages[3]["content"].endswith('{"temp": 21}')
    no_system, _ = tc.GenericFormat().template_messages(CONVERSATION[1:2], TOOLS)
    assert no_system[0]["role"] == "system" and no_system[1] == CONVERSATION[1]


def test_arguments_that_are_not_a_json_object_are_refused():
    bad = copy.deepcopy(CONVERSATION)
    bad[2]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(InvalidArgumentError, match="get_weather"):
        tc.HermesFormat().template_messages(bad, TOOLS)


# -- parsing ---------------------------------------------------------------------

PARIS, TOKYO = {"city": "Paris"}, {"city": "東京"}
Q = '<|"|>'  # Gemma 4's string quote
GEMMA_TWO = (f"Checking.<|tool_call>call:get_weather{{city:{Q}São Paulo{Q},days:3,detail:{{wind:true,gusts:[1,2.5]}}}}"
             f"<tool_call|><|tool_call>call:get_time{{city:{Q}Lyon{Q}}}<tool_call|>")
HERMES_TWO = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "東京"}}\n</tool_call>')
XML_TWO = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=detail>\n{\"wind\": true}\n</parameter>\n"
           "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=city>\nLyon\n</parameter>\n"
           "</function>\n</tool_call>")
XML_ARGS = {"city": "São Paulo", "days": 3, "detail": {"wind": True}}  # JSON where it parses, else text
GLM_TWO = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>detail</arg_key>\n"
           "<arg_value>{\"wind\": true}</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>city</arg_key>\n"
           "<arg_value>Lyon</arg_value>\n</tool_call>")
SAME = None  # the whole text stays content
# (format, case, model text, content, [(name, arguments)])
PARSE_CASES = [
    ("hermes", "one", HERMES_CALL, "", [("get_weather", ARGS)]),
    ("hermes", "parallel, text before", HERMES_TWO, "I will check both.",
     [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("hermes", "bad JSON", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', SAME, []),
    ("hermes", "cut", '<tool_call>\n{"name": "get_weather", "argum', SAME, []),
    ("hermes", "cut, then a call", '<tool_call>\n{"name": "get_w' + HERMES_CALL, '<tool_call>\n{"name": "get_w',
     [("get_weather", ARGS)]),
    ("hermes", "no name", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', SAME, []),
    ("hermes", "arguments a list", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', SAME, []),
    ("hermes", "no call", "Just text, no call.", SAME, []),
    ("qwen3_xml", "parallel, text before", XML_TWO, "Checking.",
     [("get_weather", XML_ARGS), ("get_time", {"city": "Lyon"})]),
    ("qwen3_xml", "no wrapper", "<function=get_time>\n</function>", "", [("get_time", {})]),
    ("qwen3_xml", "cut", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", SAME, []),
    ("qwen3_xml", "stray text", "<tool_call>\n<function=get_weather>\nwords\n</function>\n</tool_call>", SAME, []),
    ("glm45", "parallel, text before", GLM_TWO, "Checking.", [("get_weather", XML_ARGS), ("get_time", {"city": "Lyon"})]),
    ("glm45", "no arguments", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    ("glm45", "cut", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", SAME, []),
    ("glm45", "stray text", "<tool_call>get_weather\nwords\n</tool_call>", SAME, []),
    ("glm45", "no name", "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", SAME, []),
    ("gemma4", "parallel, text before", GEMMA_TWO, "Checking.",
     [("get_weather", {"city": "São Paulo", "days": 3, "detail": {"wind": True, "gusts": [1, 2.5]}}),
      ("get_time", {"city": "Lyon"})]),
    ("gemma4", "no arguments", "<|tool_call>call:get_time{}<tool_call|>", "", [("get_time", {})]),
    ("gemma4", "a result the model wrote itself is dropped",
     f"<|tool_call>call:get_time{{city:{Q}Lyon{Q}}}<tool_call|><|tool_response>response:get_time{{value:1}}", "",
     [("get_time", {"city": "Lyon"})]),
    ("gemma4", "cut", f"<|tool_call>call:get_weather{{city:{Q}Par", SAME, []),
    ("gemma4", "unclosed string", f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>", SAME, []),
    ("gemma4", "not an object", "<|tool_call>call:f[1]<tool_call|>", SAME, []),
    ("deepseek_v3", "parallel, text before", "Checking." + DS_OPEN + 'get_weather<｜tool▁sep｜>{"city": "Paris"}'
     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "東京"}' + DS_CLOSE, "Checking.",
     [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("deepseek_v3", "cut", DS_OPEN + 'get_weather<｜tool▁sep｜>{"city": "Pa', SAME, []),
    ("deepseek_v3", "bad JSON", DS_OPEN + "get_weather<｜tool▁sep｜>{city}" + DS_CLOSE, SAME, []),
    ("kimi_k2", "parallel, text before", "Checking." + KIMI_OPEN + 'functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
     '{"city": "東京"}' + KIMI_CLOSE, "Checking.", [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("kimi_k2", "cut", KIMI_OPEN + 'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Pa', SAME, []),
    ("kimi_k2", "bad JSON", KIMI_OPEN + "functions.get_weather:0<|tool_call_argument_begin|>{city}" + KIMI_CLOSE,
     SAME, []),
    ("pythonic", "parallel, text before, Python and JSON literals",
     "Checking.<|tool_call_start|>[get_weather(city='São Paulo', days=3, detail={\"wind\": true, \"gusts\": [1, "
     "-2.5]}, alerts=True, since=None), get_time(city=\"Lyon\")]<|tool_call_end|>", "Checking.",
     [("get_weather", {"city": "São Paulo", "days": 3, "detail": {"wind": True, "gusts": [1, -2.5]}, "alerts": True,
                       "since": None}), ("get_time", {"city": "Lyon"})]),
    ("pythonic", "JSON calls, as llama.cpp's LFM2 template writes them",
     '<|tool_call_start|>[{"name": "get_time", "arguments": {"city": "Lyon"}}]<|tool_call_end|>', "",
     [("get_time", {"city": "Lyon"})]),
    ("pythonic", "an expression is not evaluated", "<|tool_call_start|>[get_time(city=open('x').read())]"
     "<|tool_call_end|>", SAME, []),
    ("pythonic", "a method", "<|tool_call_start|>[os.system(cmd='ls')]<|tool_call_end|>", SAME, []),
    ("pythonic", "positional arguments", "<|tool_call_start|>[get_time('Lyon')]<|tool_call_end|>", SAME, []),
    ("pythonic", "cut", "<|tool_call_start|>[get_time(city='Ly", SAME, []),
    ("pythonic", "an unquoted apostrophe", "<|tool_call_start|>[get_time(city='L'Aquila')]<|tool_call_end|>",
     SAME, []),
    ("llama3", "one", '{"name": "get_weather", "parameters": {"city": "Zürich"}}', "",
     [("get_weather", {"city": "Zürich"})]),
    ("llama3", "python_tag, parallel",
     '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", PARIS), ("get_time", {})]),
    ("llama3", "Llama 4's text before, calls one after another",
     '<|python_start|>Checking.<|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
     '{"name": "get_time", "parameters": {"city": "東京"}}<|eot|>', "Checking.",
     [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("llama3", "a JSON answer", '{"name": "Ada", "age": 36}', SAME, []),
    ("llama3", "cut", '{"name": "get_weather", "parameters": {"city": "Pa', SAME, []),
    ("llama3", "not at the start", 'The call would be {"name": "get_weather", "parameters": {}}', SAME, []),
    ("mistral", "array, parallel",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
     '{"name": "get_time", "arguments": {"city": "東京"}}]</s>', "", [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("mistral", "[ARGS], text before",
     'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
     '[TOOL_CALLS]get_time[CALL_ID]123456789[ARGS]{"city": "東京"}',
     "Sure.", [("get_weather", PARIS), ("get_time", TOKYO)]),
    ("mistral", "cut", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', SAME, []),
    ("mistral", "bad JSON", "[TOOL_CALLS]get_weather[ARGS]not json", SAME, []),
    ("harmony", "the model's order", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris"}<|call|>', "", [("get_weather", PARIS)]),
    ("harmony", "the template's order, <|call|> left off as an end token",
     ' to=functions.get_time<|channel|>commentary json<|message|>{"city": "東京"}', "", [("get_time", TOKYO)]),
    ("harmony", "after the analysis, a preamble first",
     '<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>'
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "Checking.",
     [("get_weather", PARIS)]),
    ("harmony", "no arguments", "<|channel|>commentary to=functions.ping<|message|>", "", [("ping", {})]),
    ("harmony", "bad JSON", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": P',
     SAME, []),
    ("harmony", "cut in the header", "<|channel|>commentary to=functions.get_wea", SAME, []),
    ("harmony", "a commentary message, no call", "<|channel|>commentary<|message|>Just a note.", "Just a note.", []),
    ("generic", "call", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', "",
     [("get_weather", PARIS)]),
    ("generic", "response", '  {"response": "It is sunny ☀."}\n', "It is sunny ☀.", []),
    ("generic", "arguments a string", '{"tool_call": {"name": "get_weather", "arguments": "Paris"}}', SAME, []),
    ("generic", "cut", '{"tool_call": {"name": "get_weather", "argu', SAME, []),
    ("generic", "plain text", "Plain words.", SAME, []),
]
FORMATS = {"hermes": tc.HermesFormat(), "qwen3_xml": tc.Qwen3XmlFormat(), "glm45": tc.GlmFormat(),
           "gemma4": tc.Gemma4Format(), "deepseek_v3": tc.DeepSeekFormat(), "kimi_k2": tc.KimiK2Format(),
           "pythonic": tc.PythonicFormat(),
           "llama3": tc.Llama3Format(),
           "mistral": tc.MistralFormat(), "generic": tc.GenericFormat(), "harmony": tc.HarmonyFormat()}


@pytest.mark.parametrize("fmt, text, content, expected", [c[:1] + c[2:] for c in PARSE_CASES],
                         ids=[f"{c[0]}-{c[1]}" for c in PARSE_CASES])
def test_parse(fmt, text, content, expected):
    got_content, calls = FORMATS[fmt].parse(text)
    assert got_content == (text if content is SAME else content)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for c in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id) and isinstance(json.loads(c.arguments), dict)
    assert len({c.id for c in calls}) == len(calls)


def test_unicode_arguments_stay_readable():
    text = '<tool_call>\n{"name": "f", "arguments": {"q": "\\u6771\\u4eac"}}\n</tool_call>'
    (call,) = tc.HermesFormat().parse(text)[1]
    assert call.arguments == '{"q": "東京"}'


# -- grammars --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llg(tokenizer_json):
    """The llguidance tokenizer, and the marker texts it holds as special tokens -> ids."""
    tok = lg.LLTokenizer(tokenizer_json, eos_token=[SPECIALS.index(EOS)])
    added = json.loads(tokenizer_json)["added_tokens"]
    return tok, {a["content"]: a["id"] for a in added if tok.is_special_token(a["id"])}


def accepts(llg, grammar: str, text: str) -> bool:
    tok, _ = llg
    m = lg.LLMatcher(tok, lg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.tokenize_str(text)) and m.is_accepting()


WEATHER_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                 "</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "gemma4": f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>",
    "deepseek_v3": DS_OPEN + 'get_weather<｜tool▁sep｜>{"city": "Paris"}' + DS_CLOSE,
    "kimi_k2": KIMI_OPEN + 'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}' + KIMI_CLOSE,
    "pythonic": "<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "generic": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
}
GRAMMAR_FORMATS = {**FORMATS, "mistral_args": tc.MistralFormat(args_form=True)}


def two_calls(fmt: str) -> str:
    first, second = WEATHER_CALLS[fmt], WEATHER_CALLS[fmt].replace("get_weather", "get_time")
    if fmt == "mistral":
        return first[:-1] + ", " + second.removeprefix("[TOOL_CALLS][")
    if fmt == "deepseek_v3":  # one section, its calls one after another
        return first.removesuffix("<｜tool▁calls▁end｜>") + second.removeprefix("<｜tool▁calls▁begin｜>")
    if fmt == "kimi_k2":
        return first.removesuffix("<|tool_calls_section_end|>") + second.removeprefix("<|tool_calls_section_begin|>")
    if fmt == "pythonic":  # one list
        return first.removesuffix("]<|tool_call_end|>") + ", " + second.removeprefix("<|tool_call_start|>[")
    return first + {"hermes": "\n", "qwen3_xml": "\n", "glm45": "\n", "llama3": "; "}.get(fmt, "") + second


@pytest.mark.parametrize("fmt", sorted(WEATHER_CALLS))
def test_grammar_forces_a_call_to_the_named_function(fmt, llg):
    f, special = GRAMMAR_FORMATS[fmt], llg[1]
    required = f.grammar(TOOLS, None, special_tokens=special)
    named = f.grammar(TOOLS, "get_time", special_tokens=special)
    weather, time = WEATHER_CALLS[fmt], WEATHER_CALLS[fmt].replace("get_weather", "get_time")
    assert accepts(llg, required, weather) and accepts(llg, required, time)
    assert accepts(llg, named, time) and not accepts(llg, named, weather)
    assert not accepts(llg, required, weather.replace("city", "town"))  # the schema's required key
    assert not accepts(llg, required, "Sure, let me check. " + weather)
    if fmt not in ("generic", "harmony"):  # one JSON object, one call a reply (<|call|> ends it), by design
        assert accepts(llg, required, two_calls(fmt))
        assert not accepts(llg, f.grammar(TOOLS, None, parallel=False, special_tokens=special), two_calls(fmt))


def test_grammar_checks_argument_types_and_free_text_values(llg):
    hermes = tc.HermesFormat().grammar([WEATHER], None, special_tokens=llg[1])
    assert not accepts(llg, hermes, WEATHER_CALLS["hermes"].replace('"Paris"}', '"Paris", "unit": "k"}'))
    xml = tc.Qwen3XmlFormat().grammar([WEATHER], None, special_tokens=llg[1])
    optional = WEATHER_CALLS["qwen3_xml"].replace("</function>", "<parameter=unit>\nc\n</parameter>\n</function>")
    assert accepts(llg, xml, optional)
    assert accepts(llg, xml, WEATHER_CALLS["qwen3_xml"].replace("Paris", "two\nlines < & >"))
    assert not accepts(llg, xml, WEATHER_CALLS["qwen3_xml"].replace("city", "town"))
    typed = {"type": "function", "function": {"name": "trip", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]}, "note": {"type": "string"}}, "required": ["city", "days"]}}}
    glm = tc.GlmFormat().grammar([typed], None, special_tokens=llg[1])

    def trip(city="Paris", days="3", unit=None, note=None):
        pairs = [("city", city), ("days", days)] + [(k, v) for k, v in (("unit", unit), ("note", note)) if v]
        return "<tool_call>trip\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                             for k, v in pairs) + "</tool_call>"

    assert accepts(llg, glm, trip()) and accepts(llg, glm, trip(unit="f", note="two\nlines & >"))
    assert not accepts(llg, glm, trip(days="x")) and not accepts(llg, glm, trip(days="9"))  # JSON, in range
    assert not accepts(llg, glm, trip(unit="k")) and not accepts(llg, glm, trip(city="Llanfairpwll"))
    assert json.loads(tc.GlmFormat().parse(trip(unit="c"))[1][0].arguments) == {"city": "Paris", "days": 3,
                                                                                "unit": "c"}
    xml = tc.Qwen3XmlFormat().grammar([typed], None, special_tokens=llg[1])

    def xtrip(city="Paris", days="3", unit=None, note=None):
        pairs = [("city", city), ("days", days)] + [(k, v) for k, v in (("unit", unit), ("note", note)) if v]
        return ("<tool_call>\n<function=trip>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs)
                + "</function>\n</tool_call>")

    assert accepts(llg, xml, xtrip()) and accepts(llg, xml, xtrip(unit="f", note="two\nlines & >"))
    assert not accepts(llg, xml, xtrip(days="x")) and not accepts(llg, xml, xtrip(days="9"))
    assert not accepts(llg, xml, xtrip(unit="k")) and not accepts(llg, xml, xtrip(city="Llanfairpwll"))
    gemma = tc.Gemma4Format().grammar([typed], None, special_tokens=llg[1])

    def gtrip(city="Paris", days="3", unit=None, note=None):  # keys sorted, as Gemma 4's template writes them
        pairs = [("city", f"{Q}{city}{Q}"), ("days", days)] + [(k, f"{Q}{v}{Q}") for k, v in (("note", note),
                                                                                            ("unit", unit)) if v]
        return "<|tool_call>call:trip{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}<tool_call|>"

    assert accepts(llg, gemma, gtrip()) and accepts(llg, gemma, gtrip(unit="f", note="two\nlines & >"))
    assert not accepts(llg, gemma, gtrip(days="x")) and not accepts(llg, gemma, gtrip(days="9"))
    assert not accepts(llg, gemma, gtrip(unit="k")) and not accepts(llg, gemma, gtrip(city="Llanfairpwll"))
    assert not accepts(llg, gemma, gtrip().replace("city:", "town:"))
    assert json.loads(tc.Gemma4Format().parse(gtrip(unit="c"))[1][0].arguments) == {"city": "Paris", "days": 3,
                                                                                   "unit": "c"}
    pythonic = tc.PythonicFormat().grammar([typed], None, special_tokens=llg[1])

    def ptrip(city="'Paris'", days="3", unit=None, note=None):  # in the schema's order, as the call sets them
        pairs = [("city", city), ("days", days)] + [(k, v) for k, v in (("unit", unit), ("note", note)) if v]
        return "<|tool_call_start|>[trip(" + ", ".join(f"{k}={v}" for k, v in pairs) + ")]<|tool_call_end|>"

    assert accepts(llg, pythonic, ptrip()) and accepts(llg, pythonic, ptrip(unit="'f'", note="'l\\'Aquila'"))
    assert not accepts(llg, pythonic, ptrip(days="'3'")) and not accepts(llg, pythonic, ptrip(days="9"))
    assert not accepts(llg, pythonic, ptrip(unit="'k'")) and not accepts(llg, pythonic, ptrip(city="'Llanfairpwll'"))
    assert not accepts(llg, pythonic, ptrip(city="\"Paris\"")) and not accepts(llg, pythonic, ptrip(days=None))
    assert json.loads(tc.PythonicFormat().parse(ptrip(note="'l\\'Aquila'"))[1][0].arguments) == {
        "city": "Paris", "days": 3, "note": "l'Aquila"}
    optional = {"type": "function", "function": {"name": "find", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}}}}}
    find = tc.PythonicFormat().grammar([optional], None, special_tokens=llg[1])
    for args in ("", "q='x'", "limit=2", "exact=True", "q='x', exact=False", "limit=2, exact=True"):
        assert accepts(llg, find, f"<|tool_call_start|>[find({args})]<|tool_call_end|>"), args
    for args in (", limit=2", "limit=2, q='x'", "exact=true", "q='x',limit=2"):
        assert not accepts(llg, find, f"<|tool_call_start|>[find({args})]<|tool_call_end|>"), args
    clock = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
    none = tc.GlmFormat().grammar([clock], None, special_tokens=llg[1])  # declared without arguments: none
    assert accepts(llg, none, "<tool_call>clock\n</tool_call>")
    assert accepts(llg, tc.Qwen3XmlFormat().grammar([clock], None, special_tokens=llg[1]),
                   "<tool_call>\n<function=clock>\n</function>\n</tool_call>")
    assert not accepts(llg, none, "<tool_call>clock\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>")
    bare = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object
    assert accepts(llg, tc.HermesFormat().grammar([bare], None, special_tokens=llg[1]),
                   '<tool_call>\n{"name": "ping", "arguments": {"x": [1]}}\n</tool_call>')


def test_glm_grammar_takes_its_tags_as_special_tokens_where_the_tokenizer_has_them(tokenizer_json):
    """GLM-4.5's tokenizer holds <arg_key> and the rest as added tokens: the grammar then writes them as such, and a
    value still runs up to its closing tag, newlines and '<' included."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tokenizer_json)
    hf.add_tokens([AddedToken(t, special=False) for t in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")])
    tok = lg.LLTokenizer(hf.to_str(), eos_token=[SPECIALS.index(EOS)])
    added = json.loads(hf.to_str())["added_tokens"]
    special = {a["content"]: a["id"] for a in added if tok.is_special_token(a["id"])}
    assert "</arg_value>" in special
    g = tc.GlmFormat().grammar([WEATHER], None, special_tokens=special)
    assert accepts((tok, special), g, WEATHER_CALLS["glm45"])
    assert accepts((tok, special), g, WEATHER_CALLS["glm45"].replace("Paris", "two\nlines < & >"))
    assert not accepts((tok, special), g, WEATHER_CALLS["glm45"].replace("city", "town"))
    assert not accepts((tok, special), tc.GlmFormat().grammar([WEATHER], None), WEATHER_CALLS["glm45"])


def test_markers_must_be_given_as_special_tokens(llg):
    """Without the ids, a grammar spells '<tool_call>' out and refuses the token the model writes."""
    assert not accepts(llg, tc.HermesFormat().grammar(TOOLS, None), WEATHER_CALLS["hermes"])


def test_generic_auto_allows_a_call_or_a_response(llg):
    g = tc.generic_auto_grammar(TOOLS)
    assert accepts(llg, g, WEATHER_CALLS["generic"]) and accepts(llg, g, '{"response": "Hi ☀"}')
    assert not accepts(llg, g, "Hi")


def test_bad_choice_is_an_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="get_date"):
        tc.HermesFormat().grammar(TOOLS, "get_date")
    with pytest.raises(InvalidArgumentError):
        tc.Llama3Format().grammar([], None)
