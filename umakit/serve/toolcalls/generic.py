"""The generic format, for templates without tool syntax: tools in the system message, one JSON object back."""

from __future__ import annotations

import json

from umakit.serve.toolcalls.syntax import (ToolFormat, arguments_dict, call_from_object, call_schema, functions_of,
                                           json_rule, one_of)


GENERIC_INSTRUCTIONS = (
    "You can call these tools (each described as a JSON schema):\n{tools}\n\n"
    'To call a tool, reply with only this JSON object: {{"tool_call": {{"name": <tool name>, '
    '"arguments": <object of arguments>}}}}\n'
    'To answer without a tool, reply with only: {{"response": <your answer as a string>}}'
)


class GenericFormat(ToolFormat):
    """For templates without tool syntax: the tools are described in the system message, and the model
    writes one JSON object, ``{"tool_call": {"name": ..., "arguments": {...}}}`` or ``{"response": "..."}``
    (one call per reply, so `grammar` ignores ``parallel``); past calls are written back that way and
    tool results become user messages that name the call they answer."""

    name = "generic"
    markers = ()

    def template_messages(self, messages, tools):
        names = {c.get("id"): (c.get("function") or {}).get("name")
                 for m in messages for c in (m.get("tool_calls") or [])}
        out: list[dict] = []
        for i, m in enumerate(messages):
            if m.get("role") == "tool":
                text = _tool_result_text(m, names)
                if i and messages[i - 1].get("role") == "tool":  # parallel calls' results: one user message
                    out[-1]["content"] += "\n\n" + text
                else:
                    out.append({"role": "user", "content": text})
            elif m.get("tool_calls"):
                out.append({"role": "assistant", "content": _generic_calls_text(m)})
            else:
                out.append({"role": m["role"], "content": m.get("content")})
        if tools:
            described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
            out = with_system_text(out, GENERIC_INSTRUCTIONS.format(tools=described))
        return out, None

    def parse(self, text):
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []
        if isinstance(obj, dict) and set(obj) == {"tool_call"}:
            call = call_from_object(obj["tool_call"], ("arguments",))
            return ("", [call]) if call else (text, [])
        if isinstance(obj, dict) and set(obj) == {"response"} and isinstance(obj["response"], str):
            return obj["response"], []
        return text, []

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        return f"start: {json_rule(_generic_call_schema(functions_of(tools, choice)))}\n"


def _generic_call_schema(functions: list[dict]) -> dict:
    call = one_of([call_schema(fn) for fn in functions])
    return {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
            "additionalProperties": False}


def generic_auto_grammar(tools: list[dict]) -> str:
    """tool_choice 'auto' on a template without tool syntax: a tool_call object or a response object."""
    response = {"type": "object", "properties": {"response": {"type": "string"}},
                "required": ["response"], "additionalProperties": False}
    schema = {"anyOf": [_generic_call_schema(functions_of(tools, None)), response]}
    return f"start: {json_rule(schema)}\n"


def _generic_calls_text(message: dict) -> str:
    """An assistant message's calls as the JSON the generic format has the model write, after any text."""
    calls = [json.dumps({"tool_call": {"name": c["function"]["name"], "arguments": arguments_dict(c)}},
                        ensure_ascii=False) for c in message["tool_calls"]]
    return "\n".join(([message["content"]] if message.get("content") else []) + calls)


def _tool_result_text(message: dict, names: dict) -> str:
    call_id = message.get("tool_call_id")
    name = message.get("name") or names.get(call_id) or "a tool"
    answer = f"Result of the call to {name}" + (f" (id {call_id})" if call_id else "")
    return f"{answer}:\n{message.get('content') or ''}"


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """``text`` appended to the first system message, or a new system message in front."""
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
