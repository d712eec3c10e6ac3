"""Shared fixtures: engines on the default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# One intra-op thread per process: the suite runs engines in this process and in live-server
# subprocesses side by side on 2 cores, and oversubscribed OpenMP threads make every torch op
# wait on a descheduled sibling (measured here: 8 tokens in 19 s with 2 threads vs 0.9 s with 1).
# Tests check behaviour, never speed; benchmarks/ use all cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
