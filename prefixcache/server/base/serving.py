"""What every API's routes share: from an authenticated, parsed request to engine requests.

:class:`Serving` holds the server's state (the engine, the tenants, the limits, the metrics,
the log, the cache-call gate, the remembered prompts) and the checks every API makes the same
way; ``start`` adds a request's choices to the engine as one :class:`~.run.Run`. It knows no
API's bodies or rendering: the OpenAI routes render prompts with openai/prompt.py, the
Anthropic ones with the renderer their package registers here (``renderer``), so this base
imports neither (tests/structure/test_server_layout.py).

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
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from prefixcache.api.engine import EngineAPI, EngineRequest
from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.request import CacheLease, RetentionPriority, SamplingParams, SharedPrefix
from prefixcache.api.segments import SegmentRequest
from prefixcache.server.base.auth import Tenant, TenantDirectory
from prefixcache.server.base.cache_gate import CacheCallGate
from prefixcache.server.base.comparison import Comparison, PromptRecord, ResponseStore, compare
from prefixcache.server.base.protocol import parse_body
from prefixcache.server.base.run import Choice, Run
from prefixcache.server.edge.errors import APIError, from_engine_error
from prefixcache.server.edge.limits import ServerLimits
from prefixcache.server.edge.refusals import RefusalLimiter
from prefixcache.server.observability.activity import Activity
from prefixcache.server.observability.cache_keys import PromptCacheKeyStats
from prefixcache.server.observability.metrics import ServerMetrics
from prefixcache.server.observability.snapshot import Snapshot, SnapshotReader

R = TypeVar("R")
PRIORITY_BOUND = 2**31 - 1


def new_id(prefix: str) -> str:
    """``chatcmpl-<hex>``; a prefix ending in ``_`` is Anthropic's style: ``msg_<hex>``."""
    return f"{prefix}{'' if prefix.endswith('_') else '-'}{uuid.uuid4().hex}"


def as_api_error(e: InvalidRequestError) -> APIError:
    err = from_engine_error(e)
    assert err is not None
    return err


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
        renderers: Iterable[Callable[[object], object]] = (),
    ) -> None:
        """``renderers``: each API's prompt renderer, built from the tokenizer (the API's
        package passes its class: base/app.py ``Surface.renderer``)."""
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
        self._renderers = {type(r): r for r in (make(self.tokenizer) for make in renderers)}
        self.activity = Activity(lambda ids: self.tokenizer.decode(ids), engine.config.block_size)
        # /metrics: rendered by one reader at a time off the default executor
        # (observability/snapshot.py).
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

    def renderer(self, kind: type[R]) -> R:
        """The renderer of class ``kind`` an API registered (one per server, built at startup)."""
        return self._renderers[kind]

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

    def check_text_fits(self, num_chars: int, param: str) -> None:
        limit = self.engine.max_model_len
        if num_chars > limit and num_chars > limit * self.max_token_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; a text of {num_chars} "
                f"characters cannot fit (no token is longer than {self.max_token_chars}).",
                param=param, code="context_length_exceeded",
            )  # fmt: skip

    def prompt_ids(self, ids: list[int], param: str) -> list[int]:
        """``ids`` checked against the vocabulary and the context (400 naming ``param``)."""
        try:
            self.engine.validate_prompt(ids)
        except InvalidRequestError as e:
            raise as_api_error(replace_param(e, param)) from None
        return ids

    def text_ids(self, text: str, param: str) -> list[int]:
        """A text prompt's ids, BOS included when the model wants one (as the offline API)."""
        self.check_text_fits(len(text), param)
        return self.prompt_ids(self.tokenizer.encode(text, add_special_tokens=True), param)

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
        stats count in (observability/cache_keys.py); ``retention_priority``: how the blocks
        it uses rank for eviction among the tenant's own."""
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
    (edge/refusals.py)."""
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
