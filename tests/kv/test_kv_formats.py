"""KV cache dtypes (kv/formats.py, kernels/kv_store.cpp): what is stored, and cold == warm in each.

Unit: the native store writes the same bytes and scales as the Python reference and returns what
it stored; reading back gives those values; the native decode attention over a quantized cache
equals the reference path. Engine (real model): in every KV dtype a prefix served from the cache
gives the same greedy tokens as a cold run, at prefix lengths k*16-1 / k*16 / k*16+1, under
eviction, preemption and chunked prefill; sizes and keys follow the dtype.
"""

from __future__ import annotations

import random

import pytest
import torch
from _helpers import PROSE, shared_default_weights

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import LayerKV
from prefixcache.model.attention import build_metadata, paged_attention

FORMATS = ["float32", "bfloat16", "int16", "int8", "fp8_e4m3"]
QUANTIZED = ["bfloat16", "int8", "fp8_e4m3"]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


def _layer(fmt, kvh=3, slots=64, d=64, native=False) -> LayerKV:
    k = torch.zeros(kvh, slots, d, dtype=fmt.storage)
    scales = (torch.zeros(kvh, slots), torch.zeros(kvh, slots)) if fmt.scaled else (None, None)
    return LayerKV(k, torch.zeros_like(k), *scales, fmt, native)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("name", FORMATS)
def test_stored_values_are_what_attention_sees(name):
    fmt = kv_format(name, torch.float32, exact=True)
    kv = _layer(fmt)
    gen = torch.Generator().manual_seed(1)
    k_new, v_new = torch.randn(10, 3, 64, generator=gen) * 4, torch.randn(10, 3, 64, generator=gen)
    k_new[2, 1] = 0  # an all-zero row has a tiny scale, not a division by zero
    slots = torch.tensor([5, 7, 1, 63, 20, 21, 22, 40, 41, 0])
    k_seen, v_seen = kv.store(slots, k_new, v_new)
    k_back, v_back = kv.gather(slots, torch.float32)
    assert torch.equal(k_back, k_seen.transpose(0, 1)) and torch.equal(v_back, v_seen.transpose(0, 1))
    assert torch.equal(k_seen[2, 1], torch.zeros(64))
    err = (k_seen - k_new).abs()
    if name == "float32":
        assert torch.equal(k_seen, k_new)
    elif name == "bfloat16":
        assert bool((err <= k_new.abs() * 2**-8).all())
    else:  # half a step of the row's scale (int8, int16), an e4m3 mantissa step (fp8)
        step = kv.k_scale.index_select(1, slots).transpose(0, 1).unsqueeze(-1)
        bound = step * 0.5 if name in ("int8", "int16") else k_new.abs() * 2**-4 + step * 2**-9
        assert bool((err <= bound * (1 + 1e-6)).all())


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_native_store_writes_the_references_bytes(name):
    fmt = kv_format(name, torch.float32, exact=True)
    ref, nat = _layer(fmt), _layer(fmt, native=True)
    gen = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(17, 3, 64, generator=gen) * 3, torch.randn(17, 3, 64, generator=gen)
    slots = torch.randperm(64, generator=gen)[:17]
    a, b = ref.store(slots, k_new, v_new), nat.store(slots, k_new, v_new)
    assert torch.equal(_bytes(ref.k), _bytes(nat.k)) and torch.equal(_bytes(ref.v), _bytes(nat.v))
    if fmt.scaled:
        assert torch.equal(ref.k_scale, nat.k_scale) and torch.equal(ref.v_scale, nat.v_scale)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_kernels
@pytest.mark.parametrize("name", QUANTIZED)
def test_native_decode_attention_over_quantized_cache_equals_reference(name):
    """Random prefix trees over a quantized cache: the native kernel (reading stored rows in
    place) and the reference path (gather, dequantize, matmul) agree to float32 rounding."""
    fmt = kv_format(name, torch.float32)
    bs, blocks = 4, 256
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    cache = _layer(fmt, kvh=2, slots=blocks * bs, d=16)
    everything = torch.arange(blocks * bs)
    cache.store(everything, torch.randn(blocks * bs, 2, 16, generator=gen) * 2,
                torch.randn(blocks * bs, 2, 16, generator=gen))  # fmt: skip
    free = list(range(blocks))
    roots = [[free.pop() for _ in range(rng.randint(4, 8))] for _ in range(2)]
    tables, done = [], []
    for _ in range(8):
        base = rng.choice(roots)
        own = [free.pop() for _ in range(rng.randint(1, 3))]
        tables.append(base + own)
        done.append(len(base) * bs + rng.choice([0, 1, bs - 1]))
    q = torch.randn(len(tables), 6, 16, generator=gen)
    k_new = torch.randn(len(tables), 2, 16, generator=gen)
    v_new = torch.randn(len(tables), 2, 16, generator=gen)
    outs = []
    for native in (False, True):
        kv = LayerKV(cache.k.clone(), cache.v.clone(), cache.k_scale.clone() if fmt.scaled else None,
                     cache.v_scale.clone() if fmt.scaled else None, fmt, native)  # fmt: skip
        meta = build_metadata(tables, done, [1] * len(tables), bs, torch.device("cpu"), native=native)
        assert meta.decode.segment_sizes()  # shared segments are exercised
        outs.append(paged_attention(q, k_new, v_new, kv, meta, 0.25))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


