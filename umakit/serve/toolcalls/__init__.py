"""Tool calls in each model family's own syntax, chosen from its chat template.

A model calls tools in the syntax it was trained on, and its chat template is
the one place that syntax is written down: Qwen2.5 and Hermes wrap JSON in
``<tool_call>`` tags, Qwen3-Coder writes XML-like ``<function=...>`` blocks,
GLM-4.5 writes the function's name then ``<arg_key>``/``<arg_value>`` pairs in them,
Gemma 4 writes ``<|tool_call>call:f{key:value}<tool_call|>`` in a notation of its own, DeepSeek V3.1
puts JSON arguments between marker tokens of its own, Kimi K2 too after an id that names the function,
LFM2 writes a Python list of calls with keyword arguments,
Mistral prefixes ``[TOOL_CALLS]``, Llama 3.x replies with a bare JSON object,
gpt-oss addresses a message on its commentary channel to the function (harmony).
So the format is judged from the template text, never from the model's name
(a Hermes fine-tune of Llama speaks Hermes). Each format does three things:

- `template_messages`: reshape OpenAI messages into what the template expects
  (transformers' ``apply_chat_template(messages, tools=...)`` convention);
- `parse`: turn the generated text back into OpenAI tool calls; a call the
  model got wrong stays in the content as text, so nothing is lost or raised;
- `grammar`: a Lark grammar (llguidance's dialect) that forces a call when
  ``tool_choice`` is ``required`` or names a function.

Templates with no tool syntax get the ``generic`` format: the tools are
described in a system message and the model answers with one JSON object.

The markers in a grammar (``<tool_call>``, ``[TOOL_CALLS]``) are single tokens
in the models that use them, and llguidance treats them as special tokens,
which a string literal never matches. `grammar` therefore takes the ids of
those the tokenizer holds as special tokens and writes them as ``<[id]>``.
"""

from __future__ import annotations

import re

from umakit.serve.toolcalls.syntax import ToolCall, ToolFormat
from umakit.serve.toolcalls.formats import GlmFormat, HermesFormat, Llama3Format, MistralFormat, Qwen3XmlFormat
from umakit.serve.toolcalls.deepseek_calls import DeepSeekFormat
from umakit.serve.toolcalls.gemma_calls import Gemma4Format
from umakit.serve.toolcalls.kimi_calls import KimiK2Format
from umakit.serve.toolcalls.pythonic_calls import PythonicFormat
from umakit.serve.toolcalls.generic import GenericFormat, generic_auto_grammar
from umakit.serve.toolcalls.harmony import HarmonyFormat

__all__ = ["ToolCall", "ToolFormat", "HermesFormat", "Qwen3XmlFormat", "GlmFormat", "MistralFormat", "Llama3Format",
           "HarmonyFormat", "Gemma4Format", "DeepSeekFormat", "KimiK2Format", "PythonicFormat", "GenericFormat",
           "generic_auto_grammar", "detect", "template_supports_tools"]

# -- choosing a format -----------------------------------------------------------

_JINJA_CODE = re.compile(r"\{%.*?%\}|\{\{.*?\}\}", re.S)
_JINJA_STRING = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"", re.S)


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template's code (not its text or string literals) reads a ``tools`` variable."""
    codes = (_JINJA_STRING.sub("", code) for code in _JINJA_CODE.findall(chat_template or ""))
    return any(re.search(r"\btools\b", code) for code in codes)


def detect(chat_template: str | None) -> ToolFormat:
    """The format of the template's own tool syntax, judged from its text (not the model's name)."""
    t = chat_template or ""
    if "<｜tool▁calls▁begin｜>" in t:  # DeepSeek V3.1's marker tokens (fullwidth bars)
        return DeepSeekFormat()
    if "<|tool_calls_section_begin|>" in t or "<|im_system|>tool_declare" in t:  # Kimi K2's sections
        return KimiK2Format(calls_in_content="tool_calls" not in t)
    if "<|tool_call_start|>" in t:  # LFM2's Python calls
        return PythonicFormat()
    if "<|tool_call>" in t and "<tool_call|>" in t:  # Gemma 4's own notation
        return Gemma4Format()
    if "<tool_call>" in t and "<arg_key>" in t:  # GLM-4.5's keys and values, before Hermes' JSON in the same tags
        return GlmFormat()
    if "<tool_call>" in t:
        return Qwen3XmlFormat() if "<function=" in t else HermesFormat()
    if "[TOOL_CALLS]" in t:
        return MistralFormat(args_form="[ARGS]" in t)
    if "<|channel|>" in t and "<|call|>" in t:  # gpt-oss's harmony: a call is a commentary message
        return HarmonyFormat()
    if "<|python_tag|>" in t or ('"parameters"' in t and ("<|eom_id|>" in t or "ipython" in t)):
        return Llama3Format(single_call="<|python_start|>" not in t)  # Llama 4's template takes several
    return GenericFormat()
