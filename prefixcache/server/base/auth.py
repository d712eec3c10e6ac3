"""API keys, tenants and the cache namespace of a request.

The namespace of a request decides which cached blocks it may reuse (it enters the root of the
block hash chain, docs/design.md §3), so the server derives it and never takes it from the client:

    no cache_salt                  -> "<tenant>"
    cache_salt in the shared set   -> "<tenant>/<cache_salt>", and its declared shared prefix
                                      in "<cache_salt>" (the same for every tenant)
    any other cache_salt           -> "<tenant>/<cache_salt>"

A shared salt shares only what the request declares shared (``request.SharedPrefix``; the
server declares a chat's leading system/developer messages, and an admin's warm a whole
prompt): the rest of the request, its output included, stays in the tenant's own
"<tenant>/<cache_salt>", so no tenant hits or explains another's suffix (docs/design.md §3).

Tenant names and shared names may not contain "/" and may not equal each other, so a namespace
names exactly one owner: a tenant cannot reach another tenant's namespace by choosing a salt.

Keys file (JSON, or YAML read as strings), either a flat mapping of key to tenant::

    sk-alice: alice
    sk-bob: bob

or the full form::

    keys:
      sk-alice: alice
      sk-ops: {tenant: ops, admin: true}
    shared_namespaces: [public]

The schema is strict (pydantic, ``extra="forbid"``): ``admin`` must be a boolean (``"false"``
as a string is an error, not an admin), tenant names and keys must be strings, a duplicate key
is an error naming its line. YAML is read with only ``true``/``false`` resolved (to booleans);
every other plain scalar stays the string it looks like, so ``yes``, ``null``, ``0123`` and
``1e3`` are the keys and names they are written as. SIGHUP reloads the file (app.py): the new
keys apply to new requests, running ones keep the tenant they were admitted as; a file that
fails to load leaves the old keys in force. Error messages never show a key (SIGHUP logs them):
a key is named by its line. The tenant names ``admin`` and ``default`` are reserved (the server's
own tenants) and refused in a keys file.

Without any key configured the server is open: every caller is the admin tenant "default".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from prefixcache.api.request import SharedPrefix
from prefixcache.server.edge.errors import APIError

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"
# Names the server gives tenants itself (--admin-key, --api-key / the open server): a keys-file
# tenant named so would share their namespace, pin quota and dashboard prompt excerpts.
RESERVED_TENANTS = frozenset({ADMIN_TENANT, DEFAULT_TENANT})
MAX_SALT_LEN = 256


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False


def credential(headers: Mapping[str, str]) -> str | None:
    """The ``Authorization`` value a request authenticates with: its own, or ``Bearer <key>``
    for an ``x-api-key`` header (401 when both are given and name different keys)."""
    auth = headers.get("authorization")
    key = headers.get("x-api-key")
    if key is None:
        return auth
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            _digest(token.strip()), _digest(key.strip())
        ):
            raise APIError(
                401, "the x-api-key and Authorization headers carry different keys",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
    return f"Bearer {key.strip()}"


def _digest(key: str) -> bytes:
    # Keys are looked up by digest, so the lookup's timing says nothing about the stored keys.
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or name != name.strip():
        raise ValueError(f"{kind} must be a non-empty string without '/', got {name!r}")
    return name


@dataclass(frozen=True)
class _Keys:
    """One consistent set of keys and shared namespaces (swapped whole on reload)."""

    by_digest: dict[bytes, Tenant]
    shared: frozenset[str]


@dataclass(frozen=True)
class CacheScope:
    """Where a request is cached: ``namespace``, its own (the tenant's), and with a shared
    salt ``shared``, the namespace in which a prefix the request declares may be cached."""

    namespace: str
    shared: str | None = None

    def prefix(self, num_tokens: int) -> SharedPrefix | None:
        """The declaration of a shared prefix of ``num_tokens`` tokens (None: nothing shared)."""
        if self.shared is None or num_tokens <= 0:
            return None
        return SharedPrefix(self.shared, num_tokens)


class TenantDirectory:
    """Who a request is (from its bearer token) and which namespaces it may use."""

    def __init__(
        self,
        keys: Mapping[str, Tenant] | None = None,
        shared_namespaces: Iterable[str] = (),
    ) -> None:
        self._keys = _build(keys or {}, shared_namespaces)
        self._options: dict | None = None  # from_options: what reload() re-reads

    @property
    def shared_namespaces(self) -> frozenset[str]:
        return self._keys.shared

    @property
    def reloadable(self) -> bool:
        return bool(self._options and self._options.get("api_keys_file"))

    def reload(self) -> int:
        """Re-read the keys file; all or nothing. Returns the number of keys now in force."""
        if not self.reloadable:
            raise ValueError("no keys file to reload")
        fresh = TenantDirectory.from_options(**self._options)
        self._keys = fresh._keys  # one reference: a request sees the old set or the new one
        return len(self._keys.by_digest)

    @property
    def auth_required(self) -> bool:
        return bool(self._keys.by_digest)

    @property
    def tenants(self) -> list[Tenant]:
        return sorted(set(self._keys.by_digest.values()), key=lambda t: t.name)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_options(
        cls,
        api_key: str | None = None,
        api_keys_file: str | Path | None = None,
        admin_key: str | None = None,
        shared_namespaces: Iterable[str] = (),
    ) -> TenantDirectory:
        if api_key and api_keys_file:
            raise ValueError("use either --api-key or --api-keys-file, not both")
        keys: dict[str, Tenant] = {}
        shared = list(shared_namespaces)
        if api_key:
            keys[api_key] = Tenant(DEFAULT_TENANT, admin=True)
        if api_keys_file:
            file_keys, file_shared = load_keys_file(api_keys_file)
            keys.update(file_keys)
            shared.extend(file_shared)
        if admin_key:
            if admin_key in keys and not keys[admin_key].admin:
                raise ValueError("the admin key is also a tenant's key in the keys file")
            keys[admin_key] = Tenant(ADMIN_TENANT, admin=True)
        d = cls(keys, shared)
        d._options = {"api_key": api_key, "api_keys_file": api_keys_file,
                      "admin_key": admin_key, "shared_namespaces": list(shared_namespaces)}  # fmt: skip
        return d

    # -- per request --------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header; 401 when it is not known."""
        if not self.auth_required:
            return Tenant(DEFAULT_TENANT, admin=True)
        if not authorization:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.partition(" ")
        tenant = self._keys.by_digest.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(
                401,
                "incorrect API key provided",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    def authenticate_request(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request's headers: ``Authorization: Bearer <key>`` or, as
        Anthropic's clients send it, ``x-api-key: <key>`` (the same keys). Both at once must
        name the same key: a proxy adding one must not silently win over the client's other."""
        return self.authenticate(credential(headers))

    def authenticate_metrics(self, authorization: str | None, metrics_key: str | None) -> None:
        """``/metrics`` when it is not public: the metrics key (if any) or an admin key; else
        401."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        bearer = scheme.lower() == "bearer"
        if bearer and metrics_key is not None and hmac.compare_digest(
            _digest(token), _digest(metrics_key)
        ):
            return
        tenant = self._keys.by_digest.get(_digest(token)) if bearer else None
        if tenant is None or not tenant.admin:
            what = "the metrics key or an admin key" if metrics_key is not None else "an admin key"
            raise APIError(
                401, f"/metrics needs {what}", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    def namespace(self, tenant: Tenant, cache_salt: str | None) -> str:
        """The namespace ``cache_salt`` names for ``tenant`` (a shared salt: the shared
        namespace itself, e.g. to invalidate it). Where a request is cached: ``scope``."""
        if cache_salt is None:
            return tenant.name
        if not cache_salt or len(cache_salt) > MAX_SALT_LEN:
            raise APIError(
                400, f"cache_salt must be 1..{MAX_SALT_LEN} characters", param="cache_salt"
            )
        if cache_salt in self._keys.shared:
            return cache_salt
        return f"{tenant.name}/{cache_salt}"

    def scope(self, tenant: Tenant, cache_salt: str | None) -> CacheScope:
        """Where ``tenant``'s request with ``cache_salt`` is cached (the table at the top)."""
        namespace = self.namespace(tenant, cache_salt)
        if cache_salt is not None and cache_salt in self._keys.shared:
            return CacheScope(f"{tenant.name}/{cache_salt}", cache_salt)
        return CacheScope(namespace)

    def owns(self, tenant: Tenant, namespace: str) -> bool:
        """May ``tenant`` drop the blocks of ``namespace``? Its own ones; the admin any."""
        return tenant.admin or namespace == tenant.name or namespace.startswith(tenant.name + "/")


def _build(keys: Mapping[str, Tenant], shared_namespaces: Iterable[str]) -> _Keys:
    shared = frozenset(_check_name("shared namespace", n) for n in shared_namespaces)
    by_digest: dict[bytes, Tenant] = {}
    for key, tenant in keys.items():
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError("API keys must be non-empty strings without surrounding spaces")
        _check_name("tenant name", tenant.name)
        if tenant.name in shared:
            raise ValueError(f"tenant {tenant.name!r} has the name of a shared namespace; rename one")
        by_digest[_digest(key)] = tenant
    if DEFAULT_TENANT in shared and not by_digest:
        raise ValueError(f"{DEFAULT_TENANT!r} cannot be a shared namespace without API keys")
    return _Keys(by_digest, shared)


# ---- the keys file ------------------------------------------------------------------------------
class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tenant: str
    admin: bool = False


class _FullFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    keys: dict[str, str | _Entry]
    shared_namespaces: list[str] = []


class _FlatFile(BaseModel):
    model_config = ConfigDict(strict=True)
    entries: dict[str, str | _Entry]


class _StringsLoader(yaml.SafeLoader):
    """YAML with every plain scalar a string except ``true``/``false``; duplicate keys fail."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            if isinstance(key, str):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_StringsLoader.yaml_implicit_resolvers = {}
_StringsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$"), list("tf")
)
_StringsLoader.add_constructor(
    "tag:yaml.org,2002:map", lambda loader, node: loader.construct_mapping(node)
)


def _json_no_duplicates(text: str, path: Path):
    def pairs(items):
        out: dict = {}
        for k, v in items:
            if k in out:
                raise ValueError(  # never the key itself: it may be an API key
                    f"API keys file {path}: duplicate key on line {_json_line(text, k)}"
                )
            out[k] = v
        return out

    return json.loads(text, object_pairs_hook=pairs)


def _json_line(text: str, key: str) -> int:
    """The line of the second occurrence of ``"key":`` (the duplicate)."""
    hits = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    pos = hits[1] if len(hits) > 1 else (hits[0] if hits else 0)
    return text.count("\n", 0, pos) + 1


def load_keys_file(path: str | Path) -> tuple[dict[str, Tenant], list[str]]:
    """Parse a keys file (JSON or YAML, by content): (key -> tenant, shared namespaces).

    Raises ValueError (or TypeError) with a message that names the file and the problem.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read API keys file {path}: {e}") from e
    try:
        data = _json_no_duplicates(text, path)
    except json.JSONDecodeError:
        try:
            data = yaml.load(text, Loader=_StringsLoader)  # a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ValueError(
                f"API keys file {path} is neither JSON nor valid YAML: {_yaml_problem(e)}"
            ) from None
    if not isinstance(data, dict):
        raise TypeError(f"API keys file {path} must hold a mapping")
    try:
        if isinstance(data.get("keys"), dict):
            full = _FullFile.model_validate(data)
            entries, shared = full.keys, full.shared_namespaces
        else:
            entries, shared = _FlatFile.model_validate({"entries": data}).entries, []
    except ValidationError as e:
        # Of a union's failures, the deepest says most ("admin: should be a valid boolean"
        # rather than "should be a valid string").
        first = max(e.errors(), key=lambda x: len(x["loc"]))
        where = _where(first["loc"], text)
        raise ValueError(f"API keys file {path}: {where}: {first['msg']}") from None
    keys = {
        k: Tenant(v) if isinstance(v, str) else Tenant(v.tenant, admin=v.admin)
        for k, v in entries.items()
    }
    if not keys:
        raise ValueError(f"API keys file {path} holds no keys")
    for k, t in keys.items():
        if t.name in RESERVED_TENANTS:
            raise ValueError(
                f"API keys file {path}: the key on line {_line_of(text, k)} names tenant "
                f"{t.name!r}, which is reserved (the server's own tenants: "
                f"{', '.join(sorted(RESERVED_TENANTS))}); rename the tenant"
            )
    return keys, list(shared)


_FIELDS = {"keys", "shared_namespaces", "tenant", "admin"}


def _where(loc: tuple, text: str) -> str:
    """A validation error's location with every API key in it replaced by its line: the key
    under ``keys`` (or at the top of a flat file), and any unknown top-level name."""
    parts = [p for p in loc if p not in ("str", "_Entry")]
    out = []
    for i, p in enumerate(parts):
        is_key = (i == 1 and parts[0] in ("keys", "entries")) or (i == 0 and p not in _FIELDS)
        if p == "entries" and i == 0:
            continue
        redact = is_key and isinstance(p, str)
        out.append(f"<key on line {_line_of(text, p)}>" if redact else str(p))
    return ".".join(out)


def _line_of(text: str, key: str) -> int:
    """The line where ``key`` first appears in the file (1-based; 1 if not found as written)."""
    pos = text.find(key)
    return text.count("\n", 0, pos) + 1 if pos >= 0 else 1


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error without the snippet of the file PyYAML quotes (it may hold a key)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    what = getattr(e, "problem", None) or type(e).__name__
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what
