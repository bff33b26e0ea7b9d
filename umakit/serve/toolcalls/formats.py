"""The formats of templates with tool syntax: Hermes (Qwen2.5/3), Qwen3-Coder's XML, GLM-4.5's, Mistral and
Llama 3.x."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Mapping

from umakit.serve.toolcalls.syntax import (DECODER, ToolCall, ToolFormat, call_from_object, call_schema, functions_of,
                                           json_rule, literal, marker, new_call, one_of, parameters_of, tagged_calls)


class HermesFormat(ToolFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call (Qwen2.5/3, Hermes)."""

    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)(?:</tool_call>|\Z)", re.S)  # stops at the next opener

    def parse(self, text):
        def make(match):
            try:
                return call_from_object(json.loads(match.group(1)))
            except ValueError:
                return None

        return tagged_calls(text, self._CALL, make)

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        body = one_of([call_schema(fn) for fn in functions_of(tools, choice)])
        start = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {start}\n"
                f'call: {marker("<tool_call>", special)} "\\n" body "\\n" {marker("</tool_call>", special)}\n'
                f"body: {json_rule(body)}\n")


class _PairedCalls(ToolFormat):
    """A format whose call holds the function's name and key-value pairs, each value text (`_CALL` finds a call:
    the name, then the pairs; `_PAIR` one pair: the key, then the value)."""

    _CALL: re.Pattern
    _PAIR: re.Pattern

    def parse(self, text):
        return tagged_calls(text, self._CALL, lambda m: self._call(m.group(1), m.group(2)))

    def _call(self, name: str, body: str) -> ToolCall | None:
        arguments, pos = {}, 0
        while match := self._PAIR.match(body, pos):
            arguments[match.group(1).strip()] = _xml_value(match.group(2))
            pos = match.end()
        if body[pos:].strip():
            return None  # text that is not a pair: not a call this format writes
        return new_call(name, arguments)


class Qwen3XmlFormat(_PairedCalls):
    """Qwen3-Coder: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``.

    Values are raw text. `parse` cannot see the schema, so a value that parses as JSON (a number, a
    boolean, an object) is taken as that, anything else as a string. The grammar fixes the function and
    parameter names (required ones present, in the schema's order) and each value as the template writes it
    (`_typed_value`): a string as free text up to the ``\\n</parameter>`` that closes it.
    """

    name = "qwen3_xml"
    markers = ("<tool_call>", "<function=")
    _CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>(?:\s*</tool_call>)?", re.S)
    _PAIR = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        start = 'call ("\\n" call)*' if parallel else "call"
        open_, close = marker("<tool_call>", special), marker("</tool_call>", special)
        lines = [
            f"start: {start}",
            f'call: {open_} "\\n<function=" fn "</function>\\n" {close}',
            "fn: " + " | ".join(literal(fn["name"] + ">\n") + ("" if _no_arguments(fn) else f" f{i}")
                                for i, fn in enumerate(functions)),
            r"value[lazy]: /(?s:.*)\n<\/parameter>\n/",
            r'any_param: "<parameter=" /[^>\n]+/ ">\n" value',
        ]
        for i, fn in enumerate(functions):
            if not _no_arguments(fn):
                lines += self._function_rules(i, parameters_of(fn))
        return "\n".join(lines) + "\n"

    @staticmethod
    def _function_rules(i: int, schema: dict) -> list[str]:
        properties = schema.get("properties") or {}
        if not properties:  # parameters not described: any names
            return [f"f{i}: any_param*"]
        required = set(schema.get("required") or ())
        items, rules = [], []
        for j, (pname, pschema) in enumerate(properties.items()):
            value = _typed_value(pschema, literal("\n</parameter>\n"), "value")
            rules.append(f"p{i}_{j}: " + literal("<parameter=" + pname + ">\n") + " " + value)
            items.append(f"p{i}_{j}" + ("" if pname in required else "?"))
        return [f"f{i}: " + " ".join(items)] + rules


