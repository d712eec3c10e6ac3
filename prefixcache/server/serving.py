"""From an API request to engine requests: prompts, limits, sampling, admission.

The order of checks is the order of costs: everything bounded by ``ServerLimits`` and the
context length is checked before anything proportional to the input is done. Text is tokenized
(and chat templates rendered) in a worker thread, never on the event loop; a text that cannot
fit the context whatever it tokenizes to (longer than ``max_model_len`` times the longest token
in characters) is refused without being tokenized. Token ids are checked against the vocabulary
and the context before they are hashed or looked up.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, replace

import jinja2

from prefixcache.api.engine import EngineAPI, EngineRequest
from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.request import CacheLease, RetentionPriority, SamplingParams, SharedPrefix
from prefixcache.api.segments import DEFAULT_RECOMPUTE_TOKENS, SegmentOptions, SegmentRequest
from prefixcache.server.auth import CacheScope, Tenant, TenantDirectory
from prefixcache.server.cache_gate import CacheCallGate
from prefixcache.server.comparison import Comparison, PromptRecord, ResponseStore, compare
from prefixcache.server.edge.errors import APIError, from_engine_error
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.refusals import RefusalLimiter
from prefixcache.server.messages_prompt import MessagesRenderer
from prefixcache.server.observability.activity import Activity
from prefixcache.server.observability.cache_keys import PromptCacheKeyStats
from prefixcache.server.observability.metrics import ServerMetrics
from prefixcache.server.observability.snapshot import Snapshot, SnapshotReader
from prefixcache.server.protocol import (
    ChatMessage,
    CompletionRequest,
    _CacheQuery,
    _Generation,
    parse_body,
    template_text_chars,
)
from prefixcache.server.run import Choice, Run

PRIORITY_BOUND = 2**31 - 1


def new_id(prefix: str) -> str:
    """``chatcmpl-<hex>``; a prefix ending in ``_`` is Anthropic's style: ``msg_<hex>``."""
    return f"{prefix}{'' if prefix.endswith('_') else '-'}{uuid.uuid4().hex}"


