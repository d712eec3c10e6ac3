"""LLMEngine: the step loop — schedule, run, postprocess — and the request lifecycle around it.

Not thread-safe by itself; ``AsyncEngine`` (async_engine.py) serialises access with a lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from prefixcache import engine_stats, kernels
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import KVCacheManager, blocks_needed
from prefixcache.config import EngineConfig, parse_bytes
from prefixcache.engine_api import EngineStats, LookupResult, TenantStats
from prefixcache.engine_tiers import build_tiers
from prefixcache.errors import (
    ContextLengthError,
    InvalidRequestError,
    PinQuotaError,
    SequenceFailedError,
)
from prefixcache.events.publisher import attach_kv_events
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import plan_kv_layout
from prefixcache.model.loader import load_weights
from prefixcache.model.paths import DEFAULT_MODEL_NAME, resolve_model_path
from prefixcache.model.runner import ModelRunner, resolve_dtype, weight_format
from prefixcache.model.weights_cache import load_model
from prefixcache.output import OutputProcessor
from prefixcache.request import (
    CacheExplanation,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    SharedPrefix,
)
from prefixcache.sampler import SampleFailure, make_generator, sample
from prefixcache.scheduler import Scheduler, SchedulerOutput
from prefixcache.segments.assembler import SegmentAssembler
from prefixcache.segments.plan import SegmentRequest
from prefixcache.segments.store import SegmentStore
from prefixcache.sequence import Sequence

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        path = resolve_model_path(config.model)
        # Through the weights cache (model/weights_cache.py); passing the module-level
        # load_weights lets tests that patch it share one load per process.
        weights, self.tokenizer = load_model(path, config.weights_cache_dir, load_weights)
        self.model_config = weights.config
        self.model_name = DEFAULT_MODEL_NAME if config.model is None else path.name
        dtype = resolve_dtype(config.dtype, device)
        model_max = weights.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {model_max}"
            )
        self.max_model_len = config.max_model_len or model_max
        kv_fmt = kv_format(config.kv_cache_dtype, dtype)
        layout = plan_kv_layout(weights.config, kv_fmt, config.block_size, config.kv_cache_memory, device)
        self.layout = layout
        fmt = weight_format(config.quantization, device)
        self.runner = ModelRunner(
            weights, dtype, device, self.max_model_len, layout, fmt, config.activations
        )
        self.weights_format = self.runner.model.describe()
        # The model fingerprint enters every cache key: weights, tokenizer, dtype, and the
        # quantization when it changed the file's numbers (the group kernels running the file's
        # own groups compute what the dense layers compute, so they share keys).
        numbers = config.quantization if self.runner.model.requantized else "file"
        # The KV format too: a block's stored K/V depend on it (int8 and float32 blocks never mix).
        # And the arithmetic: the exact integer path gives the same bits on every ISA path and
        # thread count (tested), so its blocks are exchangeable between hosts; float32 GEMMs
        # round differently per ISA (oneDNN picks kernels by host), so their blocks carry the
        # host's ISA and a tier never mixes them.
        arith = self.runner.model.arithmetic
        if arith == "float32":
            arith = f"float32:{(kernels.supported_isas() or ['generic'])[0]}"
        self.fingerprint = hashlib.sha256(
            f"{weights.weights_digest}|{self.tokenizer.fingerprint()}|{dtype}|{numbers}|"
            f"kv:{kv_fmt.name}|arith:{arith}".encode()
        ).hexdigest()
        pool = BlockPool(
            layout.num_blocks,
            config.block_size,
            max_pinned_blocks=int(layout.num_blocks * config.pin_budget_fraction),
        )
        self.kv = KVCacheManager(pool, self.fingerprint, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        # Segment caching, for requests that ask for it (segments/); idle otherwise.
        segment_store = SegmentStore(parse_bytes(config.segment_cache_memory))
        # Disk and Redis behind the pool and the segment store (engine_tiers.py); NoTiers when
        # none is configured.
        self.tiers = build_tiers(
            config, self.fingerprint, weights.config, self.kv, self.runner.kv, segment_store
        )
        self.kv_events = attach_kv_events(config, self.kv)  # None unless configured
        self.segments = SegmentAssembler(
            self.runner, self.kv, segment_store, self.fingerprint,
            config.max_num_batched_tokens, on_computed=self.tiers.offload_segment,
            max_segments=config.max_segments_per_request,
            max_record_bytes=parse_bytes(config.max_segment_record),
        )  # fmt: skip
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self._n_added = 0
        # The last explanation, with what it answered: (namespace, across, scope, prompt,
        # answer). The
        # choices of one API request (up to prompts x n) arrive one after another with the same
        # prompt and are explained once. Only a step or an invalidation changes the index, so
        # both forget it.
        self._explained: tuple | None = None
        self.generation_tokens_total = 0
        self._generated_by_tenant: Counter = Counter()
        log.info(
            "KV cache: %s, %d bytes/token, %d blocks of %d tokens, capacity %d tokens (%.1f MiB)",
            kv_fmt.name, layout.bytes_per_token, layout.num_blocks, layout.block_size,
            layout.capacity_tokens, layout.capacity_bytes / 2**20,
        )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what can never run (typed errors, ``param`` = "prompt" or "max_tokens")."""
        self.validate_prompt(prompt_token_ids)
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {n + params.max_tokens} ({n} in the prompt, "
                f"{params.max_tokens} to generate)",
                param="max_tokens" if n < self.max_model_len else "prompt",
            )
        usable = self.pool.num_blocks - self.pool.max_pinned_blocks
        need = blocks_needed(n + params.max_tokens, self.config.block_size)
        if need > usable:
            raise ContextLengthError(
                f"request needs {need} KV blocks ({n + params.max_tokens} tokens) but the cache "
                f"holds {usable} unpinnable blocks; raise kv_cache_memory",
                param="max_tokens",
            )

    def validate_prompt(self, prompt_token_ids: list[int], max_len: int | None = None) -> None:
        """A prompt of token ids: not empty, at most ``max_len`` (the context) long, every id an
        int in the vocabulary. Checked before anything hashes or looks up the ids."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: at least one token is needed", param="prompt")
        limit = self.max_model_len if max_len is None else max_len
        if n > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {n}",
                param="prompt",
            )
        vocab = self.model_config.vocab_size
        bad = next(
            (t for t in prompt_token_ids if type(t) is not int or not (0 <= t < vocab)), None
        )
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        namespace: str | None = None,
        priority: int = 0,
        explain: bool = False,
        arrival_time: float | None = None,
        tenant: str | None = None,
        explain_across_namespaces: bool = False,
        segments: SegmentRequest | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> Sequence:
        """``explain_across_namespaces`` (admins only): a miss may be explained by blocks of
        other namespaces. Without it the explanation looks at this namespace alone, so what it
        says and what it costs never depend on other tenants' prompts. ``segments``: reuse
        these document spans through the segment store (cache_mode="segments"); with
        ``segments.store_only`` (a warm) the request only computes and keeps them and ends
        with no output. ``shared_prefix``: the leading tokens that are cached in a shared
        namespace (whole blocks of them); everything else of the request, its output included,
        is keyed in ``namespace`` only."""
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
        self.validate(ids, params)
        check_shared_prefix(shared_prefix, len(ids))
        scope = self.kv.scope(namespace, shared_prefix, len(ids))
        plan = None
        if segments is not None and segments.spans:
            plan = self.segments.plan(ids, segments, namespace)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            root=self.kv.first_root(scope),
            namespace=namespace,
            shared_namespace=scope.shared_namespace,
            num_shared_blocks=scope.shared_blocks,
            tenant=tenant,
            priority=priority,
            prompt=text,
            explain=explain,
            metrics=RequestMetrics(time.time() if arrival_time is None else arrival_time),
        )
        seq.generator = make_generator(params, self.config.seed, self._n_added)
        if plan is not None:
            seq.segments = plan
            seq.max_registered_blocks = self.segments.register_limit(plan)
        if explain:
            last, key = self._explained, (namespace, explain_across_namespaces, scope)
            if last is None or last[:3] != key or last[3] != ids:
                info = self.explain(ids, namespace, explain_across_namespaces, shared_prefix)
                last = self._explained = (*key, ids, info)
            seq.cache_info = last[4]
        self._n_added += 1
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.tiers.on_add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request now and free its blocks (its computed full blocks stay cached)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        self.tiers.forget(seq)
        if not seq.finished:
            seq.finish_reason = "abort"
            seq.status = RequestStatus.FINISHED
            seq.metrics.finished_time = time.time()
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One batch: schedule, run, postprocess. Returns the sequences that got a new token."""
        t0 = time.perf_counter()
        self._explained = None
        self.pool.expire_pins()
        self.tiers.install_completed()
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.tiers.idle_wait()  # only restores are left: wait for one, briefly
            return []
        tokens = out.num_batched_tokens
        try:
            return self._run(out)
        finally:  # the pace that sizes steps while tenants share (fairness.py 4.)
            self.scheduler.observe_step(tokens, time.perf_counter() - t0)

    def _run(self, out: SchedulerOutput) -> list[Sequence]:
        """The scheduled batch: segments' share of it, the forward, sampling, commit."""
        # Segments requests reaching their documents spend their tokens of the step on their
        # assembly (in pieces, over as many steps as it takes) and leave this batch; warms that
        # kept their last document are finished.
        out.scheduled[:], stored = self.segments.prepare(out.scheduled)
        for seq in stored:
            self._finish_stored(seq)
        if not out.scheduled:
            return stored
        now = time.time()
        for s in out.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        # A failure from here on belongs to one sequence: it is finished alone (finish_reason
        # "error", seq.error set) and every other sequence of the step goes on unchanged. The
        # forward pass itself is shared; if it raises, the caller fails the whole batch.
        t0 = time.perf_counter()
        logits = self.runner.execute(out.scheduled)
        self.tiers.observe_step(_prompt_tokens(out.scheduled), time.perf_counter() - t0)
        sampling = [s for s in out.scheduled if s.samples]
        sampled = sample(logits, [s.seq.params for s in sampling], [s.seq.generator for s in sampling])
        failed: dict[int, BaseException] = {}
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            registered = s.seq.num_registered_blocks
            try:
                self.kv.commit(s.seq)
                self.tiers.offload(s.seq, registered)  # write-through to disk / Redis
            except Exception as e:  # noqa: BLE001 - isolated to this sequence
                failed[id(s.seq)] = e
        updated: list[Sequence] = list(stored)
        now = time.time()
        for s, res in zip(sampling, sampled):
            seq = s.seq
            try:
                if id(seq) in failed:
                    raise failed.pop(id(seq))
                if isinstance(res, SampleFailure):
                    raise res.error
                self.generation_tokens_total += 1
                self._generated_by_tenant[seq.tenant] += 1
                done = self.output.append(seq, res, now)
            except Exception as e:  # noqa: BLE001 - isolated to this sequence
                self._fail_sequence(seq, e)
                done = False
            if done:
                self.scheduler.remove(seq)
                self.seqs.pop(seq.request_id, None)
            updated.append(seq)
        for s in out.scheduled:  # a commit failed on a chunk that samples nothing
            if id(s.seq) in failed:
                self._fail_sequence(s.seq, failed.pop(id(s.seq)))
                updated.append(s.seq)
        return updated

    def _finish_stored(self, seq: Sequence) -> None:
        """A store-only segments request (a warm) kept its documents: it ends, no output."""
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        seq.finish_reason = "stop"
        seq.status = RequestStatus.FINISHED
        seq.metrics.finished_time = time.time()

    def _fail_sequence(self, seq: Sequence, err: BaseException) -> None:
        """Finish one sequence with an error and free its blocks; nobody else is touched."""
        log.error(
            "request %s failed in its step and was finished alone: %s: %s",
            seq.request_id, type(err).__name__, err, exc_info=err,
        )  # fmt: skip
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        seq.error = SequenceFailedError(seq.request_id, err)
        seq.finish_reason = "error"
        seq.status = RequestStatus.FINISHED
        seq.metrics.finished_time = time.time()

    # ---- cache control ----------------------------------------------------------------------------
    def lookup(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> LookupResult:
        check_shared_prefix(shared_prefix, len(prompt_token_ids))
        hit = self.kv.lookup(prompt_token_ids, namespace, shared_prefix)
        return LookupResult(len(prompt_token_ids), hit)

    def explain(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        across: bool = False,
        shared_prefix: SharedPrefix | None = None,
    ) -> CacheExplanation:
        """Why this prompt would (not) hit. ``across`` (admin): other namespaces may explain
        a miss; they are the namespaces holding cached blocks now, a set bounded by the pool."""
        check_shared_prefix(shared_prefix, len(prompt_token_ids))
        others = self.pool.index.namespaces() if across else ()
        return self.kv.explain(prompt_token_ids, namespace, others, shared_prefix)

    def block_hashes(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> list[bytes]:
        return self.kv.keys_for(prompt_token_ids, namespace, shared_prefix)

    def num_stored_segments(self, token_ids: list[int], spans, namespace: str | None) -> int:
        """How many of these spans of ``token_ids`` the segment store holds now. A warm in
        segments mode is a request (``add_request`` with ``SegmentRequest.store_only``)."""
        return self.segments.num_stored(token_ids, spans, namespace)

    def pin_prefix(
        self,
        prompt_token_ids: list[int],
        namespace: str | None,
        ttl: float | None,
        owner: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> int:
        """Pin the cached full blocks of a prompt (after it was prefilled) for ``ttl`` seconds
        (None: the longest, ``max_pin_ttl_seconds``), charged to ``owner``'s quota
        (``pool.set_pin_quotas``; an owner without one: only the pool's budget). Returns the
        blocks pinned."""
        ttl = self.check_pin_ttl(ttl)
        scope = self.kv.scope(namespace, shared_prefix, len(prompt_token_ids))
        m = self.kv.match_prompt(prompt_token_ids, scope)
        try:
            self.pool.pin(m.block_ids, ttl, owner=owner)
        except ValueError as e:
            raise PinQuotaError(str(e), param="pin") from None
        return len(m.block_ids)

    def check_pin_ttl(self, ttl: float | None) -> float:
        """The TTL a pin gets: ``ttl``, or the maximum when None; above the maximum is refused."""
        longest = self.config.max_pin_ttl_seconds
        if ttl is None:
            return longest
        if not (0 < ttl <= longest):
            raise InvalidRequestError(
                f"ttl_seconds must be in (0, {longest:g}], got {ttl!r}", param="ttl_seconds"
            )
        return ttl

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> int:
        """Drop a namespace (or all) from the RAM pool and every tier. Returns the RAM blocks
        dropped; a tier that cannot be reached: TierUnavailableError, after the rest is done."""
        n, ticket = self.start_invalidate(namespace, all_namespaces)
        self.tiers.wait(ticket)
        return n

    def start_invalidate(self, namespace: str | None, all_namespaces: bool = False):
        """The RAM part now, the tiers' deletion queued: (RAM blocks dropped, ticket for
        ``tiers.wait``). The async engine waits for the ticket outside its lock."""
        self._explained = None
        n = self.pool.invalidate(namespace, all_namespaces)
        self.segments.store.invalidate(namespace, all_namespaces)
        return n, self.tiers.start_invalidate(namespace, all_namespaces)

    # ---- facts (engine_stats.py) ------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """The offline API's view of ``stats()`` (the keys documented in docs/engine.md)."""
        return engine_stats.cache_stats(self)

    def stats(self) -> EngineStats:
        return engine_stats.engine_stats(self)

    def tenant_stats(self, tenant: str | None, owns: Callable[[str | None], bool]) -> TenantStats:
        """``tenant``'s own numbers; ``owns(namespace)`` says which namespaces are its."""
        return engine_stats.tenant_stats(self, tenant, owns)

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.scheduler.live_block_tables())
        self.tiers.check_integrity()
        self.segments.store.check_integrity()


def check_shared_prefix(shared: SharedPrefix | None, num_prompt_tokens: int) -> None:
    """A shared prefix lies within the prompt: generated output is never shared."""
    if shared is not None and shared.num_tokens > num_prompt_tokens:
        raise InvalidRequestError(
            f"the shared prefix ({shared.num_tokens} tokens) is longer than the prompt "
            f"({num_prompt_tokens} tokens)",
            param="shared_prefix",
        )


def _prompt_tokens(scheduled) -> int:
    return sum(
        max(0, min(s.num_new_tokens, s.seq.num_prompt_tokens - s.seq.num_computed_tokens))
        for s in scheduled
    )


def __getattr__(name: str):
    # AsyncEngine lives in async_engine.py (threading); importable from here as well.
    if name == "AsyncEngine":
        from prefixcache import async_engine

        return async_engine.AsyncEngine
    if name in ("EngineShutDownError", "QueueFullError"):  # their home is prefixcache.errors
        from prefixcache import errors

        return getattr(errors, name)
    if name == "WarmResult":
        from prefixcache import engine_api

        return engine_api.WarmResult
    raise AttributeError(name)