class GlmFormat(_PairedCalls):
    """GLM-4.5 and 4.6: ``<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>``, calls one
    after another on their own lines.

    The template writes a string value as it is and any other as JSON, so `parse` takes a value that parses as
    JSON as that (as `Qwen3XmlFormat` does). The grammar fixes the function and its keys (required ones present,
    in the schema's order) and each value as the template writes it: a typed value as JSON that follows its
    schema, a string as text (an enum's, or bounded by ``maxLength``); the tags are written as the tokenizer's
    special tokens where it has them.
    """

    name = "glm45"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>([^<\n]*)(.*?)</tool_call>", re.S)
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        tag = {t: marker(t, special) for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                               "<arg_value>", "</arg_value>")}
        close = f'{tag["</arg_value>"]} "\\n"'
        start = 'call ("\\n" call)*' if parallel else "call"
        lines = [
            f"start: {start}",
            f'call: {tag["<tool_call>"]} fn {tag["</tool_call>"]}',
            "fn: " + " | ".join(literal(fn["name"] + "\n") + ("" if _no_arguments(fn) else f" f{i}")
                                for i, fn in enumerate(functions)),
            # free text up to the closing tag: where the tag is a special token no text can contain it
            f"text: /(?s:.*)/ {close}" if "</arg_value>" in special else r"text[lazy]: /(?s:.*)<\/arg_value>\n/",
            f'any_arg: {tag["<arg_key>"]} /[^<\\n]+/ {tag["</arg_key>"]} "\\n" {tag["<arg_value>"]} text',
        ]
        for i, fn in enumerate(functions):
            properties = parameters_of(fn).get("properties") or {}
            required = set(parameters_of(fn).get("required") or ())
            if _no_arguments(fn):
                continue
            if not properties:  # parameters not described: any keys
                lines.append(f"f{i}: any_arg*")
                continue
            lines.append(f"f{i}: " + " ".join(f"a{i}_{j}" + ("" if key in required else "?")
                                             for j, key in enumerate(properties)))
            for j, (key, schema) in enumerate(properties.items()):
                lines.append(f'a{i}_{j}: {tag["<arg_key>"]} {literal(key)} {tag["</arg_key>"]} "\\n" '
                             f'{tag["<arg_value>"]} {_typed_value(schema, close, "text")}')
        return "\n".join(lines) + "\n"


def _typed_value(schema, close: str, free: str) -> str:
    """A value as these templates write it, then ``close``: a string as it is (one of its ``enum``, or a line of at
    most ``maxLength`` characters without a '<'; else ``free``, the format's free-text rule, which closes itself), a
    boolean as JSON or Python writes it (Qwen3-Coder's template writes ``True``), anything else as JSON that
    follows its schema."""
    if not isinstance(schema, dict):
        return free
    kind, enum = schema.get("type"), schema.get("enum")
    if kind == "string" or (enum and all(isinstance(e, str) for e in enum)):
        if enum:
            return "(" + " | ".join(literal(e) for e in enum) + f") {close}"
        if isinstance(schema.get("maxLength"), int) and "pattern" not in schema:
            return f"/[^<\\n]{{0,{schema['maxLength']}}}/ {close}"  # one line, so it cannot run into close
        return free
    if kind == "boolean":
        return f'("true" | "false" | "True" | "False") {close}'
    if kind in ("integer", "number", "object", "array", "null"):
        return f"{json_rule(schema)} {close}"
    return free


def _no_arguments(fn: dict) -> bool:
    """Whether a function declares that it takes no arguments (an object schema with no properties)."""
    return parameters_of(fn).get("properties") == {}