def as_api_error(e: InvalidRequestError) -> APIError:
    err = from_engine_error(e)
    assert err is not None
    return err


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its ids, its document spans (cache_mode "segments"), and how many of
    its leading ids render its leading system/developer messages (counted when asked: the
    prefix a chat with a shared salt declares shared)."""

    ids: list[int]
    spans: tuple = ()
    system_tokens: int = 0


class Serving:
    """What the routes share: the engine, the tenants, the limits, the metrics, the log."""

    def __init__(
        self,
        engine: EngineAPI,
        served_model_names: list[str],
        tenants: TenantDirectory,
        metrics: ServerMetrics,
        request_log=None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.engine = engine
        self.model_names = served_model_names
        self.tenants = tenants
        self.metrics = metrics
        self.request_log = request_log  # a BackgroundRequestLog, or None
        self.limits = limits or ServerLimits()
        self.cache_gate = CacheCallGate(
            self.limits.cache_route_threads, self.limits.max_cache_calls_per_tenant,
            self.limits.max_cache_calls_per_second,
        )  # fmt: skip
        self.refusals = RefusalLimiter(
            self.limits.max_refusals_per_second, self.limits.refusal_penalty
        )
        self.tokenizer = engine.tokenizer
        self.messages_renderer = MessagesRenderer(self.tokenizer)  # Anthropic's Messages API
        self.activity = Activity(lambda ids: self.tokenizer.decode(ids), engine.config.block_size)
        # /metrics: rendered by one reader at a time off the default executor (snapshot.py).
        self.snapshot_reader = SnapshotReader()
        self.metrics_snapshot = Snapshot(
            self.metrics.render, self.snapshot_reader, self.limits.metrics_max_age
        )
        self.cache_keys = PromptCacheKeyStats()
        self.responses = ResponseStore()  # prompts kept for comparisons (comparison.py)
        self._chars_lock = threading.Lock()
        self._token_texts: list[str] | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def close(self) -> None:
        """At shutdown: the cache routes' and the snapshots' threads (calls not started are
        dropped)."""
        self.cache_gate.close()
        self.snapshot_reader.close()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    # -- prompts (the sync parts run in a worker thread) ---------------------------------------

    @property
    def max_token_chars(self) -> int:
        return self.tokenizer.max_token_chars

    async def token_texts(self) -> list[str]:
        """Each token id's text alone, ``tokenizer.decode([id])``, indexed by id: how logprobs
        name tokens. Built once per process in a worker thread (one batched decode, ~0.05 s
        for 50k ids), so a token of a logprobs response costs list lookups on the event loop,
        not ``1 + top_logprobs`` tokenizer calls. It covers the model's rows as well as the
        tokenizer's ids (an embedding table may be padded past the vocabulary)."""
        if self._token_texts is None:
            await asyncio.to_thread(self._build_token_texts)
        return self._token_texts

    def _build_token_texts(self) -> None:
        with self._chars_lock:
            if self._token_texts is None:
                n = max(self.tokenizer.vocab_size, self.engine.vocab_size)
                self._token_texts = self.tokenizer.decode_each(range(n))

    def _check_text_fits(self, num_chars: int, param: str) -> None:
        limit = self.engine.max_model_len
        if num_chars > limit and num_chars > limit * self.max_token_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; a text of {num_chars} "
                f"characters cannot fit (no token is longer than {self.max_token_chars}).",
                param=param, code="context_length_exceeded",
            )  # fmt: skip

    def _ids(self, ids: list[int], param: str) -> list[int]:
        try:
            self.engine.validate_prompt(ids)
        except InvalidRequestError as e:
            raise as_api_error(replace_param(e, param)) from None
        return ids

    def _text(self, text: str, param: str) -> list[int]:
        """A text prompt's ids, BOS included when the model wants one (as the offline API)."""
        self._check_text_fits(len(text), param)
        return self._ids(self.tokenizer.encode(text, add_special_tokens=True), param)

    def num_prompts(self, p) -> int:
        """The prompts of a completion's ``prompt`` (400 when none, or over the limit): known
        before anything is tokenized."""
        n = 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)
        if not n:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if n > self.limits.max_prompts_per_request:
            raise APIError(
                400, f"at most {self.limits.max_prompts_per_request} prompts per request",
                param="prompt", code="too_many_prompts",
            )  # fmt: skip
        return n

    def _completion_prompts(self, p) -> list[list[int]]:
        self.num_prompts(p)
        if isinstance(p, str):
            prompts = [("text", p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [("ids", p)]
        else:
            prompts = [("text" if isinstance(x, str) else "ids", x) for x in p]
        return [self._text(x, "prompt") if k == "text" else self._ids(list(x), "prompt")
                for k, x in prompts]  # fmt: skip

    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        return await asyncio.to_thread(self._completion_prompts, req.prompt)

    def _chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        segments: bool = False,
        system_prefix: bool = False,
    ) -> ChatPrompt:
        """The prompt ids; with ``segments``, the document spans too, rendered by the segment
        boundary convention (model/tokenizer_segments.py); with ``system_prefix``, the count
        of leading ids that are the leading system/developer messages."""
        if len(messages) > self.limits.max_messages:
            raise APIError(
                400, f"at most {self.limits.max_messages} messages per request", param="messages"
            )
        dicts = [m.as_template_dict() for m in messages]
        # A document's heading is its title, else its name (model/tokenizer_chat.py): rendered
        # and tokenized like its content, so counted with it.
        chars = template_text_chars(dicts)
        self._check_text_fits(chars, "messages")
        spans = ()
        try:
            if segments:
                sp = self.tokenizer.encode_chat_segments(dicts, add_generation_prompt)
                ids, spans = sp.token_ids, sp.spans
            else:
                ids = self.tokenizer.encode_chat(dicts, add_generation_prompt=add_generation_prompt)
        except (ValueError, KeyError, TypeError, jinja2.TemplateError):
            # The template's own message may quote internals; say what is wrong in our words.
            raise APIError(
                400, "these messages cannot be rendered with the model's chat template "
                "(check roles and their order)", param="messages",
            ) from None  # fmt: skip
        if not ids:
            raise APIError(400, "messages render to an empty prompt", param="messages")
        ids = self._ids(list(ids), "messages")
        system = self._system_tokens(dicts, ids) if system_prefix else 0
        return ChatPrompt(ids, tuple(spans), system)

    def _system_tokens(self, dicts: list[dict], ids: list[int]) -> int:
        """The leading ``ids`` that render the chat's leading system messages (developer ones
        are system messages here) alone: what a chat with a shared salt declares shared. None
        of them comes from a later message, a document (merged after the system text) or the
        output (Tokenizer.leading_system_tokens)."""
        return self.tokenizer.leading_system_tokens(dicts, ids)

    async def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        segments: bool = False,
        system_prefix: bool = False,
    ) -> ChatPrompt:
        return await asyncio.to_thread(
            self._chat_prompt, messages, add_generation_prompt, segments, system_prefix
        )

    @staticmethod
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

    @staticmethod
    def retention_priority(req) -> RetentionPriority | None:
        """The request's ``retention_priority`` (0-100) and ``retention_priority_seconds``
        (400 naming the field when out of range, or seconds without a priority)."""
        if req.retention_priority is None:
            if req.retention_priority_seconds is not None:
                raise APIError(400, "retention_priority_seconds needs retention_priority",
                               param="retention_priority_seconds")  # fmt: skip
            return None
        try:
            return RetentionPriority(req.retention_priority, req.retention_priority_seconds)
        except InvalidRequestError as e:
            raise as_api_error(e) from None

    async def cache_prompt(
        self, req: _CacheQuery, tenant: Tenant, scope: CacheScope
    ) -> tuple[list[int], SharedPrefix | None]:
        """The prompt of /v1/cache/warm and /lookup, validated like a completion's, and the
        prefix it declares shared: with a shared salt, an admin's whole prompt (a public
        prefix), else a chat's leading system messages, as a chat completion declares them;
        nothing of another tenant's raw prompt."""
        req.check_one_input()
        shared = scope.shared is not None
        if req.messages is not None:
            chat = await self.chat_prompt(
                req.messages, req.add_generation_prompt, system_prefix=shared and not tenant.admin
            )
            ids, declared = chat.ids, chat.system_tokens
        else:
            if isinstance(req.prompt, str):
                ids = await asyncio.to_thread(self._text, req.prompt, "prompt")
            else:
                ids = self._ids(list(req.prompt), "prompt")  # O(1) length check before the scan
            declared = 0
        if shared and tenant.admin:
            declared = len(ids)
        return ids, scope.prefix(declared)

    def shared_tokens(self, shared: SharedPrefix | None) -> int:
        """The tokens of a declared shared prefix that are shared: its whole blocks."""
        if shared is None:
            return 0
        b = self.engine.config.block_size
        return shared.num_tokens // b * b

    # -- comparisons (comparison.py) -------------------------------------------------------------

    async def compare_with(
        self, tenant: Tenant, previous_id: str, record: PromptRecord, render_prefix
    ) -> Comparison | None:
        """``record`` compared with the prompt of the tenant's response ``previous_id`` (None
        when that is not one of its own: another tenant's id is not found either). The run's
        own record is kept with ``responses.put`` once it has its id."""
        previous = self.responses.get(tenant.name, previous_id)
        if previous is None:
            return None
        # A comparison renders prefixes (a binary search over the parts): a call of the
        # tenant's cache-call rate, on the cache routes' threads (cache_gate.py).
        return await self.cache_gate.run(tenant.name, compare, previous, record, render_prefix,
                                         rated=not tenant.admin)  # fmt: skip

    def chat_prefix(self, dicts: list[dict]):
        """``render_prefix`` of a chat: its first k messages alone, no generation prompt."""

        def render(k: int) -> list[int]:
            try:
                return self.tokenizer.encode_chat(dicts[:k], add_generation_prompt=False) if k else []
            except (ValueError, KeyError, TypeError, jinja2.TemplateError):
                return []

        return render

    # -- sampling -----------------------------------------------------------------------------

    def check_generation_limits(self, req: _Generation, logprobs: int | None) -> None:
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(400, f"n must be at most {lim.max_n}", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > lim.max_stop_sequences:
            raise APIError(
                400, f"at most {lim.max_stop_sequences} stop sequences", param="stop"
            )
        if any(len(s) > lim.max_stop_chars for s in stop):
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
        self,
        req: _Generation,
        prompt_len: int,
        max_tokens: int | None,
        default_max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        room = self.engine.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.engine.max_model_len} tokens, "
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

    # -- running ------------------------------------------------------------------------------
    def check_admission(self, tenant: Tenant, num_sequences: int) -> None:
        """Before a prompt is rendered or tokenized: 400 when ``num_sequences`` could never
        wait at once, 429 when they do not fit the tenant's share of the queue (or the queue)
        now. A refused request costs its parse only (``start`` checks again when it adds)."""
        self._check_sequences(num_sequences)
        try:
            self.engine.check_admission(tenant.name, num_sequences)
        except Exception as e:
            err = from_engine_error(e)
            if err is None:
                raise
            raise err from None


    def start(
        self,
        prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        tenant: Tenant,
        namespace: str,
        priority: int = 0,
        explain: bool = False,
        segments: SegmentRequest | None = None,
        shared_prefix: SharedPrefix | None = None,
        leases: tuple[CacheLease, ...] = (),
        retention: str | None = None,
        prompt_cache_key: str | None = None,
        retention_priority: RetentionPriority | None = None,
    ) -> Run:
        """Add every choice to the engine; on any refusal abort those already added. The whole
        request is admitted or refused at once (429 for a tenant over its share).
        ``shared_prefix``: declared by every prompt (a chat's one prompt); ``leases``: asked
        by every prompt (a Messages request's cache breakpoints); ``retention``: how its blocks
        are kept beyond RAM (EngineRequest); ``prompt_cache_key``: the group its per-key
        stats count in (cache_keys.py); ``retention_priority``: how the blocks it uses rank
        for eviction among the tenant's own."""
        total = len(prompts) * n
        self._check_sequences(total)
        run = Run(self, new_id(prefix), tenant, namespace, n)
        run.segments = segments is not None
        run.shared_prefix = shared_prefix
        run.prompt_cache_key = prompt_cache_key
        try:
            self.engine.check_admission(tenant.name, total)
            for p, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                for j in range(n):
                    index = p * n + j
                    choice = Choice(index, p, f"{run.id}-{index}", ids)
                    # Choices of one prompt with a seed get seed, seed+1, ... (wrapping within
                    # 64 bits): equal seeds would make n copies of the same sample.
                    choice_sp = sp
                    if sp.seed is not None and j:
                        choice_sp = replace(sp, seed=_wrap_seed(sp.seed + j))
                    choice.stream = self.engine.add(EngineRequest(
                        choice.request_id, ids, choice_sp, namespace, priority, explain,
                        tenant=tenant.name, explain_across_namespaces=tenant.admin,
                        segments=segments, shared_prefix=shared_prefix, leases=leases,
                        retention=retention, retention_priority=retention_priority,
                    ))  # fmt: skip
                    run.choices.append(choice)
        except BaseException as e:
            run.close()
            err = from_engine_error(e)
            if err is None:
                raise
            raise err from None
        return run


    def _check_sequences(self, total: int) -> None:
        cfg = self.engine.config
        most = min(cfg.max_waiting_requests, cfg.tenant_waiting_limit)
        if total > most:
            raise APIError(
                400, f"this request asks for {total} sequences (prompts x n); at most {most} "
                "can ever wait at once", param="n", code="too_many_sequences",
            )  # fmt: skip


