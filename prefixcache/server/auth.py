"""API keys, tenants and the cache namespace of a request.

The namespace of a request decides which cached blocks it may reuse (it enters the root of the
block hash chain, docs/design.md §3), so the server derives it and never takes it from the client:

    no cache_salt                  -> "<tenant>"
    cache_salt in the shared set   -> "<cache_salt>"        (same for every tenant)
    any other cache_salt           -> "<tenant>/<cache_salt>"

Tenant names and shared names may not contain "/" and may not equal each other, so a namespace
names exactly one owner: a tenant cannot reach another tenant's namespace by choosing a salt.

Keys file (JSON or YAML), either a flat mapping of key to tenant::

    sk-alice: alice
    sk-bob: bob

or the full form::

    keys:
      sk-alice: alice
      sk-ops: {tenant: ops, admin: true}
    shared_namespaces: [public]

Without any key configured the server is open: every caller is the admin tenant "default".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from prefixcache.server.errors import APIError

DEFAULT_TENANT = "default"
MAX_SALT_LEN = 256


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False


def _digest(key: str) -> bytes:
    # Keys are looked up by digest, so the lookup's timing says nothing about the stored keys.
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or name != name.strip():
        raise ValueError(f"{kind} must be a non-empty string without '/', got {name!r}")
    return name


class TenantDirectory:
    """Who a request is (from its bearer token) and which namespaces it may use."""

    def __init__(
        self,
        keys: Mapping[str, Tenant] | None = None,
        shared_namespaces: Iterable[str] = (),
    ) -> None:
        self.shared_namespaces = frozenset(
            _check_name("shared namespace", n) for n in shared_namespaces
        )
        self._by_digest: dict[bytes, Tenant] = {}
        for key, tenant in (keys or {}).items():
            if not isinstance(key, str) or not key:
                raise ValueError("API keys must be non-empty strings")
            _check_name("tenant name", tenant.name)
            if tenant.name in self.shared_namespaces:
                raise ValueError(
                    f"tenant {tenant.name!r} has the name of a shared namespace; rename one"
                )
            self._by_digest[_digest(key)] = tenant
        if DEFAULT_TENANT in self.shared_namespaces and not self._by_digest:
            raise ValueError(f"{DEFAULT_TENANT!r} cannot be a shared namespace without API keys")

    @property
    def auth_required(self) -> bool:
        return bool(self._by_digest)

    @property
    def tenants(self) -> list[Tenant]:
        return sorted(set(self._by_digest.values()), key=lambda t: t.name)

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
            keys[admin_key] = Tenant("admin", admin=True)
        return cls(keys, shared)

    # -- per request --------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header; 401 when it is not known."""
        if not self.auth_required:
            return Tenant(DEFAULT_TENANT, admin=True)
        if not authorization:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = authorization.partition(" ")
        tenant = self._by_digest.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(
                401,
                "incorrect API key provided",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    def namespace(self, tenant: Tenant, cache_salt: str | None) -> str:
        if cache_salt is None:
            return tenant.name
        if not cache_salt or len(cache_salt) > MAX_SALT_LEN:
            raise APIError(
                400, f"cache_salt must be 1..{MAX_SALT_LEN} characters", param="cache_salt"
            )
        if cache_salt in self.shared_namespaces:
            return cache_salt
        return f"{tenant.name}/{cache_salt}"

    def owns(self, tenant: Tenant, namespace: str) -> bool:
        """May ``tenant`` drop the blocks of ``namespace``? Its own ones; the admin any."""
        return tenant.admin or namespace == tenant.name or namespace.startswith(tenant.name + "/")


def load_keys_file(path: str | Path) -> tuple[dict[str, Tenant], list[str]]:
    """Parse a keys file (JSON or YAML, by content): (key -> tenant, shared namespaces).

    Raises ValueError or TypeError with a message that names the file and the problem.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read API keys file {path}: {e.strerror}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"API keys file {path} is neither JSON nor YAML: {e}") from e
    if not isinstance(data, dict):
        raise TypeError(f"API keys file {path} must hold a mapping")
    if isinstance(data.get("keys"), dict):
        entries, shared = data["keys"], data.get("shared_namespaces") or []
        unknown = set(data) - {"keys", "shared_namespaces"}
        if unknown:
            raise ValueError(f"API keys file {path}: unknown sections {sorted(unknown)}")
    else:
        entries, shared = data, []
    if not isinstance(shared, list):
        raise TypeError(f"API keys file {path}: shared_namespaces must be a list")
    keys: dict[str, Tenant] = {}
    for key, value in entries.items():
        if isinstance(value, str):
            keys[str(key)] = Tenant(value)
        elif isinstance(value, dict) and isinstance(value.get("tenant"), str):
            keys[str(key)] = Tenant(value["tenant"], admin=bool(value.get("admin", False)))
        else:
            raise TypeError(
                f"API keys file {path}: the value of a key must be a tenant name or "
                "{tenant: NAME, admin: BOOL}"
            )
    if not keys:
        raise ValueError(f"API keys file {path} holds no keys")
    return keys, [str(s) for s in shared]
