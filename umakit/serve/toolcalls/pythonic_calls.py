"""LFM2's tool calls: a Python list of calls with keyword arguments, between marker tokens.

    <|tool_call_start|>[get_weather(city='Paris', days=3), get_time(city='Lyon')]<|tool_call_end|>

LFM2.5's template writes a string in single quotes as it is, an object as JSON, anything else as Python prints it
(``True``, ``None``, ``['a', 1]``). `parse` reads the list with Python's own parser (`ast`, which evaluates
nothing) and takes literals only: strings, numbers, booleans and None (JSON's spellings too), lists and objects
of them; a call with positional arguments, or any other expression, stays in the content. The grammar writes
each value as the template does, checked against its schema: an integer or number as a literal in its range
where JSON's grammar checks one, a boolean as ``True``/``False``, an object or array as JSON that follows its
schema (which Python reads as well), a string on one line in single quotes (escapes allowed: the parser reads
``\\'``).
"""

from __future__ import annotations

import ast
import math
import re

from umakit.serve.toolcalls.syntax import (ToolCall, ToolFormat, call_from_object, functions_of, json_rule, literal,
                                           marker, new_call, parameters_of, tagged_calls)

START, END = "<|tool_call_start|>", "<|tool_call_end|>"
_CALLS = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_STRING = r"/'(?:[^'\\\n]|\\.)*'/"


class PythonicFormat(ToolFormat):
    name = "pythonic"
    markers = (START,)

    def template_messages(self, messages, tools):
        out, tools = super().template_messages(messages, tools)
        for m in out:  # LFM2.5's template reads an assistant's reasoning as ``thinking``
            if m.get("reasoning_content") is not None and "thinking" not in m:
                m["thinking"] = m.pop("reasoning_content")
        return out, tools

    def parse(self, text):
        return tagged_calls(text, _CALLS, lambda match: _calls(match.group(1)))

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        calls = 'call (", " call)*' if parallel else "call"
        lines = [f'start: {marker(START, special)} "[" {calls} "]" {marker(END, special)}',
                 "call: " + " | ".join(f"f{i}" for i in range(len(functions))),
                 f"string: {_STRING}",
                 "any_value: string | json_value",
                 f"json_value: {json_rule({})}",
                 'any_arg: /[A-Za-z_][A-Za-z0-9_]*/ "=" any_value']
        for i, fn in enumerate(functions):
            lines += _function_rules(i, fn)
        return "\n".join(lines) + "\n"


def _function_rules(i: int, fn: dict) -> list[str]:
    """``fN``: the call, its keyword arguments in the schema's order, required ones present."""
    schema = parameters_of(fn)
    properties, required = schema.get("properties"), set(schema.get("required") or ())
    head = literal(fn["name"] + "(")
    if properties is None:  # parameters not described: any names
        return [f'f{i}: {head} (any_arg (", " any_arg)*)? ")"']
    if not properties:
        return [f'f{i}: {head} ")"']
    names = list(properties)
    rules = [f"p{i}_{j}: {literal(name + '=')} {_value(properties[name])}" for j, name in enumerate(names)]
    # the first argument written has no comma before it: one alternative for each that can come first
    firsts = []
    for j, name in enumerate(names):
        rest = " ".join(f'(", " p{i}_{k})' + ("" if names[k] in required else "?") for k in range(j + 1, len(names)))
        firsts.append(f"p{i}_{j} {rest}".strip())
        if name in required:
            break
    optional_all = not required & set(names)
    args = "(" + " | ".join(firsts) + ")" + ("?" if optional_all else "")
    return [f'f{i}: {head} {args} ")"'] + rules


def _value(schema) -> str:
    if not isinstance(schema, dict):
        return "any_value"
    kind, enum = schema.get("type"), schema.get("enum")
    if enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(literal(f"'{e}'") for e in enum) + ")"
    if kind == "string":
        if isinstance(schema.get("maxLength"), int) and "pattern" not in schema:
            return f"/'[^'\\\\\\n]{{0,{schema['maxLength']}}}'/"
        return "string"
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    if kind in ("integer", "number", "object", "array"):
        return json_rule(schema)
    return "any_value"


def _calls(text: str) -> list[ToolCall] | None:
    """The calls of a Python list of calls with keyword arguments, or None where the text is anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_call(node) for node in tree.elts]
    return None if None in calls else calls


def _call(node) -> ToolCall | None:
    """``f(key=value, ...)``, or JSON's ``{"name": ..., "arguments": {...}}`` as llama.cpp's LFM2 template writes."""
    try:
        if isinstance(node, ast.Dict):
            return call_from_object(_literal(node))
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                or any(k.arg is None for k in node.keywords)):
            return None
        return new_call(node.func.id, {k.arg: _literal(k.value) for k in node.keywords})
    except (ValueError, RecursionError):
        return None


def _literal(node):
    """A Python or JSON literal's value (no expression is evaluated); ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float)) or (
            isinstance(node, ast.Constant) and node.value is None):
        value = node.value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("an object's keys are strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    elif isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    else:
        raise ValueError(f"not a literal: {type(node).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a finite number")
    return value
