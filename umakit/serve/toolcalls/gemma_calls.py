"""Gemma 4's tool calls: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, in Gemma's own notation.

Gemma 4's template writes a call's arguments neither as JSON nor as XML (its ``format_argument``): keys bare and
in sorted order, a string between two ``<|"|>`` tokens, numbers and booleans as JSON writes them, objects in
braces and lists in brackets; calls follow one another with nothing between. A tool's result is no message of
its own: the template reads it from the assistant message that made the call (``tool_responses``, each a
``{name, response}``), and the model's turn goes on after it. So:

- `template_messages` folds each tool message into the message whose call it answers (a JSON object result as
  a mapping, anything else as its text);
- `parse` reads the notation back into JSON arguments, and drops a result the model wrote itself after its
  call (``<|tool_response>`` onwards: the runtime's part, never the model's);
- `grammar` writes each argument as its schema says: a string quoted (one of its ``enum``, or at most
  ``maxLength`` characters), a number or a boolean as JSON, an object's keys in sorted order, required ones
  present; anything untyped in the notation's general form.
"""

from __future__ import annotations

import json
import re

from umakit.serve.toolcalls.syntax import (ToolCall, ToolFormat, functions_of, json_rule, literal, marker, new_call,
                                           parameters_of, tagged_calls)

