"""The model's tokenizer over HTTP, as vLLM's server offers it (and llama-server's field names too): tools that count
and split text the way the model does without a copy of its tokenizer, such as lm-evaluation-harness's remote
tokenizer, which looks for ``/tokenizer_info`` and ``/tokenize``.

- ``POST /tokenize``: ``{"prompt": text}`` (llama-server's ``"content"``), or a chat's ``{"messages": [...]}``
  rendered by the model's template (``add_generation_prompt``, default true), -> ``{"tokens": [...], "count": n,
  "max_model_len": context}``. ``add_special_tokens`` (llama-server's ``add_special``; default true) adds the BOS
  the tokenizer adds to a text; a rendered chat carries its own.
- ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}`` (and llama-server's ``"content"``).
- ``GET /tokenizer_info``: the special tokens, the chat template, the context length.

Each function here takes the model and the request's decoded JSON and returns the answer's; a bad request raises
an `APIError` naming its field.
"""

from __future__ import annotations

from umakit.serve.api_errors import APIError
from umakit.serve.conversation import ChatCall, prepare
from umakit.serve.generation import checked
from umakit.serve.protocol import ChatMessage, refuse_unknown

TOKENIZE_FIELDS = {"model", "prompt", "content", "messages", "add_special_tokens", "add_special",
                   "add_generation_prompt"}


def tokenize(model, data: dict) -> dict:
    _known(data, TOKENIZE_FIELDS)
    tok = model.tokenizer
    texts = [k for k in ("prompt", "content", "messages") if data.get(k) is not None]
    if len(texts) != 1:
        raise APIError(400, "give one of 'prompt' (or 'content') and 'messages'", param="prompt")
    special = _flag(data, "add_special_tokens", _flag(data, "add_special", True))
    if texts[0] == "messages":
        ids = checked(lambda: _chat_ids(model, data), "messages")
    else:
        text = data[texts[0]]
        if not isinstance(text, str):
            raise APIError(400, f"'{texts[0]}' must be a string", param=texts[0])
        ids = checked(lambda: tok.encode(text, add_special_tokens=special), texts[0])
    return {"tokens": ids, "count": len(ids), "max_model_len": model.info.context_length or None}


def detokenize(model, data: dict) -> dict:
    _known(data, {"model", "tokens"})
    tokens, vocabulary = data.get("tokens"), model.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in the model's vocabulary of {vocabulary}", param="tokens")
    text = model.tokenizer.decode(tokens)
    return {"prompt": text, "content": text}


def tokenizer_info(model, data: dict) -> dict:
    _known(data, {"model"})
    tok = model.tokenizer
    return {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "chat_template": tok.chat_template,
            "add_bos_token": bool(tok.add_bos), "model_max_length": model.info.context_length or None,
            "vocab_size": tok.vocab_size}


def _chat_ids(model, data: dict) -> list[int]:
    """A chat's prompt, as a chat completion of these messages would be given it."""
    messages = data["messages"]
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
    parsed = []
    for i, m in enumerate(messages):
        try:
            parsed.append(ChatMessage.model_validate(m).as_message())
        except ValueError as e:
            raise APIError(400, f"messages[{i}] is not a chat message: {e}", param=f"messages[{i}]") from e
    return prepare(model, ChatCall(messages=parsed, generation_prompt=_flag(data, "add_generation_prompt", True))
                   ).prompt


def _known(data: dict, fields: set[str]) -> None:
    refuse_unknown({k: v for k, v in data.items() if k not in fields})


def _flag(data: dict, key: str, default: bool) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{key}' must be true or false", param=key)
    return value
