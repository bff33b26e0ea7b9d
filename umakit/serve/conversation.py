"""A chat request as every API asks for it, and what it becomes: the prompt, the constraint, the reply's parser.

OpenAI's chat completions, Anthropic's messages and OpenAI's responses each
translate their request into one `ChatCall` (OpenAI-shaped messages and
tools), and `prepare` does the rest once:

- tools go through the model's own chat template (transformers' ``tools=``
  convention) in the syntax the template uses (`umakit.serve.toolcalls.detect`);
  a template without tool syntax gets the generic form, tools described in a
  system message and the reply one JSON object;
- ``tool_choice`` ``required`` or a named function is enforced by a grammar
  (the arguments follow the function's parameters), as is ``auto`` on the
  generic form (a call or a plain answer, both JSON), and ``response_format``;
- a reasoning model's thinking is left free: the constraint starts after the
  template's end-of-thinking marker, and `ReplyParser` returns the thinking
  apart from the content;
- ``chat_template_kwargs`` go to the template; ``reasoning_effort`` is mapped
  where the template has a switch for it, and refused where it has none;
- a final assistant message may be continued (Anthropic's prefill, vLLM's
  ``continue_final_message``): the prompt ends with its text, and the reply is
  what follows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from umakit.errors import InvalidArgumentError
from umakit.generate.chat import thinking_markers
from umakit.generate.constrain import Constraint, special_tokens
from umakit.serve.api_errors import APIError
from umakit.serve.replies import ReplyParser, Thinking
from umakit.serve.toolcalls import GenericFormat, ToolFormat, detect, generic_auto_grammar

EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_CHARS_PER_TOKEN = 64  # more text than this a token cannot fit the context, whatever the tokenizer
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class ChatCall:
    """One chat request in OpenAI's terms, whichever API it came in through.

    ``messages``: dicts with ``role`` (system, user, assistant, tool), ``content`` (text or None) and, where
    they apply, ``tool_calls`` (OpenAI's shape, arguments as JSON text), ``tool_call_id``, ``name`` and
    ``reasoning_content``. ``tool_choice``: "auto", "none", "required" or a function's name.
    """

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    response: Constraint | None = None  # response_format's
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    effort_field: str = "reasoning_effort"  # the request's field that asked for it, as errors name it
    generation_prompt: bool | None = None  # the template's opening of the assistant's turn (None: unless continued)
    continue_final: bool = False  # the last message is an assistant's text, which the reply continues


@dataclass
class Prepared:
    """What the scheduler and the reply's output need."""

    prompt: list[int]
    constraint: Constraint | None
    thinking: Thinking | None
    tools: ToolFormat | None  # the format calls are parsed in; None: no tools offered

    def parser(self) -> ReplyParser:
        return ReplyParser(self.thinking, self.tools)


def check_tools(tools: list[dict] | None, choice: str) -> list[dict] | None:
    """``tools`` checked (functions with unique names and object parameters), and ``choice`` against them."""
    names = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidArgumentError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-', '.' or ':'")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON schema of an object")
        if name in names:
            raise InvalidArgumentError(f"tools[{i}]: a second function named {name!r}")
        names.append(name)
    if choice not in ("auto", "none") and not names:
        raise InvalidArgumentError(f"tool_choice {choice!r} needs tools")
    if choice not in ("auto", "none", "required") and choice not in names:
        raise InvalidArgumentError(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})")
    return [{"type": "function", "function": t["function"]} for t in tools] if tools else None


def _template_kwargs(template: str, call: ChatCall) -> dict:
    kwargs = dict(call.template_kwargs)
    effort = call.reasoning_effort
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise InvalidArgumentError(f"{call.effort_field} must be one of {', '.join(EFFORTS)}, got {effort!r}")
    if "reasoning_effort" in template:  # the template reads it itself (gpt-oss's)
        kwargs.setdefault("reasoning_effort", effort)
    elif "enable_thinking" in template:  # an on/off switch (Qwen3's)
        kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
    else:
        raise InvalidArgumentError(f"{call.effort_field}: this model's chat template has no reasoning switch")
    return kwargs


