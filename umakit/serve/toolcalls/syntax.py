"""What every tool-call format shares: the call, the format's interface, and the grammar's pieces."""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

from umakit.errors import InvalidArgumentError

ANY_OBJECT = {"type": "object"}  # the schema of a function declared without parameters
DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends function.arguments
    id: str  # "call_" + 24 random hex digits, made at parse time


# -- shared pieces ---------------------------------------------------------------


def new_call(name, arguments) -> ToolCall | None:
    """A ToolCall when ``name`` is a non-empty string and ``arguments`` an object (or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
        return None
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False), "call_" + secrets.token_hex(12))


def call_from_object(obj, keys: tuple[str, ...] = ("arguments", "parameters"), need_arguments: bool = False):
    """A ToolCall from ``{"name": ..., <one of keys>: {...}}``, or None."""
    if not isinstance(obj, dict) or "name" not in obj:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None and need_arguments:
        return None
    return new_call(obj["name"], obj[key] if key else {})


def json_call(name: str, arguments: str) -> ToolCall | None:
    """A call whose arguments are JSON text, or None where they are not JSON (or not an object)."""
    try:
        return new_call(name, json.loads(arguments))
    except ValueError:
        return None


def tagged_calls(text: str, pattern: re.Pattern, make) -> tuple[str, list[ToolCall]]:
    """Cut every match of ``pattern`` that ``make(match)`` turns into a call (or a non-empty list of calls: a
    section of several) out of ``text``."""
    calls, kept, pos = [], [], 0
    for match in pattern.finditer(text):
        call = make(match)
        if not call:
            continue  # malformed: the text stays in the content
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls += call if isinstance(call, list) else [call]
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def functions_of(tools: list[dict] | None, choice: str | None) -> list[dict]:
    """The function dicts a forced call may use: all of them, or the one ``choice`` names."""
    functions = []
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgumentError("each tool needs a function with a name")
        functions.append(fn)
    if choice is not None:
        functions = [fn for fn in functions if fn["name"] == choice]
        if not functions:
            raise InvalidArgumentError(f"tool_choice names {choice!r}, which is not one of the tools")
    if not functions:
        raise InvalidArgumentError("tool_choice 'required' needs at least one tool")
    return functions


def parameters_of(fn: dict) -> dict:
    return fn.get("parameters") or ANY_OBJECT


def call_schema(fn: dict, args_key: str = "arguments", extra: dict | None = None) -> dict:
    """JSON schema of one call object: the name fixed, the arguments checked by the function's schema."""
    properties = {"name": {"const": fn["name"]}, args_key: parameters_of(fn), **(extra or {})}
    return {"type": "object", "properties": properties, "required": ["name", args_key], "additionalProperties": False}


def one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, special: Mapping[str, int]) -> str:
    """A marker: the special token when the tokenizer has one for it, else the literal text."""
    return f"<[{special[text]}]>" if text in special else literal(text)


# JSON as json.dumps (and a template's tojson) writes it, ``{"a": 1, "b": 2}``, with no other whitespace: a call
# cannot run on in blank lines.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}},
                                 ensure_ascii=False)


def arguments_dict(call: dict) -> dict:
    """An OpenAI tool call's ``function.arguments`` (JSON text) as a dict, as templates want it."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args) if isinstance(args, str) and args.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"tool call {fn.get('name')!r} has arguments that are not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise InvalidArgumentError(f"tool call {fn.get('name')!r} has arguments that are not a JSON object")
    return parsed


# -- formats ---------------------------------------------------------------------


class ToolFormat(ABC):
    """One family's tool-call syntax. Instances are stateless."""

    name: str = ""
    markers: tuple[str, ...] = ()  # texts that begin a call: streaming holds text back once one may be forming
    exits: tuple[str, ...] = ()  # texts that end a reply's reasoning with a call (harmony's), where no marker does
    call_opens_reply = False  # a forced call's grammar starts with the reply, before any reasoning

    def template_messages(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """Messages and tools as the chat template takes them: each assistant tool call's arguments parsed
        into a dict (templates write ``arguments | tojson``), its message's content None made "", the rest passed
        through; no tools -> None."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [self._template_call(c) for c in m["tool_calls"]]
                if m.get("content") is None:  # no text beside the calls (templates that iterate a content need "")
                    m["content"] = ""
            else:
                m.pop("tool_calls", None)  # templates test `'tool_calls' in message`
            if m.get("tool_call_id") is not None:
                m["tool_call_id"] = self._template_id(m["tool_call_id"])
            out.append(m)
        return out, (list(tools) if tools else None)

    def _template_call(self, call: dict) -> dict:
        fn = call.get("function") or {}
        out = {**call, "type": "function", "function": {**fn, "arguments": arguments_dict(call)}}
        if call.get("id") is not None:
            out["id"] = self._template_id(call["id"])
        return out

    def _template_id(self, call_id: str) -> str:
        return call_id

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content left after removing the calls, the calls). Malformed or cut calls stay in the content."""

    @abstractmethod
    def grammar(self, tools: list[dict], choice: str | None, parallel: bool = True,
                special_tokens: Mapping[str, int] | None = None) -> str:
        """A Lark grammar (llguidance) matching one call, or with ``parallel`` one or more, to any of
        ``tools`` (``choice`` None: tool_choice 'required') or only to the function named ``choice``.
        Arguments follow each function's ``parameters`` schema. ``special_tokens`` maps the texts of the
        tokenizer's added tokens that llguidance holds special (``LLTokenizer.is_special_token``) to their
        ids; markers found there are written as those tokens."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
