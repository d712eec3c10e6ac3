"""The simulator and the engine agree: a Mooncake trace replayed through the real engine (the
default model, one request at a time, one output token) hits exactly what the engine model of
``analyze --engine-model`` (analyze/engine_sim.py) predicts, for every eviction policy."""

from __future__ import annotations

import json
import random

import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.analyze.engine_sim import simulate_engine, trace_prompts
from prefixcache.analyze.trace_sim import simulate_trace
from prefixcache.bench.mooncake import parse_request

BT = 4  # tokens per hash block, and the engine's block size
# blocks of 4 tokens: the KV stays float32 (int16's layout needs multiples of 16), default model
BYTES_PER_TOKEN = 46080


def _trace(seed: int, n: int) -> list:
    """Conversations over a few shared roots, with partial last blocks and exact repeats."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    rows, next_id = [], 100
    for t in range(n):
        if convs and rng.random() < 0.2:
            path = list(rng.choice(convs))  # a repeat of a conversation's last prompt
        else:
            if convs and rng.random() < 0.6:
                path = rng.choice(convs)
            else:
                path = [rng.randrange(3)]
                convs.append(path)
            for _ in range(rng.randrange(1, 3)):
                path.append(next_id)
                next_id += 1
            if len(path) > 12:
                convs.remove(path)
        tail = rng.choice((512, 512, 300, 40))  # a full or a partial last block
        row = {"timestamp": t, "input_length": 512 * (len(path) - 1) + tail,
               "output_length": 1, "hash_ids": list(path)}
        rows.append(parse_request(json.dumps(row)))
    return rows


@pytest.mark.parametrize("policy", ["lru", "lru-demote", "hit-density", "adaptive"])
def test_live_engine_hits_what_the_engine_model_predicts(policy):
    reqs = _trace(11, 70)
    prompts = trace_prompts(reqs, BT, vocab=2000)
    blocks = 2 * max(len(p) for p in prompts) // BT
    sim = simulate_engine(reqs, policy, blocks, BT, prompts=prompts)
    llm = LLM(kv_cache_memory=blocks * BT * BYTES_PER_TOKEN, block_size=BT, seed=0,
              eviction_policy=policy)
    assert llm.engine.kv.pool.num_blocks == blocks
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for p in prompts:
        llm.generate([p], greedy)
    llm.engine.check_integrity()
    stats = llm.cache_stats()
    assert sim.evicted_blocks > 20  # the pool was full: the policy chose victims
    assert (stats["query_tokens"], stats["hit_tokens"], stats["evicted_blocks"]) == (
        sim.query_tokens, sim.hit_tokens, sim.evicted_blocks)
    # and the trace model is near: the engine's differences are small here
    assert abs(sim.hit_rate - simulate_trace(reqs, policy, blocks).hit_rate) < 0.1
