"""Sequence: the engine's mutable state of one request, in parts that each have one writer.

Plain data, no torch, core fields only: a feature's state lives with its connector
(cache/connector.py), keyed by request id. Who writes what (tests/structure/test_layering.py checks
the parts' writers on the source):

- ``request``: the ``EngineRequest`` as it came in (frozen; request id, params, namespace,
  tenant, priority, ...), held and never copied; ``prompt_token_ids``, its tokens (never
  written after ``LLMEngine.add``).
- ``kv``: ``SeqKV``, the KV cache manager's state of the sequence (cache/manager.py alone: a
  connector that limits what is registered or reserved asks the manager, ``restrict``).
- ``out``: ``SeqOutput``, the output processor's bookkeeping (engine/output.py alone: the
  engine calls ``OutputProcessor.append`` and ``finish``).
- the cache facts the request is told, one writer each (listed at the fields).
- ``status`` (the scheduler's queue states, the connectors' WAITING <-> LOADING, the engine's
  FINISHED), ``metrics`` (timestamps, each set once where it happens), and the scheduler's and
  engine's own few fields.

The model runner only reads the token ids, positions and block table it is handed (as
``ScheduledSeq``, which lives here and not in the scheduler so that ``model/`` does not import
the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from prefixcache.api.engine import EngineRequest
from prefixcache.api.keys import BlockHash
from prefixcache.api.request import (
    CacheReport,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
)


@dataclass(eq=False)
class SeqKV:
    """The KV cache manager's state of one sequence: written by cache/manager.py only."""

    root: BlockHash  # parent of block 0: key format, block size, model fingerprint, namespace
    # A declared shared prefix (request.SharedPrefix) of whole blocks: blocks
    # 0..num_shared_blocks-1 are keyed in shared_namespace (``root`` is then its root), every
    # later block in the request's namespace, block num_shared_blocks with parent ``join``
    # (hashing.join_hash of the last shared key; set by the KV cache manager when hashed).
    shared_namespace: str | None = None
    num_shared_blocks: int = 0
    join: BlockHash | None = None
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockHash] = field(default_factory=list)  # keys of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_table findable in the index
    # With window parts (cache/window.py): the sequence holds the parts of
    # block_table[window_from:].
    window_from: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the blocks of block_table
    # Only the first max_registered_blocks full blocks may enter the prefix index (None: all):
    # set at arrival for the segments connector (blocks from the first document on may hold
    # reused segment KV, which a cold run would not compute; ``KVCacheManager.restrict``) and
    # lowered by the manager at a key collision (the rest of the chain stays private).
    max_registered_blocks: int | None = None
    # A connector fills the slots of the first ``reserve_until`` tokens in one go (segments: an
    # assembly places every document at once): while fewer are computed, the scheduler allocates
    # them all whenever it schedules the sequence, preempting as for any allocation, so the
    # connector never finds itself without room mid-assembly. Set at arrival (0: none).
    reserve_until: int = 0
    # Temporary pool blocks a connector computes into while it fills the reserved slots
    # (segments: documents computed alone, each at its own positions, before they are placed):
    # the manager holds ``scratch_tokens`` tokens' worth in ``scratch`` from the sequence's
    # first allocation until ``release_scratch`` (``scratch_done``), allocating them with the
    # sequence's own slots, all or nothing, so they are paid for like any slot. A preemption
    # frees them and re-arms the need (the connector's work starts over). Set at arrival.
    scratch_tokens: int = 0
    scratch: list[int] = field(default_factory=list)
    scratch_done: bool = False


