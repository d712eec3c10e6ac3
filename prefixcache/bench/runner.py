"""Running a workload against a server: arrivals, concurrency, multi-turn replay, timing.

Requests start at gamma-distributed arrival times (``burstiness`` 1 = Poisson; an infinite rate
sends everything at once) and at most ``max_concurrency`` are in flight. A multi-turn
conversation starts at its first turn's arrival time; each later turn is sent as soon as the
previous answer is in, with that answer appended to the history. The server's prefix-cache
counters are read just before the first timed request and just after the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
import numpy as np
from tqdm.auto import tqdm

from prefixcache.bench.client import RequestFuncInput, RequestFuncOutput, request_openai
from prefixcache.bench.datasets import SampleRequest
from prefixcache.bench.server_metrics import hit_rate, read_counters


@dataclass
class RunConfig:
    backend: str
    api_url: str
    base_url: str
    model: str
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    disable_tqdm: bool = False
    ready_check: bool = True
    timeout_s: float = 6 * 3600


@dataclass
class RunResult:
    outputs: list[RequestFuncOutput]  # in the order of the requests
    duration_s: float
    cache: dict  # prefix_cache_* fields, see server_metrics.hit_rate


class InitialRequestFailed(RuntimeError):
    """The single test request before the run failed: the arguments are wrong for this server."""


def arrival_delays(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds from the start at which each of ``n`` arrivals happens."""
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if rate == float("inf"):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    delays = np.cumsum(gaps)
    # Rescale so n requests take n / rate seconds whatever the draw (as vLLM does).
    if delays[-1] > 0:
        delays *= (n / rate) / delays[-1]
    return delays.tolist()


def _input(cfg: RunConfig, r: SampleRequest, messages=None, prompt=None) -> RequestFuncInput:
    return RequestFuncInput(
        api_url=cfg.api_url, model=cfg.model,
        prompt=r.prompt if prompt is None else prompt,
        messages=r.messages if messages is None else messages,
        prompt_len=r.prompt_len, output_len=r.expected_output_len, ignore_eos=cfg.ignore_eos,
        extra_body=cfg.extra_body, headers=cfg.headers, request_id=r.request_id)


async def run_benchmark(
    cfg: RunConfig,
    requests: list[SampleRequest],
    count_tokens: Callable[[str], int],
    seed: int = 0,
) -> RunResult:
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 1000, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if cfg.ready_check:
            print("Starting initial single prompt test run...")
            first = requests[0]
            test = await request_openai(client, cfg.backend, _input(
                cfg, replace(first, request_id=None), messages=first.chat_messages()))
            if not test.success:
                raise InitialRequestFailed(
                    "Initial test run failed - please make sure the benchmark arguments are "
                    f"correct for this server. Error: {test.error}")
            print("Initial test run completed.")
        if cfg.num_warmups > 0:
            print(f"Warming up with {cfg.num_warmups} requests...")
            sem = _semaphore(cfg.max_concurrency)

            async def warm(r: SampleRequest):
                async with sem:
                    await request_openai(client, cfg.backend, _input(
                        cfg, replace(r, request_id=None), messages=r.chat_messages()))

            await asyncio.gather(*(warm(requests[i % len(requests)])
                                   for i in range(cfg.num_warmups)))
            print("Warmup run completed.")

        print("Starting main benchmark run...")
        distribution = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {cfg.request_rate}")
        print(f"Burstiness factor: {cfg.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {cfg.max_concurrency}")

        before = await read_counters(client, cfg.base_url, cfg.headers)
        pbar = None if cfg.disable_tqdm else tqdm(total=len(requests))
        sem = _semaphore(cfg.max_concurrency)
        rng = np.random.default_rng(seed)
        start = time.perf_counter()
        if any(r.conversation_id is not None for r in requests):
            outputs = await _run_conversations(client, cfg, requests, sem, pbar, rng, start,
                                               count_tokens)
        else:
            outputs = await _run_independent(client, cfg, requests, sem, pbar, rng, start)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        after = await read_counters(client, cfg.base_url, cfg.headers)
    return RunResult(outputs, duration, hit_rate(before, after))


def _semaphore(limit: int | None):
    return asyncio.Semaphore(limit) if limit else contextlib.nullcontext()


async def _sleep_until(start: float, delay: float) -> None:
    wait = start + delay - time.perf_counter()
    if wait > 0:
        await asyncio.sleep(wait)


async def _run_independent(client, cfg, requests, sem, pbar, rng, start):
    if requests and all("arrival_s" in r.extra for r in requests):  # a trace's own times
        delays = [float(r.extra["arrival_s"]) for r in requests]
    else:
        delays = arrival_delays(len(requests), cfg.request_rate, cfg.burstiness, rng)

    async def one(r: SampleRequest, delay: float) -> RequestFuncOutput:
        await _sleep_until(start, delay)
        async with sem:
            out = await request_openai(client, cfg.backend, _input(cfg, r))
        if pbar is not None:
            pbar.update(1)
        return out

    return await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))


async def _run_conversations(client, cfg, requests, sem, pbar, rng, start, count_tokens):
    """Each conversation replays its turns in order, the server's answers in its history."""
    convs: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        convs.setdefault(r.conversation_id or f"single-{i}", []).append(i)
    for idx in convs.values():
        idx.sort(key=lambda i: requests[i].turn)
    delays = arrival_delays(len(convs), cfg.request_rate, cfg.burstiness, rng)
    outputs: list[RequestFuncOutput | None] = [None] * len(requests)

    async def conversation(idx: list[int], delay: float) -> None:
        await _sleep_until(start, delay)
        history: list[dict] = []
        text_history = ""
        for k, i in enumerate(idx):
            r = requests[i]
            history = history + r.chat_messages()
            text_history += "".join(m["content"] for m in r.chat_messages())
            async with sem:
                out = await request_openai(client, cfg.backend, _input(
                    cfg, r, messages=history, prompt=text_history))
            # The full prompt's length is known only now: the server's count, else our own.
            out.prompt_len = out.prompt_tokens if out.prompt_tokens is not None else (
                count_tokens(text_history))
            outputs[i] = out
            if pbar is not None:
                pbar.update(1)
            if not out.success:
                for j in idx[k + 1:]:
                    outputs[j] = RequestFuncOutput(prompt_len=requests[j].prompt_len,
                                                   error="an earlier turn failed")
                    if pbar is not None:
                        pbar.update(1)
                return
            history = history + [{"role": "assistant", "content": out.generated_text}]
            text_history += out.generated_text

    await asyncio.gather(*(conversation(idx, d) for idx, d in zip(convs.values(), delays)))
    return outputs
