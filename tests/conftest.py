"""Shared fixtures: engines on the default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# Two cores: one intra-op pool per process is enough; more threads only fight each other.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def llm():
    """Default model, float32, caching on. Tests isolate themselves with a unique cache_salt."""
    from prefixcache import LLM

    return LLM(kv_cache_memory="128MiB", seed=0)


@pytest.fixture(scope="session")
def llm_cold():
    """Default model, float32, caching off: the reference for cold == warm."""
    from prefixcache import LLM

    return LLM(kv_cache_memory="128MiB", enable_prefix_caching=False, seed=0)
