"""Shared fixtures: engines on the default model, loaded once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# One intra-op thread per process: the suite runs engines in this process and in live-server
# subprocesses side by side on 2 cores, and oversubscribed OpenMP threads make every torch op
# wait on a descheduled sibling (measured here: 8 tokens in 19 s with 2 threads vs 0.9 s with 1).
# Tests check behaviour, never speed; benchmarks/ use all cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# As prefixcache sets it when imported before torch (its __init__): here before any test module
# imports torch, so the kernels' own thread pool is the one under test (kernels/parallel.h).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Engines keep the converted model in a weights cache ("auto": $PREFIXCACHE_CACHE_DIR, else
# ~/.cache/prefixcache; model/weights_cache.py). The suite gets its own directory, new for the
# session and removed after it: tests never write to the home directory, and never read an entry
# left by another checkout or run (the build id would reject one, but a test run should not hinge
# on that). Engines here and live-server subprocesses (they inherit the variable) share it: the
# first engine converts the model, the rest read the entry (~0.5 s instead of ~10 s).
_WEIGHTS_CACHE_DIR = tempfile.mkdtemp(prefix="prefixcache-test-cache-")
os.environ["PREFIXCACHE_CACHE_DIR"] = _WEIGHTS_CACHE_DIR
atexit.register(shutil.rmtree, _WEIGHTS_CACHE_DIR, ignore_errors=True)


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
