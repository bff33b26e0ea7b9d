"""Tokenizer, chat template and streaming detokenizer.

Built on the `tokenizers` library and jinja2 directly (not transformers), so
loading a model stays fast. The chat template is the model's own, rendered the
way transformers renders it (trim_blocks, lstrip_blocks, `raise_exception`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Sequence

from umakit.errors import TokenizerError

Message = dict  # {"role": ..., "content": ...}

# Used only when a model ships no chat template: a plain, readable transcript.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


def _generation_tag():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks an assistant's text for training masks):
    the body renders as it is, in a scope of its own, as there."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


class Tokenizer:
    """Encode, decode and render chats for one model directory."""

    def __init__(self, path: Path, config: dict | None = None, extra_eos_ids: set[int] = frozenset()):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # pragma: no cover - declared dependency
            raise TokenizerError("the 'tokenizers' package is missing: pip install tokenizers") from e
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (umakit needs a fast tokenizer file)")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        tc = {}
        tc_file = path / "tokenizer_config.json"
        if tc_file.is_file():
            try:
                tc = json.loads(tc_file.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{tc_file} is not valid JSON: {e}") from e
        template = tc.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        self.add_bos = bool(tc.get("add_bos_token", False))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = set(extra_eos_ids)
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    # -- ids and text -------------------------------------------------------
    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (to tell whether two tokenizers agree)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a BOS is added once when the model wants one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for a grammar engine that reads every token's bytes)."""
        return self._tok.to_str()

    # -- chat ---------------------------------------------------------------
    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template error: {message}")

        # None prints as nothing: an assistant's `content` None beside its tool calls is no text "None" (templates
        # that test `content is none` still see None, as they were written for)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()],
                                            finalize=lambda value: "" if value is None else value)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template or FALLBACK_TEMPLATE)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise TokenizerError(f"the model's chat template does not parse: {e}") from e

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, **template_kwargs) -> str:
        """Render messages with the model's chat template into prompt text.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) and ``template_kwargs``
        (``enable_thinking=False``, say) reach the template as transformers' ``apply_chat_template``
        passes them; a message may carry what templates read beside its content (``tool_calls``, ...).
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise TokenizerError("each message needs 'role' and 'content' keys")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(template_kwargs)
        if reserved:
            raise TokenizerError(f"chat template arguments {', '.join(sorted(reserved))} are set by umakit")
        try:
            return self._template.render(
                **template_kwargs,
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TokenizerError:
            raise
        except Exception as e:  # jinja2 runtime errors
            raise TokenizerError(f"the model's chat template failed to render: {e}") from e

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a rendered chat. Templates that write the BOS themselves get no second one."""
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def added_tokens(self) -> dict[str, int]:
        """The text and id of every token added to the vocabulary (special or not)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}


class StreamingDetokenizer:
    """Turns a stream of token ids into text pieces without breaking characters.

    Decoding token by token loses the spaces that BPE/SentencePiece decoders add
    in context and splits multi-byte UTF-8 characters. Instead the tokens since
    the last emitted newline are decoded together, and only the new, complete
    suffix is emitted; text ending in U+FFFD waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = ""  # text of self._ids already returned

    def add(self, token: int) -> str:
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for more bytes
        piece = text[len(self._emitted):]
        if text.endswith("\n"):
            # Start a new segment, keeping the newline token as left context so
            # that decoders which strip a leading space still see one.
            self._ids = [token]
            self._emitted = self._tok.decode(self._ids)
        else:
            self._emitted = text
        return piece

    def flush(self) -> str:
        """Whatever is left (an unfinished character is emitted as U+FFFD)."""
        text = self._tok.decode(self._ids)
        piece = text[len(self._emitted):]
        self._ids, self._emitted = [], ""
        return piece
