"""Who may read the KV event stream: where it may be bound, and ZMQ CURVE keys for remote readers.

The stream is every tenant's cache traffic (block hashes, chains, timing; token ids when opted
in), so it is for trusted routers only, and the defaults keep it on the machine:

- An endpoint that stays on the machine is always allowed: ``ipc://`` (file permissions apply),
  ``inproc://``, and ``tcp://`` on a loopback host (``127.0.0.0/8``, ``::1``, ``localhost``).
- A ``tcp://`` bind on anything else (``*``, ``0.0.0.0``, ``[::]``, a routable address, an
  interface name) needs CURVE (``curve=True``: the sockets are CURVE servers, readers must know
  the server's public key, the traffic is encrypted), or ``allow_remote=True``: the explicit
  choice to publish in plaintext to whoever reaches the port. Anything else is a ValueError at
  config validation, so ``serve`` stops with a message before the model loads.

CURVE runs without a ZAP handler: every client that knows the server's public key completes
the handshake (its own keypair is not checked). The public key is therefore the access secret
of the stream: hand it to the routers, and nowhere else. A key file holds the server's secret
key, z85 (40 characters), alone or as a zmq certificate's ``secret-key = "..."`` line
(``zmq.auth.create_certificates``); the public key is derived from it. ``prefixcache events
keygen PATH`` writes one (events/cli.py).
"""

from __future__ import annotations

import ipaddress
import os
import struct
from pathlib import Path
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

Z85_KEY_CHARS = 40  # a 32-byte curve25519 key in z85


def is_local_endpoint(endpoint: str) -> bool:
    """True when binding ``endpoint`` cannot expose it beyond this machine."""
    scheme = endpoint.partition("://")[0]
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(endpoint).hostname or ""  # [::1] -> ::1; "*" stays "*"
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: may be reachable from outside
        return False


def check_bind(endpoint: str, *, curve: bool, allow_remote: bool) -> None:
    """Raise ValueError unless the policy above lets ``endpoint`` be bound."""
    if curve or allow_remote or is_local_endpoint(endpoint):
        return
    raise ValueError(
        f"KV events endpoint {endpoint!r} is not on loopback: the stream shows every tenant's "
        "cache traffic. Bind tcp://127.0.0.1:PORT or ipc://PATH, or protect it with "
        "--kv-events-curve-secret-file (CURVE), or publish it in plaintext with "
        "--kv-events-allow-remote"
    )


def _valid_z85_key(key: bytes) -> bool:
    if len(key) != Z85_KEY_CHARS:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, struct.error):  # a bad character; a group out of range
        return False


def load_server_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)``, z85, from a server key file; ValueError for anything else."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the KV events CURVE key file: {e}") from None
    secret = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(b"secret-key"):  # a zmq certificate
            secret = line.split(b"=", 1)[-1].strip(b" \t'\"")
            break
        if line and not line.startswith(b"#") and secret is None:
            secret = line
    if secret is None or not _valid_z85_key(secret):
        raise ValueError(
            f"{os.fspath(path)!r} holds no CURVE secret key (40 z85 characters; "
            "`prefixcache events keygen PATH` writes one)"
        )
    return zmq.curve_public(secret), secret


def curve_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make ``sock`` a CURVE server with this secret key; call before bind."""
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.curve_server = True


def curve_client(
    sock: zmq.Socket, server_public: bytes | str, keypair: tuple[bytes, bytes] | None = None
) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_public`` (z85);
    ``keypair`` is the client's (public, secret), a fresh one when None; call before connect."""
    server_public = server_public.encode() if isinstance(server_public, str) else server_public
    if not _valid_z85_key(server_public):
        raise ValueError("a CURVE server public key is 40 z85 characters")
    public, secret = keypair if keypair is not None else zmq.curve_keypair()
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def write_keypair(path: str | os.PathLike) -> bytes:
    """Write a new server secret key to ``path`` (refusing to overwrite one) and its public key
    to ``path.pub``, both mode 0600 (the public key grants reading too); returns the public key."""
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    fd = os.open(f"{os.fspath(path)}.pub", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(public + b"\n")
    return public


def check_endpoint(endpoint: str) -> None:
    """A ZMQ endpoint we can bind: tcp://HOST:PORT, ipc://PATH or inproc://NAME."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}")
    if scheme == "tcp":
        try:
            port = urlsplit(endpoint).port
        except ValueError:
            port = None
        if port is None:
            raise ValueError(f"a tcp KV events endpoint needs a port, got {endpoint!r}")
