"""Bit-for-bit outputs under the exact integer path (activations mixed on the default model's 4-bit
layers, auto's choice; int16 and int8 checked within themselves below).

Every check is ``torch.equal`` on the stored K/V of each computed token and on the logits of each
sampled position, never a tolerance: a token's numbers must not depend on its batch companions,
on how its prompt was chunked, on whether its context came from the cache (RAM or disk), on
whether it was decoded or prefilled, on preemption, on the thread count or on the ISA path.

Records are keyed by the token ids up to the position (a token's K/V and the logits after it are
functions of exactly those), so runs in different namespaces, engines and batches compare
directly.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from _exact import Recorder, assert_same, cold_and_warm, key, run
from _helpers import BYTES_PER_TOKEN, PROSE, token_budget
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.model.int_linear import (
    WIDE_ROWS,
    IntLinear,
    pack8,
    quantize_activations,
    reference,
    w8_quads,
    wide_groups,
)
from prefixcache.model.linear import quantize_int4, quantize_int8
from prefixcache.model.loader import Int4Groups, Int8Groups, Int8Groups16

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the exact path needs the CPU kernels")

B = 16


def _salt(tag: str) -> str:
    # os.urandom, not random: hypothesis reseeds the random module for every example
    return f"exact-{tag}-{os.urandom(8).hex()}"


@pytest.fixture(scope="module")
def prose_ids(llm):
    return llm.get_tokenizer().encode(PROSE * 20)


def test_default_model_runs_the_exact_path(llm):
    assert llm.engine.runner.model.exact
    assert "exact integer sums" in llm.engine.weights_format
    # the output projection too: the file's Q8_0 groups x mixed activations, integer sums
    head = llm.engine.runner.model.lm_head
    assert isinstance(head, IntLinear) and head.kind == "w8a8x16"


# ---- the kernel against the same integer arithmetic in plain PyTorch


def _int5_offsets(w: torch.Tensor) -> Int8Groups:
    """8-bit groups with a minimum, as GGUF Q5_1/Q5_K load: q in 0..31, w = q d + m."""
    g = w.view(w.shape[0], -1, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 31).clamp_min(1e-8)
    q = torch.round((g - lo.unsqueeze(-1)) / d.unsqueeze(-1)).clamp(0, 31).to(torch.int8)
    return Int8Groups(q.view(w.shape), d, lo)


def _int6_sixteens(w: torch.Tensor) -> Int8Groups16:
    """6-bit groups of 16, as GGUF Q6_K loads: q in -32..31, w = q scale."""
    g = w.view(w.shape[0], -1, 16)
    scale = (g.abs().amax(-1) / 31).clamp_min(1e-8)
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-32, 31).to(torch.int8)
    return Int8Groups16(q.view(w.shape), scale)


def _int2_sixteens(w: torch.Tensor) -> Int8Groups16:
    """2-bit groups of 16 with a minimum, as GGUF Q2_K loads: q in 0..3, w = q scale + offset."""
    g = w.view(w.shape[0], -1, 16)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 3).clamp_min(1e-8)
    q = torch.round((g - lo.unsqueeze(-1)) / d.unsqueeze(-1)).clamp(0, 3).to(torch.int8)
    return Int8Groups16(q.view(w.shape), d, 2, 16, lo)


@pytest.mark.parametrize("weights", ["w4", "w8", "w5m", "w6", "w2m"])
@pytest.mark.parametrize("bits", [16, 8, "mixed"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 16), (5, 96, 40), (70, 576, 200)])
def test_kernel_equals_the_integer_reference_on_every_isa(weights, bits, m, k, n):
    """w5m: 8-bit groups with a minimum (Q5_1/Q5_K), int4's offset epilogue on the 8-bit
    layouts (pairs, and quads on AVX512-VNNI). w6: 6-bit groups of 16 (Q6_K), 8-bit pairs with an
    epilogue per 16 weights; its reference also close to the float product. w2m: the same with
    a minimum per 16 (Q2_K), its offset term over each 16 activations."""
    gen = torch.Generator().manual_seed(m * k + n)
    quantize = {"w4": quantize_int4, "w8": quantize_int8, "w5m": _int5_offsets, "w6": _int6_sixteens,
                "w2m": _int2_sixteens}[weights]
    groups = quantize(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[:, 32:64] *= 6  # a group that stands out of its row (16 bits under mixed)
    x[0, :32] = 0  # an all-zero group: scale 0
    mixed = bits == "mixed"
    bits = 16 if mixed else bits
    if mixed and k >= 96:  # both kinds of group are present (two groups: neither can be wide)
        wide = wide_groups(x.view(m, -1, 32).abs().amax(-1))
        assert wide.any() and not wide.all()
    ref = reference(x, groups, bits, mixed)
    if weights in ("w6", "w2m") and bits == 16 and not mixed:  # the groups of 16 compute this weight's product
        dense = x @ groups.dequantize().T
        assert float((ref - dense).abs().max()) < 1e-3 * float(dense.abs().max())
    for isa in kernels.supported_isas():
        lin = IntLinear(groups, None, bits, isa, mixed)
        y = lin(x)
        assert torch.equal(y, ref), isa
        # one row alone: the same bits as in the batch
        assert torch.equal(lin(x[m // 2 : m // 2 + 1])[0], y[m // 2]), isa


def test_mixed_activations_follow_the_rule_by_hand():
    """Group maxima 1, 1, 1, 10 in a row of 4 groups: energy 103, and a group is wide when
    4 amax^2 > 2 x 103, so only the last keeps 16 bits; the others are 8-bit integers carried
    as 256 a8 with the scale s8 / 256. A zero row is all narrow with scale 0."""
    x = torch.zeros(2, 128)
    x[0, :96] = torch.linspace(-1, 1, 96)
    x[0, 0], x[0, 32], x[0, 64] = 1.0, -1.0, 1.0  # maxima exactly 1
    x[0, 96:] = torch.linspace(-10, 10, 32)
    amax = x.view(2, 4, 32).abs().amax(-1)
    assert wide_groups(amax).tolist() == [[False, False, False, True], [False] * 4]
    a, s = quantize_activations(x, 16, mixed=True)
    s8 = torch.tensor(1.0) / 127
    assert torch.equal(s[0, :3], (s8 / 256).expand(3))
    assert torch.equal(a[0, :96], 256 * torch.round(x[0, :96] / s8).long())
    assert torch.equal(s[0, 3], torch.tensor(10.0) / 32639)
    assert a[0, 96:].abs().max() == 32639 and (a[0, 96:] % 256 != 0).any()
    assert torch.equal(s[1], torch.zeros(4)) and not a[1].any()
    groups = quantize_int4(torch.randn(16, 128, generator=torch.Generator().manual_seed(1)))
    for isa in kernels.supported_isas():
        assert torch.equal(IntLinear(groups, None, 16, isa, mixed=True)(x),
                           reference(x, groups, 16, mixed=True)), isa  # fmt: skip


def test_mixed_is_auto_on_4bit_groups_only(llm):
    """The default model (4-bit GGUF) runs mixed; a mixed layer is closer to int16 than int8 is
    (its wide groups) and different from both."""
    assert llm.engine.runner.model.arithmetic == "w4a8x16"
    gen = torch.Generator().manual_seed(3)
    groups = quantize_int4(torch.randn(64, 256, generator=gen))
    x = torch.randn(9, 256, generator=gen) * torch.exp(torch.randn(1, 256, generator=gen))
    y16, y8, ym = (reference(x, groups, b, m) for b, m in ((16, False), (8, False), (16, True)))
    assert not torch.equal(ym, y16) and not torch.equal(ym, y8)
    assert (ym - y16).abs().mean() < (y8 - y16).abs().mean()


@pytest.mark.parametrize("bits", [16, 8])
def test_kernel_is_exact_at_the_largest_partial_sums(bits):
    """The AVX2 path sums a group's u8 x s8 pair products in 16 bits (|sum| <= 8 x 2 x 15 x 128 =
    30720): every weight at 15 and every activation part at its most negative value (-128 for
    the low part of 16-bit activations, -127 for 8-bit) reach that bound, and the kernel still
    equals the int64 reference."""
    n, k = 32, 96
    groups = Int4Groups(torch.full((n, k), 15, dtype=torch.uint8), torch.ones(n, k // 32),
                        torch.zeros(n, k // 32), 32)  # fmt: skip
    rows = []
    if bits == 16:  # a = 256 h - 128 has low part -128; one element at the group max sets s
        x = torch.full((k,), -(256 * 100 - 128) / 32639.0)
        x[::32] = -1.0
        rows += [x, -x]
    rows += [torch.full((k,), -1.0), torch.full((k,), 1.0)]
    x = torch.stack(rows)
    a, _ = quantize_activations(x, bits)
    if bits == 16:
        lo = a - 256 * torch.div(a + 128, 256, rounding_mode="floor")
        assert (lo[0] == -128).sum() >= k - 3  # the bound is reached
    ref = reference(x, groups, bits)
    for isa in kernels.supported_isas():
        lin = IntLinear(groups, None, bits, isa)
        assert torch.equal(lin(x), ref), isa
        assert torch.equal(lin(x.repeat(9, 1)), ref.repeat(9, 1)), isa  # 16-row tiles (AMX)


@pytest.mark.parametrize(("bits", "mixed"), [(8, False), (16, True), (16, False)])
@pytest.mark.parametrize("q", [127, -128])
def test_8bit_weights_are_exact_at_their_extremes(bits, mixed, q):
    """8-bit quads (u = q + 128 as vpdpbusd's unsigned operand, the offset taken back as
    128 sum(a)): weights at 127 (u = 255) and -128 (u = 0) against activations at both ends,
    where 256 dpbusd(u, hi) is largest (|.| <= 256 x 32 x 255 x 128 < 2^31); equal to the int64
    reference on every path and layout."""
    n, k = 32, 96
    groups = Int8Groups(torch.full((n, k), q, dtype=torch.int8), torch.ones(n, k // 32))
    x = torch.full((6, k), -1.0)
    x[1] = 1.0
    x[2, ::2] = -1.0  # alternating signs
    x[2, 1::2] = 1.0
    x[3, :32] *= 50.0  # a wide group beside narrow ones (mixed)
    x[4] = -(256 * 100 - 128) / 32639.0  # low parts at -128 (16 bits)
    x[4, ::32] = -1.0
    x[5] = -x[4]
    ref = reference(x, groups, bits, mixed)
    for isa in kernels.supported_isas():
        lin = IntLinear(groups, None, bits, isa, mixed)
        assert lin.wq.dtype == (torch.uint8 if w8_quads(isa, bits, mixed) else torch.int8)
        assert torch.equal(lin(x), ref), isa
        assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(6)]), ref), isa  # narrow tiles
        assert torch.equal(lin(x.repeat(6, 1)), ref.repeat(6, 1)), isa  # 16-row tiles (AMX)


def test_4bit_groups_held_as_int8_give_the_nibble_kernels_bits():
    """On AVX2 a wide call with 16-bit activations runs 4-bit groups through int8_linear
    (WIDE_ROWS rows or more) and a narrow one through the nibble kernel: every row is the same
    bits either way."""
    if "avx2" not in kernels.supported_isas():
        pytest.skip("no AVX2")
    gen = torch.Generator().manual_seed(7)
    groups = quantize_int4(torch.randn(48, 128, generator=gen))
    x = torch.randn(WIDE_ROWS + 5, 128, generator=gen) * 3
    lin = IntLinear(groups, None, 16, "avx2")
    assert lin.wq8 is not None and lin.resident_bytes > lin.nbytes
    assert IntLinear(groups, None, 8, "avx2").wq8 is None  # 8-bit activations keep the nibbles
    wide = lin(x)
    one_by_one = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(wide, one_by_one)
    assert torch.equal(wide, reference(x, groups, 16))
    as8 = Int8Groups(groups.q.to(torch.int8), groups.scale)
    for isa in kernels.supported_isas():  # the offset epilogue on every ISA path of int8_linear
        wq8, _ = pack8(as8, quads=w8_quads(isa, 16, False))
        y = kernels.int8_linear(x, wq8, lin.wd, lin.out_features, 16, isa, lin.wm)
        assert torch.equal(y, wide), isa


def test_isa_switch(monkeypatch):
    have = kernels.supported_isas()
    monkeypatch.setenv("PREFIXCACHE_ISA", "avx2")
    assert kernels.isa() == "avx2"
    monkeypatch.setenv("PREFIXCACHE_ISA", "sse9")
    with pytest.raises(ValueError, match="one of"):
        kernels.isa()
    monkeypatch.delenv("PREFIXCACHE_ISA")
    assert kernels.isa() == have[0]
    for name in ("amx", "avx512-vnni"):
        if name not in have:
            monkeypatch.setenv("PREFIXCACHE_ISA", name)
            with pytest.raises(ValueError, match="lacks"):
                kernels.isa()
    if "amx" not in have:  # the kernel refuses the path itself, not only the Python side
        lin = IntLinear(quantize_int4(torch.randn(16, 64)), None, 16, have[-1])
        with pytest.raises(RuntimeError, match="AMX"):
            kernels.int4_linear(torch.randn(16, 64), lin.wq, lin.wd, lin.wm, 16, 16, "amx")


def test_the_model_gives_the_same_bits_on_every_isa_path(llm, prose_ids):
    isas = kernels.supported_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU has one integer path ({isas[0]}): nothing to compare")
    prompt = prose_ids[:70]
    ref = run(llm, [prompt], salt=_salt("isa"))
    with _isa(llm, isas[-1]):  # the lowest: AVX2
        low = run(llm, [prompt], salt=_salt("isa"))
    assert_same(ref, low, min_kv=70, min_logits=4)


@contextlib.contextmanager
def _isa(llm, isa: str):
    """The linears, attention (int16 K/V: integer products) and the decode step on ``isa``."""
    model = llm.engine.runner.model
    lins = [lin for layer in model.layers
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]  # fmt: skip
    assert all(isinstance(lin, IntLinear) for lin in lins)
    objs = [*lins, *model.layers, model]
    before = [obj.isa for obj in objs]
    for obj in objs:
        obj.isa = isa
    try:
        yield
    finally:
        for obj, was in zip(objs, before):
            obj.isa = was


def test_the_same_bits_on_any_thread_count(llm, prose_ids):
    prompt = prose_ids[5:90]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(llm, [prompt], salt=_salt("t1"))
        torch.set_num_threads(2)
        two = run(llm, [prompt], salt=_salt("t2"))
    finally:
        torch.set_num_threads(before)
    assert_same(one, two, min_kv=85, min_logits=4)


# ---- the engine: batches, chunks, cache hits, decode vs prefill


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    companions=st.lists(st.integers(1, 120), min_size=1, max_size=12),
    budget=st.sampled_from([None, 7, 33, 100]),
    seed=st.integers(0, 2**16),
)
def test_a_prompt_alone_equals_it_in_any_batch_and_chunking(llm, prose_ids, companions, budget, seed):
    rng = random.Random(seed)
    target = prose_ids[: 40 + seed % 50]
    alone = run(llm, [target], salt=_salt("alone"))
    others = [[rng.randrange(100, 40000) for _ in range(n)] for n in companions]
    prompts = others[: len(others) // 2] + [target] + others[len(others) // 2 :]
    with token_budget(llm, budget):  # chunked prefill at this token budget
        batched = run(llm, prompts, salt=_salt("batch"))
    assert_same(alone, batched, min_kv=len(target) + 3, min_logits=4)


@pytest.mark.parametrize("k", [1, 3])
def test_cold_equals_warm_bit_for_bit_around_block_boundaries(llm, prose_ids, k):
    for shared in (k * B - 1, k * B, k * B + 1):
        cold, warm, out = cold_and_warm(llm, prose_ids, shared, (_salt("cold"), _salt("warm")))
        # the whole shared part: its full blocks, then the next block's first tokens, copied
        assert out.num_cached_tokens == shared
        # the warm run computed only the suffix, and every number it computed equals cold's
        assert_same(cold, warm, min_kv=30, min_logits=4)
        llm.check_integrity()


def test_decode_steps_run_in_one_native_call(llm, prose_ids, monkeypatch):
    """A decode-only step runs every layer in kernels.exact_decode (exact_decode.cpp); the tests
    around it (decoded vs prefilled, alone vs batched) hold its bits to the per-layer path's."""
    calls = []
    real = kernels.exact_decode
    monkeypatch.setattr(kernels, "exact_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [prose_ids[:20], prose_ids[30:61]]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                 cache_salt=_salt("fused"))  # fmt: skip
    assert len(calls) >= 5  # two prefills, then decode-only steps


def test_a_wide_decode_batch_equals_its_rows_alone(llm, prose_ids):
    """70 sequences decoding together: one exact_decode call per step takes them all as one
    item, 64 rows and more, the 16-row tiles (AMX) and the row remainder (VNNI) included. Each
    row's K/V and logits are the bits it gets alone."""
    prompts = [prose_ids[i : i + 12 + i % 5] for i in range(70)]
    together = run(llm, prompts, max_tokens=3, salt=_salt("wide"))
    for i in (0, 33, 69):
        alone = run(llm, [prompts[i]], max_tokens=3, salt=_salt("wide-alone"))
        assert_same(alone, together, min_kv=len(prompts[i]) + 2, min_logits=3)


def test_rows_sharing_a_cached_prefix_decode_in_groups_with_their_alone_bits(llm, prose_ids, monkeypatch):
    """Six sequences over one cached 300-token prefix, one sharing only 96 tokens of it and one of
    their own decode together: exact_decode attends the six as groups (the prefix's K/V read
    once for each group, kernels.decode_groups on the step's own tables shows it), the other two
    alone. Every row's K/V and logits are the bits it gets alone."""
    groups = []
    real = kernels.exact_decode

    def spy(*a, **k):
        p = a[5].paged  # the step's AttentionMetadata
        groups.append(kernels.decode_groups(p.ctx, p.slots_off, p.slots, 256, 1))
        return real(*a, **k)

    monkeypatch.setattr(kernels, "exact_decode", spy)
    prefix = prose_ids[:300]
    tails = [prose_ids[400 + 37 * i : 401 + 42 * i] for i in range(6)]
    prompts = [prefix + t for t in tails] + [prose_ids[:96] + prose_ids[900:940], prose_ids[1000:1050]]
    salt = _salt("groups")
    run(llm, [prefix], max_tokens=1, salt=salt)  # cached: the batch's prompts hit it
    together = run(llm, prompts, max_tokens=6, salt=salt)
    g = max(groups, key=len)  # a decode step of all eight rows (in the scheduler's order)
    sizes = {int(i): int((g[:, 0] == i).sum()) for i in g[:, 0].unique()}
    assert len(g) == 8 and sorted(sizes.values()) == [1, 1, 6]
    assert sorted(g[:, 1].tolist()) == [0, 0] + [288] * 6  # the prefix's 18 whole blocks
    isas = kernels.supported_isas()
    low = None
    if len(isas) > 1:  # the groups' softmax on AVX2 too (8 queries a pass)
        run(llm, [prefix], max_tokens=1, salt=salt + "-low")
        with _isa(llm, isas[-1]):
            low = run(llm, prompts, max_tokens=6, salt=salt + "-low")
    for i in (0, 5, 6, 7):
        alone = run(llm, [prompts[i]], max_tokens=6, salt=_salt("groups-alone"))
        for batch in (together, low) if low is not None else (together,):
            assert_same(alone, batch, min_kv=len(prompts[i]) - 300 + 5, min_logits=6)


def test_decode_groups_by_shared_prefix():
    """kernels.decode_groups on hand-made tables (int16 contexts in whole units of 16 slots):
    rows sharing 320 keys group, a row sharing 64 and one of its own stay alone, and one sharing
    144 joins only where that is half the best its leader shares; the shared length stops short
    of any row's last key, at a multiple of 32; groups are halved until there are min_groups."""
    def ctx_slots(blocks, tail):  # a context over these 16-slot blocks, `tail` keys of the last
        return [16 * b_ + j for b_ in blocks for j in range(16)][: 16 * len(blocks) - 16 + tail]

    def groups(rows, min_shared=256, min_groups=1):
        lens = [len(r) for r in rows]
        off = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        slots = torch.tensor([x for r in rows for x in r])
        return kernels.decode_groups(torch.tensor(lens), off, slots, min_shared, min_groups)

    p = list(range(20))  # a prefix of 20 blocks, 320 keys
    rows = [ctx_slots(p + [100], 5), ctx_slots(p + [101, 102], 16), ctx_slots(p + [103], 1),
            ctx_slots(p[:5] + [104, 105], 3), ctx_slots([200, 201], 9),
            ctx_slots(p[:9] + [106], 7)]  # fmt: skip
    g = groups(rows)
    assert g[0, 0] == g[1, 0] == g[2, 0] and (g[:3, 1] == 320).all()
    assert len(set(g[:, 0].tolist())) == 4 and (g[3:, 1] == 0).all()
    g = groups(rows, min_groups=5)  # {0}, {1, 2}: each keeps its shared length, a row alone 0
    assert len(set(g[:, 0].tolist())) == 5 and g[1, 0] == g[2, 0] != g[0, 0] and g[0, 1] == 0 and g[1, 1] == 320
    assert groups(rows, min_shared=128)[5, 1] == 0  # 144 keys, 128 in blocks: < half of 320
    g = groups([rows[0], rows[5]], min_shared=128)  # 128 is its leader's best now
    assert g[0, 0] == g[1, 0] and (g[:, 1] == 128).all()
    assert (groups([rows[2], ctx_slots(p, 16)])[:, 1] == 288).all()  # short of 320's last key


def test_decoded_kv_equals_prefilled_kv(llm, prose_ids):
    prompt = prose_ids[10:60]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    with Recorder(llm.engine) as decoded:
        out = llm.generate([prompt], params, cache_salt=_salt("dec"))
    generated = out[0].outputs[0].token_ids
    # the prompt followed by what was generated, prefilled in one pass in a fresh namespace
    prefilled = run(llm, [prompt + generated[:8]], max_tokens=1, salt=_salt("pre"))
    # the K/V of the 8 decoded tokens (and the prompt's)
    assert_same(decoded, prefilled, min_kv=len(prompt) + 8, min_logits=1)
    # the logits after each of them: a prefill that projects every position
    full = prompt + generated[:8]
    every = llm.engine.runner.all_logits(full)
    for p in range(len(prompt) - 1, len(full)):
        assert torch.equal(decoded.logits[key(full[: p + 1])], every[p]), p


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory):
    """A pool of 20 blocks (16 unpinnable: 256 tokens) and a disk tier: requests preempt each other, blocks are
    evicted and come back from disk."""
    return LLM(kv_cache_memory=20 * B * BYTES_PER_TOKEN, disk_cache_dir=str(tmp_path_factory.mktemp("kv")),
               seed=0)  # fmt: skip


