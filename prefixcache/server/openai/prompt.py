"""The OpenAI routes' prompts and sampling: a completion's prompts (text or token ids), a chat
rendered with the model's template, a generation's limits and its ``SamplingParams``.

Functions of the shared :class:`~prefixcache.server.base.serving.Serving` (its tokenizer,
limits and prompt checks): the base knows no API's rendering. The cache routes render their
``messages`` here too. The sync parts run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import jinja2

from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.request import SamplingParams
from prefixcache.api.segments import DEFAULT_RECOMPUTE_TOKENS, SegmentOptions, SegmentRequest
from prefixcache.server.base.serving import PRIORITY_BOUND, Serving, as_api_error
from prefixcache.server.edge.errors import APIError
from prefixcache.server.openai.protocol import (
    ChatMessage,
    CompletionRequest,
    _Generation,
    template_text_chars,
)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its ids, its document spans (cache_mode "segments"), and how many of
    its leading ids render its leading system/developer messages (counted when asked: the
    prefix a chat with a shared salt declares shared)."""

    ids: list[int]
    spans: tuple = ()
    system_tokens: int = 0


# -- completions ------------------------------------------------------------------------------


def num_prompts(s: Serving, p) -> int:
    """The prompts of a completion's ``prompt`` (400 when none, or over the limit): known
    before anything is tokenized."""
    n = 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)
    if not n:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if n > s.limits.max_prompts_per_request:
        raise APIError(
            400, f"at most {s.limits.max_prompts_per_request} prompts per request",
            param="prompt", code="too_many_prompts",
        )  # fmt: skip
    return n


def _completion_prompts(s: Serving, p) -> list[list[int]]:
    num_prompts(s, p)
    if isinstance(p, str):
        prompts = [("text", p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [("ids", p)]
    else:
        prompts = [("text" if isinstance(x, str) else "ids", x) for x in p]
    return [s.text_ids(x, "prompt") if k == "text" else s.prompt_ids(list(x), "prompt")
            for k, x in prompts]  # fmt: skip


async def completion_prompts(s: Serving, req: CompletionRequest) -> list[list[int]]:
    return await asyncio.to_thread(_completion_prompts, s, req.prompt)


# -- chats ------------------------------------------------------------------------------------


def _chat_prompt(
    s: Serving,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    segments: bool = False,
    system_prefix: bool = False,
) -> ChatPrompt:
    """The prompt ids; with ``segments``, the document spans too, rendered by the segment
    boundary convention (tokenizer/segments.py); with ``system_prefix``, the count
    of leading ids that are the leading system/developer messages."""
    if len(messages) > s.limits.max_messages:
        raise APIError(
            400, f"at most {s.limits.max_messages} messages per request", param="messages"
        )
    dicts = [m.as_template_dict() for m in messages]
    # A document's heading is its title, else its name (tokenizer/chat.py): rendered
    # and tokenized like its content, so counted with it.
    chars = template_text_chars(dicts)
    s.check_text_fits(chars, "messages")
    spans = ()
    try:
        if segments:
            sp = s.tokenizer.encode_chat_segments(dicts, add_generation_prompt)
            ids, spans = sp.token_ids, sp.spans
        else:
            ids = s.tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt)
    except (ValueError, KeyError, TypeError, jinja2.TemplateError):
        # The template's own message may quote internals; say what is wrong in our words.
        raise APIError(
            400, "these messages cannot be rendered with the model's chat template "
            "(check roles and their order)", param="messages",
        ) from None  # fmt: skip
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    ids = s.prompt_ids(list(ids), "messages")
    system = _system_tokens(s, dicts, ids) if system_prefix else 0
    return ChatPrompt(ids, tuple(spans), system)


def _system_tokens(s: Serving, dicts: list[dict], ids: list[int]) -> int:
    """The leading ``ids`` that render the chat's leading system messages (developer ones
    are system messages here) alone: what a chat with a shared salt declares shared. None
    of them comes from a later message, a document (merged after the system text) or the
    output (Tokenizer.leading_system_tokens)."""
    return s.tokenizer.leading_system_tokens(dicts, ids)


async def chat_prompt(
    s: Serving,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    segments: bool = False,
    system_prefix: bool = False,
) -> ChatPrompt:
    return await asyncio.to_thread(
        _chat_prompt, s, messages, add_generation_prompt, segments, system_prefix
    )


def chat_prefix(s: Serving, dicts: list[dict]):
    """``render_prefix`` of a chat (base/comparison.py): its first k messages alone, no
    generation prompt."""

    def render(k: int) -> list[int]:
        try:
            return s.tokenizer.encode_chat(dicts[:k], add_generation_prompt=False) if k else []
        except (ValueError, KeyError, TypeError, jinja2.TemplateError):
            return []

    return render


def segment_request(req: _Generation, spans) -> SegmentRequest:
    """cache_mode="segments": the spans and the validated recompute options (400 naming
    the field when out of range). A chat without documents has no span: a no-op."""
    try:
        opts = SegmentOptions(
            DEFAULT_RECOMPUTE_TOKENS if req.segment_recompute_tokens is None
            else req.segment_recompute_tokens,
            req.segment_recompute_ratio or 0.0,
            "first" if req.segment_selection is None else req.segment_selection,
        )  # fmt: skip
    except InvalidRequestError as e:
        raise as_api_error(e) from None
    return SegmentRequest(tuple(spans), opts)


# -- sampling ---------------------------------------------------------------------------------


def check_generation_limits(s: Serving, req: _Generation, logprobs: int | None) -> None:
    lim = s.limits
    if req.n > lim.max_n:
        raise APIError(400, f"n must be at most {lim.max_n}", param="n")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > lim.max_stop_sequences:
        raise APIError(
            400, f"at most {lim.max_stop_sequences} stop sequences", param="stop"
        )
    if any(len(x) > lim.max_stop_chars for x in stop):
        raise APIError(
            400, f"stop sequences are at most {lim.max_stop_chars} characters", param="stop"
        )
    if len(req.stop_token_ids or ()) > lim.max_stop_token_ids:
        raise APIError(
            400, f"at most {lim.max_stop_token_ids} stop_token_ids", param="stop_token_ids"
        )
    if logprobs is not None and logprobs > lim.max_logprobs:
        raise APIError(400, f"logprobs must be at most {lim.max_logprobs}", param="logprobs")
    if abs(req.priority) > PRIORITY_BOUND:
        raise APIError(400, "priority must be a 32-bit integer", param="priority")


def sampling_params(
    s: Serving,
    req: _Generation,
    prompt_len: int,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    room = s.engine.max_model_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {s.engine.max_model_len} tokens, "
                f"but the prompt has {prompt_len} tokens.",
                param="messages" if hasattr(req, "messages") else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop or (),
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except InvalidRequestError as e:
        raise as_api_error(e) from None
