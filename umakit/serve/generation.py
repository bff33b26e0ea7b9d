"""A request read by its API, as the scheduler's `GenerationRequest` (with, for a chat, its
`umakit.serve.conversation.Prepared`): what the request models alone cannot check (the model's context, its
vocabulary, the engine's features, a chat's template and tools) is checked here, each refusal a 400 naming the
field.
"""

from __future__ import annotations

from dataclasses import dataclass

from umakit.backends.base import CONSTRAIN
from umakit.errors import UmakitError
from umakit.generate.constrain import Constraint
from umakit.generate.infill import infill_ids
from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from umakit.serve.api_errors import APIError
from umakit.serve.conversation import ChatCall, Prepared, cannot_fit, prepare
from umakit.serve.protocol import UNKNOWN_CONTEXT_MAX_TOKENS, ChatRequest, CompletionRequest, RequestBase, sampling_from
from umakit.serve.types import GenerationRequest


MAX_CHOICES = 64  # choices one request may ask for: its prompts times n


@dataclass(frozen=True)
class Choice:
    """One choice a request asks for: the scheduler's request, a chat's `Prepared`, a completion's prompt text to
    echo (or None), and whether it is its prompt's first (the one whose prompt the usage counts)."""

    request: GenerationRequest
    prepared: Prepared | None
    echo: str | None
    first: bool


def openai_choices(req: RequestBase, model, *, id: str, timeout_s: float | None) -> list[Choice]:
    """Every choice of an OpenAI request: ``n`` of each of its prompts (a completion may give several), the k-th
    of a prompt seeded ``seed + k`` where the request gives a seed; each validated (`generation_request`)."""
    n = 1 if req.n is None else req.n
    prompts = req.prompts() if isinstance(req, CompletionRequest) else [None]
    if n < 1:
        raise APIError(400, f"n must be at least 1 (got {n})", param="n")
    if n * len(prompts) > MAX_CHOICES:
        raise APIError(400, f"a request may ask for at most {MAX_CHOICES} choices: {len(prompts)} prompt(s) times "
                            f"n={n} is {n * len(prompts)}", param="n" if n > 1 else "prompt")
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo, which scores the prompt)",
                       param="max_tokens")
    if echo and req.suffix is not None:
        raise APIError(400, "echo and suffix together are not supported: the prompt of a fill-in-the-middle is the "
                            "prefix and the suffix around markers, not one text to echo", param="echo")
    if echo and req.stream and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's tokens scored) is answered whole, not streamed",
                       param="echo")
    out = []
    for p, prompt in enumerate(prompts):
        for k in range(n):
            made, prepared = generation_request(req, model, id=f"{id}-{p * n + k}" if len(prompts) * n > 1 else id,
                                                timeout_s=timeout_s, prompt=prompt)
            if k and made.seed is not None:  # (in the signed 64-bit range seeds take)
                made.seed = (made.seed + k + 2**63) % 2**64 - 2**63
            if echo:
                made.prompt_logprobs = req.logprobs
            text = (prompt if isinstance(prompt, str) else model.tokenizer.decode(made.prompt)) if echo else None
            out.append(Choice(made, prepared, text, k == 0))
    return out


def generation_request(req: RequestBase, model, *, id: str, timeout_s: float | None, prompt=None
                       ) -> tuple[GenerationRequest, Prepared | None]:
    """Validate what the models alone cannot (model name, context, tools, constraints) and build the scheduler's
    request, with a chat's `Prepared` (its reply's format); ``prompt``: a completion's (one of its prompts)."""
    logprobs = req.logprobs_count()
    sampling = sampling_from(req)
    if sampling.logit_bias and sampling.logit_bias[-1][0] >= model.tokenizer.vocab_size:
        raise APIError(400, f"logit_bias names token {sampling.logit_bias[-1][0]}, past the model's vocabulary of "
                            f"{model.tokenizer.vocab_size}", param="logit_bias")
    if isinstance(req, ChatRequest):
        made, prepared = chat_request(model, checked(req.chat_call, "response_format"), req.requested_max_tokens(),
                                      sampling=sampling, seed=req.seed, stop=req.stop, logprobs=logprobs, id=id,
                                      timeout_s=timeout_s)
    else:
        constraint = checked(lambda: req.response_format.constraint() if req.response_format else None,
                              "response_format")
        ids = checked(lambda: _prompt_ids(model, req.prompts()[0] if prompt is None else prompt), "prompt")
        if req.suffix is not None:  # the reply goes between the prompt and the suffix
            ids = checked(lambda: infill_ids(model.tokenizer, ids, model.encode(req.suffix, raw=True)), "suffix")
        made, prepared = _request(model, ids, constraint, req.requested_max_tokens(), "prompt", sampling=sampling,
                                  seed=req.seed, stop=req.stop, logprobs=logprobs, id=id, timeout_s=timeout_s), None
    made.cache_salt = req.cache_salt or ""
    return made, prepared


