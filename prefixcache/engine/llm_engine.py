"""LLMEngine: the step loop — schedule, run, sample, commit, connectors — and the request
lifecycle around it.

Every feature that reads or fills the KV cache beyond the prefix index (persistent tiers,
segment caching, KV events) is a KV connector (cache/connector.py), built by connectors/build.py; the
engine calls the protocol and never a concrete connector.

Not thread-safe by itself; ``AsyncEngine`` (async_engine.py) serialises access with a lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prefixcache import kernels
from prefixcache.api.engine import (
    RETENTIONS,
    EngineRequest,
    EngineStats,
    LookupResult,
    TenantStats,
)
from prefixcache.api.errors import (
    ContextLengthError,
    InvalidRequestError,
    PinQuotaError,
    SequenceFailedError,
)
from prefixcache.api.request import (
    CacheExplanation,
    RequestMetrics,
    RequestStatus,
    RetentionPriority,
    SamplingParams,
    SharedPrefix,
)
from prefixcache.cache.connector import IDLE_WAIT
from prefixcache.cache.manager import blocks_needed, new_kv_cache
from prefixcache.cache.window import WindowParts
from prefixcache.config import EngineConfig
from prefixcache.connectors.build import build_connectors
from prefixcache.engine import stats as engine_stats
from prefixcache.engine.leases import grant_leases
from prefixcache.engine.output import OutputProcessor
from prefixcache.engine.sampler import SampleFailure, make_generator, sample
from prefixcache.engine.scheduler import Scheduler, SchedulerOutput
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import plan_kv_layout
from prefixcache.model.loader import load_weights
from prefixcache.model.paths import DEFAULT_MODEL_NAME, NAMED_MODELS, resolve_model_path
from prefixcache.model.runner import ModelRunner, resolve_dtype, weight_format
from prefixcache.model.weights_cache import load_model
from prefixcache.sequence import ScheduledSeq, Sequence

log = logging.getLogger(__name__)


def _float_kernels(device: torch.device) -> str:
    """Whose float GEMMs compute the numbers: the host's best ISA, or the GPU model."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return (kernels.supported_isas() or ["generic"])[0]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        """``clock``: the time pins and cache leases expire by (seconds; tests inject one)."""
        self.config = config
        self.clock = clock
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        path = resolve_model_path(config.model)
        # Through the weights cache (model/weights_cache.py); passing the module-level
        # load_weights lets tests that patch it share one load per process.
        weights, self.tokenizer = load_model(path, config.weights_cache_dir, load_weights)
        self.model_config = weights.config
        # The name a client asks for: the default's, a named model's own name (as given to
        # --model), else the file or directory name.
        self.model_name = (
            DEFAULT_MODEL_NAME if config.model is None
            else str(config.model) if str(config.model) in NAMED_MODELS and not Path(str(config.model)).exists()
            else path.name
        )  # fmt: skip
        dtype = resolve_dtype(config.dtype, device)
        model_max = weights.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {model_max}"
            )
        self.max_model_len = config.max_model_len or model_max
        fmt = weight_format(config.quantization, device)
        self.runner = ModelRunner(weights, dtype, device, self.max_model_len, fmt, config.activations)
        kv_fmt = kv_format(config.kv_cache_dtype, dtype, self.runner.model.exact, config.block_size)
        layout = plan_kv_layout(weights.config, kv_fmt, config.block_size, config.kv_cache_memory, device,
                                config.max_num_seqs, config.max_num_batched_tokens)  # fmt: skip
        self.layout = layout
        # Sliding-window layers' K/V in window parts, held a window back (cache/window.py).
        window = None
        if layout.window_parts:
            window = WindowParts(layout.window_parts, weights.config.sliding_window, config.block_size)
        self.runner.allocate_kv(layout, None if window is None else window.table)
        self.weights_format = self.runner.model.describe()
        # The model fingerprint enters every cache key: weights, tokenizer, dtype, and the
        # quantization when it changed the file's numbers (the group kernels running the file's
        # own groups compute what the dense layers compute, so they share keys).
        numbers = config.quantization if self.runner.model.requantized else "file"
        # The KV format too: a block's stored K/V depend on it (int8 and float32 blocks never mix).
        # And the arithmetic: the exact integer path gives the same bits on every ISA path and
        # thread count (tested), so its blocks are exchangeable between hosts; float32 GEMMs
        # round differently per ISA (oneDNN picks kernels by host), so their blocks carry the
        # host's ISA and a tier never mixes them. On CUDA cuBLAS picks kernels per GPU model
        # (measured on an H200: float32 K/V differ by ~2e-5 between batch shapes), so those
        # blocks carry the GPU's name and compute capability: no CPU or other GPU reads them.
        arith = self.runner.model.arithmetic
        if arith == "float32":
            arith = f"float32:{_float_kernels(device)}"
        self.fingerprint = hashlib.sha256(
            f"{weights.weights_digest}|{self.tokenizer.fingerprint()}|{dtype}|{numbers}|"
            f"kv:{kv_fmt.name}|arith:{arith}".encode()
        ).hexdigest()
        self.kv = new_kv_cache(
            layout.num_blocks, config.block_size, self.fingerprint,
            max_pinned_blocks=int(layout.num_blocks * config.pin_budget_fraction),
            eviction_policy=config.eviction_policy, enable_caching=config.enable_prefix_caching,
            clock=clock, partial_reuse=config.partial_block_reuse, window=window,
        )  # fmt: skip
        # Segments, the persistent tiers, KV events: what the config asks for (connectors/build.py).
        self.connectors = build_connectors(config, self.fingerprint, self.kv, self.runner)
        self.scheduler = Scheduler(config, self.kv, wants=self.connectors.wants)
        if self.connectors.wants_events:
            self.kv.record_events()
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self._leases: dict[str, tuple] = {}  # request id -> its CacheLeases, until granted
        self._n_added = 0
        # The last explanation, with what it answered: (namespace, across, scope, prompt,
        # answer). The
        # choices of one API request (up to prompts x n) arrive one after another with the same
        # prompt and are explained once. Only a step or an invalidation changes the index, so
        # both forget it.
        self._explained: tuple | None = None
        self._step_tokens = 0  # tokens the step under way computed (its pace: step())
        self.generated = engine_stats.Generated()
        log.info(
            "KV cache: %s, %d bytes/token, %d blocks of %d tokens, capacity %d tokens (%.1f MiB)",
            kv_fmt.name, layout.bytes_per_token, layout.num_blocks, layout.block_size,
            layout.capacity_tokens, layout.capacity_bytes / 2**20,
        )  # fmt: skip
        if layout.window_parts:
            log.info(
                "KV cache: sliding-window layers' K/V in %d window parts of %d tokens (%d bytes/token), "
                "kept %d tokens back; blocks hold the other layers' (%d bytes/token)",
                layout.window_parts - 1, layout.block_size, layout.window_bytes_per_token,
                weights.config.sliding_window, layout.block_bytes_per_token,
            )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------------
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
        usable = self.kv.usable_blocks
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

    def add_request(self, *args, **fields) -> Sequence:
        """``add`` of ``EngineRequest(*args, **fields)`` (request_id, prompt, params, then its
        optional fields, api/engine.py)."""
        return self.add(EngineRequest(*args, **fields))

    def check_request(self, ids: list[int], request: EngineRequest) -> None:
        """Refuse what can never run (typed errors): the prompt and lengths, a shared prefix
        past the prompt, what a connector can never do (a segments request over its limits).
        Pure: no lock needed."""
        self.validate(ids, request.params)
        check_shared_prefix(request.shared_prefix, len(ids))
        if request.retention_priority is not None and not isinstance(
            request.retention_priority, RetentionPriority
        ):
            raise InvalidRequestError(
                "retention_priority must be a RetentionPriority", param="retention_priority"
            )
        if request.retention not in (None, *RETENTIONS):
            raise InvalidRequestError(
                f"retention must be one of {RETENTIONS}, got {request.retention!r}",
                param="prompt_cache_retention",
            )
        self.connectors.check(ids, request)

    def add(self, request: EngineRequest) -> Sequence:
        """A request enters: checked, keyed, explained if asked, queued, and shown to the
        connectors (a segments request is planned, a restore from the tiers may start). With
        ``segments.store_only`` (a warm) the request only computes and keeps its documents and
        ends with no output."""
        r = request
        if r.request_id in self.seqs:
            raise InvalidRequestError(f"request id {r.request_id!r} is already in use")
        text = r.prompt if isinstance(r.prompt, str) else None
        ids = self.tokenizer.encode(text, add_special_tokens=True) if text is not None else list(r.prompt)
        self.check_request(ids, r)
        scope = self.kv.scope(r.namespace, r.shared_prefix, len(ids))
        seq = Sequence(
            request=r,
            prompt_token_ids=ids,
            kv=self.kv.new_state(scope),
            metrics=RequestMetrics(time.time() if r.arrival_time is None else r.arrival_time),
        )
        seq.generator = make_generator(r.params, self.config.seed, self._n_added)
        if r.explain:
            last, key = self._explained, (r.namespace, r.explain_across_namespaces, scope)
            if last is None or last[:3] != key or last[3] != ids:
                info = self.explain(ids, r.namespace, r.explain_across_namespaces, r.shared_prefix)
                last = self._explained = (*key, ids, info)
            seq.cache.cache_info = last[4]
        self._n_added += 1
        self.seqs[r.request_id] = seq
        if r.leases:
            self._leases[r.request_id] = tuple(r.leases)
        self.scheduler.add(seq)
        self.connectors.on_arrival(seq, r)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request now and free its blocks (its computed full blocks stay cached)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        if seq.finished:
            self._retire(seq)
        else:
            self._finish(seq, "abort")
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One batch: schedule, run, sample, commit; the connectors around it. Returns the
        sequences that got a new token (or finished)."""
        t0 = time.perf_counter()
        self._explained = None
        self.kv.expire(self.clock())
        try:
            for seq in self.connectors.before_step():  # finished restores are installed
                if seq.request.explain:  # explained at arrival, before the restore: what now
                    seq.cache.cache_info = self.kv.explain_in(
                        seq.prompt_token_ids, self.kv.scope_of(seq), ()
                    )
            out = self.scheduler.schedule()
            # Partial blocks reused token-exactly at admission: their tokens' K/V are copied
            # before anything computes after them (cache/manager.py).
            self.kv.copy_partial_blocks(self.runner.copy_kv)
            if not out.scheduled:
                self.connectors.idle_wait(IDLE_WAIT)  # only connector work is left: briefly
                return []
            # The pace that sizes steps while tenants share (fairness.py 4.) counts the tokens
            # the step computed: the forward's, and what connectors spent of their grants.
            self._step_tokens, rows = out.num_batched_tokens, len(out.scheduled)
            batch = [s.seq.request_id for s in out.scheduled]
            try:
                return self._run(out)
            except Exception as e:  # the batch's own work failed: it concerns the batch alone
                raise BatchFailedError(batch, e) from e
            finally:
                self.scheduler.observe_step(self._step_tokens, time.perf_counter() - t0, rows)
        finally:
            self.connectors.on_events(self.kv.take_events())

    def _run(self, out: SchedulerOutput) -> list[Sequence]:
        """The scheduled batch: connectors' share of it, then run, sample, commit, postprocess.

        A failure after the forward belongs to one sequence: it is finished alone
        (finish_reason "error", seq.error set) and every other sequence of the step goes on
        unchanged. The forward itself is shared; if it raises, the caller fails the batch."""
        # A connector may spend the tokens granted to some sequences on pieces of its own
        # prefill plan (segments assembling their documents, over as many steps as it takes):
        # they run in this one forward in place of those sequences' chunks, and those it
        # finished (warms that kept their documents) end.
        ordinary, pieces, worked = self.connectors.prefill(out.scheduled)
        self._step_tokens = sum(s.num_new_tokens for s in ordinary) + worked
        self._mark_scheduled(ordinary)
        pieces = [s.piece() for s in ordinary] + pieces
        t0 = time.perf_counter()
        output = self.runner.execute(pieces) if pieces else None
        finished = self.connectors.after_forward(
            output, _prompt_tokens(ordinary) + worked, time.perf_counter() - t0
        )
        for seq in finished:
            self._finish(seq, "stop")
        if not ordinary:
            return finished
        sampling = [s for s in ordinary if s.samples]
        sampled = sample(output.logits, [s.seq.params for s in sampling], [s.seq.generator for s in sampling])
        failed = self._commit(ordinary)
        return finished + self._postprocess(ordinary, sampling, sampled, failed)

    @staticmethod
    def _mark_scheduled(scheduled: list[ScheduledSeq]) -> None:
        now = time.time()
        for s in scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now

    def _commit(self, scheduled: list[ScheduledSeq]) -> dict[int, BaseException]:
        """The step's tokens are computed: full blocks enter the index, connectors see them
        (write-through). Returns the failures, by id of the sequence."""
        failed: dict[int, BaseException] = {}
        for s in scheduled:
            self.kv.mark_computed(s.seq, s.seq.kv.num_computed_tokens + s.num_new_tokens)
            registered = s.seq.kv.num_registered_blocks
            try:
                self.kv.commit(s.seq)
                self.connectors.after_commit(s.seq, registered)
                if s.seq.kv.num_computed_tokens >= s.seq.num_prompt_tokens:
                    self._grant_leases(s.seq)
            except Exception as e:  # noqa: BLE001 - isolated to this sequence
                failed[id(s.seq)] = e
        return failed

    def _grant_leases(self, seq: Sequence) -> None:
        """Its prompt is computed and registered: pin what its leases ask (engine/leases.py)."""
        leases = self._leases.pop(seq.request_id, None)
        if leases:
            seq.cache.lease_grants = grant_leases(
                self.kv, seq, leases, now=self.clock(),
                max_ttl=self.config.max_pin_ttl_seconds, caching=self.kv.enable_caching,
            )  # fmt: skip

    def _postprocess(self, scheduled, sampling, sampled, failed) -> list[Sequence]:
        """Append each sampled token, finish what stopped, fail what failed alone."""
        updated: list[Sequence] = []
        now = time.time()
        for s, res in zip(sampling, sampled):
            seq = s.seq
            try:
                if id(seq) in failed:
                    raise failed.pop(id(seq))
                if isinstance(res, SampleFailure):
                    raise res.error
                self.generated.add(seq.tenant)
                stop = self.output.append(seq, res, now)
            except Exception as e:  # noqa: BLE001 - isolated to this sequence
                self._fail_sequence(seq, e)
                stop = None
            if stop is not None:
                self._finish(seq, stop.reason, stop.stop_reason, now)
            updated.append(seq)
        for s in scheduled:  # a commit failed on a chunk that samples nothing
            if id(s.seq) in failed:
                self._fail_sequence(s.seq, failed.pop(id(s.seq)))
                updated.append(s.seq)
        return updated

    def _retire(self, seq: Sequence) -> None:
        """The sequence leaves the engine (finished, aborted, failed): its blocks are freed and
        the connectors forget it."""
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        self._leases.pop(seq.request_id, None)
        self.connectors.on_finish(seq)

    def _finish(self, seq: Sequence, reason: str, stop_reason=None, now: float | None = None) -> None:
        """The one place a sequence becomes FINISHED: a stop condition, its length, an abort,
        an error, or a warm that kept its documents (no output)."""
        self._retire(seq)
        self.output.finish(seq, reason, stop_reason)
        seq.status = RequestStatus.FINISHED
        seq.metrics.finished_time = time.time() if now is None else now

    def _fail_sequence(self, seq: Sequence, err: BaseException) -> None:
        """Finish one sequence with an error and free its blocks; nobody else is touched."""
        log.error(
            "request %s failed in its step and was finished alone: %s: %s",
            seq.request_id, type(err).__name__, err, exc_info=err,
        )  # fmt: skip
        seq.error = SequenceFailedError(seq.request_id, err)
        self._finish(seq, "error")

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
        others = self.kv.namespaces() if across else ()
        return self.kv.explain(prompt_token_ids, namespace, others, shared_prefix)

    def block_hashes(
        self,
        prompt_token_ids: list[int],
        namespace: str | None = None,
        shared_prefix: SharedPrefix | None = None,
    ) -> list[bytes]:
        return self.kv.keys_for(prompt_token_ids, namespace, shared_prefix)

    def held(self, request: EngineRequest) -> dict[str, int]:
        """What each connector holds of this request now, under its name (a warm in segments
        mode reports ``held["segments"]``, the documents already stored, before it runs as a
        request: ``add`` with ``SegmentRequest.store_only``). Under the engine lock."""
        return self.connectors.held(list(request.prompt), request)

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
        (``kv.set_pin_quotas``; an owner without one: only the pool's budget). Returns the
        blocks pinned."""
        ttl = self.check_pin_ttl(ttl)
        scope = self.kv.scope(namespace, shared_prefix, len(prompt_token_ids))
        m = self.kv.match_prompt(prompt_token_ids, scope)
        try:
            self.kv.pin(m.block_ids, ttl, self.clock(), owner=owner)
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
        n, tickets = self.start_invalidate(namespace, all_namespaces)
        self.connectors.wait(tickets)
        return n

    def start_invalidate(self, namespace: str | None, all_namespaces: bool = False):
        """The RAM part now, the tiers' deletion queued: (RAM blocks dropped, tickets for
        ``connectors.wait``). The async engine waits for them outside its lock."""
        self._explained = None
        n = self.kv.invalidate(namespace, all_namespaces)
        tickets = self.connectors.start_invalidate(namespace, all_namespaces)
        self.connectors.on_events(self.kv.take_events())
        return n, tickets

    # ---- facts (stats.py) -----------------------------------------------------------------------
    def cache_stats(self) -> dict:
        """The offline API's view of ``stats()`` (the keys documented in docs/engine.md)."""
        return engine_stats.cache_stats(self.stats(), self.layout, self.connectors)

    def stats(self) -> EngineStats:
        return engine_stats.engine_stats(
            self.kv, self.scheduler, self.layout, self.generated, self.connectors
        )

    def tenant_stats(self, tenant: str | None, owns: Callable[[str | None], bool]) -> TenantStats:
        """``tenant``'s own numbers; ``owns(namespace)`` says which namespaces are its."""
        return engine_stats.tenant_stats(
            tenant, owns, self.kv, self.scheduler, self.generated, self.connectors
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.scheduler.running + self.scheduler.waiting)
        self.connectors.check_integrity()


class BatchFailedError(Exception):
    """A step failed running its batch (the forward pass is shared by it): ``request_ids`` are
    the sequences it concerns, those scheduled in that step; ``cause`` is the error. Sequences
    outside the batch (waiting, or not scheduled this step) are untouched by it."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the step's batch of {len(request_ids)} failed: {cause!r}")
        self.request_ids = tuple(request_ids)
        self.cause = cause


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
        max(0, min(s.num_new_tokens, s.seq.num_prompt_tokens - s.seq.kv.num_computed_tokens))
        for s in scheduled
    )