@dataclass(eq=False)
class SeqOutput:
    """What the sequence generated and how far it streamed: written by engine/output.py only."""

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Text bookkeeping for stop strings and streaming.
    text: str = ""
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0
    detok: object | None = None


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    prompt_token_ids: list[int]
    kv: SeqKV
    out: SeqOutput = field(default_factory=SeqOutput)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # Written by the scheduler (its queue states), cache/connector.py (WAITING <-> LOADING)
    # and engine/llm_engine.py (FINISHED).
    status: RequestStatus = RequestStatus.WAITING
    arrival_step: int = 0  # the scheduler's: engine step at arrival (the lpm starvation guard)
    num_preemptions: int = 0  # the scheduler's
    # What the request is told it got (api.request.CacheReport), each field written by one
    # module: num_cached_tokens (cache/manager.py, at first admission), tier_tokens
    # (connectors/tiers.py), num_segment_cached_tokens (segments/assembler.py), cache_info and
    # lease_grants (engine/llm_engine.py). Snapshots of it go out unchanged (engine/output.py).
    cache: CacheReport = field(default_factory=CacheReport)
    # Set when the sequence failed alone inside a step (finish_reason "error"); a bug of ours.
    error: BaseException | None = None  # engine/llm_engine.py
    generator: object | None = None  # torch.Generator for sampling; engine/llm_engine.py

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        root: BlockHash,
        *,
        shared_namespace: str | None = None,
        num_shared_blocks: int = 0,
        **request_fields,
    ) -> Sequence:
        """A sequence of an ``EngineRequest(request_id, prompt_token_ids, params,
        **request_fields)`` keyed from ``root`` (tests and simulations; the engine builds its
        own from the request it is given)."""
        request = EngineRequest(request_id, prompt_token_ids, params, **request_fields)
        kv = SeqKV(root, shared_namespace=shared_namespace, num_shared_blocks=num_shared_blocks)
        return cls(request, prompt_token_ids, kv)

    # ---- the request's own (read-only) ----------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def namespace(self) -> str | None:
        """The request's own namespace (its blocks past a declared shared prefix)."""
        return self.request.namespace

    @property
    def tenant(self) -> str | None:
        """Who sent it: fair admission and quotas count per tenant (None: the offline API's one
        user)."""
        return self.request.tenant

    @property
    def priority(self) -> int:
        """Orders a tenant's own waiting sequences; never jumps other tenants."""
        return self.request.priority

    @property
    def prompt(self) -> str | None:
        """The prompt text, when it came as text."""
        p = self.request.prompt
        return p if isinstance(p, str) else None

    # ---- derived --------------------------------------------------------------------------------
    def namespace_of_block(self, i: int) -> str | None:
        """The namespace block ``i`` is keyed and registered in."""
        return self.kv.shared_namespace if i < self.kv.num_shared_blocks else self.namespace

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.out.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.out.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Still computing prompt (or, after preemption, recomputing) tokens before sampling."""
        return self.kv.num_computed_tokens < self.num_tokens - 1

    @property
    def num_cached_tokens(self) -> int | None:
        """``cache.num_cached_tokens``: prompt tokens served from cache at first admission."""
        return self.cache.num_cached_tokens

    @property
    def loading(self) -> bool:
        """A connector is loading KV for it (RequestStatus.LOADING): not admitted meanwhile."""
        return self.status is RequestStatus.LOADING

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class Piece:
    """A run of the step's one forward: tokens ``token_ids[start:start + n]`` at positions
    start.., computed into the blocks of ``block_table`` with attention over every slot before
    ``start``. ``samples``: its last token's logits are wanted. ``probe``: it runs through layer
    0 and stores layer 1's K/V only, measuring how far they are from what that layer held
    (segments' recompute selection, segments/blend.py; ``ModelRunner.execute``). Pieces may
    share a block table: every layer stores all the forward's new K/V before any of them
    attends (model/attention.py), so a piece sees an earlier piece of the same forward as if
    it had been computed in a forward before it."""

    token_ids: Seq[int]
    block_table: list[int]
    start: int
    n: int
    samples: bool = False
    probe: bool = False


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: its next ``num_new_tokens`` tokens are computed."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.kv.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    def piece(self) -> Piece:
        """The forward's run for this chunk."""
        seq = self.seq
        return Piece(seq.all_token_ids, seq.kv.block_table, seq.kv.num_computed_tokens,
                     self.num_new_tokens, self.samples)  # fmt: skip
