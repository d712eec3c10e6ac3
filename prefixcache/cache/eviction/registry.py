"""The eviction policies by name: ``POLICY_NAMES`` (the engine's choices,
``EngineConfig.eviction_policy``), ``make_policy``, and ``parse_policies`` for the simulator's
lists, which may also name the offline ``belady`` (``analyze/belady.py``)."""

from __future__ import annotations

from prefixcache.cache.eviction.adaptive import AdaptivePolicy
from prefixcache.cache.eviction.hit_density import HitDensityPolicy
from prefixcache.cache.eviction.lru import LRUPolicy
from prefixcache.cache.eviction.lru_demote import DemotePolicy
from prefixcache.cache.eviction.policy import EvictionPolicy
from prefixcache.config import EVICTION_POLICIES

# The online policies (the engine's choices); "belady" is offline (simulator only).
POLICY_NAMES = EVICTION_POLICIES


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """An online policy by name (``POLICY_NAMES``)."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "lru-demote":
        return DemotePolicy(capacity)
    if name == "hit-density":
        return HitDensityPolicy(capacity)
    if name == "adaptive":
        return AdaptivePolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def parse_policies(spec: str, offline: bool = True) -> list[str]:
    """``"all"`` or comma-separated names → the list, in a stable order; belady is offline."""
    names = list(POLICY_NAMES) + (["belady"] if offline else [])
    if spec.strip() == "all":
        return names
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if part not in names:
            raise ValueError(f"unknown eviction policy {part!r}; choose from "
                             f"{', '.join(names)} or all")
        if part not in out:
            out.append(part)
    if not out:
        raise ValueError("no eviction policy given")
    return out
