"""gpt-oss's harmony format: a tool call is a message of its own, on the commentary channel, addressed to the
function.

A reply is a run of messages, each ``<|start|>assistant`` (the prompt writes the first one), a header, then
``<|message|>`` and its text up to ``<|end|>``; a call ends with ``<|call|>``, which ends the reply too. The
header names the channel (``analysis``: the reasoning; ``final``: the answer; ``commentary``: a call, or a
preamble before one) and, for a call, its recipient and the arguments' type, in either order:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

The second is how gpt-oss's chat template writes a past call, the first how the model often writes a new one;
`parse` reads both. The template holds one call per assistant message and names a tool result's function after
the call just before it, so `template_messages` writes parallel calls one message each, each followed by its
result. `ReplyParser` leaves the analysis channel as reasoning and hands the text from the first call's header
on to `parse` (``exits``: where a call can end the reasoning).
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from umakit.serve.toolcalls.syntax import (ToolCall, ToolFormat, functions_of, json_rule, literal, marker, new_call,
                                           parameters_of)

START, END, MESSAGE, CALL, RETURN = "<|start|>assistant", "<|end|>", "<|message|>", "<|call|>", "<|return|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
# one message: an optional start, its header, its text up to its end (a call's <|call|> is an end-of-sequence
# token, so a finished reply's text may stop right after the arguments)
_MESSAGE = re.compile(r"(?:<\|end\|>)?\s*(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)"
                      r"<\|message\|>(?P<body>(?:(?!<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>).)*)"
                      r"(?:<\|end\|>|<\|call\|>|<\|return\|>)?", re.S)
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class HarmonyFormat(ToolFormat):
    name = "harmony"
    markers = (" to=functions.", "to=functions.", CHANNEL + "commentary")
    # the analysis channel ends in <|end|>; a call's message may follow it instead of the final channel's
    exits = (END + START + CHANNEL + "commentary", END + START + " to=", END + START + "to=")
    call_opens_reply = True  # a forced call is the reply's first message: the grammar starts at once

    def template_messages(self, messages, tools):
        """As for every format, but one call per assistant message, each followed by its result, and each
        call's reasoning where the template reads it (`_with_thinking`)."""
        results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
        placed = set()
        split = []
        for m in messages:
            if m.get("role") == "tool":
                if id(m) not in placed:
                    split.append(m)
                continue
            calls = m.get("tool_calls") or []
            if not calls:
                split.append(_with_thinking(m))
                continue
            first = _with_thinking(m, calls=True)
            for i, call in enumerate(calls):
                one = {k: v for k, v in first.items() if i == 0 or k != "thinking"}
                one["content"], one["tool_calls"] = first["content"] if i == 0 else "", [call]
                split.append(one)
                result = results.get(call.get("id"))
                if result is not None and len(calls) > 1:
                    split.append(result)
                    placed.add(id(result))
        return super().template_messages(split, tools)

    def parse(self, text):
        calls, kept, pos, messages = [], [], 0, 0
        for messages, match in enumerate(_MESSAGE.finditer(text), 1):
            header, body = match.group("header"), match.group("body")
            kept.append(text[pos:match.start()])
            pos = match.end()
            recipient = _RECIPIENT.search(header)
            if recipient is None:
                kept.append(body)  # a preamble on the commentary channel, or an answer: content
                continue
            call = self._call(recipient.group(1), body)
            if call is None:
                return text, []  # a call the model got wrong: all of it stays as text
            calls.append(call)
        if not messages:
            return text, []
        kept.append(text[pos:])  # messages with no call (a commentary note) give their text, without markers
        return "".join(kept).strip(), calls

    @staticmethod
    def _call(name: str, body: str) -> ToolCall | None:
        try:
            arguments = json.loads(body) if body.strip() else {}
        except ValueError:
            return None
        return new_call(name, arguments)

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        """One call, whatever ``parallel`` says: a call's ``<|call|>`` ends the reply."""
        special: Mapping[str, int] = special_tokens or {}
        functions = functions_of(tools, choice)
        channel, constrain, message = (marker(m, special) for m in (CHANNEL, CONSTRAIN, MESSAGE))
        lines = ["start: " + " | ".join(f"f{i}" for i in range(len(functions)))]
        for i, fn in enumerate(functions):
            lines.append(f"f{i}: {channel} {literal('commentary to=functions.' + fn['name'] + ' ')} {constrain} "
                         f'"json" {message} a{i}')
            lines.append(f"a{i}: {json_rule(parameters_of(fn))}")
        return "\n".join(lines) + "\n"


def _with_thinking(m: dict, calls: bool = False) -> dict:
    """An assistant message with its reasoning where gpt-oss's template reads it (``thinking``; OpenAI's
    clients send ``reasoning_content`` or ``reasoning``). The template renders a call's reasoning (the one
    analysis it keeps in a prompt) and refuses a call's message with both content and thinking, so a call's
    text before it (a preamble) joins its reasoning there, and its content is text, never None."""
    if m.get("role") != "assistant":
        return m
    out = {k: v for k, v in m.items() if k not in ("reasoning_content", "reasoning")}
    thinking = m.get("thinking") or m.get("reasoning_content") or m.get("reasoning")
    if thinking:
        out["thinking"] = thinking
    if calls:
        content = out.get("content") or ""
        out["content"] = "" if thinking else content
        if content and thinking:
            out["thinking"] = f"{thinking}\n\n{content}"
    return out