def _xml_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class MistralFormat(ToolFormat):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Nemo, Small 3.1), or with ``args_form``
    (templates that write ``[ARGS]``: Small 3.2, Ministral, Devstral) ``[TOOL_CALLS]f[ARGS]{...}``
    per call, optionally with ``[CALL_ID]id`` before ``[ARGS]``. Its templates want call ids of nine
    letters and digits, so longer ids are mapped to such (the same way for a call and its result)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    _ARGS = re.compile(r"([^\[\]\s]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\](.*)", re.S)

    def __init__(self, args_form: bool = False):
        self.args_form = args_form

    def __repr__(self):
        return f"MistralFormat(args_form={self.args_form})"

    def _template_id(self, call_id):
        if re.fullmatch(r"[A-Za-z0-9]{9}", str(call_id)):
            return call_id
        return hashlib.sha256(str(call_id).encode()).hexdigest()[:9]

    def parse(self, text):
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return text, []
        kept, calls = [head], []
        for segment in rest.split("[TOOL_CALLS]"):
            found = self._segment(segment)
            if found is None:
                kept.append("[TOOL_CALLS]" + segment)
            else:
                calls += found
        if not calls:
            return text, []
        return "".join(kept).strip(), calls

    def _segment(self, segment: str) -> list[ToolCall] | None:
        body = segment.strip().removesuffix("</s>").strip()
        try:
            if body.startswith(("[", "{")):
                value = json.loads(body)
                calls = [call_from_object(v) for v in (value if isinstance(value, list) else [value])]
            elif match := self._ARGS.fullmatch(body):
                calls = [new_call(match.group(1), json.loads(match.group(3)))]
            else:
                return None
        except ValueError:
            return None
        return calls if calls and all(calls) else None

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        special = special_tokens or {}
        functions = functions_of(tools, choice)
        if self.args_form:
            return self._args_grammar(functions, parallel, special)
        item = one_of([call_schema(fn, extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
                        for fn in functions])
        array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f'start: {marker("[TOOL_CALLS]", special)} calls\ncalls: {json_rule(array)}\n'

    @staticmethod
    def _args_grammar(functions: list[dict], parallel: bool, special: Mapping[str, int]) -> str:
        lines = [
            f"start: {'call+' if parallel else 'call'}",
            f'call: {marker("[TOOL_CALLS]", special)} (' + " | ".join(f"f{i}" for i in range(len(functions))) + ")",
            f'call_id: {marker("[CALL_ID]", special)} /[a-zA-Z0-9]{{9}}/',
        ]
        for i, fn in enumerate(functions):
            lines.append(f'f{i}: {literal(fn["name"])} call_id? {marker("[ARGS]", special)} a{i}')
            lines.append(f"a{i}: {json_rule(parameters_of(fn))}")
        return "\n".join(lines) + "\n"


class Llama3Format(ToolFormat):
    """Llama 3.1-3.3 and 4: the whole reply is ``{"name": ..., "parameters": {...}}`` (or "arguments"),
    perhaps after ``<|python_tag|>`` (3.x) or after ``<|python_start|>text<|python_end|>`` (4's template writes a
    call's text there); several calls are separated by ``;`` or follow one another. Since a call can only open the
    reply, ``{`` is a marker: streaming holds back replies that begin with one."""

    name = "llama3"
    markers = ("<|python_tag|>", "<|python_start|>", "{")
    _SEPARATOR = re.compile(r"\s*;?\s*")
    _TEXT = re.compile(r"<\|python_start\|>(.*?)<\|python_end\|>", re.S)

    def __init__(self, single_call: bool = True):
        self.single_call = single_call  # 3.x's templates refuse more than one call in a message; 4's take several

    def __repr__(self):
        return f"Llama3Format(single_call={self.single_call})"

    def template_messages(self, messages, tools):
        """As for every format, but where the template takes one call in a message, a message with several
        becomes one message per call."""
        split = []
        for m in messages:
            calls = (m.get("tool_calls") or []) if self.single_call else []
            split.append({**m, "tool_calls": calls[:1]} if calls else m)
            split += [{**m, "content": None, "tool_calls": [call]} for call in calls[1:]]
        return super().template_messages(split, tools)

    def parse(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        body = body.removesuffix("<|eom_id|>").removesuffix("<|eot_id|>").removesuffix("<|eot|>").strip()
        content = ""
        if wrapped := self._TEXT.match(body):
            content, body = wrapped.group(1).strip(), body[wrapped.end():].strip()
        if not body.startswith("{"):
            return text, []
        calls, pos = [], 0
        try:
            while pos < len(body):
                obj, pos = DECODER.raw_decode(body, pos)
                call = call_from_object(obj, need_arguments=True)
                if call is None:
                    return text, []
                calls.append(call)
                pos = self._SEPARATOR.match(body, pos).end()
        except ValueError:
            return text, []
        return content, calls

    def grammar(self, tools, choice, parallel=True, special_tokens=None):
        body = one_of([call_schema(fn, "parameters") for fn in functions_of(tools, choice)])
        # several: separated by "; " in 3.x's prompt format; one after another, as Llama 4's template writes them
        start = ("call+" if not self.single_call else 'call (";" " "? call)*') if parallel else "call"
        return f"start: {start}\ncall: {json_rule(body)}\n"
