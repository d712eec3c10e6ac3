"""KV cache events: what the prefix index stores and drops, published in vLLM's wire format
(ZMQ PUB + msgpack, with a replay socket) so external KV-aware routers (llm-d's precise prefix
scorer, NVIDIA Dynamo's KV router) can track which replica holds which block.

Torch-free: imports only ``prefixcache.cache.hashing`` (the hashing of roots) and the standard
library, ``zmq`` and ``msgpack``. Its KV connector is ``prefixcache.connectors.kv_events``.
"""

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
    "decode_batch",
    "encode_batch",
    "offset_endpoint",
]
