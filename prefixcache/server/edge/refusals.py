"""A tenant whose requests keep being refused is refused early for a while.

A refused request is not free: its body is read and parsed and its text tokenized before the
length check can say 400 (a chat of 64 documents of ~300 tokens is ~128 KiB of JSON and ~20k
tokens to count). Sent back to back, such requests keep the CPU and the interpreter's lock
busy and every tenant's steps slow down with them: measured on 2 cores, two clients of one
tenant sending over-long segments chats raised another tenant's time to first token 14x while
every one of their requests was a 400 (docs/benchmarks-journal.md "Tenant isolation"). Decisions:

- **Count refusals, not requests.** A tenant may have ``max_refusals_per_second`` answers of
  400, 404, 413, 422 or 429 in any second; past that, for ``refusal_penalty`` seconds, its
  generation and cache requests are a 429 ``too_many_refusals`` (``Retry-After``) before their
  body is read. A 404 (a model that is not served) and a 429 (over its share of the queue or
  its cache-call rate) come after the body was read and parsed too (issue #37: a wrong model
  name made every parse free), so they count; the early 429 of this limiter itself does not.
  An honest client's requests are accepted, or it waits out a 429's ``Retry-After`` (at most
  a few a second), so it never meets this. After the penalty comes a probation as long: the
  tenant may start at most ``max_refusals_per_second`` requests a second (more are the same
  early 429), so its clients returning together from one ``Retry-After`` are not all parsed
  before the first refusal is counted.
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

from prefixcache.server.edge.errors import APIError

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
        # tenant -> (end of its probation, requests it may still start now, when counted)
        self._probation: dict[str, tuple[float, float, float]] = {}
        self.refused_early = 0  # requests answered 429 here (a counter for tests and stats)

    def check(self, tenant: str) -> None:
        """Raise the 429 while ``tenant`` is refused early, or on probation and over its rate."""
        now = self.clock()
        with self._lock:
            until = self._until.get(tenant)
            if until is not None and now >= until:
                del self._until[tenant]
                self._probation[tenant] = (now + self.penalty, float(self.per_second), now)
                until = None
            if until is None:
                if self._admit_on_probation(tenant, now):
                    return
                retry = 1.0
            else:
                retry = until - now
            self.refused_early += 1
        raise APIError(
            429,
            f"too many invalid requests from this key: more than {self.per_second} refused in "
            f"a second; requests are refused for {self.penalty:g} s, then at most "
            f"{self.per_second} a second for as long",
            code="too_many_refusals",
            headers={"Retry-After": str(max(1, math.ceil(retry)))},
        )

    def _admit_on_probation(self, tenant: str, now: float) -> bool:
        """After its penalty a tenant starts at most ``per_second`` requests a second for as
        long again (a token bucket): its clients, back from the same Retry-After at once, would
        otherwise all be read and parsed before the first of their refusals was counted (a
        wrong model name's 404s slowed the others 6.5x that way, issue #37)."""
        p = self._probation.get(tenant)
        if p is None:
            return True
        end, tokens, then = p
        if now >= end:
            del self._probation[tenant]
            return True
        tokens = min(float(self.per_second), tokens + (now - then) * self.per_second)
        if tokens < 1:
            self._probation[tenant] = (end, tokens, now)
            return False
        self._probation[tenant] = (end, tokens - 1, now)
        return True

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


class PeerGuard:
    """Client addresses whose requests keep failing authentication are cut off for a while.

    A keyless client has no tenant to charge, and a 401 costs the event loop a whole request's
    handling (HTTP parsing, middleware, routing, the error body): 64 loops of keyless scrapes
    answered 401 slowed ``/health`` 15x (issue #37). So a client address with more than
    ``per_second`` answers of 401 in a second is *blocked* for ``penalty`` seconds: the
    connection guard (http.py) closes its connections after their current response and refuses
    new ones as soon as they are made, which costs a fraction of a request. An honest client
    with a wrong key meets a few 401s, never 64 a second. Behind a reverse proxy every client has the
    proxy's address: there, let the proxy bound its clients. Bounded: at most ``MAX_PEERS``
    addresses remembered (the least recent forgotten)."""

    MAX_PEERS = 4096

    def __init__(
        self, per_second: int, penalty: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_second = per_second
        self.penalty = penalty
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = {}
        self._until: dict[str, float] = {}
        self.blocked_total = 0  # times an address was blocked

    def refused(self, peer: str | None) -> None:
        """One 401 answered to ``peer``; past the limit, it is blocked."""
        if not peer:
            return
        now = self.clock()
        with self._lock:
            q = self._recent.pop(peer, None) or deque(maxlen=self.per_second + 1)
            self._recent[peer] = q  # most recent last
            q.append(now)
            while q and q[0] <= now - 1.0:
                q.popleft()
            if len(q) > self.per_second:
                self._until[peer] = now + self.penalty
                self.blocked_total += 1
                q.clear()
            while len(self._recent) > self.MAX_PEERS:
                del self._recent[next(iter(self._recent))]
            while len(self._until) > self.MAX_PEERS:
                del self._until[next(iter(self._until))]

    def blocked(self, peer: str | None) -> bool:
        if not peer:
            return False
        with self._lock:
            until = self._until.get(peer)
            if until is None:
                return False
            if self.clock() >= until:
                del self._until[peer]
                return False
            return True