def test_the_same_bits_under_preemption_eviction_and_disk_restore(llm, small_llm, prose_ids):
    prompts = [prose_ids[i * 7 : i * 7 + 60 + 9 * i] for i in range(4)]
    alone = [run(llm, [p], max_tokens=12, salt=_salt("ref")) for p in prompts]
    # four at once (~340 tokens) in 256 tokens of KV: some are preempted and recomputed
    preempted = small_llm.engine.scheduler.counters.num_preemptions
    crowded = run(small_llm, prompts, max_tokens=12, salt="crowd")
    assert small_llm.engine.scheduler.counters.num_preemptions > preempted
    for ref in alone:
        assert_same(ref, crowded, min_kv=60, min_logits=12)
    # the first prompt's blocks are evicted by another prompt: its prefix comes back from disk
    assert small_llm.engine.connectors.flush()
    run(small_llm, [prose_ids[500:700]], max_tokens=1, salt="crowd")
    assert small_llm.engine.connectors.flush()
    hits = small_llm.cache_stats()["tiers"]["disk"]["hit_tokens"]
    prompt = prompts[0] + prose_ids[700:710]
    restored = run(small_llm, [prompt], max_tokens=4, salt="crowd")
    assert small_llm.cache_stats()["tiers"]["disk"]["hit_tokens"] >= hits + 48
    cold = run(llm, [prompt], max_tokens=4, salt=_salt("ref2"))
    assert_same(cold, restored, min_kv=10, min_logits=4)
    small_llm.check_integrity()


