"""KV cache events: what the prefix index stores and drops, published in vLLM's wire format
(ZMQ PUB + msgpack, with a replay socket) so external KV-aware routers (llm-d's precise prefix
scorer, NVIDIA Dynamo's KV router) can track which replica holds which block.

Torch-free: imports only ``prefixcache.cache`` (the hashing of roots, the connector protocol and
its event records), ``prefixcache.sequence`` and the standard library, ``zmq`` and ``msgpack``.
"""

from prefixcache.events.connector import KVEventsConnector, build_kv_events
from prefixcache.events.publisher import KVEventPublisher, offset_endpoint
from prefixcache.events.subscriber import BlockSetSubscriber
from prefixcache.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockSetSubscriber",
    "BlockStored",
    "EventBatch",
    "KVEventPublisher",
    "KVEventsConnector",
    "build_kv_events",
    "decode_batch",
    "encode_batch",
    "offset_endpoint",
]
