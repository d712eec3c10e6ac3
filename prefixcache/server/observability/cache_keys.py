"""Per-``prompt_cache_key`` statistics of each tenant (OpenAI's field; docs/server.md).

A ``prompt_cache_key`` groups a tenant's requests that share a prompt prefix (one user, one
conversation, one agent): a cluster routes them together (cluster/route_keys.py) and here their
hits are counted together, so a tenant sees which of its groups the cache serves well. The key
never changes what a request may hit: the cache namespace is still the tenant's (and its
``cache_salt``), so a key chosen to equal another tenant's reaches nothing of theirs.

Bounded and private: a tenant's own figures only (keys are client-chosen strings: nobody else
sees them, admins included), at most ``MAX_KEYS_PER_TENANT`` keys per tenant (the least
recently used goes first), tenants named by authentication (the keys file), never by a request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_KEYS_PER_TENANT = 256


class PromptCacheKeyStats:
    def __init__(self, max_keys: int = MAX_KEYS_PER_TENANT) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[str, list[int]]] = {}

    def record(self, tenant: str, key: str, prompt_tokens: int, cached_tokens: int) -> None:
        """One prompt of a request sent with ``key``."""
        with self._lock:
            keys = self._by_tenant.setdefault(tenant, OrderedDict())
            row = keys.get(key)
            if row is None:
                row = keys[key] = [0, 0, 0]
                if len(keys) > self.max_keys:
                    keys.popitem(last=False)
            keys.move_to_end(key)
            row[0] += 1
            row[1] += prompt_tokens
            row[2] += cached_tokens

    def of(self, tenant: str) -> dict[str, dict]:
        """``tenant``'s keys, most recently used last: requests, prompt and cached tokens."""
        with self._lock:
            keys = self._by_tenant.get(tenant, {})
            return {
                k: {"requests": r, "prompt_tokens": p, "cached_tokens": c,
                    "hit_rate": c / p if p else 0.0}
                for k, (r, p, c) in keys.items()
            }  # fmt: skip