def _exact_within(llm, tag: str) -> None:
    """Alone vs batched and chunked, decoded vs prefilled: bit for bit."""
    ids = llm.get_tokenizer().encode(PROSE)[:50]
    with Recorder(llm.engine) as alone:
        out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with token_budget(llm, 23):
        batched = run(llm, [ids[:17], ids, ids[3:40]], salt=_salt(tag))
    assert_same(alone, batched, min_kv=50, min_logits=4)
    prefilled = run(llm, [ids + out[0].outputs[0].token_ids[:4]], max_tokens=1, salt=_salt(tag))
    assert_same(alone, prefilled, min_kv=54, min_logits=1)


def test_int16_activations_are_exact_within_themselves():
    """int16 (float32-like quality, no longer auto's choice on 4-bit layers) keeps the bitwise
    contract: alone vs batched and chunked, decoded vs prefilled; its fingerprint is not
    mixed's."""
    a16 = LLM(kv_cache_memory="32MiB", activations="int16", seed=0)
    assert a16.engine.runner.model.arithmetic == "w4a16"
    _exact_within(a16, "a16")
    mixed = LLM(kv_cache_memory="32MiB", activations="mixed", seed=0)
    assert a16.engine.fingerprint != mixed.engine.fingerprint


def test_8bit_groups_with_mixed_activations_are_exact_within_themselves():
    """8-bit groups with mixed activations run the quads (vpdpbusd, one pass for the narrow
    groups) on AVX512-VNNI, prefill and decode-only steps alike: the same contract, and the
    same bits as the AVX2 pairs path (the kernel tests compare both with the reference)."""
    w8 = LLM(kv_cache_memory="32MiB", quantization="int8", activations="mixed", seed=0)
    assert w8.engine.runner.model.arithmetic == "w8a8x16"
    _exact_within(w8, "w8m")


def test_int8_activations_and_int8_kv_are_exact_too():
    """The opt-in 8-bit mode keeps the bitwise contract within itself, over a scaled KV format
    (attention reads the stored values), and carries another fingerprint (its blocks never mix
    with int16's)."""
    a8 = LLM(kv_cache_memory="32MiB", activations="int8", kv_cache_dtype="int8", seed=0)
    ids = a8.get_tokenizer().encode(PROSE)[:50]
    with Recorder(a8.engine) as alone:
        out = a8.generate([ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    batched = run(a8, [ids[:17], ids, ids[3:40]], salt=_salt("a8"))
    assert_same(alone, batched, min_kv=50, min_logits=4)
    prefilled = run(a8, [ids + out[0].outputs[0].token_ids[:4]], max_tokens=1, salt=_salt("a8"))
    assert_same(alone, prefilled, min_kv=54, min_logits=1)
    f32 = LLM(kv_cache_memory="32MiB", activations="float32", seed=0)
    fps = {a8.engine.fingerprint, f32.engine.fingerprint}
    assert len(fps) == 2
    assert not f32.engine.runner.model.exact