# ---- engine, real model --------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
B = 16


@pytest.fixture(scope="module")
def engines():
    """Per KV dtype: a warm engine (caching on, small pool: evictions happen), a cold reference."""
    out = {}
    with shared_default_weights():
        for name in QUANTIZED:
            out[name] = (
                LLM(kv_cache_dtype=name, kv_cache_memory=48 * B * 12240, seed=0),
                LLM(kv_cache_dtype=name, kv_cache_memory="64MiB", enable_prefix_caching=False, seed=0),
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED)
def test_cold_equals_warm_around_block_boundaries(engines, name):
    warm, cold = engines[name]
    tok = warm.get_tokenizer()
    doc = tok.encode(PROSE * 10)
    for k in (1, 5):
        for shared in (k * B - 1, k * B, k * B + 1):
            prompts = [doc[:shared] + tok.encode(" Question: what is cached?"),
                       doc[:shared] + tok.encode(" Which city is in Spain?")]  # fmt: skip
            salt = f"{name}-{shared}"
            first = warm.generate([prompts[0]], GREEDY, cache_salt=salt)[0]
            second = warm.generate([prompts[1]], GREEDY, cache_salt=salt)[0]
            ref = cold.generate(prompts, GREEDY)
            assert second.num_cached_tokens == shared  # whole blocks, then a partial one's
            assert first.outputs[0].token_ids == ref[0].outputs[0].token_ids
            assert second.outputs[0].token_ids == ref[1].outputs[0].token_ids
            warm.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_cold_equals_warm_under_eviction_and_chunked_prefill(engines, name):
    warm, cold = engines[name]
    tok = warm.get_tokenizer()
    base = tok.encode(PROSE * 6)
    # a hot 48-token head and distinct tails: more full blocks than the pool's 48
    prompts = [base[:48] + base[60 + i * 40 : 160 + i * 40] for i in range(10)]
    for _round in range(2):
        for p in prompts:
            assert warm.generate([p], GREEDY)[0].outputs[0].token_ids == \
                cold.generate([p], GREEDY)[0].outputs[0].token_ids  # fmt: skip
    assert warm.cache_stats()["evicted_blocks"] > 0
    # chunked prefill: a long prompt in 32-token chunks, over a cached head
    with shared_default_weights():
        chunked = LLM(kv_cache_dtype=name, kv_cache_memory="64MiB", max_num_batched_tokens=32, seed=0)
    long = base[:48] + base[400:560]
    chunked.generate([base[:48] + base[700:720]], GREEDY)  # caches the head
    got = chunked.generate([long], GREEDY)[0]
    assert got.num_cached_tokens == 48
    assert got.outputs[0].token_ids == cold.generate([long], GREEDY)[0].outputs[0].token_ids


@pytest.mark.slow
def test_cold_equals_warm_under_preemption_int8(engines):
    _, cold = engines["int8"]
    tok = cold.get_tokenizer()
    doc = tok.encode(PROSE * 6)
    # 6 blocks for two 30-token prompts that each grow past 2 blocks: one is preempted
    with shared_default_weights():
        small = LLM(kv_cache_dtype="int8", kv_cache_memory=6 * B * 12240, pin_budget_fraction=0.0,
                    seed=0)  # fmt: skip
    prompts = [doc[:30], doc[100:130]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.counters.num_preemptions > 0
    ref = cold.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    small.check_integrity()


@pytest.mark.slow
def test_sizes_keys_and_reports_follow_the_kv_dtype(engines, llm):
    auto = llm.cache_stats()  # the exact path's default: int16
    int8 = engines["int8"][0].cache_stats()
    assert auto["kv_cache_dtype"] == "int16" and auto["bytes_per_token"] == 23760
    assert int8["kv_cache_dtype"] == "int8" and int8["bytes_per_token"] == 12240
    assert engines["bfloat16"][1].cache_stats()["bytes_per_token"] == 23040
    assert int8["capacity_tokens"] == int8["total_blocks"] * B
    fingerprints = {llm.engine.fingerprint} | {w.engine.fingerprint for w, _ in engines.values()}
    assert len(fingerprints) == 4  # blocks of different KV dtypes never share a key


@pytest.mark.slow
def test_fused_decode_equals_layer_by_layer_int8(engines, monkeypatch):
    warm, _ = engines["int8"]
    model = warm.engine.runner.model
    if model.fused_layers is None:
        pytest.skip("no fused decode path here")
    tok = warm.get_tokenizer()
    prompts = [tok.encode(PROSE)[: 5 * B] + tok.encode(f" Question {i}?") for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    fused = warm.generate(prompts, params, cache_salt="f-on")
    monkeypatch.setattr(model, "fused_layers", None)
    plain = warm.generate(prompts, params, cache_salt="f-off")
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
