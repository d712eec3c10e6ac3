"""LLMEngine: the step loop — schedule, run, postprocess — and the request lifecycle around it.

Not thread-safe by itself; ``AsyncEngine`` (async_engine.py) serialises access with a lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import KVCacheManager, blocks_needed
from prefixcache.config import EngineConfig
from prefixcache.kv.pool import plan_kv_layout
from prefixcache.model.loader import load_weights
from prefixcache.model.paths import DEFAULT_MODEL_NAME, resolve_model_path
from prefixcache.model.runner import ModelRunner, resolve_dtype, weight_format
from prefixcache.model.weights_cache import load_model
from prefixcache.output import OutputProcessor
from prefixcache.request import CacheExplanation, RequestMetrics, RequestStatus, SamplingParams
from prefixcache.sampler import make_generator, sample
from prefixcache.scheduler import Scheduler
from prefixcache.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupResult:
    num_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    evicted_blocks_total: int
    kv_cache_usage: float  # blocks held by live requests / total (idle cached blocks are free)


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
        layout = plan_kv_layout(weights.config, dtype, config.block_size, config.kv_cache_memory, device)
        self.layout = layout
        fmt = weight_format(config.quantization, device)
        self.runner = ModelRunner(weights, dtype, device, self.max_model_len, layout, fmt)
        self.weights_format = self.runner.model.describe()
        # The model fingerprint enters every cache key: weights, tokenizer, dtype, and the
        # quantization when it changed the file's numbers (the group kernels running the file's
        # own groups compute what the dense layers compute, so they share keys).
        numbers = config.quantization if self.runner.model.requantized else "file"
        self.fingerprint = hashlib.sha256(
            f"{weights.weights_digest}|{self.tokenizer.fingerprint()}|{dtype}|{numbers}".encode()
        ).hexdigest()
        pool = BlockPool(
            layout.num_blocks,
            config.block_size,
            max_pinned_blocks=int(layout.num_blocks * config.pin_budget_fraction),
        )
        self.kv = KVCacheManager(pool, self.fingerprint, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.seqs: dict[str, Sequence] = {}
        self._namespaces: set[str | None] = set()
        self._n_added = 0
        self.generation_tokens_total = 0
        log.info(
            "KV cache: %d bytes/token, %d blocks of %d tokens, capacity %d tokens (%.1f MiB), %s",
            layout.bytes_per_token, layout.num_blocks, layout.block_size, layout.capacity_tokens,
            layout.capacity_bytes / 2**20, dtype,
        )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {n + params.max_tokens} ({n} in the prompt, "
                f"{params.max_tokens} to generate)"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        usable = self.pool.num_blocks - self.pool.max_pinned_blocks
        need = blocks_needed(n + params.max_tokens, self.config.block_size)
        if need > usable:
            raise ValueError(
                f"request needs {need} KV blocks ({n + params.max_tokens} tokens) but the cache "
                f"holds {usable} unpinnable blocks; raise kv_cache_memory"
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
    ) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if text is not None else list(prompt)
        self.validate(ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            root=self.kv.root(namespace),
            namespace=namespace,
            priority=priority,
            prompt=text,
            explain=explain,
            metrics=RequestMetrics(time.time() if arrival_time is None else arrival_time),
        )
        seq.generator = make_generator(params, self.config.seed, self._n_added)
        if explain:
            seq.cache_info = self.explain(ids, namespace)
        self._n_added += 1
        self._namespaces.add(namespace)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request now and free its blocks (its computed full blocks stay cached)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
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
        self.pool.expire_pins()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        now = time.time()
        for s in out.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        logits = self.runner.execute(out.scheduled)
        sampling = [s for s in out.scheduled if s.samples]
        sampled = sample(logits, [s.seq.params for s in sampling], [s.seq.generator for s in sampling])
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.commit(s.seq)
        updated: list[Sequence] = []
        now = time.time()
        for s, tok in zip(sampling, sampled):
            seq = s.seq
            self.generation_tokens_total += 1
            if self.output.append(seq, tok, now):
                self.scheduler.remove(seq)
                self.seqs.pop(seq.request_id, None)
            updated.append(seq)
        return updated

    # ---- cache control ----------------------------------------------------------------------------
    def lookup(self, prompt_token_ids: list[int], namespace: str | None = None) -> LookupResult:
        return LookupResult(len(prompt_token_ids), self.kv.lookup(prompt_token_ids, namespace))

    def explain(self, prompt_token_ids: list[int], namespace: str | None = None) -> CacheExplanation:
        return self.kv.explain(prompt_token_ids, namespace, sorted(self._namespaces, key=str))

    def block_hashes(self, prompt_token_ids: list[int], namespace: str | None = None) -> list[bytes]:
        return self.kv.keys_for(prompt_token_ids, namespace)

    def pin_prefix(self, prompt_token_ids: list[int], namespace: str | None, ttl: float | None) -> int:
        """Pin the cached full blocks of a prompt (after it was prefilled). Returns pinned blocks."""
        keys = self.kv.keys_for(prompt_token_ids, namespace)
        m = self.pool.match(keys, prompt_token_ids, self.kv.root(namespace))
        self.pool.pin(m.block_ids, ttl)
        return len(m.block_ids)

    def invalidate(self, namespace: str | None, all_namespaces: bool = False) -> int:
        return self.pool.invalidate(namespace, all_namespaces)

    def cache_stats(self) -> dict:
        c = self.pool.counts()
        bpt = self.layout.bytes_per_token
        q, h = self.kv.query_tokens, self.kv.hit_tokens
        return {
            "query_tokens": q,
            "hit_tokens": h,
            "hit_rate": h / q if q else 0.0,
            "cached_blocks": c.cached,
            "free_blocks": c.free,
            "in_use_blocks": c.in_use,
            "pinned_blocks": c.pinned,
            "total_blocks": c.total,
            "block_size": self.config.block_size,
            "used_bytes": (c.cached + c.in_use) * self.config.block_size * bpt,
            "capacity_bytes": self.layout.capacity_bytes,
            "evicted_blocks": self.pool.evicted_blocks,
            "enable_prefix_caching": self.kv.enable_caching,
        }

    def stats(self) -> EngineStats:
        c = self.pool.counts()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.counters.num_preemptions,
            prompt_tokens_total=self.kv.query_tokens,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=self.kv.query_tokens,
            prefix_cache_hits_total=self.kv.hit_tokens,
            evicted_blocks_total=self.pool.evicted_blocks,
            kv_cache_usage=c.in_use / c.total,
        )

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.scheduler.live_block_tables())


def __getattr__(name: str):
    # AsyncEngine lives in async_engine.py (threading); importable from here as well.
    if name in ("AsyncEngine", "EngineShutDownError", "QueueFullError", "WarmResult"):
        from prefixcache import async_engine

        return getattr(async_engine, name)
    raise AttributeError(name)
