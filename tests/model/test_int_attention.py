"""Attention on the integer units over int16 K/V (kernels/int_attention.h), on random tensors.

The kernel against a float64 model of its own arithmetic (queries rounded to Q(D), blocks of 32
keys with a running max, value weights rounded to 14 bits against each block's largest) and
against plain float softmax attention; the same bits on every ISA path, for a query alone or in
any chunk or batch; the int32 sums at their bounds; and the int16 pool layout (16-slot units):
what the native and Python stores write, gathers and partial-block copies.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache import LLM, kernels
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import KVCache, KVLayout, LayerKV
from prefixcache.model.attention import PagedBatch
from prefixcache.model.config import ModelConfig

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
FMT = kv_format("int16", torch.float32, exact=True)
KVH, G = 2, 3
H = KVH * G


def pool(n_slots: int, d: int, seed: int = 0, k_gain: float = 2.0) -> LayerKV:
    kv = LayerKV(torch.zeros(KVH, n_slots, d, dtype=torch.int16), torch.zeros(KVH, n_slots, d, dtype=torch.int16),
                 torch.zeros(KVH, n_slots), torch.zeros(KVH, n_slots), FMT, True)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    kv.store(torch.arange(n_slots), torch.randn(n_slots, KVH, d, generator=gen) * k_gain,
             torch.randn(n_slots, KVH, d, generator=gen))  # fmt: skip
    return kv


def context(n: int, n_slots: int, seed: int) -> torch.Tensor:
    """n slots in whole units of 16 (as block tables give them), units in random order."""
    units = torch.randperm(n_slots // 16, generator=torch.Generator().manual_seed(seed))[: (n + 15) // 16]
    return (units[:, None] * 16 + torch.arange(16)).flatten()[:n]


def batch(seqs: list[tuple[int, torch.Tensor]]) -> PagedBatch:
    """seqs: (queries, context slots) per sequence, queries at the end of their context."""
    q_len = [n for n, _ in seqs]
    ctx = [len(s) for _, s in seqs]
    starts, offs = [0], [0]
    for n, c in zip(q_len, ctx):
        starts.append(starts[-1] + n)
        offs.append(offs[-1] + c)
    return PagedBatch(torch.tensor(starts[:-1]), torch.tensor(q_len), torch.tensor(ctx), torch.tensor(offs),
                      torch.cat([s for _, s in seqs]))  # fmt: skip


def reference(q, k, v, sv, scale: float, first: int, float_weights: bool = False) -> torch.Tensor:
    """The kernel's arithmetic in float64: q [T, H, D] at positions first.., k, v [KVH, C, D] as
    stored (dequantized), sv [KVH, C] V's scales."""
    t, h, d = q.shape
    qmax = 8191.0 if d <= 64 else 4095.0 if d <= 128 else 2047.0
    q = q.double()
    sq = (q.abs().amax(-1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    qi = torch.round(q / sq).clamp(-qmax, qmax) * sq
    out = torch.empty(t, h, d, dtype=torch.float64)
    for i in range(t):
        for hh in range(h):
            kh = hh // (h // k.shape[0])
            n = first + i + 1
            s = (k[kh, :n].double() @ qi[i, hh]) * scale
            m, l, o = -torch.inf, 0.0, torch.zeros(d, dtype=torch.float64)
            for b0 in range(0, n, 32):
                sb = s[b0 : b0 + 32]
                m_new = max(m, float(sb.max()))
                p = torch.exp(sb - m_new)
                w_old = 0.0 if m == -torch.inf else float(torch.exp(torch.tensor(m - m_new)))
                vb = v[kh, b0 : b0 + len(sb)].double()
                if not float_weights:  # w = p sv rounded to 14 bits against the block's largest
                    svb = sv[kh, b0 : b0 + len(sb)].double()
                    w = p * svb
                    us = float(w.max()) / 16383
                    p = torch.round(w / us) * us / svb
                o = o * w_old + p @ vb
                l = l * w_old + float(torch.exp(sb - m_new).sum())
                m = m_new
            out[i, hh] = o / l
    return out


@pytest.mark.parametrize("ctx,ql", [(1, 1), (31, 31), (32, 5), (33, 1), (100, 37), (250, 1)])
def test_kernel_follows_its_arithmetic(ctx, ql):
    d = 64
    kv = pool(512, d)
    slots = context(ctx, 512, seed=ctx)
    q = torch.randn(ql, H, d, generator=torch.Generator().manual_seed(ql))
    k, v = kv.gather(slots, torch.float32)
    out = kernels.paged_attention(q, kv, batch([(ql, slots)]), d**-0.5, kernels.supported_isas()[0])
    # rounding a weight to the other side of a half step moves an output by |v| / 16383 at most
    sv = kv.v_scale[:, slots]
    ref = reference(q, k, v, sv, d**-0.5, ctx - ql)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-3)
    exact = reference(q, k, v, sv, d**-0.5, ctx - ql, float_weights=True)  # close to float softmax too
    torch.testing.assert_close(out.double(), exact, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_same_bits_on_every_isa_and_in_any_chunk_or_batch(d):
    kv = pool(1024, d, seed=d)
    gen = torch.Generator().manual_seed(7)
    a, b = context(300, 1024, seed=1), context(77, 1024, seed=2)
    qa, qb = torch.randn(40, H, d, generator=gen), torch.randn(9, H, d, generator=gen)
    scale = d**-0.5
    outs = {}
    for isa in kernels.supported_isas():
        both = kernels.paged_attention(torch.cat([qa, qb]), kv, batch([(40, a), (9, b)]), scale, isa)
        outs[isa] = both
        alone = kernels.paged_attention(qa, kv, batch([(40, a)]), scale, isa)
        assert torch.equal(both[:40], alone), isa
        for i in (0, 17, 39):  # one query alone, as a decode of its prefix
            one = kernels.paged_attention(qa[i : i + 1], kv, batch([(1, a[: 300 - 40 + i + 1])]), scale, isa)
            assert torch.equal(one[0], alone[i]), (isa, i)
        split = torch.cat([kernels.paged_attention(qa[:13], kv, batch([(13, a[:273])]), scale, isa),
                           kernels.paged_attention(qa[13:], kv, batch([(27, a)]), scale, isa)])  # fmt: skip
        assert torch.equal(split, alone), isa
    first = next(iter(outs.values()))
    assert all(torch.equal(first, o) for o in outs.values())


def test_sliding_window_same_bits_on_every_isa_and_in_any_chunk():
    """A sliding window (Gemma 3's local layers) masks keys before p - W + 1 inside a block: the
    same bits on every ISA path (the AVX512 softmax builds its masks differently from AVX2's),
    alone, chunked, as one decode; and a window past the context is plain attention."""
    d, w = 64, 50
    kv = pool(512, d, seed=3)
    ctx = context(300, 512, seed=4)
    q = torch.randn(40, H, d, generator=torch.Generator().manual_seed(8))
    scale = d**-0.5
    outs = []
    for isa in kernels.supported_isas():
        whole = kernels.paged_attention(q, kv, batch([(40, ctx)]), scale, isa, window=w)
        split = torch.cat([kernels.paged_attention(q[:11], kv, batch([(11, ctx[:271])]), scale, isa, window=w),
                           kernels.paged_attention(q[11:], kv, batch([(29, ctx)]), scale, isa, window=w)])  # fmt: skip
        assert torch.equal(split, whole), isa
        one = kernels.paged_attention(q[39:], kv, batch([(1, ctx)]), scale, isa, window=w)
        assert torch.equal(one[0], whole[39]), isa
        full = kernels.paged_attention(q, kv, batch([(40, ctx)]), scale, isa)
        assert torch.equal(kernels.paged_attention(q, kv, batch([(40, ctx)]), scale, isa, window=300), full), isa
        assert not torch.equal(whole, full), isa
        outs.append(whole)
    assert all(torch.equal(outs[0], o) for o in outs)
    k, v = kv.gather(ctx, torch.float32)
    sv = kv.v_scale[:, ctx]
    ref = reference(q[39:], k[:, 300 - w :], v[:, 300 - w :], sv[:, 300 - w :], scale, w - 1, float_weights=True)
    torch.testing.assert_close(outs[0][39:].double(), ref, atol=3e-3, rtol=3e-3)


def test_int32_sums_at_their_bounds():
    """Scores at D * 8191 * 4095 (key 0 wins only if no sum wrapped) and value sums at
    32 * 16383 * 4095 (all weights equal and at their top, every V at +4095): the output is
    exactly key 0's V where a wrap would flip signs."""
    d, n = 64, 32
    kv = LayerKV(torch.zeros(1, n, d, dtype=torch.int16), torch.zeros(1, n, d, dtype=torch.int16),
                 torch.zeros(1, n), torch.zeros(1, n), FMT, True)  # fmt: skip
    k = torch.full((n, 1, d), -1.0)
    k[0] = 1.0
    kv.store(torch.arange(n), k, torch.full((n, 1, d), 1.0))
    assert int(kv.k.abs().max()) == 4095 and int(kv.v.min()) == 4095
    q = torch.full((1, 1, d), 3.0)
    for isa in kernels.supported_isas():
        out = kernels.paged_attention(q, kv, batch([(1, torch.arange(n))]), 1.0, isa)
        torch.testing.assert_close(out, torch.ones(1, 1, d), rtol=1e-6, atol=0)  # weight 1 on key 0
        # every key equal: all weights 1, u all 16383, acc = 32 * 16383 * 4095 < 2^31
        flat = kernels.paged_attention(torch.zeros(1, 1, d), kv, batch([(1, torch.arange(n))]), 1.0, isa)
        torch.testing.assert_close(flat, torch.ones(1, 1, d), rtol=1e-6, atol=0)


def test_pool_layout_in_units_of_16():
    """Python and native stores write the same bytes in the unit layout; gathers read them back;
    a partial-block copy (partial reuse) moves a slot's values wherever the layout keeps them."""
    d = 32
    ref = LayerKV(torch.zeros(KVH, 64, d, dtype=torch.int16), torch.zeros(KVH, 64, d, dtype=torch.int16),
                  torch.zeros(KVH, 64), torch.zeros(KVH, 64), FMT, False)  # fmt: skip
    nat = LayerKV(ref.k.clone(), ref.v.clone(), ref.k_scale.clone(), ref.v_scale.clone(), FMT, True)
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([3, 16, 17, 31, 40, 0, 63])
    k_new, v_new = torch.randn(7, KVH, d, generator=gen), torch.randn(7, KVH, d, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(ref.store(slots, k_new, v_new), nat.store(slots, k_new, v_new)))
    assert torch.equal(ref.k, nat.k) and torch.equal(ref.v, nat.v) and torch.equal(ref.k_scale, nat.k_scale)
    # without the stored values returned (callers that read the pool): the same bytes; and ties
    # (x / s exactly half-way, s = 1 where the row's largest is 4095) round to even on both
    ties = torch.tensor([4095.0, 2.5, -3.5, 0.5, -0.5, 1.5, 4094.5, -4095.0] * (d // 8))
    k_new[1], v_new[4] = ties.expand(KVH, d), -ties.expand(KVH, d)
    seen = ref.store(slots, k_new, v_new)
    assert nat.store(slots, k_new, v_new, seen=False) is None and ref.store(slots, k_new, v_new, seen=False) is None
    assert torch.equal(ref.k, nat.k) and torch.equal(ref.v, nat.v) and torch.equal(ref.v_scale, nat.v_scale)
    assert seen[0][1, 0, :8].tolist() == [4095.0, 2.0, -4.0, 0.0, -0.0, 2.0, 4094.0, -4095.0]
    # K of slot 17, dimensions 4 and 5: int32 pair 2 of unit 1, lane 1
    q17 = torch.round(k_new[2, 0] / ref.k_scale[0, 17]).to(torch.int16)
    unit = ref.k[0, 16:32].flatten()
    assert int(unit[(2 * 16 + 1) * 2]) == int(q17[4]) and int(unit[(2 * 16 + 1) * 2 + 1]) == int(q17[5])
    k_back, _ = ref.gather(slots, torch.float32)
    torch.testing.assert_close(k_back.transpose(0, 1), k_new, atol=float(ref.k_scale.max()) / 2 + 1e-7, rtol=0)
    config = ModelConfig("llama", vocab_size=8, hidden_size=KVH * d, intermediate_size=8, num_layers=1,
                         num_heads=KVH, num_kv_heads=KVH, head_dim=d, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    cache = KVCache(config, KVLayout(4, 16, FMT.bytes_per_token(1, KVH, d), FMT), torch.device("cpu"))
    layer = cache.layer(0)
    layer.store(torch.arange(16, 32), torch.randn(16, KVH, d, generator=gen), torch.randn(16, KVH, d, generator=gen))
    cache.copy_tokens([(1, 3, 5)])  # the first 5 tokens of block 1 into block 3
    a, b = layer.gather(torch.arange(16, 21), torch.float32), layer.gather(torch.arange(48, 53), torch.float32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCache(config, KVLayout(4, 8, FMT.bytes_per_token(1, KVH, d), FMT), torch.device("cpu"))


def test_int16_is_the_exact_paths_default_and_refused_elsewhere():
    assert kv_format("auto", torch.float32, exact=True).name == "int16"
    assert kv_format("auto", torch.float32, exact=True, block_size=8).name == "float32"
    assert kv_format("auto", torch.float32, exact=False).name == "float32"
    with pytest.raises(ValueError, match="exact integer path"):
        kv_format("int16", torch.float32, exact=False)
    with pytest.raises(ValueError, match="multiple of 16"):
        LLM(kv_cache_dtype="int16", block_size=8, kv_cache_memory="4MiB")
