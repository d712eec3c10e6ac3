"""Which KV connectors (cache/connector.py) an engine has, from its config: the one module
that knows the concrete connectors; the engine knows only the protocol.

Order matters at arrival: segments plan a request (and bound the blocks it may register)
before the tiers look up its blocks.
"""

from __future__ import annotations

from prefixcache.cache.connector import ConnectorSet
from prefixcache.cache.manager import KVCacheManager
from prefixcache.config import EngineConfig, parse_bytes
from prefixcache.connectors.kv_events import build_kv_events
from prefixcache.connectors.segments import SegmentConnector
from prefixcache.connectors.tiers import TierConnector, build_storage
from prefixcache.model.runner import ModelRunner
from prefixcache.segments.assembler import SegmentAssembler
from prefixcache.segments.store import SegmentStore


def build_connectors(
    config: EngineConfig, fingerprint: str, kv: KVCacheManager, runner: ModelRunner
) -> ConnectorSet:
    # Disk and Redis behind the pool and the segment store, when configured.
    storage = build_storage(config, fingerprint, runner.config, runner.kv)
    assembler = SegmentAssembler(
        runner, kv, SegmentStore(parse_bytes(config.segment_cache_memory)), fingerprint,
        config.max_num_batched_tokens, max_segments=config.max_segments_per_request,
        max_record_bytes=parse_bytes(config.max_segment_record),
    )  # fmt: skip
    connectors = [SegmentConnector(assembler, storage)]
    if storage is not None:
        connectors.append(TierConnector(storage, kv, runner.kv))
    events = build_kv_events(config, kv)  # None unless configured
    if events is not None:
        connectors.append(events)
    return ConnectorSet(connectors)
