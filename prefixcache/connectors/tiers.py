"""The persistent tiers (prefixcache/tiers) as a KV connector (cache/connector.py): restore
on arrival, write-through of new blocks, and installing restored blocks into the RAM pool.

Flow of a restore:
1. ``on_arrival`` (engine thread, when a request arrives): the request's full blocks beyond what
   RAM holds are handed to the reader thread, and the request is marked ``restoring``; the
   scheduler leaves it in the queue while everything else runs.
2. At the start of each step ``before_step`` takes the finished restores: the blocks
   found are copied into fresh pool blocks and registered in the prefix index exactly like
   computed ones (then released: cached, evictable); the request stops restoring and its
   admission in the same step hits on them like on any cached block.
   The reader serves tenants in turn and each has a bounded queue (manager.py): a restore
   over its tenant's bound is not queued, and the request computes those blocks instead.
3. A restore that found nothing, was invalidated meanwhile, or whose request was aborted,
   installs nothing. The step never waits on it while other work exists; when nothing else
   can run, the step waits at most ``connector.IDLE_WAIT`` seconds for a restore to finish.

Retention (``EngineRequest.retention``, OpenAI's ``prompt_cache_retention``): the blocks a
request registers are written through unless it asked for "in_memory" (RAM only: nothing of it
reaches a tier), and with "24h" they are written to expire there after 24 hours (Redis TTLs,
a sweep of the disk tier: tiers/disk.py, tiers/redis_tier.py). A block's retention is that of
the request that registered it first; a later request reusing it changes nothing. So a request's
retention applies to its own blocks only: the blocks of a declared shared prefix (every tenant
of the salt's) are written with the deployment's default, whoever computed them first (issue
#37: the first tenant's "in_memory" or "24h" decided it for everyone).

Segments (cache_mode "segments") ride the same TierManager as records of their own kind
(segments/record.py); the segments connector (connectors/segments.py) restores and writes them.
Without tiers there is no tier connector (and ``build_storage`` returns None).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter, OrderedDict
from pathlib import Path

from prefixcache.api.engine import RETENTION_SECONDS
from prefixcache.api.errors import TierUnavailableError
from prefixcache.cache.connector import KVConnector
from prefixcache.cache.hashing import block_chunks
from prefixcache.cache.manager import KVCacheManager
from prefixcache.cache.shares import owner_of
from prefixcache.config import EngineConfig, parse_bytes
from prefixcache.kv.pool import KVCache
from prefixcache.model.config import ModelConfig
from prefixcache.sequence import Sequence
from prefixcache.tiers.jobs import RestoreJob, take_mine
from prefixcache.tiers.keys import StoreLayout
from prefixcache.tiers.manager import TierManager
from prefixcache.tiers.records import BLOCKS, BlockRef
from prefixcache.tiers.secret import load_keys

log = logging.getLogger(__name__)

MIN_PREFILL_SAMPLE = 256  # prompt tokens a step needs to count as a prefill-speed sample
_RECENT_KEYS = 65536  # keys known to be in the tiers already (written or restored): not rewritten


def resolve_disk_dir(setting: str | Path) -> Path:
    """``auto``: ``kv/`` under the user cache directory (as the weights cache resolves it)."""
    if str(setting) != "auto":
        return Path(setting).expanduser()
    if os.environ.get("PREFIXCACHE_CACHE_DIR"):
        base = Path(os.environ["PREFIXCACHE_CACHE_DIR"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "prefixcache"
    else:
        base = Path.home() / ".cache" / "prefixcache"
    return base / "kv"


def _requester(seq: Sequence) -> str | None:
    """Whose turn at the tiers' reader a restore for ``seq`` takes (manager.py): the owner of
    its own namespace (its tenant), also when the chain's shared part is read."""
    return owner_of(seq.namespace)