def _wrap_seed(seed: int) -> int:
    return (seed + 2**63) % 2**64 - 2**63


def replace_param(e: InvalidRequestError, param: str) -> InvalidRequestError:
    """The same error naming the API field the ids came from (prompt, messages)."""
    if e.param in (None, "prompt") and param != e.param:
        e.param = param
    return e


def authenticate(request) -> Tenant:
    """The caller of a generation or cache route; a non-admin tenant over its refusal limit is
    refused here, before its body is read, and its refusals are counted by the error handler
    (refusals.py)."""
    s: Serving = request.app.state.serving
    tenant = s.tenants.authenticate_request(request.headers)
    if not tenant.admin:
        s.refusals.check(tenant.name)
        request.state.refusal_tenant = tenant.name
    return tenant


async def accept(request, schema, charge: bool = False):
    """The start of every generation and cache route: authenticate the caller, parse the body
    as ``schema`` (bounded, strict), check the model name, and derive the cache namespace
    (never from the client alone). Returns (serving, tenant, body, scope): ``scope.namespace``
    is the request's own, ``scope.shared`` the namespace of what it declares shared.
    ``charge``: a call of the tenant's cache-call rate (cache_gate.py), taken before the body
    is read (429 over it)."""
    s: Serving = request.app.state.serving
    tenant = authenticate(request)
    if charge and not tenant.admin:
        s.cache_gate.take(tenant.name)
    req = await parse_body(request, schema, s.limits)
    s.check_model(req.model)
    return s, tenant, req, s.tenants.scope(tenant, req.cache_salt)
