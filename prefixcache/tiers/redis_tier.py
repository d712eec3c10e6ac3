"""The remote tier: blocks in a Redis (or Valkey) shared by every server pointed at it.

    key = "pc-kv:<namespace id>:<record name>"  -> the encoded block (codec.py)
    "pc-kv-index:<namespace id>"                  -> set of the block names written there
    "pc-kv-namespaces"                            -> set of the namespace ids written

Invalidation never scans the keyspace (SCAN is O(every key in Redis), run per request it lets
one tenant stall Redis and the tier writer for everyone). Each write adds its name to its
namespace's index set in the same MULTI as the SET, and dropping a namespace takes the set and
deletes it atomically (MULTI: SMEMBERS, DEL), then unlinks its members; dropping everything
does the same over the set of namespace ids. The index is a superset of what is stored: a
member whose block Redis evicted is a harmless stale name (UNLINK of a missing key), and is
gone with the set at the next invalidation. Reads TOUCH the index so that, under an LRU
policy, it is never colder than the blocks it names (an evicted index would orphan them: they
would outlive an invalidation until Redis evicts them too). Blocks written by a version
without the index are not in it: flush those once (``redis-cli --scan --pattern 'pc-kv:*'``).

Every replica of a deployment (one tier secret, secret.py) computes the same names for the same
blocks (keys.py), so server B restores what server A computed; another deployment's names for
the same tenant and blocks differ. Eviction is Redis's own (run it with a ``maxmemory`` and an
``allkeys-lru`` policy); we never assume a block we wrote is still there.

Faults: a write Redis refuses (``OOM`` under a ``noeviction`` policy, a value over its limits)
is dropped and counted, and nothing else changes: the server is up. A record larger than
``max_value_bytes`` is never sent (counted, ``oversize_writes``): one SET of hundreds of MB
(a long document's segment) would outlast the socket timeout. A connection error marks the
tier down for a back-off (1 s, doubling to 30 s) during which reads are misses and writes are
dropped (counted): requests are served by recomputing, and no step waits on a dead server. The
first command after the back-off reconnects (the client's pool makes a new connection) and the
tier is up again. Operations time out after ``socket_timeout`` seconds, so a hung server costs
a restore at most that; a timeout is told apart from a dead server by a PING on a fresh
connection: if Redis answers, only that command was slow (a large value, a busy server),
which costs that read or write (counted as an error) and nobody else's.
"""

from __future__ import annotations

import logging
import threading
import time

from prefixcache.tiers.stats import TierCounters, TierStats

log = logging.getLogger(__name__)

PREFIX = "pc-kv"
INDEX_PREFIX = "pc-kv-index"
NAMESPACES = "pc-kv-namespaces"
_UNLINK_BATCH = 1000


