"""Cache leases: a prefix of a request's prompt kept from eviction for a while (no torch).

A lease (``api.request.CacheLease``; the server makes one of each cache breakpoint) is granted
once the request's prompt is computed, right after the step that registered its last blocks:
the whole blocks of its prefix are pinned in the pool with its TTL, owned by the request's
tenant. So a lease is a pin, the one mechanism, with everything pins promise:

- it is charged to the tenant's pin quota; the quotas of the server's tenants sum within the
  pin budget, so a tenant leasing up to its quota (and renewing forever) never takes another's
  room, and a lease never evicts anything: it only keeps blocks that are already cached;
- a later request with the same prefix renews it: the deadline moves on, no quota is spent
  again (Anthropic refreshes a cache entry on every read the same way);
- its TTL is at most the server's longest pin: a longer one is *clipped* to it; a lease that
  cannot be held is *rejected* with the reason, and the request runs on unchanged (its blocks
  stay cached as any request's, evictable).

A lease also *ranks* its blocks at the top retention priority (100) for its TTL, whatever the
pin got: retention priorities order only the tenant's own blocks for eviction (which of its
blocks go, never whose; cache/eviction.py), so they need no quota, and a lease refused over
the quota still keeps its prefix ahead of the tenant's other blocks. Blocks of a shared prefix
are not the tenant's to rank and keep theirs.

Deadlines are on the engine's clock (``LLMEngine.clock``), which tests inject.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.api.request import (
    LEASE_ACCEPTED,
    LEASE_CLIPPED,
    LEASE_REJECTED,
    MAX_RETENTION_PRIORITY,
    CacheLease,
    LeaseGrant,
)
from prefixcache.cache.manager import KVCacheManager
from prefixcache.sequence import Sequence


def grant_leases(
    kv: KVCacheManager,
    seq: Sequence,
    leases: Iterable[CacheLease],
    *,
    now: float,
    max_ttl: float,
    caching: bool,
) -> tuple[LeaseGrant, ...]:
    """Pin each lease's whole blocks of ``seq``'s prompt (computed and registered: the step
    committed them) for its TTL, owned by ``seq.tenant``, and rank them at the top priority
    for that TTL among the tenant's own blocks."""
    b = kv.block_size
    out = []
    for lease in leases:
        n = min(lease.num_tokens, seq.num_prompt_tokens) // b
        blocks = seq.kv.block_table[: min(n, seq.kv.num_registered_blocks)]
        if not caching:
            out.append(_rejected("caching_disabled"))
            continue
        if n == 0:
            out.append(_rejected("shorter_than_a_block"))
            continue
        if not blocks:
            out.append(_rejected("not_cached"))
            continue
        ttl = min(lease.ttl_seconds, max_ttl)
        kv.rank(seq, blocks, MAX_RETENTION_PRIORITY, ttl, now)
        try:
            kv.pin(blocks, ttl, now, owner=seq.tenant)
        except ValueError:  # over the quota or the budget; a failed pin pins nothing
            out.append(_rejected(_why_refused(kv, seq.tenant, len(blocks))))
            continue
        status = LEASE_CLIPPED if ttl < lease.ttl_seconds else LEASE_ACCEPTED
        out.append(LeaseGrant(len(blocks) * b, status, ttl))
    return tuple(out)


def _rejected(reason: str) -> LeaseGrant:
    return LeaseGrant(0, LEASE_REJECTED, 0.0, reason)


def _why_refused(kv: KVCacheManager, owner: str | None, num_blocks: int) -> str:
    """The tenant's own quota, told from its own figures (its pins and quota), else the
    budget. Never the pool's message: that names how much every tenant has pinned."""
    quota = kv.pin_quota(owner)
    if quota is not None and kv.pinned_by(owner) + num_blocks > quota:
        return "pin_quota_exceeded"
    return "pin_budget_exceeded"