def _continued(call: ChatCall) -> None:
    """Refuse what a continued final message cannot be combined with: the reply starts inside its text."""
    last = call.messages[-1] if call.messages else {}
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or last.get("tool_calls"):
        raise InvalidArgumentError("the message to continue must be the last one, an assistant's text")
    if call.generation_prompt:
        raise InvalidArgumentError("a continued message is not followed by the template's generation prompt: "
                                   "add_generation_prompt must not be true")
    if call.reasoning_effort not in (None, "none", "minimal"):
        raise InvalidArgumentError("a continued assistant message cannot be combined with reasoning: the reply "
                                   "continues the message's text")


def _cut_after_final(text: str, content: str) -> str:
    """``text`` (the template's rendering) up to the end of the final message's ``content``, as the model
    would have written it; transformers' ``continue_final_message`` finds it the same way."""
    for wanted in (content, content.strip()):
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            return text[:at + len(wanted)]
    raise InvalidArgumentError("this model's chat template does not keep the final assistant message's text as "
                               "given, so the reply cannot continue it")


def _thinking(template: str, prompt_text: str) -> Thinking | None:
    """The template's thinking markers, if it has them, and whether the prompt opened them."""
    markers = thinking_markers(template)
    if markers is None:
        return None
    return Thinking(*markers, open=prompt_text.rstrip().endswith(markers[0]))


def prepare(model, call: ChatCall) -> Prepared:
    """The prompt ids, constraint and reply format of ``call`` on ``model``; a bad call raises
    `InvalidArgumentError` naming what is wrong."""
    tok = model.tokenizer
    template = tok.chat_template or ""
    tools = check_tools(call.tools, call.tool_choice)
    offered = tools if call.tool_choice != "none" else None
    fmt = detect(tok.chat_template)
    if call.continue_final:
        _continued(call)
    messages, template_tools = fmt.template_messages(call.messages, offered)
    opens = not call.continue_final if call.generation_prompt is None else call.generation_prompt
    text = tok.render_chat(messages, add_generation_prompt=opens, tools=template_tools,
                           **_template_kwargs(template, call))
    if call.continue_final:
        text = _cut_after_final(text, call.messages[-1]["content"])
    prompt = tok.encode(text)
    thinking = _thinking(template, text)
    constraint = None
    if offered:
        if call.response is not None and call.tool_choice == "auto" and not isinstance(fmt, GenericFormat):
            raise InvalidArgumentError("response_format together with tools (tool_choice 'auto') is not supported "
                                       "yet: give one or the other, or tool_choice 'none'")
        if call.tool_choice == "auto":
            if isinstance(fmt, GenericFormat):
                constraint = Constraint.grammar(generic_auto_grammar(offered))
        else:
            choice = None if call.tool_choice == "required" else call.tool_choice
            constraint = Constraint.grammar(fmt.grammar(offered, choice, parallel=call.parallel_tool_calls and
                                                        choice is None, special_tokens=special_tokens(tok)))
    else:
        constraint = call.response
    if constraint is not None and call.continue_final:
        raise InvalidArgumentError("a continued assistant message cannot be combined with a response format or "
                                   "a constrained tool call (tool_choice required or named, or this template's "
                                   "JSON tool calls): its grammar starts at the reply's beginning")
    thinks = thinking is not None and (thinking.open or not text.rstrip().endswith(thinking.end))
    forced_call = offered and call.tool_choice != "auto"
    if forced_call and fmt.call_opens_reply:
        thinks = False  # the call is the reply's first message (harmony's): no reasoning before it
    if constraint is not None and thinks:
        # after the thinking's end; with harmony, after the final channel's header, which ends that marker and
        # also opens a reply that skipped the analysis
        lead = next((m for m in thinking.leads if thinking.end.endswith(m)), thinking.end)
        constraint = constraint.starting_after(lead)
    return Prepared(prompt, constraint, thinking, fmt if offered else None)


def cannot_fit(call: ChatCall, limit: int) -> None:
    """400 before the template is rendered, for a conversation that cannot fit the context whatever its tokens:
    more messages than tokens (each takes at least one), or more text than `MAX_CHARS_PER_TOKEN` a token."""
    if not limit:
        return
    chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in call.messages)
    if len(call.messages) > limit or chars > limit * MAX_CHARS_PER_TOKEN:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; these {len(call.messages)} "
                            f"messages ({chars} characters) cannot fit in it", param="messages",
                       code="context_length_exceeded")
