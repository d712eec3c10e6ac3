"""Browser defences of the HTTP edge: a web page the operator visits may not drive the server.

A browser lets any page send requests to any address, ``http://127.0.0.1:8000`` included: an
open server (no keys: every caller is the admin) would let such a page invalidate the whole
cache (RAM, disk and Redis) or use the engine. Two attacks, three checks, one ASGI middleware
that runs before routing, so no route can forget them:

| check                                            | applies to                 | refused |
|--------------------------------------------------|----------------------------|---------|
| ``Host`` names an allowed host                   | every request, when on     | 403 ``host_not_allowed`` |
| ``Origin``, when sent, names an allowed host     | POST, PUT, PATCH, DELETE   | 403 ``origin_not_allowed`` |
| ``Content-Type: application/json`` (charset utf-8 allowed) | POST, PUT, PATCH, DELETE | 415 ``unsupported_media_type`` |

- **Cross-site requests (CSRF).** A page on another site can send a "simple" POST (a form, or a
  ``fetch`` with ``text/plain``) without asking first; a JSON content type makes the browser ask
  with a CORS preflight, which this server never grants. So every body must say it is JSON
  (in every mode: our bodies are JSON, and one rule is easier to trust than two), and a POST
  whose ``Origin`` (browsers send it on every POST) is another site's is refused outright.
- **DNS rebinding.** A page at ``evil.example`` whose name is then re-pointed at 127.0.0.1 is
  same-origin with the server in the browser's eyes: no preflight, responses readable (the open
  dashboard route shows prompt text). Its requests still carry ``Host: evil.example``, so a
  server bound to loopback answers only Hosts it knows: localhost, 127.0.0.1, [::1] (any port)
  and ``--allowed-hosts``. Bound to a wildcard or another address, the server is reached by
  names we cannot guess, so the Host check is off unless ``--allowed-hosts`` lists them.

Non-browser clients (the openai package, httpx, curl with ``-H 'Content-Type:
application/json'``) send a JSON content type, their own Host and no Origin: nothing changes
for them. A request without a Host header (HTTP/1.0, the cluster's in-process calls) is not a
browser's and passes the Host check. An Origin is judged by its host name alone, in every mode,
whether or not the Host check is on: a page served from an allowed host, on any port, may POST.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefixcache.server.edge.errors import APIError, ErrorDialect

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "*"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def normalize_host(name: str) -> str:
    """A host name as compared: lower case, no trailing dot, IPv6 without brackets."""
    name = name.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name


def is_loopback(host: str) -> bool:
    host = normalize_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of_header(value: str) -> str | None:
    """The host name of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``); None when
    malformed (a bare IPv6 address, a port that is not a number, an empty name)."""
    value = value.strip()
    if value.startswith("["):
        name, bracket, port = value[1:].partition("]")
        if not bracket:
            return None
    else:
        name, _, port = value.partition(":")
        port = value[len(name) :]
    if port and not (port.startswith(":") and port[1:].isdigit()):
        return None  # also a bare IPv6 address: its second ":" is not a digit
    return normalize_host(name) or None


@dataclass(frozen=True)
class OriginPolicy:
    """Which host names this server answers to (``Host``) and accepts POSTs from (``Origin``).

    ``allowed_hosts``: normalized names (see :func:`normalize_host`), any port.
    ``check_host``: whether ``Host`` must be one of them (on for a loopback bind)."""

    allowed_hosts: frozenset[str] = LOOPBACK_NAMES
    check_host: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.allowed_hosts, frozenset):
            raise TypeError("allowed_hosts must be a frozenset of host names")
        for name in self.allowed_hosts:
            _check_name(name)

    @classmethod
    def for_bind(cls, host: str, extra: Iterable[str] = ()) -> OriginPolicy:
        """The policy of a server bound to ``host`` with ``--allowed-hosts extra`` (names may
        be comma-separated). The bound address itself is allowed unless it is a wildcard."""
        names = {normalize_host(n) for e in extra for n in e.split(",") if n.strip()}
        for n in names:
            _check_name(n)
        check = is_loopback(host) or bool(names)
        if normalize_host(host) not in WILDCARD_BINDS:
            names.add(normalize_host(host))
        return cls(frozenset(LOOPBACK_NAMES | names), check)

    # -- per request ------------------------------------------------------------------------

    def check(self, method: str, headers: dict[str, str]) -> APIError | None:
        """The refusal for a request with these (lower-cased) headers; None to let it through."""
        host = headers.get("host")
        if self.check_host and host is not None:
            name = host_of_header(host)
            if name not in self.allowed_hosts:
                return APIError(
                    403,
                    f"Host {host[:100]!r} is not a name this server answers to (a guard "
                    f"against DNS rebinding); start it with --allowed-hosts NAME to add one",
                    code="host_not_allowed",
                )
        if method in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        if origin is not None:
            name = _origin_host(origin)
            if name is None or name not in self.allowed_hosts:
                return APIError(
                    403,
                    f"cross-origin request refused: Origin {origin[:100]!r} is not an allowed "
                    f"host (a guard against cross-site requests; --allowed-hosts adds hosts)",
                    code="origin_not_allowed",
                )
        ctype = headers.get("content-type")
        if not _is_json(ctype):
            got = "none" if ctype is None else repr(ctype[:100])
            return APIError(
                415,
                f"{method} bodies must be JSON: send 'Content-Type: application/json' (got {got})",
                code="unsupported_media_type",
            )
        return None


_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def _check_name(name: str) -> None:
    if name != normalize_host(name) or not (_NAME.fullmatch(name) or _is_ip(name)):
        raise ValueError(
            f"allowed hosts are host names or IP addresses, without scheme, port or path; "
            f"got {name!r}"
        )


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_host(origin: str) -> str | None:
    """The host name of an ``Origin`` header; None for ``null`` or anything unparsable."""
    try:
        parts = urlsplit(origin.strip())
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return normalize_host(parts.hostname)


def _is_json(ctype: str | None) -> bool:
    """``application/json``, with no parameter but ``charset=utf-8`` (JSON is UTF-8; body.py
    reads it as such, so another charset would be misread)."""
    if ctype is None:
        return False
    media, *params = (p.strip().lower() for p in ctype.split(";"))
    if media != "application/json":
        return False
    for p in params:
        if not p:
            continue  # "application/json;"
        key, _, value = p.partition("=")
        if key.strip() != "charset" or value.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return True


class BrowserGuard:
    """The ASGI middleware applying an :class:`OriginPolicy` to every HTTP request, before
    routing and before its body is read; a refusal is answered in the dialect of the route's
    API (``dialects``: errors.py)."""

    def __init__(self, app, policy: OriginPolicy, dialects: Iterable[ErrorDialect] = ()) -> None:
        self.app = app
        self.policy = policy
        self.dialects = tuple(dialects)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers: dict[str, str] = {}
            for k, v in scope.get("headers", ()):
                headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
            refusal = self.policy.check(scope["method"], headers)
            if refusal is not None:
                await refusal.response_for(scope.get("path", ""), self.dialects)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)