def _prompt_ids(model, prompt: str | list[int]) -> list[int]:
    """A completion's prompt as token ids: text encoded as it is, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        return model.encode(prompt, raw=True)
    vocabulary = model.tokenizer.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise APIError(400, f"the prompt's token id {bad} is not in the model's vocabulary of {vocabulary}",
                       param="prompt")
    return list(prompt)


def chat_request(model, call: ChatCall, max_tokens: int | None, **settings) -> tuple[GenerationRequest, Prepared]:
    """A chat (whichever API it came through) as the scheduler's request and its reply's format."""
    cannot_fit(call, model.info.context_length)
    where = "tools" if call.tools and call.tool_choice != "auto" else "messages"
    prepared = checked(lambda: prepare(model, call), where)
    return _request(model, prepared.prompt, prepared.constraint, max_tokens, "messages", **settings), prepared


def checked(build, where: str):
    """``build()``, a library error it raises made a 400 naming ``where``."""
    try:
        return build()
    except APIError:
        raise
    except UmakitError as e:  # a chat template that refuses the conversation, a schema umakit cannot enforce
        raise APIError(400, str(e), param=where) from e


def _request(model, prompt: list[int], constraint: Constraint | None, max_tokens: int | None, where: str, *,
             sampling: SamplingParams, seed: int | None, stop, logprobs: int | None, id: str,
             timeout_s: float | None) -> GenerationRequest:
    if not prompt:
        raise APIError(400, f"the {where} is empty", param=where)
    matcher = None
    if constraint is not None:
        if CONSTRAIN not in model.engine.features:
            raise APIError(400, f"the {model.engine.name} backend here does not support constrained decoding "
                                f"({constraint.describe()})", param="response_format")
        matcher = checked(lambda: constraint.matcher(model.tokenizer), "response_format")
    return GenerationRequest(prompt=prompt, max_tokens=_max_tokens(max_tokens, len(prompt), model.info.context_length,
                                                                   where),
                             sampling=sampling, seed=seed,  # seed_or_random maps any int64 into range
                             stop=tuple(stop or ()), logprobs=logprobs, timeout_s=timeout_s, id=id,
                             constraint=matcher)


def _max_tokens(asked: int | None, prompt_tokens: int, limit: int, where: str) -> int:
    """The tokens asked for, or by default as many as fit up to `DEFAULT_MAX_TOKENS`; 400 when they do not fit
    (at most `UNKNOWN_CONTEXT_MAX_TOKENS` for a model that does not say its context length)."""
    if asked == 0 and (not limit or prompt_tokens <= limit):  # the prompt scored alone (echo)
        return 0
    if not limit:
        if asked is not None and asked > UNKNOWN_CONTEXT_MAX_TOKENS:
            raise APIError(400, f"max_tokens is {asked}; this model does not say its context length, and a request "
                                f"may ask for at most {UNKNOWN_CONTEXT_MAX_TOKENS}", param="max_tokens")
        return asked or DEFAULT_MAX_TOKENS
    if prompt_tokens + (asked or 1) > limit:
        raise APIError(
            400, f"This model's maximum context length is {limit} tokens. However, you requested "
                 f"{prompt_tokens + (asked or 1)} tokens ({prompt_tokens} in the {where}, {asked or 1} in the "
                 f"completion). Please reduce the length of the {where} or completion.",
            param=where, code="context_length_exceeded")
    return asked or min(DEFAULT_MAX_TOKENS, limit - prompt_tokens)
