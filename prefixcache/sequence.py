"""Sequence: the engine's mutable state of one request (tokens, block table, progress).

Plain data, no torch, core fields only: a feature's state lives with its connector
(cache/connector.py), keyed by request id. The scheduler and the KV cache manager change it;
the model runner only reads the token ids, positions and block table it is handed (as
``ScheduledSeq``, which lives here and not in the scheduler so that ``model/`` does not import
the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.api.keys import BlockHash
from prefixcache.api.request import (
    CacheExplanation,
    RequestMetrics,
    RequestStatus,
    RetentionPriority,
    SamplingParams,
)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root: BlockHash  # parent of block 0: key format, block size, model fingerprint, namespace
    namespace: str | None = None  # the request's own namespace
    # A declared shared prefix (request.SharedPrefix) of whole blocks: blocks
    # 0..num_shared_blocks-1 are keyed in shared_namespace (``root`` is then its root), every
    # later block in ``namespace``, block num_shared_blocks with parent ``join``
    # (hashing.join_hash of the last shared key; set by the KV cache manager when hashed).
    shared_namespace: str | None = None
    num_shared_blocks: int = 0
    join: BlockHash | None = None
    # Who sent it: fair admission and quotas count per tenant (None: the offline API's one user).
    tenant: str | None = None
    priority: int = 0  # orders a tenant's own waiting sequences; never jumps other tenants
    prompt: str | None = None
    explain: bool = False
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    arrival_step: int = 0  # engine step at arrival; the lpm starvation guard counts from it
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockHash] = field(default_factory=list)  # keys of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_table findable in the index
    # With window parts (cache/window.py): the sequence holds the parts of
    # block_table[window_from:]. Written by the KV cache manager alone.
    window_from: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the blocks of block_table
    num_cached_tokens: int | None = None  # tokens served from cache at first admission
    num_preemptions: int = 0
    # Only the first max_registered_blocks full blocks may enter the prefix index (None: all):
    # set at arrival by the segments connector (blocks from the first document on may hold
    # reused segment KV, which a cold run would not compute) and lowered by the KV cache
    # manager at a key collision (the rest of the chain stays private).
    max_registered_blocks: int | None = None
    # A connector fills the slots of the first ``reserve_until`` tokens in one go (segments: an
    # assembly places every document at once): while fewer are computed, the scheduler allocates
    # them all whenever it schedules the sequence, preempting as for any allocation, so the
    # connector never finds itself without room mid-assembly. Set at arrival (0: none).
    reserve_until: int = 0
    # What the request is told it got, each written by one connector: tokens restored per
    # tier ("disk", "redis"; the tiers), segment tokens reused and not recomputed (segments).
    tier_tokens: dict[str, int] | None = None
    num_segment_cached_tokens: int | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cache_info: CacheExplanation | None = None
    # How its own blocks are ranked for eviction among its tenant's (api.request.RetentionPriority;
    # None: as they are), applied by the KV cache manager when it hits or registers them.
    retention_priority: RetentionPriority | None = None
    # What its cache leases got (EngineRequest.leases), written by the engine once the prompt is
    # computed (engine/leases.py); a tuple of api.request.LeaseGrant.
    lease_grants: tuple | None = None
    # Set when the sequence failed alone inside a step (finish_reason "error"); a bug of ours.
    error: BaseException | None = None
    # Text bookkeeping for stop strings and streaming (owned by the output processor).
    text: str = ""
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0
    detok: object | None = None
    generator: object | None = None  # torch.Generator for sampling; set by the engine

    def namespace_of_block(self, i: int) -> str | None:
        """The namespace block ``i`` is keyed and registered in."""
        return self.shared_namespace if i < self.num_shared_blocks else self.namespace

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Still computing prompt (or, after preemption, recomputing) tokens before sampling."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def loading(self) -> bool:
        """A connector is loading KV for it (RequestStatus.LOADING): not admitted meanwhile."""
        return self.status is RequestStatus.LOADING

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: its next ``num_new_tokens`` tokens are computed."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens
