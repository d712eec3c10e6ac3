"""The remote tier: blocks in a Redis (or Valkey) shared by every server pointed at it.

    key = "pc-kv:<namespace id>:<record name>"  -> the encoded block (codec.py)
    "pc-kv-index:<namespace id>"                  -> set of the block names written there
    "pc-kv-namespaces:<deployment id>"            -> set of the namespace ids it wrote
    "pc-kv-use:<deployment id>"                   -> hash: owner id -> bytes we wrote for it
    "pc-kv-lru:<owner id>"                        -> sorted set: "<ns>:<name>" by last use
    "pc-kv-size:<owner id>"                       -> hash: "<ns>:<name>" -> bytes
    "pc-kv-exp:<deployment id>"                   -> sorted set: "<owner>|<ns>:<name>" by the
                                                     deadline of a record kept for a while

Shares (shares.py). With a capacity (``remote_cache_size``; "auto": half the server's
``maxmemory``, none when it has none), every write runs one script that stores the
record, counts its bytes against its owner and, while the deployment's records exceed the
capacity, deletes the least recently used record of the owner holding the most: the rule of
the disk tier, applied atomically in Redis, so every replica shares one account and a restart
keeps it. A tenant writing unique prompts deletes its own records, and another's only while
that one holds more than it; a tenant alone may use the whole capacity. Reads refresh the
records' places (``ZADD XX``, in the read's round trip). Redis's own eviction is a second line:
give Redis a ``maxmemory`` above the capacity (keys, sets and the accounting take room too), so
that it never has to pick a victim itself, blind to tenants. A record Redis evicted anyway is a
stale entry that costs its owner share until our eviction reaches it (deleting a missing key is
harmless); an owner whose accounting Redis evicted is forgotten at its turn to give way.

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

Retention. A record written with a TTL (``prompt_cache_retention: "24h"``) is SET with that
expiry, so Redis deletes it on time whether or not any server runs; its name and deadline go
into the deployment's expiry set, and ``sweep`` (the writer thread, once a minute) takes the
records past their deadline out of the index sets and the owners' accounts, so an expired
record stops counting against its owner's share. A record written again without a TTL loses it
(and leaves the set).

Every replica of a deployment (one tier secret, secret.py) computes the same names for the same
blocks (keys.py), so server B restores what server A computed; another deployment's names for
the same tenant and blocks differ. Redis may still evict by itself (run it with a ``maxmemory``
above our capacity and an ``allkeys-lru`` policy: see Shares); we never assume a block we wrote
is still there.

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
from prefixcache.tiers.tier import Tier

log = logging.getLogger(__name__)

PREFIX = "pc-kv"
INDEX_PREFIX = "pc-kv-index"
NAMESPACES = "pc-kv-namespaces"
EXPIRY_PREFIX = "pc-kv-exp"
_SWEEP_BATCH = 1000
USE_PREFIX = "pc-kv-use"
LRU_PREFIX = "pc-kv-lru"
SIZE_PREFIX = "pc-kv-size"
AUTO = "auto"  # capacity_bytes: from the server's maxmemory
# Of maxmemory, for "auto". The rest is for what a record costs Redis beyond its bytes: the
# allocator's size classes (up to a quarter of a large value; 100 kB records took 15% more,
# measured), keys, index sets, our accounting, client buffers. Redis must not evict by itself.
AUTO_FRACTION = 0.5
_UNLINK_BATCH = 1000

# KEYS: record, index set, namespaces set, use hash, owner's LRU, owner's sizes, expiry set
# ARGV: data, ns, name, owner, capacity (0: none), score, then the prefixes of the keys the
# eviction reaches: records, index sets, LRUs, sizes; then the TTL in ms (0: none) and the
# deadline (Unix seconds).
# Returns {records evicted, the owner's bytes after}.
_PUT = """
local member = ARGV[2] .. ':' .. ARGV[3]
local size = string.len(ARGV[1])
local old = tonumber(redis.call('HGET', KEYS[6], member) or '0')
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
local ttl = tonumber(ARGV[11])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
  redis.call('ZADD', KEYS[7], ARGV[12], ARGV[4] .. '|' .. member)
else
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[7], ARGV[4] .. '|' .. member)
end
redis.call('HSET', KEYS[6], member, size)
redis.call('ZADD', KEYS[5], ARGV[6], member)
redis.call('HINCRBY', KEYS[4], ARGV[4], size - old)
local cap = tonumber(ARGV[5])
local evicted = 0
while cap > 0 do
  local use = redis.call('HGETALL', KEYS[4])
  local total, top, most = 0, nil, -1
  for i = 1, #use, 2 do
    local b = tonumber(use[i + 1])
    total = total + b
    if b > most then top, most = use[i], b end
  end
  if total <= cap or top == nil then break end
  local sizes = ARGV[10] .. ':' .. top
  local out = redis.call('ZPOPMIN', ARGV[9] .. ':' .. top)
  if #out == 0 then
    redis.call('HDEL', KEYS[4], top)
  else
    local m = out[1]
    local b = tonumber(redis.call('HGET', sizes, m) or '0')
    redis.call('HDEL', sizes, m)
    if redis.call('HINCRBY', KEYS[4], top, -b) <= 0 then redis.call('HDEL', KEYS[4], top) end
    local sep = string.find(m, ':', 1, true)
    redis.call('SREM', ARGV[8] .. ':' .. string.sub(m, 1, sep - 1), string.sub(m, sep + 1))
    redis.call('UNLINK', ARGV[7] .. ':' .. m)
    evicted = evicted + 1
  end
end
return {evicted, tonumber(redis.call('HGET', KEYS[4], ARGV[4]) or '0')}
"""

# KEYS: expiry set, use hash. ARGV: now, then the prefixes: LRUs, sizes, index sets, records;
# then the most entries to take. The records past their deadline leave the index sets and
# their owners' accounts (Redis deleted them already by their TTL; UNLINK is for a clock that
# runs ahead of Redis's). Returns the entries taken.
_SWEEP = """
local out = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[6]))
for _, m in ipairs(out) do
  local bar = string.find(m, '|', 1, true)
  local owner = string.sub(m, 1, bar - 1)
  local member = string.sub(m, bar + 1)
  local sizes = ARGV[3] .. ':' .. owner
  local b = redis.call('HGET', sizes, member)
  if b then
    redis.call('HDEL', sizes, member)
    redis.call('ZREM', ARGV[2] .. ':' .. owner, member)
    if redis.call('HINCRBY', KEYS[2], owner, -tonumber(b)) <= 0 then
      redis.call('HDEL', KEYS[2], owner)
    end
  end
  local sep = string.find(member, ':', 1, true)
  redis.call('SREM', ARGV[4] .. ':' .. string.sub(member, 1, sep - 1), string.sub(member, sep + 1))
  redis.call('UNLINK', ARGV[5] .. ':' .. member)
  redis.call('ZREM', KEYS[1], m)
end
return #out
"""

# KEYS: use hash. ARGV: LRU prefix, sizes prefix. Read-only, atomic: the owners whose bytes are
# not the sum of their sizes, or whose sizes and LRU name different records.
_CHECK = """
local bad = {}
local use = redis.call('HGETALL', KEYS[1])
for i = 1, #use, 2 do
  local o = use[i]
  local sizes = redis.call('HGETALL', ARGV[2] .. ':' .. o)
  local sum = 0
  for j = 2, #sizes, 2 do sum = sum + tonumber(sizes[j]) end
  if sum ~= tonumber(use[i + 1]) or redis.call('ZCARD', ARGV[1] .. ':' .. o) * 2 ~= #sizes then
    table.insert(bad, o)
  end
end
return bad
"""

# KEYS: use hash, owner's LRU, owner's sizes. ARGV: owner, record prefix, ns, names...
# Deletes the records and takes them out of the owner's account. Returns the records deleted.
_FORGET = """
local n = 0
local freed = 0
for i = 4, #ARGV do
  local m = ARGV[3] .. ':' .. ARGV[i]
  local b = redis.call('HGET', KEYS[3], m)
  if b then
    freed = freed + tonumber(b)
    redis.call('HDEL', KEYS[3], m)
    redis.call('ZREM', KEYS[2], m)
  end
  n = n + redis.call('UNLINK', ARGV[2] .. ':' .. m)