class RedisTier:
    name = "redis"
    knows_contents = False  # shared: other replicas write, Redis evicts

    def __init__(self, url: str, socket_timeout: float = 2.0, max_value_bytes: int = 64 << 20):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        # The server answered and refused this one command (OOM under ``noeviction``, a value
        # over its limits): Redis is up, so no back-off; reads go on.
        self._refused = redis.ResponseError
        self._timeout = redis.TimeoutError
        self._refusal_logged = False
        self._slow_logged = False
        self.max_value_bytes = max_value_bytes
        # One immediate retry on a connection error, none on a timeout: after Redis restarted,
        # the first command on each pooled connection fails (reset); the retry takes a new
        # one. Anything more is handled here (back-off), never by sleeping in the I/O thread.
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            health_check_interval=0,
        )  # fmt: skip
        self.url_for_logs = _without_password(url)
        self.counters = TierCounters()
        self.enabled = True
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._was_down = False
        try:
            self.client.ping()
            log.info("remote cache %s: connected", self.url_for_logs)
        except self._errors as e:
            self._failed(e)

    def _key(self, ns: str, name: str) -> str:
        return f"{PREFIX}:{ns}:{name}"

    @staticmethod
    def _index(ns: str) -> str:
        return f"{INDEX_PREFIX}:{ns}"

    # ---- health -------------------------------------------------------------------------------
    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self, e: BaseException) -> None:
        self.counters.add(errors=1)
        with self._lock:
            self._backoff = min(30.0, max(1.0, self._backoff * 2))
            self._down_until = time.monotonic() + self._backoff
            first = not self._was_down
            self._was_down = True
        if first:
            log.warning("remote cache %s unreachable (%s: %s); serving without it, retrying",
                        self.url_for_logs, type(e).__name__, e)  # fmt: skip

    def _slow_or_down(self, e: BaseException, what: str) -> None:
        """``e`` ended one command. A timeout with Redis still answering a PING (on a fresh
        connection: redis-py drops the one that timed out) costs that command only; anything
        else, or no answer, is Redis down for everyone (back-off)."""
        if isinstance(e, self._timeout):
            try:
                self.client.ping()
            except self._errors:
                pass
            else:
                self.counters.add(errors=1)
                if not self._slow_logged:
                    self._slow_logged = True
                    log.warning("remote cache %s: %s timed out but the server answers; that "
                                "one is dropped, the tier stays up", self.url_for_logs, what)  # fmt: skip
                return
        self._failed(e)

    def _ok(self) -> None:
        with self._lock:
            back = self._was_down
            self._was_down = False
            self._backoff = 0.0
        if back:
            self.counters.add(reconnects=1)
            log.warning("remote cache %s reachable again", self.url_for_logs)

    # ---- operations ---------------------------------------------------------------------------
    def get_many(self, ns: str, names: list[str]) -> list[bytes]:
        """The stored bytes of the leading ``names`` present (one round trip)."""
        if not names or not self.available():
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.touch(self._index(ns))  # keeps the index as warm as the blocks (LRU)
            pipe.mget([self._key(ns, n) for n in names])
            values = pipe.execute()[1]
        except self._errors as e:
            self._slow_or_down(e, f"a read of {len(names)} records")
            return []
        self._ok()
        out = []
        for v in values:
            if v is None:
                break
            out.append(v)
        return out

    def contains(self, ns: str, name: str) -> bool:
        return False  # unknown without a round trip; writes are idempotent

    def put(self, ns: str, name: str, data: bytes, record: str = "block") -> bool:
        if not self.available():
            self.counters.add(dropped_writes=1)
            return False
        if len(data) > self.max_value_bytes:
            self.counters.add(oversize_writes=1, dropped_writes=1)
            return False
        try:
            # One MULTI: a concurrent invalidation sees the block and its index entry, or neither.
            pipe = self.client.pipeline(transaction=True)
            pipe.sadd(NAMESPACES, ns)
            pipe.sadd(self._index(ns), name)
            pipe.set(self._key(ns, name), data)
            pipe.execute()
        except self._refused as e:
            self.counters.add(errors=1, dropped_writes=1)
            if not self._refusal_logged:
                self._refusal_logged = True
                log.warning("remote cache %s refused a write of %d bytes (%s); reads go on, "
                            "refused writes are counted as dropped", self.url_for_logs,
                            len(data), e)  # fmt: skip
            return False
        except self._errors as e:
            self._slow_or_down(e, f"a write of {len(data)} bytes")
            self.counters.add(dropped_writes=1)
            return False
        self._ok()
        self._refusal_logged = self._slow_logged = False
        self.counters.written(record, len(data))
        return True

    def remove(self, ns: str, name: str) -> None:
        try:
            self.client.unlink(self._key(ns, name))
        except self._errors as e:
            self._failed(e)

    def drop_namespace(self, ns: str | None) -> int:
        """Delete a namespace's blocks (``None``: all of ours) from the shared store, by its
        index set, never by a scan. Raises ``ConnectionError`` when Redis cannot be reached:
        the caller must say so."""
        try:
            n = 0
            for one in self._take(NAMESPACES) if ns is None else [ns]:
                one = one.decode() if isinstance(one, bytes) else one
                names = self._take(self._index(one))
                keys = [self._key(one, m.decode()) for m in names]
                for i in range(0, len(keys), _UNLINK_BATCH):
                    n += self.client.unlink(*keys[i : i + _UNLINK_BATCH])
        except self._errors as e:
            self._failed(e)
            raise ConnectionError(f"remote cache {self.url_for_logs} unreachable: {e}") from e
        self._ok()
        return n

    def _take(self, key: str) -> set[bytes]:
        """A set's members, and the set deleted, atomically: a write after this call starts a
        new set, so no member is lost between reading and deleting."""
        pipe = self.client.pipeline(transaction=True)
        pipe.smembers(key)
        pipe.delete(key)
        return pipe.execute()[0]

    # ---- facts --------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        return self.counters.snapshot(self.name, self.enabled, self.available(), None, None, None)

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass


def _without_password(url: str) -> str:
    """The URL as logs may show it."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