class TierConnector(KVConnector):
    name = "tiers"

    def __init__(self, manager: TierManager, kv: KVCacheManager, cache: KVCache):
        self.manager = manager
        self.kv = kv
        self.cache = cache
        self.block_size = kv.block_size
        self._jobs: dict[str, tuple[Sequence, RestoreJob, int]] = {}  # rid -> (seq, job, first)
        self._known: OrderedDict[bytes, str | None] = OrderedDict()  # key -> its namespace
        self._by_tenant: dict[str | None, Counter] = {}
        self._retention: dict[str, str] = {}  # request id -> its retention, when one was asked
        # Queued writes are flushed and the I/O threads stopped when the engine goes away or
        # the interpreter exits (the offline LLM has no shutdown call): a restart finds them.
        weakref.finalize(self, manager.close)

    # ---- restore ---------------------------------------------------------------------------------
    def on_arrival(self, seq: Sequence, request) -> None:
        seq.cache.tier_tokens = {}
        if request.retention is not None:
            self._retention[seq.request_id] = request.retention
        self._restore_blocks(seq)

    def pending(self, seq: Sequence) -> bool:
        return seq.request_id in self._jobs

    def _restore_blocks(self, seq: Sequence, after_shared: bool = False) -> None:
        """Hand the reader the next run of ``seq``'s full blocks beyond what RAM holds, all of
        one namespace: a restore job reads one namespace, so a chain that crosses from a shared
        prefix into the owner's part is restored in two jobs, the owner's part
        (``after_shared``) once the shared part is installed."""
        m = self.kv.match(seq)  # hashes the usable full blocks into seq.kv.block_keys
        first, n_full = len(m.block_ids), (seq.num_tokens - 1) // self.block_size
        n_full = min(n_full, self.kv.usable_blocks)
        if seq.kv.max_registered_blocks is not None:  # segments: later blocks are never stored
            n_full = min(n_full, seq.kv.max_registered_blocks)
        k = seq.kv.num_shared_blocks
        if after_shared and first != k:
            return  # the shared part is not (or no longer) all in RAM: the chain stops there
        end = min(k, n_full) if first < k else n_full
        namespace = seq.namespace_of_block(first)
        if first >= end or not self.manager.may_have(namespace, seq.kv.block_keys[first]):
            return
        b = self.block_size
        chunks = block_chunks(seq.all_token_ids, b, start_block=first, num_tokens=end * b)
        refs = [
            BlockRef(seq.kv.block_keys[i], self.kv.parent_of(seq, i) + chunk)
            for i, chunk in enumerate(chunks, start=first)
        ]
        job = self.manager.submit_restore(seq.request_id, namespace, refs, _requester(seq))
        if job is None:
            return  # the tenant's restore queue is full: the request computes these blocks
        self._jobs[seq.request_id] = (seq, job, first)

    def on_finish(self, seq: Sequence) -> None:
        """The request left (finished, aborted): its restore installs nothing."""
        self._retention.pop(seq.request_id, None)
        entry = self._jobs.pop(seq.request_id, None)
        if entry is not None and entry[0] is seq:
            self.manager.cancel(entry[1])

    def before_step(self) -> list[Sequence]:
        if not self._jobs:
            return []
        changed = []
        for entry, job in take_mine(self.manager.take_completed(BLOCKS), self._jobs):
            seq = entry[0]
            changed.append(seq)
            if not job.found or not self.manager.is_current(job):
                continue
            self._install(seq, job, entry[2])
            shared_run = entry[2] + len(job.refs) == seq.kv.num_shared_blocks
            if shared_run and len(job.found) == len(job.refs):
                self._restore_blocks(seq, after_shared=True)
        return changed

    def _install(self, seq: Sequence, job: RestoreJob, first: int) -> None:
        """The restored blocks into the RAM cache (the cache manager installs them, as if
        computed), then what they count: tier tokens, the tenant's, the tier's."""
        b = self.block_size
        found = [(ref.key, ref.key_input, payload) for ref, payload, _ in job.found]
        got: Counter = Counter()
        for i, fresh in self.kv.install(seq, first, found, self.cache.write_block):
            ref, _, where = job.found[i - first]
            self._remember(ref.key, seq.namespace_of_block(i))
            if fresh:
                got[where] += b
        for where, n in got.items():  # a chain crossing a shared prefix comes in two jobs
            seq.cache.tier_tokens[where] = seq.cache.tier_tokens.get(where, 0) + n
        self._by_tenant.setdefault(seq.tenant, Counter()).update(got)
        self.manager.count_served({k: v // b for k, v in got.items()})

    def after_forward(self, output, prefill_tokens: int, seconds: float) -> tuple[()]:
        """A step's prompt tokens and forward time: steps mostly of prefill teach the tiers
        what recomputing costs (a tier slower than that is skipped)."""
        if prefill_tokens >= MIN_PREFILL_SAMPLE:
            self.manager.observe_prefill(prefill_tokens, seconds)
        return ()

    def has_pending(self) -> bool:
        return bool(self._jobs)

    def idle_wait(self, timeout: float) -> None:
        self.manager.wait_completed(timeout)

    # ---- write-through ---------------------------------------------------------------------------
    def after_commit(self, seq: Sequence, first_block: int) -> None:
        """Queue the blocks ``seq`` registered since ``first_block`` for every tier (none of its
        own with retention "in_memory"; to expire after 24 hours with "24h"; a shared prefix's
        with the default, whatever it asked)."""
        b = self.block_size
        n = seq.kv.num_registered_blocks
        retention = self._retention.get(seq.request_id)
        shared = seq.kv.num_shared_blocks  # blocks below this: a shared prefix, default retention
        if n <= first_block or (retention == "in_memory" and first_block >= shared):
            return
        ttl = RETENTION_SECONDS.get(retention)
        chunks = block_chunks(seq.all_token_ids, b, start_block=first_block, num_tokens=n * b)
        out: dict[tuple, list] = {}  # (namespace, ttl) -> its blocks (a shared run, the owner's)
        for i, chunk in enumerate(chunks, start=first_block):
            key = seq.kv.block_keys[i]
            if key in self._known or (i >= shared and retention == "in_memory"):
                continue
            namespace = seq.namespace_of_block(i)
            ref = BlockRef(key, self.kv.parent_of(seq, i) + chunk)
            block = seq.kv.block_table[i]
            part = self.kv.part_of(block)
            if self.cache.windowed and part is None:
                continue  # (its window layers' K/V are gone: a tier holds whole blocks only)
            group = out.setdefault((namespace, None if i < shared else ttl), [])
            group.append((ref, self.cache.read_block(block, part)))
            self._remember(key, namespace)
        for (namespace, block_ttl), blocks in out.items():
            self.manager.offload(namespace, blocks, ttl=block_ttl)

    def _remember(self, key: bytes, namespace: str | None) -> None:
        self._known[key] = namespace
        self._known.move_to_end(key)
        if len(self._known) > _RECENT_KEYS:
            self._known.popitem(last=False)

    # ---- control and facts -----------------------------------------------------------------------
    def start_invalidate(self, namespace: str | None, all_namespaces: bool):
        """Engine thread (under the engine lock, with the RAM pool's invalidation): from now on
        nothing of the namespace is written or installed. Returns a ticket to ``wait``."""
        # A dropped block must be written again when it is recomputed; other namespaces'
        # blocks stay known (one tenant's invalidations must not make every tenant rewrite).
        if all_namespaces:
            self._known.clear()
        else:
            for key in [k for k, ns in self._known.items() if ns == namespace]:
                del self._known[key]
        return self.manager.start_invalidate(namespace, all_namespaces)

    def wait(self, ticket) -> dict[str, int]:
        """Any thread: wait for the tiers to delete it (TierUnavailableError if one cannot)."""
        try:
            return self.manager.wait_invalidate(ticket)
        except ConnectionError as e:
            raise TierUnavailableError(f"the namespace was dropped from RAM, but {e}") from None

    def stats(self) -> list:
        return self.manager.stats()

    def tenant_stats(self, tenant: str | None) -> dict:
        """The tenant's tokens served from each tier, and its own share of the tiers (the owner
        of its namespaces is its name)."""
        return {"hit_tokens": dict(self._by_tenant.get(tenant, {})),
                "usage": self.manager.owner_stats(tenant)}  # fmt: skip

    def flush(self, timeout: float = 30.0) -> bool:
        return self.manager.flush(timeout)

    def check_integrity(self) -> None:
        for seq, job, _ in self._jobs.values():
            assert seq.loading and seq.request_id == job.request_id, "restore bookkeeping"
        self.manager.check_integrity()

    def close(self) -> None:
        self.manager.close()


def build_storage(config: EngineConfig, fingerprint: str, model: ModelConfig,
                  cache: KVCache) -> TierManager | None:  # fmt: skip
    """The tiers the config asks for, behind one TierManager (None when none, or caching is
    off); the tier and segments connectors share it."""
    if not config.enable_prefix_caching or not (config.disk_cache_dir or config.remote_cache):
        return None
    lay = cache.layout
    layout = StoreLayout(
        model_fingerprint=fingerprint, block_size=lay.block_size, num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, kv_dtype=lay.kv_format.name,
        scaled=lay.kv_format.scaled, block_bytes=lay.block_size * lay.bytes_per_token,
    )  # fmt: skip
    tiers = []
    root = resolve_disk_dir(config.disk_cache_dir or "auto")
    if config.disk_cache_dir:
        from prefixcache.tiers.disk import DiskTier

        tiers.append(DiskTier(root, parse_bytes(config.disk_cache_size)))
    # The secret's default home is the disk tier's directory (or, for Redis alone, the one
    # "auto" would use): a restart finds it, and with it its own records.
    keys = load_keys(config.tier_secret_file, root)
    if config.remote_cache:
        from prefixcache.tiers.redis_tier import AUTO, RedisTier

        cap = parse_bytes(config.remote_cache_max_record)
        size = str(config.remote_cache_size).lower()
        size = AUTO if size == AUTO else None if size == "none" else parse_bytes(size)
        tiers.append(RedisTier(config.remote_cache, max_value_bytes=cap, capacity_bytes=size,
                               scope=keys.deployment_id))  # fmt: skip
    log.info("KV tiers: %s (deployment %s: replicas sharing a Redis must show the same)",
             ", ".join(t.name for t in tiers), keys.deployment_id)  # fmt: skip
    return TierManager(tiers, layout, keys, config.tier_compression)
