"""DeepSeek V3.1's tool calls: JSON arguments between the template's own marker tokens.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>...
    <｜tool▁calls▁end｜>

One section holds every call of a reply, one after another. The template joins a past call's arguments to its
text as they are (no ``tojson``), so `template_messages` keeps them JSON text, as OpenAI sends them. Nor does it
describe the tools: DeepSeek has the caller put them in the system prompt, each with its description and its
parameters' JSON schema, and the syntax of a call; `template_messages` writes that (`TOOLS_PROMPT`).
"""

from __future__ import annotations

import json
import re

from umakit.serve.toolcalls.generic import with_system_text
from umakit.serve.toolcalls.syntax import (ToolCall, ToolFormat, arguments_dict, functions_of, json_call, json_rule,
                                           literal, marker, parameters_of, tagged_calls)

SECTION, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_CALL = re.compile(re.escape(CALL) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)
TOOLS_PROMPT = ("## Tools\nYou can call these tools:\n\n{tools}\n\nTo call tools, write exactly this, the calls one "
                "after another with nothing between them:\n" + SECTION + CALL + "NAME" + SEP + "ARGUMENTS" + CALL_END
                + "..." + SECTION_END + "\nwhere NAME is one of the tools' names and ARGUMENTS a JSON object that "
                "follows its parameters' schema.")
_SECTION = re.compile(re.escape(SECTION) + r"(.*?)(?:" + re.escape(SECTION_END) + r"|\Z)", re.S)


class DeepSeekFormat(ToolFormat):
    name = "deepseek_v3"
    markers = (SECTION,)

    def template_messages(self, messages, tools):
        out, _ = super().template_messages(messages, tools)
        if not tools:
            return out, None
        described = "\n\n".join(f"### {fn['name']}\nDescription: {fn.get('description') or ''}\n\nParameters: "
                                + json.dumps(parameters_of(fn), ensure_ascii=False)
                                for fn in (t.get("function", t) for t in tools))
        return with_system_text(out, TOOLS_PROMPT.format(tools=described)), None

    def _template_call(self, call: dict) -> dict:
        out = super()._template_call(call)
        out["function"]["arguments"] = json.dumps(arguments_dict(call), ensure_ascii=False)  # joined as text
        return out

    def parse(self, text):
        return tagged_calls(text, _SECTION, lambda section: _section_calls(section.group(1)))

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        m = {t: marker(t, special) for t in (SECTION, SECTION_END, CALL, SEP, CALL_END)}
        alternatives = " | ".join(f"{literal(fn['name'])} {m[SEP]} a{i}" for i, fn in enumerate(functions))
        lines = [f"start: {m[SECTION]} {'call+' if parallel else 'call'} {m[SECTION_END]}",
                 f"call: {m[CALL]} ({alternatives}) {m[CALL_END]}"]
        lines += [f"a{i}: {json_rule(parameters_of(fn))}" for i, fn in enumerate(functions)]
        return "\n".join(lines) + "\n"


def _section_calls(body: str) -> list[ToolCall] | None:
    """A section's calls, or None where it holds anything else (a call cut short, text between calls)."""
    found = [json_call(m.group(1), m.group(2)) for m in _CALL.finditer(body)]
    return None if not found or None in found or _CALL.sub("", body).strip() else found