QUOTE, OPEN, CLOSE, RESULT = '<|"|>', "<|tool_call>", "<tool_call|>", "<|tool_response>"
_CALL = re.compile(r"<\|tool_call>call:([^{\s<]+)(\{.*?\})<tool_call\|>", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_KEY = re.compile(r"[^:{}\[\],<\s][^:{}\[\],<]*")
_WORDS = {"true": True, "false": False, "null": None, "None": None}


class Gemma4Format(ToolFormat):
    name = "gemma4"
    markers = (OPEN,)

    def template_messages(self, messages, tools):
        out, names, caller = [], {}, None
        for m in messages:
            if m.get("role") == "tool" and caller is not None:
                name = names.get(m.get("tool_call_id")) or m.get("name") or "unknown"
                caller["tool_responses"].append({"name": name, "response": _result(m.get("content"))})
                continue
            m = dict(m)
            caller = None
            if m.get("role") == "assistant" and m.get("tool_calls"):
                caller, m["tool_responses"] = m, []
                names.update({c.get("id"): (c.get("function") or {}).get("name") for c in m["tool_calls"]})
            out.append(m)
        for m in out:
            if not m.get("tool_responses"):
                m.pop("tool_responses", None)  # the template tests whether a message has them
        return super().template_messages(out, tools)

    def parse(self, text):
        return tagged_calls(text.split(RESULT, 1)[0], _CALL, lambda m: _call(m.group(1), m.group(2)))

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        rules = _Rules(special_tokens or {})
        functions = functions_of(tools, choice)
        calls = " | ".join(literal("call:" + fn["name"]) + " " + rules.value(parameters_of(fn)) for fn in functions)
        head = [f"start: {'call+' if parallel else 'call'}",
                f"call: {marker(OPEN, rules.special)} ({calls}) {marker(CLOSE, rules.special)}"]
        return "\n".join(head + rules.lines) + "\n"


def _result(content):
    """A tool message's content as the template's ``response``: a JSON object as a mapping, else the text."""
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except ValueError:
        return content
    return value if isinstance(value, dict) else content


def _call(name: str, body: str) -> ToolCall | None:
    try:
        arguments, end = read(body, 0)
    except ValueError:
        return None  # malformed: the text stays in the content
    return new_call(name, arguments) if end == len(body) and isinstance(arguments, dict) else None


def read(text: str, i: int):
    """The value of Gemma's notation at ``text[i:]``, and where it ends; ValueError where it is not one."""
    i = _blank(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[i + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", i) or text.startswith("[", i):
        return _collection(text, i)
    word = next((w for w in _WORDS if text.startswith(w, i)), None)
    if word is not None:
        return _WORDS[word], i + len(word)
    number = _NUMBER.match(text, i)
    if number is None:
        raise ValueError(f"no value at {i}")
    s = number.group()
    return (float(s) if any(c in s for c in ".eE") else int(s)), number.end()


def _collection(text: str, i: int):
    closing, keyed = ("}", True) if text[i] == "{" else ("]", False)
    out: dict | list = {} if keyed else []
    i = _blank(text, i + 1)
    if text.startswith(closing, i):
        return out, i + 1
    while True:
        if keyed:
            i = _blank(text, i)
            if text.startswith(QUOTE, i):
                key, i = read(text, i)
            elif key_match := _KEY.match(text, i):
                key, i = key_match.group().strip(), key_match.end()
            else:
                raise ValueError(f"no key at {i}")
            if not text.startswith(":", i):
                raise ValueError(f"no ':' at {i}")
            out[key], i = read(text, i + 1)
        else:
            value, i = read(text, i)
            out.append(value)
        i = _blank(text, i)
        if text.startswith(",", i):
            i += 1
        elif text.startswith(closing, i):
            return out, i + 1
        else:
            raise ValueError(f"no ',' or {closing!r} at {i}")


def _blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class _Rules:
    """The grammar's rules for values in Gemma's notation, made as schemas ask for them."""

    def __init__(self, special):
        self.special, self.lines, self._made = special, [], {}
        q = marker(QUOTE, special)
        text = r"/(?s:.*)/" if QUOTE in special else r"/[^<]*/"  # a special quote cannot be written inside
        self._quote = q
        self.lines += [f"string: {q} {text} {q}",
                       r'any: string | /-?\d+(\.\d+)?([eE][+-]?\d+)?/ | "true" | "false" | '
                       r'"{" (pair ("," pair)*)? "}" | "[" (any ("," any)*)? "]"',
                       r'pair: /[A-Za-z_][A-Za-z0-9_]*/ ":" any']

    def value(self, schema) -> str:
        """A rule (its name, or an inline expression) for a value that ``schema`` describes."""
        if not isinstance(schema, dict):
            return "any"
        kind, enum = schema.get("type"), schema.get("enum")
        if enum and all(isinstance(e, str) for e in enum):
            return "(" + " | ".join(f"{self._quote} {literal(e)} {self._quote}" for e in enum) + ")"
        if kind == "string":
            if isinstance(schema.get("maxLength"), int) and "pattern" not in schema:
                inner = "(?s:.)" if QUOTE in self.special else "[^<]"
                return f"{self._quote} /{inner}{{0,{schema['maxLength']}}}/ {self._quote}"
            return "string"
        if kind in ("integer", "number"):
            return self._rule(json_rule(schema))
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "array" and isinstance(schema.get("items"), dict):
            item = self.value(schema["items"])
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object" or "properties" in schema:
            return self._object(schema)
        return "any"

    def _object(self, schema: dict) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return '"{" (pair ("," pair)*)? "}"'
        required = set(schema.get("required") or ())
        items = [(literal(key + ":") + " " + self.value(properties[key]), key in required)
                 for key in sorted(properties)]  # the template writes the keys sorted (dictsort)

        def tail(j: int) -> str:  # items j.. each after a comma
            if j == len(items):
                return ""
            item, needed = items[j]
            return f'("," {item}){"" if needed else "?"} {tail(j + 1)}'.strip()

        def head(j: int) -> str:  # items j.., the first one present without a comma
            if j == len(items):
                return ""
            item, needed = items[j]
            first = f"{item} {tail(j + 1)}".strip()
            if needed:
                return first
            rest = head(j + 1)
            return f"({first} | {rest})" if rest else f"({first})?"

        return self._rule(f'"{{" {head(0)} "}}"'.replace("  ", " "))

    def _rule(self, body: str) -> str:
        if body not in self._made:
            self._made[body] = f"v{len(self._made)}"
            self.lines.append(f"{self._made[body]}: {body}")
        return self._made[body]
