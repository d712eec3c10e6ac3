"""A tenant whose requests keep being refused is refused early for a while.

A refused request is not free: its body is read and parsed and its text tokenized before the
length check can say 400 (a chat of 64 documents of ~300 tokens is ~128 KiB of JSON and ~20k
tokens to count). Sent back to back, such requests keep the CPU and the interpreter's lock
busy and every tenant's steps slow down with them: measured on 2 cores, two clients of one
tenant sending over-long segments chats raised another tenant's time to first token 14x while
every one of their requests was a 400 (docs/benchmarks.md "Tenant isolation"). Decisions:

- **Count refusals, not requests.** A tenant may have ``max_refusals_per_second`` answers of
  400, 404, 413, 422 or 429 in any second; past that, for ``refusal_penalty`` seconds, its
  generation and cache requests are a 429 ``too_many_refusals`` (``Retry-After``) before their
  body is read. A 404 (a model that is not served) and a 429 (over its share of the queue or
  its cache-call rate) come after the body was read and parsed too (issue #37: a wrong model
  name made every parse free), so they count; the early 429 of this limiter itself does not.
  An honest client's requests are accepted, or it waits out a 429's ``Retry-After`` (at most
  a few a second), so it never meets this.
- **Per tenant, non-admins only.** The count is the tenant's own: another tenant's refusals
  never refuse you. Admins (the operator, and every caller of an open server, where there are
  no tenants to protect from each other) are not counted.
- **Bounded and clock-injected.** At most one deque of timestamps per tenant of the keys file
  (names come from authentication, never from the request), each at most the limit long.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from prefixcache.server.errors import APIError

REFUSED = frozenset({400, 404, 413, 422, 429})


class RefusalLimiter:
    def __init__(
        self, per_second: int, penalty: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_second = per_second
        self.penalty = penalty
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = {}
        self._until: dict[str, float] = {}
        self.refused_early = 0  # requests answered 429 here (a counter for tests and stats)

    def check(self, tenant: str) -> None:
        """Raise the 429 while ``tenant`` is refused early."""
        now = self.clock()
        with self._lock:
            until = self._until.get(tenant)
            if until is None:
                return
            if now >= until:
                del self._until[tenant]
                return
            self.refused_early += 1
        raise APIError(
            429,
            f"too many invalid requests from this key: more than {self.per_second} refused in "
            f"a second; requests are refused for {self.penalty:g} s",
            code="too_many_refusals",
            headers={"Retry-After": str(max(1, math.ceil(until - now)))},
        )

    def record(self, tenant: str, status: int) -> None:
        """One answer to ``tenant``; a refusal past the limit starts the penalty."""
        if status not in REFUSED:
            return
        now = self.clock()
        with self._lock:
            q = self._recent.setdefault(tenant, deque(maxlen=self.per_second + 1))
            q.append(now)
            while q and q[0] <= now - 1.0:
                q.popleft()
            if len(q) > self.per_second:
                self._until[tenant] = now + self.penalty
                q.clear()