end
if freed > 0 and redis.call('HINCRBY', KEYS[1], ARGV[1], -freed) <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return n
"""


class RedisTier(Tier):
    name = "redis"
    knows_contents = False  # shared: other replicas write, Redis evicts

    def __init__(self, url: str, socket_timeout: float = 2.0, max_value_bytes: int = 64 << 20,
                 capacity_bytes: int | str | None = None, scope: str = ""):  # fmt: skip
        """``capacity_bytes``: the bytes of records this deployment may keep (per-owner
        shares of it), ``AUTO`` (from the server's maxmemory, read at the first connection)
        or None (no bound of ours: Redis's eviction only). ``scope``: the deployment's id,
        which names its account (replicas of one deployment share it)."""
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
        self._auto_capacity = capacity_bytes == AUTO
        self.capacity_bytes: int | None = None if self._auto_capacity else capacity_bytes
        self._use_key = f"{USE_PREFIX}:{scope}"
        # Per deployment: dropping "all of ours" must not reach another deployment's records
        # on the same Redis (its namespace ids differ: keyed by its secret, keys.py).
        self._namespaces_key = f"{NAMESPACES}:{scope}"
        self._expiry_key = f"{EXPIRY_PREFIX}:{scope}"
        self._owner_bytes: dict[str, int] = {}  # owner -> its bytes as of our last write of it
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
        self._put_script = self.client.register_script(_PUT)
        self._forget_script = self.client.register_script(_FORGET)
        self._check_script = self.client.register_script(_CHECK)
        self._sweep_script = self.client.register_script(_SWEEP)
        try:
            self.client.ping()
            log.info("remote cache %s: connected", self.url_for_logs)
            self._resolve_capacity()
        except self._errors as e:
            self._failed(e)

    def _resolve_capacity(self) -> None:
        """``AUTO``: ``AUTO_FRACTION`` of the server's ``maxmemory`` (INFO needs no CONFIG
        rights), once; a server without one leaves our bound off (Redis grows, or refuses)."""
        if not self._auto_capacity:
            return
        self._auto_capacity = False
        maxmemory = int(self.client.info("memory").get("maxmemory", 0))
        self.capacity_bytes = int(maxmemory * AUTO_FRACTION) or None
        if self.capacity_bytes is None:
            log.warning("remote cache %s has no maxmemory: per-tenant shares are off there "
                        "(set one, or --remote-cache-size)", self.url_for_logs)  # fmt: skip

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
            if self._auto_capacity:
                try:
                    self._resolve_capacity()
                except self._errors:
                    self._auto_capacity = True  # at the next reconnect

    # ---- operations ---------------------------------------------------------------------------
    def get_many(self, ns: str, names: list[str], owner: str | None = None) -> list[bytes]:
        """The stored bytes of the leading ``names`` present (one round trip). ``owner``:
        whose account's LRU order the read refreshes."""
        if not names or not self.available():
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.touch(self._index(ns))  # keeps the index as warm as the blocks (LRU)
            pipe.mget([self._key(ns, n) for n in names])
            if owner is not None and self.capacity_bytes:
                now = time.time()
                pipe.zadd(f"{LRU_PREFIX}:{owner}", {f"{ns}:{n}": now for n in names}, xx=True)
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

    def put(self, ns: str, name: str, data: bytes, record: str = "block", *, owner: str,
            ttl: float | None = None) -> bool:  # fmt: skip
        """Store one record of ``ns`` in ``owner``'s account (one script: see the top), for
        ``ttl`` seconds (None: until evicted)."""
        if not self.available():
            self.counters.add(dropped_writes=1)
            return False
        if len(data) > self.max_value_bytes:
            self.counters.add(oversize_writes=1, dropped_writes=1)
            return False
        try:
            # One script, atomic like a MULTI: a concurrent invalidation sees the block, its
            # index entry and its accounting, or none of them.
            now = time.time()
            ttl_ms = 0 if ttl is None else max(1, int(ttl * 1000))
            evicted, mine = self._put_script(
                keys=[self._key(ns, name), self._index(ns), self._namespaces_key, self._use_key,
                      f"{LRU_PREFIX}:{owner}", f"{SIZE_PREFIX}:{owner}", self._expiry_key],
                args=[data, ns, name, owner, self.capacity_bytes or 0, now, PREFIX,
                      INDEX_PREFIX, LRU_PREFIX, SIZE_PREFIX, ttl_ms, now + (ttl or 0)],
            )  # fmt: skip
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
        if evicted:
            self.counters.add(evicted=evicted)
        with self._lock:
            self._owner_bytes[owner] = mine
        return True

    def sweep(self, now: float | None = None) -> int:
        """Take the records past their deadline out of the index sets and the accounts (see
        the top). Returns how many; 0 while Redis is down."""
        if not self.available():
            return 0
        now = time.time() if now is None else now
        total = 0
        try:
            while True:
                n = self._sweep_script(
                    keys=[self._expiry_key, self._use_key],
                    args=[now, LRU_PREFIX, SIZE_PREFIX, INDEX_PREFIX, PREFIX, _SWEEP_BATCH],
                )  # fmt: skip
                total += n
                if n < _SWEEP_BATCH:
                    break
        except self._errors as e:
            self._slow_or_down(e, "a sweep of expired records")
            return total
        if total:
            self.counters.add(expired=total)
        return total

    def remaining_ttls(self, ns: str, names: list[str]) -> list[float | None]:
        """Seconds each record has left (None: kept until evicted, or gone); one round trip."""
        if not names or not self.available():
            return [None] * len(names)
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.pttl(self._key(ns, n))
            ms = pipe.execute()
        except self._errors as e:
            self._slow_or_down(e, "a read of record TTLs")
            return [None] * len(names)
        return [m / 1000 if m >= 0 else None for m in ms]

    def _forget(self, owner: str, ns: str, names: list[str]) -> int:
        """Delete records of ``ns`` and take them out of ``owner``'s account."""
        return self._forget_script(
            keys=[self._use_key, f"{LRU_PREFIX}:{owner}", f"{SIZE_PREFIX}:{owner}"],
            args=[owner, PREFIX, ns, *names],
        )  # fmt: skip

    def remove(self, ns: str, name: str, owner: str | None = None) -> None:
        try:
            if owner is None:
                self.client.unlink(self._key(ns, name))
            else:
                self._forget(owner, ns, [name])
        except self._errors as e:
            self._failed(e)

    def drop_namespace(self, ns: str | None, owner: str | None = None) -> int:
        """Delete a namespace's blocks (``None``: all of ours) from the shared store, by its
        index set, never by a scan. Raises ``ConnectionError`` when Redis cannot be reached:
        the caller must say so."""
        try:
            n = 0
            if ns is None:
                self._drop_accounts()
            for one in self._take(self._namespaces_key) if ns is None else [ns]:
                one = one.decode() if isinstance(one, bytes) else one
                names = [m.decode() for m in self._take(self._index(one))]
                for i in range(0, len(names), _UNLINK_BATCH):
                    batch = names[i : i + _UNLINK_BATCH]
                    if owner is not None:  # the records and their accounting
                        n += self._forget(owner, one, batch)
                    else:
                        n += self.client.unlink(*(self._key(one, m) for m in batch))
        except self._errors as e:
            self._failed(e)
            raise ConnectionError(f"remote cache {self.url_for_logs} unreachable: {e}") from e
        self._ok()
        return n

    def _drop_accounts(self) -> None:
        """Every owner's accounting of this deployment (dropping everything)."""
        owners = [o.decode() for o in self._take_hash_keys(self._use_key)]
        for o in owners:
            self.client.unlink(f"{LRU_PREFIX}:{o}", f"{SIZE_PREFIX}:{o}")
        self.client.unlink(self._expiry_key)
        with self._lock:
            self._owner_bytes.clear()

    def _take_hash_keys(self, key: str) -> list[bytes]:
        pipe = self.client.pipeline(transaction=True)
        pipe.hkeys(key)
        pipe.delete(key)
        return pipe.execute()[0]

    def _take(self, key: str) -> set[bytes]:
        """A set's members, and the set deleted, atomically: a write after this call starts a
        new set, so no member is lost between reading and deleting."""
        pipe = self.client.pipeline(transaction=True)
        pipe.smembers(key)
        pipe.delete(key)
        return pipe.execute()[0]

    # ---- facts --------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        return self.counters.snapshot(self.name, self.enabled, self.available(), None, None,
                                      self.capacity_bytes)  # fmt: skip

    def owner_usage(self, owner: str) -> tuple[int | None, int | None]:
        """(None, ``owner``'s bytes as of this process's last write of it): no round trip."""
        with self._lock:
            return None, self._owner_bytes.get(owner)

    def account(self) -> dict[str, int]:
        """Owner id -> bytes, as Redis counts them now (tests, integrity checks; one HGETALL)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self._use_key).items()}

    def check_integrity(self) -> None:
        """The shared account adds up: each owner's bytes are the sum of its sizes, and its
        sizes and LRU hold as many records (one read-only script, atomic; tests). Holds while
        Redis evicts nothing of the accounting by itself."""
        try:
            bad = self._check_script(keys=[self._use_key], args=[LRU_PREFIX, SIZE_PREFIX])
        except self._errors:
            return  # down: nothing to check
        assert not bad, f"redis tier accounting drifted for {len(bad)} owners"

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
