"""Kimi K2's tool calls: JSON arguments after an id that names the function, in a section of marker tokens.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|>...<|tool_calls_section_end|>

The id is the call's name for the model, ``functions.NAME:N`` with N counting the conversation's calls from 0,
and the template writes it both before a past call's arguments and before its result (``## Return of ID``). So
`template_messages` gives each call of the request that id, in order, and its result the same one, whatever ids
the client sent; `parse` reads the function's name from it. One section holds every call of a reply. A template
that writes no past calls (llama.cpp's shortened Kimi K2 one) gets them in the message's text instead
(``calls_in_content``), as the model wrote them, so the model still sees what it called.
"""

from __future__ import annotations

import json
import re

from umakit.serve.toolcalls.syntax import (ToolCall, ToolFormat, functions_of, json_call, json_rule, literal, marker,
                                           parameters_of, tagged_calls)

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_SECTION = re.compile(re.escape(SECTION) + r"(.*?)" + re.escape(SECTION_END), re.S)
_CALL = re.compile(r"\s*" + re.escape(CALL) + r"\s*(?:functions\.)?([^\s<:]+)(?::\d+)?\s*" + re.escape(ARGS)
                   + r"(.*?)" + re.escape(CALL_END) + r"\s*", re.S)


class KimiK2Format(ToolFormat):
    name = "kimi_k2"
    markers = (SECTION,)

    def __init__(self, calls_in_content: bool = False):
        self.calls_in_content = calls_in_content

    def __repr__(self):
        return f"KimiK2Format(calls_in_content={self.calls_in_content})"

    def template_messages(self, messages, tools):
        out, tools = super().template_messages(messages, tools)
        ids: dict[str, str] = {}  # the client's call id -> the model's
        count = 0
        for m in out:  # a result comes after its call
            for call in m.get("tool_calls") or ():
                model_id, count = f"functions.{call['function'].get('name')}:{count}", count + 1
                if call.get("id") is not None:
                    ids[call["id"]] = model_id
                call["id"] = model_id
            if m.get("tool_call_id") is not None:
                m["tool_call_id"] = ids.get(m["tool_call_id"], m["tool_call_id"])
            if self.calls_in_content and m.get("tool_calls") and isinstance(m.get("content"), str):
                m["content"] += _section(m.pop("tool_calls"))
        return out, tools

    def parse(self, text):
        return tagged_calls(text, _SECTION, lambda section: _section_calls(section.group(1)))

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        m = {t: marker(t, special) for t in (SECTION, SECTION_END, CALL, ARGS, CALL_END)}
        alternatives = " | ".join(f'{literal("functions." + fn["name"] + ":")} index {m[ARGS]} a{i}'
                                  for i, fn in enumerate(functions))
        lines = [f"start: {m[SECTION]} {'call+' if parallel else 'call'} {m[SECTION_END]}",
                 f"call: {m[CALL]} ({alternatives}) {m[CALL_END]}",
                 "index: /[0-9]{1,3}/"]
        lines += [f"a{i}: {json_rule(parameters_of(fn))}" for i, fn in enumerate(functions)]
        return "\n".join(lines) + "\n"


def _section(calls: list[dict]) -> str:
    """Calls (ids given, arguments dicts) as the model writes them."""
    return SECTION + "".join(CALL + c["id"] + ARGS + json.dumps(c["function"]["arguments"], ensure_ascii=False)
                             + CALL_END for c in calls) + SECTION_END


def _section_calls(body: str) -> list[ToolCall] | None:
    """A section's calls, one after another with nothing else between them, or None."""
    found, at = [], 0
    while match := _CALL.match(body, at):
        found.append(json_call(match.group(1), match.group(2)))
        at = match.end()
    return None if not found or None in found or body[at:].strip() else found
