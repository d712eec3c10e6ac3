"""Paged attention against a dense reference, on random tensors (no model).

The shared-prefix (cascade) decode path splits each row's softmax across segments and a tail and
merges them; these tests prove the merge is exact (to float rounding) for flat, nested and
partial sharing, padding and mixed prefill + decode batches, and that the planner only shares
what is really shared.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache import kernels
from prefixcache.kv.formats import kv_format
from prefixcache.kv.pool import LayerKV
from prefixcache.model import decode_attention as da
from prefixcache.model.attention import build_metadata, paged_attention

BS, KVH, G, D = 4, 2, 3, 8
H = KVH * G


def dense_reference(q_rows, k_ctx, v_ctx, scale):
    """Causal attention of the last len(q_rows) positions over a whole context, GQA by repeat."""
    ql, ctx = q_rows.shape[0], k_ctx.shape[0]
    k = k_ctx.repeat_interleave(G, dim=1)  # [ctx, H, D]
    v = v_ctx.repeat_interleave(G, dim=1)
    scores = torch.einsum("qhd,chd->hqc", q_rows.double(), k.double()) * scale
    pos_q = torch.arange(ctx - ql, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqc,chd->qhd", scores.softmax(-1), v.double())


class World:
    """A block pool of random K/V and sequences described by block tables."""

    def __init__(self, num_blocks: int, dtype=torch.float32, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(KVH, num_blocks * BS, D, generator=gen).to(dtype)
        self.v = torch.randn(KVH, num_blocks * BS, D, generator=gen).to(dtype)
        self.gen, self.dtype = gen, dtype
        self.free = list(range(num_blocks))[::-1]

    def blocks(self, n):
        return [self.free.pop() for _ in range(n)]

    def run(self, tables, done, new, share=True, native=False):
        """paged_attention for one step and the dense reference for every sequence."""
        t = sum(new)
        q = torch.randn(t, H, D, generator=self.gen).to(self.dtype)
        k_new = torch.randn(t, KVH, D, generator=self.gen).to(self.dtype)
        v_new = torch.randn(t, KVH, D, generator=self.gen).to(self.dtype)
        meta = build_metadata(
            tables, done, new, BS, torch.device("cpu"), share_prefixes=share, native=native
        )
        k, v = self.k.clone(), self.v.clone()
        fmt = kv_format("auto", self.dtype)
        out = paged_attention(q, k_new, v_new, LayerKV(k, v, None, None, fmt, native), meta, D**-0.5)
        refs, start = [], 0
        for table, c, n in zip(tables, done, new):
            pos = torch.arange(c + n)
            slots = torch.tensor(table)[pos // BS] * BS + pos % BS
            refs.append(dense_reference(q[start : start + n], k[:, slots].transpose(0, 1),
                                        v[:, slots].transpose(0, 1), D**-0.5))  # fmt: skip
            start += n
        return out, torch.cat(refs), meta


def test_flat_sharing_equals_dense():
    w = World(64)
    shared = w.blocks(6)  # 24 tokens shared by four sequences
    tables = [shared + w.blocks(3) for _ in range(4)]
    done = [24 + 5, 24 + 8, 24 + 2, 24 + 11]  # different own lengths: tail padding
    out, ref, meta = w.run(tables, done, [1] * 4)
    assert len(meta.decode.segments) == 1
    assert meta.decode.segments[0].rows.tolist() == [0, 1, 2, 3]
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_nested_and_partial_sharing_equals_dense():
    w = World(128)
    system = w.blocks(5)
    doc_a, doc_b = w.blocks(4), w.blocks(6)
    tables = [
        system + doc_a + w.blocks(2),  # rows 0, 1: system + doc a
        system + doc_a + w.blocks(3),
        system + doc_b + w.blocks(2),  # rows 2, 3: system + doc b
        system + doc_b + w.blocks(2),
        system + w.blocks(7),  # row 4: only the system prompt is shared
        w.blocks(8),  # row 5: shares nothing
    ]
    done = [(len(t) - 1) * BS + 1 for t in tables]
    out, ref, meta = w.run(tables, done, [1] * len(tables))
    rows = sorted(s.rows.tolist() for s in meta.decode.segments)
    assert rows == [[0, 1], [0, 1, 2, 3, 4], [2, 3]]
    assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("share", [True, False])
def test_long_unshared_tail_gets_its_own_bucket(share):
    """One sequence sharing nothing among many sharing a prefix: tails are padded in buckets of
    similar length, not all to the longest, and the result is still exact."""
    w = World(256)
    shared = w.blocks(10)
    tables = [shared + w.blocks(2) for _ in range(6)] + [w.blocks(12)]
    done = [40 + i for i in range(6)] + [45]
    out, ref, meta = w.run(tables, done, [1] * 7, share=share)
    widths = sorted(b.slots.shape[1] for b in meta.decode.tails)
    if share:
        assert len(meta.decode.tails) == 2 and widths == [6, 46]  # short tails padded together
    else:
        assert len(meta.decode.tails) == 1  # all contexts are ~45 long
    assert sum(b.slots.shape[0] for b in meta.decode.tails) == 7
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_bucket_by_length():
    assert da.bucket_by_length([10, 100, 12, 30, 95, 11], 4) == [[0, 5, 2], [3], [4, 1]]
    assert da.bucket_by_length([5, 5, 5], 16) == [[0, 1, 2]]


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
NATIVE = [False, pytest.param(True, marks=needs_kernels, id="native")]


@pytest.mark.parametrize("native", NATIVE)
def test_mixed_prefill_and_decode_batch(native):
    """Decodes and prefill chunks in one step; native covers the flash-style prefill kernel
    (chunks over cached context and fresh prompts) as well as the decode kernel."""
    w = World(128)
    shared = w.blocks(8)
    tables = [shared + w.blocks(2), shared + w.blocks(2), shared + w.blocks(4), w.blocks(5)]
    # two decodes sharing the prefix, a prefill chunk over the cached prefix, a fresh prompt
    done, new = [33, 36, 32, 0], [1, 1, 9, 17]
    out, ref, meta = w.run(tables, done, new, native=native)
    assert len(meta.seqs) == 2 and meta.decode.rows.tolist() == [0, 1]
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_bfloat16_sharing_close_to_dense():
    w = World(64, dtype=torch.bfloat16)
    shared = w.blocks(8)
    tables = [shared + w.blocks(2) for _ in range(3)]
    out, ref, meta = w.run(tables, [34, 35, 33], [1, 1, 1])
    assert meta.decode.segments
    assert torch.allclose(out.double(), ref, atol=3e-2)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("seed", range(5))
def test_random_trees_shared_equals_unshared(seed, native):
    """Random prefix trees, contexts ending on and next to block boundaries: the shared path
    gives the same outputs as attending every row over its own context (the native kernel
    too: it reads K/V in place, segments once, tails unpadded)."""
    rng = random.Random(seed)
    w = World(512, seed=seed)
    roots = [w.blocks(rng.randint(4, 10)) for _ in range(3)]
    branches = [rng.choice(roots) + w.blocks(rng.randint(0, 6)) for _ in range(5)]
    tables, done = [], []
    for _ in range(12):
        base = rng.choice(branches)
        own = rng.randint(1, 3)
        tables.append(base + w.blocks(own))
        done.append(len(base) * BS + rng.choice([0, 1, BS - 1, own * BS - 1]))
    out, ref, meta = w.run(tables, done, [1] * len(tables), native=native)
    assert meta.decode.segment_sizes()  # the tree is shared somewhere
    assert torch.allclose(out.double(), ref, atol=1e-5)
    plain_out, plain_ref, plain_meta = w.run(tables, done, [1] * len(tables), False, native)
    assert plain_meta.decode.segment_sizes() == []
    assert torch.allclose(plain_out.double(), plain_ref, atol=1e-5)


def test_planner_respects_thresholds_and_new_token_block():
    # 3 full shared blocks: below MIN_SEGMENT_BLOCKS, nothing is shared
    segs, tail = da.plan_decodes([[0, 1, 2, 3], [0, 1, 2, 4]], [13, 13], BS)
    assert segs == [] and tail == [0, 0]
    # the block holding the new token is never part of a segment, even if the ids match
    tables = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6]]
    segs, tail = da.plan_decodes(tables, [4 * BS + 1, 5 * BS + 2], BS)
    assert segs == [([0, 1], [0, 1, 2, 3])] and tail == [4 * BS, 4 * BS]
    # a lone sequence shares with nobody
    assert da.plan_decodes([[0, 1, 2, 3, 4, 5]], [22], BS) == ([], [0])
    assert da.plan_decodes(tables, [4 * BS + 1, 5 * BS + 2], BS, share_prefixes=False)[0] == []


@needs_kernels
@pytest.mark.parametrize("t,c", [(1, 1), (3, 3), (17, 17), (16, 40), (33, 33), (64, 200), (100, 100)])
def test_native_prefill_attention_equals_dense(t, c):
    """The flash-style kernel against the dense reference: every query row sees exactly the keys
    up to its own position, across key-block (32) and row-block (16) boundaries."""
    gen = torch.Generator().manual_seed(t * 1000 + c)
    q = torch.randn(t, H, D, generator=gen)
    k = torch.randn(KVH, c, D, generator=gen)
    v = torch.randn(KVH, c, D, generator=gen)
    out = kernels.prefill_attention(q, k, v, D**-0.5)
    ref = dense_reference(q, k.transpose(0, 1), v.transpose(0, 1), D**-0.5)
    assert torch.allclose(out.double(), ref, atol=1e-5)
