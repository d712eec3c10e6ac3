"""The local disk tier: one file per block, per-tenant shares of a byte budget, atomic writes.

    DIR/pc-kv/<namespace id>/<record name>.blk     (keyed names: keys.py)
    DIR/pc-kv/<namespace id>/<record name>.<deadline>.blk   (a record kept until then)
    DIR/pc-kv/<namespace id>/owner                  (the namespace's owner id: shares.py)
    DIR/tier-secret                                 (the generated secret, if any: secret.py)

- **Shares.** Bytes are counted per owner (the tenant of the namespace, shares.py). When a
  write takes the tier past ``capacity_bytes``, the least recently used records of the owner
  holding the most bytes go first: a tenant writing unique prompts evicts its own blocks, and
  another's only while that one holds more than it, so no tenant is pushed below
  ``capacity / owners holding bytes`` by another. A tenant alone may fill the tier. The owner
  of a namespace is written in its directory (a keyed digest, like the namespace id), so a
  restart rebuilds the shares with the index; a directory without it (written before owners
  were recorded) counts as one owner of its own until a write there records its owner.
- **Atomic writes.** A block is written to a temporary file in the same directory, fsynced,
  then renamed over its name. A reader sees either no file or a whole one; ``kill -9``
  mid-write leaves at most a ``.tmp-*`` file, which is never read and is removed at the next
  start. A whole file is still checked on every load (codec.py): a torn or flipped sector is
  a rejected block, never KV.
- **Survives restarts.** Names are pure functions of the block (keys.py), and the index is
  rebuilt at start from the directory (LRU order = file modification time), so a new process
  finds the blocks of the old one. Files of other models or layouts share the directory
  without ever being read by us (their names differ); they count in the budget.
- **Private.** Directories are 0700 and files 0600 whatever the umask (set explicitly, and
  directories of earlier runs are tightened at start): the KV of a prompt is the prompt to
  anyone with the model. Records carry no token ids and are authenticated (codec.py).
- **Faults.** An error writing (disk full, read-only, permissions, quota) pauses writing with
  one warning (``enabled`` false) and counts an error; serving goes on from RAM and the other
  tiers, and reads from this tier go on. After a back-off (``retry_after`` seconds, doubling to
  ``MAX_RETRY_AFTER``) the next write is the probe: if it succeeds the tier writes again (one
  warning), so a disk that was full and got space back is used again without a restart. A file
  that vanished under a reader (evicted, invalidated, removed by hand) is a miss.
- **Retention.** A record written with a TTL (a request's ``prompt_cache_retention: "24h"``)
  carries its deadline (Unix seconds, the wall clock: it must outlive the process) in its
  file name, so a restart knows it without reading anything. An expired record is a miss, is
  removed at the next ``sweep`` (the writer thread runs one a minute: manager.py) and is not
  indexed at start. Records written without one stay until evicted, as before.
- **Thread safety.** The reader and writer threads share the index under one lock; file I/O
  happens outside it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from prefixcache.cache.shares import OwnerLRU, share
from prefixcache.tiers.shares import UNKNOWN_OWNER, is_owner_id
from prefixcache.tiers.stats import TierCounters, TierStats
from prefixcache.tiers.tier import Tier

log = logging.getLogger(__name__)

SUBDIR = "pc-kv"
SUFFIX = ".blk"
_TMP = ".tmp-"
OWNER_FILE = "owner"  # in each namespace directory: the owner id of its records (shares.py)
DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_RETRY_AFTER = 60.0  # seconds: the longest pause between write probes after write errors


class DiskTier(Tier):
    name = "disk"
    knows_contents = True  # the in-memory index is the directory's content

    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True,
                 retry_after: float = 1.0, clock=time.time):  # fmt: skip
        """``clock``: the wall clock retention deadlines are on (tests inject one)."""
        self.dir = Path(root).expanduser() / SUBDIR
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.retry_after = retry_after
        self.clock = clock
        self.counters = TierCounters()
        self._deadlines: dict[tuple[str, str], int] = {}  # records with a retention
        self._lock = threading.Lock()
        self._index = OwnerLRU()  # (ns, name) -> bytes, by owner, each owner's LRU first
        self._ns_owner: dict[str, str] = {}  # namespace id -> owner id, as its directory says
        self._paused_until = 0.0  # writes wait until then (monotonic) after a write error
        self._pause = 0.0  # the current back-off; 0 while writes succeed
        try:
            _private_dir(self.dir, parents=True)
            probe = self.dir / f"{_TMP}probe-{os.getpid()}"
            _write_private(probe, b"x", fsync=False)
            probe.unlink()
        except OSError as e:  # a bad --disk-cache-dir is a startup error, with its reason
            raise ValueError(f"disk cache directory {str(root)!r} is not writable: {e}") from e
        self._scan()

    @property
    def enabled(self) -> bool:
        """False while writes are paused after a write error (until a probe succeeds)."""
        with self._lock:
            return self._pause == 0.0

    # ---- start --------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the directory: oldest first; stale temporaries and expired
        records removed."""
        found = []
        now = self.clock()
        for ns_dir in self.dir.iterdir():
            if not ns_dir.is_dir():
                continue
            try:
                os.chmod(ns_dir, DIR_MODE)  # an earlier version's (or umask's) 0755
            except OSError:
                pass
            owner = _read_owner(ns_dir)
            if owner != UNKNOWN_OWNER:
                self._ns_owner[ns_dir.name] = owner
            for f in ns_dir.iterdir():
                try:
                    if f.name.startswith(_TMP):  # a write that never finished (crash, kill -9)
                        f.unlink()
                        continue
                    if f.suffix != SUFFIX:
                        continue
                    name, deadline = _parse_name(f.name)
                    if deadline is not None and deadline <= now:
                        f.unlink()  # its retention ran out while no server ran
                        continue
                    st = f.stat()
                except OSError:
                    continue
                found.append((st.st_mtime_ns, owner, ns_dir.name, name, st.st_size, deadline))
        found.sort()
        for _, owner, ns, name, size, deadline in found:
            self._index.add(owner, (ns, name), size)
            if deadline is not None:
                self._deadlines[(ns, name)] = deadline
        self._evict_over_budget()
        if found:
            log.info("disk cache %s: %d blocks, %.1f MiB from earlier runs (%d owners)",
                     self.dir, len(self._index), self._index.total / 2**20,
                     self._index.owners)  # fmt: skip

    def _path(self, ns: str, name: str, deadline: int | None = None) -> Path:
        """The file of a record (``deadline``: of one being written; else as indexed)."""
        if deadline is None:
            deadline = self._deadlines.get((ns, name))
        stem = name if deadline is None else f"{name}.{deadline}"
        return self.dir / ns / (stem + SUFFIX)

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, ns: str, name: str) -> bool:
        with self._lock:
            return (ns, name) in self._index

    def get_many(self, ns: str, names: list[str], owner: str | None = None) -> list[bytes]:
        """The stored bytes of the leading ``names`` present here (stops at the first miss).
        (``owner``: the directory knows it here.)"""
        out: list[bytes] = []
        now = self.clock()
        for name in names:
            with self._lock:
                if (ns, name) not in self._index:
                    break
                deadline = self._deadlines.get((ns, name))
                if deadline is not None and deadline <= now:
                    break  # expired: a miss; the next sweep removes it
                self._index.touch((ns, name))
            try:
                data = self._path(ns, name).read_bytes()
            except FileNotFoundError:  # evicted or invalidated meanwhile
                self._forget(ns, name)
                break
            except OSError as e:
                self.counters.add(errors=1)
                log.warning("disk cache: reading %s failed: %s", name, e)
                break
            out.append(data)
        return out

    # ---- writes -------------------------------------------------------------------------------
    def put(self, ns: str, name: str, data: bytes, record: str = "block", *, owner: str,
            ttl: float | None = None) -> bool:  # fmt: skip
        """Store one record of namespace ``ns``, owned by ``owner`` (an owner id, shares.py),
        until ``ttl`` seconds from now (None: until evicted). A record already stored is
        kept as it is."""
        with self._lock:
            paused = time.monotonic() < self._paused_until
        if paused:
            self.counters.add(dropped_writes=1)
            return False
        if self.contains(ns, name):
            return True
        d = self.dir / ns
        deadline = None if ttl is None else int(self.clock() + ttl)
        tmp = d / f"{_TMP}{name}-{os.getpid()}-{threading.get_ident()}"
        try:
            _private_dir(d)
            with self._lock:
                recorded = self._ns_owner.get(ns) == owner
            if not recorded:
                self._record_owner(d, owner)
            _write_private(tmp, data, self.fsync)
            os.replace(tmp, self._path(ns, name, deadline))
        except OSError as e:
            _unlink_quietly(tmp)
            self._write_failed(f"writing a block failed: {e}")
            return False
        self._write_ok()
        with self._lock:
            if (ns, name) not in self._index:
                self._index.add(owner, (ns, name), len(data))
                if deadline is not None:
                    self._deadlines[(ns, name)] = deadline
        self.counters.written(record, len(data))
        self._evict_over_budget()
        return True

    def _record_owner(self, d: Path, owner: str) -> None:
        """Write the owner file of namespace directory ``d`` (atomically) and count what the
        directory already holds (records of a run before owners were recorded) as its."""
        if not is_owner_id(owner):
            raise ValueError(f"not an owner id: {owner!r}")
        tmp = d / f"{_TMP}{OWNER_FILE}-{os.getpid()}-{threading.get_ident()}"
        try:
            _write_private(tmp, owner.encode(), self.fsync)
            os.replace(tmp, d / OWNER_FILE)
        except OSError:
            _unlink_quietly(tmp)
            raise
        with self._lock:
            self._ns_owner[d.name] = owner
            for key in self._index.keys_of(UNKNOWN_OWNER):
                if key[0] == d.name:
                    size = self._index.pop(key)
                    self._index.add(owner, key, size)

    def remove(self, ns: str, name: str, owner: str | None = None) -> None:
        """Drop one block (a rejected one). (``owner``: the index knows it here.)"""
        _unlink_quietly(self._forget(ns, name))

    def _forget(self, ns: str, name: str) -> Path:
        """Out of the index; its file's path (to unlink, outside the lock)."""
        with self._lock:
            path = self._path(ns, name)
            self._index.pop((ns, name))
            self._deadlines.pop((ns, name), None)
        return path

    def sweep(self, now: float | None = None) -> int:
        """Remove the records whose retention ran out. Returns how many."""
        now = self.clock() if now is None else now
        with self._lock:
            gone = [k for k, t in self._deadlines.items() if t <= now]
            paths = [self._path(*k) for k in gone]
            for k in gone:
                self._index.pop(k)
                del self._deadlines[k]
        for p in paths:
            _unlink_quietly(p)
        if gone:
            self.counters.add(expired=len(gone))
        return len(gone)

    def _evict_over_budget(self) -> None:
        """Back within the budget, from the owner holding the most (shares.py)."""
        while True:
            with self._lock:
                if self._index.total <= self.capacity_bytes:
                    return
                _, (ns, name), _ = self._index.victim()
                path = self._path(ns, name)
                self._index.pop((ns, name))
                self._deadlines.pop((ns, name), None)
                self.counters.add(evicted=1)
            _unlink_quietly(path)

    def drop_namespace(self, ns: str | None, owner: str | None = None) -> int:
        """Remove a namespace's blocks (``None``: every namespace). Returns the blocks removed."""
        with self._lock:
            gone = [k for k in self._index.records() if ns is None or k[0] == ns]
            for k in gone:
                self._index.pop(k)
                self._deadlines.pop(k, None)
            if ns is None:
                self._ns_owner.clear()
            else:
                self._ns_owner.pop(ns, None)
        dirs = [self.dir / ns] if ns is not None else [p for p in self.dir.iterdir() if p.is_dir()]
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        return len(gone)

    def _write_failed(self, why: str) -> None:
        self.counters.add(errors=1, dropped_writes=1)
        with self._lock:
            first = self._pause == 0.0
            self._pause = min(MAX_RETRY_AFTER, max(self.retry_after, self._pause * 2))
            self._paused_until = time.monotonic() + self._pause
            pause = self._pause
        if first:
            log.warning("disk cache %s: %s; writes paused (retried after %g s, then less "
                        "often), reads and serving go on", self.dir, why, pause)  # fmt: skip

    def _write_ok(self) -> None:
        with self._lock:
            back, self._pause = self._pause != 0.0, 0.0
        if back:
            self.counters.add(reconnects=1)
            log.warning("disk cache %s: writing again", self.dir)

    # ---- facts --------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._lock:
            n, b, owners = len(self._index), self._index.total, self._index.owners
        # Available even while writes are paused: reads go on.
        return self.counters.snapshot(self.name, self.enabled, True, n, b, self.capacity_bytes,
                                      owners)  # fmt: skip

    def owner_usage(self, owner: str) -> tuple[int, int]:
        """(records, bytes) that ``owner`` holds here now: its own figures, nobody else's."""
        with self._lock:
            return self._index.count_of(owner), self._index.bytes_of(owner)

    def share_bytes(self) -> int:
        """What each owner is sure to keep now (admin figures: it says how many owners write)."""
        with self._lock:
            return share(self.capacity_bytes, self._index.owners)

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check()
            assert self._index.total <= self.capacity_bytes, "disk tier over budget"
            assert all(k in self._index for k in self._deadlines), "deadline of no record"

    def close(self) -> None:
        pass


def _private_dir(d: Path, parents: bool = False) -> None:
    """``d`` exists, mode 0700 whatever the umask (``mkdir``'s mode is masked by it)."""
    d.mkdir(mode=DIR_MODE, parents=parents, exist_ok=True)
    if d.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(d, DIR_MODE)


def _write_private(path: Path, data: bytes, fsync: bool) -> None:
    """A new file of mode 0600 (set on the descriptor: no umask can widen it) holding ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(fd)
    finally:
        os.close(fd)


def _parse_name(file_name: str) -> tuple[str, int | None]:
    """(record name, deadline or None) of a record's file name."""
    stem = file_name[: -len(SUFFIX)]
    name, dot, deadline = stem.rpartition(".")
    if dot and deadline.isdigit():
        return name, int(deadline)
    return stem, None


def _read_owner(ns_dir: Path) -> str:
    """The owner id a namespace directory records (``UNKNOWN_OWNER`` when none or unreadable)."""
    try:
        owner = (ns_dir / OWNER_FILE).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return UNKNOWN_OWNER
    return owner if is_owner_id(owner) else UNKNOWN_OWNER


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
