"""KV events as a KV connector (cache/connector.py): the prefix index's recorded changes
(cache/kv_events.py), taken after each step and invalidation, go to the publisher.

A block's parent is shown as events show it (``KVCacheManager.event_parent``): None (nil) for a
namespace's root, the previous block of the chain for the first block after a shared prefix
(whose key input holds the join, cache/manager.py).
"""

from __future__ import annotations

from prefixcache.cache.connector import KVConnector
from prefixcache.cache.kv_events import BlockStored, KVEvent
from prefixcache.events.access import load_server_secret
from prefixcache.events.publisher import KVEventPublisher


class KVEventsConnector(KVConnector):
    name = "kv_events"
    wants_events = True

    def __init__(self, publisher: KVEventPublisher, event_parent):
        self.publisher = publisher
        self.event_parent = event_parent

    def on_events(self, events: list[KVEvent]) -> None:
        pub, parent_of = self.publisher, self.event_parent
        for ev in events:
            if isinstance(ev, BlockStored):
                pub.stored(ev.key, parent_of(ev.parent, ev.namespace), ev.token_ids)
            else:
                pub.removed(ev.key)

    def flush(self, timeout: float = 30.0) -> bool:
        """Subscribers see the last removals too (shutdown, tests)."""
        self.publisher.flush(min(timeout, 2.0))
        return True

    def close(self) -> None:
        self.publisher.close()


def build_kv_events(config, kv) -> KVEventsConnector | None:
    """The connector when ``config.kv_events_endpoint`` is set (else None), for ``kv`` (a
    KVCacheManager). Raises ValueError when the socket cannot bind."""
    if config.kv_events_endpoint is None:
        return None
    secret = None
    if config.kv_events_curve_secret_file is not None:
        secret = load_server_secret(config.kv_events_curve_secret_file)[1]
    publisher = KVEventPublisher(
        config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic=config.kv_events_topic,
        block_size=config.block_size,
        rank=config.kv_events_rank,
        token_ids=config.kv_events_token_ids,
        curve_secret=secret,
        allow_remote=config.kv_events_allow_remote,
    )
    return KVEventsConnector(publisher, kv.event_parent)
