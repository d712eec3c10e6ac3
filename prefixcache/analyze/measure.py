"""``--measure``: turn saved prefill tokens into saved time to first token, on this machine.

The engine prefills fresh random prompts of a few lengths (``max_tokens=1``, greedy, prefix
caching off, so nothing is reused); the median wall time per length is fitted with
``t(n) = a + b·n + c·n²`` (attention makes long prefills superlinear; ``c`` is dropped if the
fit makes it negative). Each logged request then costs ``t(n)`` cold and ``t(n - cached)``
with the ideal cache, where at least one token is always computed (the engine recomputes the
last prompt token of a fully cached prompt to get its logits).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

DEFAULT_LENGTHS = (32, 256, 1024, 2048)


def measure_prefill(
    model: str | None = None,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    repeats: int = 3,
    device: str = "cpu",
    budget_s: float = 90.0,
) -> list[tuple[int, float]]:
    """``(prompt tokens, median seconds to the first token)`` for each length that fits.

    Past ``budget_s`` of timing, each length is timed once and lengths after the second are
    skipped: a slow engine or device still gets an estimate in bounded time.
    """
    from prefixcache import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, device=device)
    params = SamplingParams(max_tokens=1, temperature=0)
    limit = getattr(getattr(llm.engine, "config", None), "max_model_len", None) or max(lengths) + 1
    vocab = 8000
    rng = np.random.default_rng(0)
    llm.generate([rng.integers(100, vocab, 16).tolist()], params)  # warm-up
    points: list[tuple[int, float]] = []
    began = time.perf_counter()
    for n in lengths:
        if n >= limit:
            continue
        over = time.perf_counter() - began > budget_s
        if over and len(points) >= 2:
            break
        times: list[float] = []
        for _ in range(1 if over else repeats):
            prompt = rng.integers(100, vocab, n).tolist()
            t0 = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - t0)
        points.append((n, statistics.median(times)))
    return points


def prefill_model(points: list[tuple[int, float]]) -> np.ndarray:
    """Polynomial coefficients (numpy order) of prefill seconds vs tokens."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    if len(points) >= 3:
        coef = np.polyfit(n, t, 2)
        if coef[0] >= 0:
            return coef
    if len(points) >= 2:
        return np.polyfit(n, t, 1)
    return np.array([t[0] / max(n[0], 1), 0.0])


def ttft_estimate(
    points: list[tuple[int, float]], n_tokens: np.ndarray, cached_tokens: np.ndarray, device: str
) -> dict:
    coef = prefill_model(points)

    def t(n: np.ndarray) -> np.ndarray:
        return np.maximum(np.polyval(coef, n.astype(float)), 0.0)

    cold = t(n_tokens)
    ideal = t(np.maximum(n_tokens - cached_tokens, 1))
    return {
        "device": device,
        "measured": [{"tokens": n, "seconds": s} for n, s in points],
        "fit": coef.tolist(),
        "mean_cold_s": float(cold.mean()) if len(cold) else 0.0,
        "mean_ideal_s": float(ideal.mean()) if len(ideal) else 0.0,
        "total_saved_s": float((cold - ideal).sum()),
    }
