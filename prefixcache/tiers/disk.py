"""The local disk tier: one file per block, LRU within a byte budget, atomic writes.

    DIR/pc-kv/<namespace id>/<record name>.blk     (keyed names: keys.py)
    DIR/tier-secret                                 (the generated secret, if any: secret.py)

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
- **Thread safety.** The reader and writer threads share the index under one lock; file I/O
  happens outside it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

from prefixcache.tiers.stats import TierCounters, TierStats

log = logging.getLogger(__name__)

SUBDIR = "pc-kv"
SUFFIX = ".blk"
_TMP = ".tmp-"
DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_RETRY_AFTER = 60.0  # seconds: the longest pause between write probes after write errors


class DiskTier:
    name = "disk"
    knows_contents = True  # the in-memory index is the directory's content

    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True,
                 retry_after: float = 1.0):  # fmt: skip
        self.dir = Path(root).expanduser() / SUBDIR
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.retry_after = retry_after
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, str], int] = OrderedDict()  # (ns, name) -> bytes
        self._bytes = 0
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
        """Rebuild the index from the directory: oldest first; stale temporaries removed."""
        found = []
        for ns_dir in self.dir.iterdir():
            if not ns_dir.is_dir():
                continue
            try:
                os.chmod(ns_dir, DIR_MODE)  # an earlier version's (or umask's) 0755
            except OSError:
                pass
            for f in ns_dir.iterdir():
                try:
                    if f.name.startswith(_TMP):  # a write that never finished (crash, kill -9)
                        f.unlink()
                        continue
                    if f.suffix != SUFFIX:
                        continue
                    st = f.stat()
                except OSError:
                    continue
                found.append((st.st_mtime_ns, ns_dir.name, f.name[: -len(SUFFIX)], st.st_size))
        found.sort()
        for _, ns, name, size in found:
            self._lru[(ns, name)] = size
            self._bytes += size
        self._evict_over_budget()
        if found:
            log.info("disk cache %s: %d blocks, %.1f MiB from earlier runs", self.dir,
                     len(self._lru), self._bytes / 2**20)  # fmt: skip

    def _path(self, ns: str, name: str) -> Path:
        return self.dir / ns / (name + SUFFIX)

    # ---- reads --------------------------------------------------------------------------------
    def contains(self, ns: str, name: str) -> bool:
        with self._lock:
            return (ns, name) in self._lru

    def get_many(self, ns: str, names: list[str]) -> list[bytes]:
        """The stored bytes of the leading ``names`` present here (stops at the first miss)."""
        out: list[bytes] = []
        for name in names:
            with self._lock:
                if (ns, name) not in self._lru:
                    break
                self._lru.move_to_end((ns, name))
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
    def put(self, ns: str, name: str, data: bytes, record: str = "block") -> bool:
        with self._lock:
            paused = time.monotonic() < self._paused_until
        if paused:
            self.counters.add(dropped_writes=1)
            return False
        if self.contains(ns, name):
            return True
        d = self.dir / ns
        tmp = d / f"{_TMP}{name}-{os.getpid()}-{threading.get_ident()}"
        try:
            _private_dir(d)
            _write_private(tmp, data, self.fsync)
            os.replace(tmp, self._path(ns, name))
        except OSError as e:
            _unlink_quietly(tmp)
            self._write_failed(f"writing a block failed: {e}")
            return False
        self._write_ok()
        with self._lock:
            if (ns, name) not in self._lru:
                self._lru[(ns, name)] = len(data)
                self._bytes += len(data)
        self.counters.written(record, len(data))
        self._evict_over_budget()
        return True

    def remove(self, ns: str, name: str) -> None:
        """Drop one block (a rejected one)."""
        self._forget(ns, name)
        _unlink_quietly(self._path(ns, name))

    def _forget(self, ns: str, name: str) -> None:
        with self._lock:
            size = self._lru.pop((ns, name), None)
            if size is not None:
                self._bytes -= size

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.capacity_bytes or not self._lru:
                    return
                (ns, name), size = self._lru.popitem(last=False)
                self._bytes -= size
            _unlink_quietly(self._path(ns, name))

    def drop_namespace(self, ns: str | None) -> int:
        """Remove a namespace's blocks (``None``: every namespace). Returns the blocks removed."""
        with self._lock:
            gone = [k for k in self._lru if ns is None or k[0] == ns]
            for k in gone:
                self._bytes -= self._lru.pop(k)
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
            n, b = len(self._lru), self._bytes
        # Available even while writes are paused: reads go on.
        return self.counters.snapshot(self.name, self.enabled, True, n, b,
                                      self.capacity_bytes)  # fmt: skip

    def check_integrity(self) -> None:
        with self._lock:
            assert self._bytes == sum(self._lru.values()), "disk tier byte count drifted"
            assert self._bytes <= self.capacity_bytes or not self._lru, "disk tier over budget"

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


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
