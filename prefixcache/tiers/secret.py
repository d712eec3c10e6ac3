"""The deployment secret of the tiers, and the keys derived from it.

Whoever can write to the Redis or the disk directory must not be able to plant KV that we
serve, and whoever can read them must not read prompts off them. So every record is
authenticated (codec.py: HMAC-SHA256 under ``TierKeys.mac``) and every name a tier sees (the
namespace id, the record name, the digest of the key input that replaces the token ids) is a
keyed digest under ``TierKeys.names``: without the secret none of them can be computed, forged
or tested against a guessed prompt or tenant name.

The secret is 32 or more random bytes in a file (``--tier-secret-file``). Without one, a secret
is generated once (``os.urandom``), kept 0600 as ``tier-secret`` in the disk tier's directory
(next to ``pc-kv/``; for Redis alone, the directory ``--disk-cache-dir auto`` would use) and
read again at every start, so a restart finds its own records. Replicas that share a Redis
must share the secret file: two deployments with different secrets derive different namespace
ids, so they never see, nor overwrite, each other's records even for the same tenant name.
A new secret makes every old record unreachable (a plain miss; disk LRU removes them).

Nothing here ever logs or returns the secret or a key; ``deployment_id`` (a digest) is what
logs show, so an operator can check that replicas agree.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SECRET_NAME = "tier-secret"
MIN_SECRET_BYTES = 32
_TAG = b"prefixcache/tiers/"


def _prf(key: bytes, label: bytes, data: bytes = b"") -> bytes:
    return hmac.digest(key, _TAG + label + b"\x00" + data, "sha256")


@dataclass(frozen=True, repr=False)  # no repr: keys must never reach a log line
class TierKeys:
    """The keys of one deployment (derived from its secret; the secret itself is not kept)."""

    mac: bytes  # authenticates every stored record (codec.py)
    names: bytes  # keys the namespace ids, record names and key-input digests
    deployment_id: str  # 16 hex chars; safe to log

    @classmethod
    def from_secret(cls, secret: bytes) -> TierKeys:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a tier secret needs at least {MIN_SECRET_BYTES} bytes")
        return cls(_prf(secret, b"mac"), _prf(secret, b"names"),
                   _prf(secret, b"deployment-id")[:8].hex())  # fmt: skip

    def digest(self, label: bytes, data: bytes, size: int = 32) -> bytes:
        """A keyed digest of ``data`` (``label`` separates its uses)."""
        return _prf(self.names, label, data)[:size]

    def __repr__(self) -> str:
        return f"TierKeys(deployment {self.deployment_id})"


def read_secret_file(path: str | Path) -> bytes:
    """The secret in ``path``: all its bytes (a trailing newline included: every replica reads
    the same file), at least ``MIN_SECRET_BYTES``. A ValueError (a startup error) otherwise."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
        mode = p.stat().st_mode
    except OSError as e:
        raise ValueError(f"tier secret file {str(path)!r} cannot be read: {e.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(
            f"tier secret file {str(path)!r} holds {len(data)} bytes; it needs "
            f"{MIN_SECRET_BYTES} or more random bytes (head -c 32 /dev/urandom > FILE)"
        )
    if mode & 0o077:
        log.warning("tier secret file %s is readable or writable by others (mode %o); "
                    "chmod 600 it", p, mode & 0o777)  # fmt: skip
    return data


def generated_secret(root: str | Path) -> bytes:
    """The secret kept in ``root/tier-secret``, created (0600, umask-independent) on first use.
    Two processes starting at once agree on one: it is written whole to a temporary file and
    linked into place only if absent (``link`` fails on an existing name, atomically)."""
    root = Path(root).expanduser()
    path = root / SECRET_NAME
    if not path.exists():
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = root / f".{SECRET_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, os.urandom(MIN_SECRET_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
                log.warning("generated a tier secret in %s: replicas sharing a Redis need this "
                            "file (--tier-secret-file)", path)  # fmt: skip
            except FileExistsError:
                pass  # another process made it first: use theirs
            finally:
                tmp.unlink()
        except OSError as e:
            raise ValueError(
                f"cannot create the tier secret {str(path)!r} ({e.strerror}); "
                "give one with --tier-secret-file"
            ) from None
    return read_secret_file(path)


def load_keys(secret_file: str | Path | None, default_root: str | Path) -> TierKeys:
    """The deployment's keys: from ``secret_file``, else from the secret kept in
    ``default_root`` (generated there the first time)."""
    secret = read_secret_file(secret_file) if secret_file else generated_secret(default_root)
    return TierKeys.from_secret(secret)


def key_input_digest(keys: TierKeys, key_input: bytes) -> bytes:
    """What a record stores instead of its key input (parent key and token ids)."""
    return keys.digest(b"key-input", key_input)
