"""LLM: the offline API, shaped like vLLM's (``LLM(...).generate(prompts, SamplingParams(...))``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path

from prefixcache.api.request import RequestOutput, RetentionPriority, SamplingParams, SharedPrefix
from prefixcache.api.segments import (
    CACHE_MODES,
    DEFAULT_RECOMPUTE_TOKENS,
    SegmentOptions,
    SegmentRequest,
)
from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine

Prompt = str | list[int]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    def __init__(self, model: str | Path | None = None, **kwargs):
        """``kwargs`` are EngineConfig fields: enable_prefix_caching, block_size,
        kv_cache_memory ("2GiB" or bytes), dtype, device, max_model_len, seed, max_num_seqs,
        max_num_batched_tokens, scheduling_policy, ..."""
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str | None = None,
        priority: Seq[int] | None = None,
        segments: Seq[SegmentRequest | None] | None = None,
        shared_prefixes: Seq[SharedPrefix | None] | None = None,
        retention_priority: RetentionPriority | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts as one batch through the scheduler; outputs in input order.
        ``segments`` (one per prompt, as ``chat(cache_mode="segments")`` builds them): document
        spans to reuse through the segment store. ``shared_prefixes`` (one per prompt): the
        leading tokens cached in a shared namespace, the rest in ``cache_salt``'s.
        ``retention_priority``: how the blocks these requests use rank for eviction
        (``RetentionPriority(priority 0-100, seconds)``; docs/engine.md)."""
        plist = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(plist)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(plist):
            raise ValueError(f"{len(params)} sampling params for {len(plist)} prompts")
        seqs = []
        try:
            for i, (p, sp) in enumerate(zip(plist, params)):
                rid = f"offline-{next(self._ids)}"
                prio = 0 if priority is None else priority[i]
                seg = None if segments is None else segments[i]
                shared = None if shared_prefixes is None else shared_prefixes[i]
                seqs.append(self.engine.add_request(
                    rid, p, sp, namespace=cache_salt, priority=prio, segments=seg,
                    shared_prefix=shared, retention_priority=retention_priority))  # fmt: skip
        except BaseException:
            for s in seqs:  # nothing half-added stays behind
                self.engine.abort(s.request_id)
            raise
        pending = {s.request_id for s in seqs}
        try:
            while pending:
                for s in self.engine.step():
                    if s.error is not None:  # it failed alone (a bug of ours); say so
                        raise s.error
                    if s.finished:
                        pending.discard(s.request_id)
        except BaseException:
            for rid in pending:
                self.engine.abort(rid)
            raise
        return [self.engine.output.request_output(s) for s in seqs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        add_generation_prompt: bool = True,
        cache_mode: str = "prefix",
        segment_recompute_tokens: int = DEFAULT_RECOMPUTE_TOKENS,
        segment_recompute_ratio: float = 0.0,
        segment_selection: str = "first",
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the model's template.

        ``cache_mode="segments"``: each ``document`` message is a segment whose KV is reused
        wherever it appears, with its first ``segment_recompute_tokens`` tokens (or the
        ``segment_recompute_ratio`` share, whichever is more) recomputed in context;
        ``segment_selection`` says which tokens: "first" (the default), "deviation" (those
        whose KV deviates most from what the context gives, CacheBlend-style) or "both".
        Approximate by nature; see docs/segments.md."""
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if cache_mode == "prefix":
            ids = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt) for c in convs]
            return self.generate(ids, sampling_params, cache_salt=cache_salt)
        opts = SegmentOptions(segment_recompute_tokens, segment_recompute_ratio, segment_selection)
        prompts = [tok.encode_chat_segments(c, add_generation_prompt) for c in convs]
        return self.generate(
            [p.token_ids for p in prompts], sampling_params, cache_salt=cache_salt,
            segments=[SegmentRequest(p.spans, opts) for p in prompts],
        )  # fmt: skip

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()
