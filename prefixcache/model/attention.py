"""Attention over the paged KV cache for a flat batch of sequences (prefill chunks and decodes).

The batch is flat: the new tokens of every scheduled sequence, concatenated.

    tokens:  [ s0: q0 q1 q2 | s1: q0 | s2: q0 q1 ]       T = 6 new tokens
    s0 has 32 earlier tokens in the cache, so its context is 35 slots and query i sees slots
    [0, 32 + i]; s1 is a decode (context = everything before + itself).

Per layer: the new K/V are written to their slots first, then each sequence attends to its
context gathered from the cache (slot ids computed once per step and shared by all layers).
Prefill chunks attend one by one (``_attend``, or the native flash-style kernel
``kernels.prefill_attention`` in float32 on CPU); the decodes of a step attend together, each
shared prefix once (decode_attention.py).

Cache layout per layer: ``[KVH, slots, D]``, so a gather of slots yields each KV head's keys as
one contiguous ``[ctx, D]`` matrix that a matmul reads as is (transposed or not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache import kernels
from prefixcache.kv.pool import LayerKV
from prefixcache.model.decode_attention import (
    DecodeBatch,
    attend_decodes,
    build_decode_batch,
    slots_of,
)


@dataclass
class SeqAttention:
    q_start: int  # offset of this sequence's new tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens in the context including the new ones
    ctx_slots: torch.Tensor | None  # [ctx_len] long; None when the context is only the new tokens


@dataclass(frozen=True)
class PagedBatch:
    """Every sequence of an exact step for ``kernels.paged_attention``, which reads the pool in
    place: sequence s has ``q_len[s]`` new tokens at rows ``q_start[s]..`` and its context
    (those tokens included) at ``slots[slots_off[s] : slots_off[s] + ctx[s]]``."""

    q_start: torch.Tensor  # [S] long
    q_len: torch.Tensor  # [S] long
    ctx: torch.Tensor  # [S] long
    slots_off: torch.Tensor  # [S + 1] long
    slots: torch.Tensor  # long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    seqs: list[SeqAttention]  # prefill chunks, attended one by one
    decode: DecodeBatch | None = None
    native: bool = False  # prefill chunks through kernels.prefill_attention (float32 CPU)
    paged: PagedBatch | None = None  # exact: every sequence in one paged_attention call
    # With window parts (kv/pool.py): the same step over the window layers' tensors, whose
    # slots are the blocks' parts' (None: every layer reads the blocks).
    window: AttentionMetadata | None = None


def build_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device,
    share_prefixes: bool = True,
    native: bool = False,
    exact: bool = False,
    windowed: bool = False,
    window_tables: list[list[int]] | None = None,
) -> AttentionMetadata:
    """Slot ids and masks for one step. ``num_computed[i]`` tokens of sequence i are cached;
    its ``num_new[i]`` new tokens follow them. ``share_prefixes=False`` attends every decode over
    its own gathered context (the reference the shared-prefix path is tested against).
    ``native``: decodes attend through the native kernel (float32 CPU with the kernels built).
    ``exact``: decodes attend like one-token prefill chunks, through the same per-query
    reduction (keys in fixed blocks of 32 from position 0) as every prefill: a token's output
    is then the same bits whether it was decoded or prefilled, alone or beside others. The
    cascade decode kernel merges shared-prefix pieces in an order that depends on the
    companions, so it stays out of the exact path. ``windowed`` (a model with sliding-window
    layers, off the exact path): decodes attend as one-query chunks too, through ``_attend``'s
    band mask; the decode kernels take no window. ``window_tables``: with window parts, each
    sequence's table of parts, for the window layers (``AttentionMetadata.window``)."""
    if window_tables is not None:
        meta = build_metadata(block_tables, num_computed, num_new, block_size, device,
                              share_prefixes, native, exact, windowed)  # fmt: skip
        meta.window = build_metadata(window_tables, num_computed, num_new, block_size, device,
                                     share_prefixes, native, exact, windowed)  # fmt: skip
        return meta
    slots: list[torch.Tensor] = []
    seqs: list[SeqAttention] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    contexts: list[torch.Tensor] = []  # each prefill's context slots (the exact path's batch)
    q_start = 0
    for table, done, new in zip(block_tables, num_computed, num_new):
        ctx = done + new
        if new == 1 and done > 0 and not exact and not windowed:  # a decode: its context is gathered by the decode batch
            slots.append(torch.tensor([table[done // block_size] * block_size + done % block_size]))
            dec_rows.append(q_start)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            ctx_slots = slots_of(table, 0, ctx, block_size)
            contexts.append(ctx_slots)
            slots.append(ctx_slots[done:])
            seqs.append(
                SeqAttention(q_start, new, ctx, None if done == 0 else ctx_slots.to(device))
            )
        q_start += new
    slot_mapping = torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long)
    if exact and native and seqs:
        lens = [len(c) for c in contexts]
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        paged = PagedBatch(
            torch.tensor([s.q_start for s in seqs]), torch.tensor([s.q_len for s in seqs]),
            torch.tensor(lens), torch.tensor(offs), torch.cat(contexts),
        )  # fmt: skip
        return AttentionMetadata(slot_mapping, [], None, native, paged)
    decode = None
    if dec_rows:
        decode = build_decode_batch(
            dec_rows, dec_tables, dec_lens, block_size, device, share_prefixes, native
        )
    return AttentionMetadata(slot_mapping, seqs, decode, native)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_new: torch.Tensor,  # [T, KVH, D]
    v_new: torch.Tensor,  # [T, KVH, D]
    kv: LayerKV,  # one layer's cache
    meta: AttentionMetadata,
    scale: float,
    isa: str = "avx2",  # the exact path's integer ISA (int16 K/V attend on the integer units)
    window: int = 0,  # > 0: a sliding window, a query at p sees keys (p - window, p]
) -> torch.Tensor:  # [T, H, D]
    # Stored first, in the KV format; attention sees the stored values, new tokens included.
    if meta.paged is not None:  # read from the pool in place: the stored values are not needed
        kv.store(meta.slot_mapping, k_new, v_new, seen=False)
        return kernels.paged_attention(q.contiguous(), kv, meta.paged, scale, isa, window)
    k_seen, v_seen = kv.store(meta.slot_mapping, k_new, v_new)
    if window and meta.decode is not None:
        raise ValueError("sliding-window layers need build_metadata(windowed=True)")
    if kv.fmt.unit:  # its numbers come from the integer kernel only: never a float stand-in
        raise ValueError(f"{kv.fmt.name} K/V attend on the exact path only (build_metadata(exact=True))")
    out = torch.empty_like(q)
    for s in meta.seqs:
        qs = q[s.q_start : s.q_start + s.q_len]  # [q, H, D]
        if s.ctx_slots is None:  # the context is exactly the new tokens: no gather
            ks = k_seen[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [KVH, ctx, D]
            vs = v_seen[s.q_start : s.q_start + s.q_len].transpose(0, 1)
        else:
            ks, vs = kv.gather(s.ctx_slots, q.dtype)
        if meta.native and not window:
            o = kernels.prefill_attention(qs.contiguous(), ks.contiguous(), vs.contiguous(), scale)
        else:
            o = _attend(qs, ks, vs, scale, window)
        out[s.q_start : s.q_start + s.q_len] = o
    if meta.decode is not None:
        out.index_copy_(0, meta.decode.rows, attend_decodes(q, kv, meta.decode, scale))
    return out


# Queries are processed in chunks of this many rows: each chunk attends only to the keys up to
# its last position (skipping most of the causal upper triangle) and its score matrix stays in
# cache. On CPU this is several times faster than SDPA for GQA prefill (measured, see
# docs/benchmarks-journal.md), and it is one code path for decodes, chunks and whole prompts.
_Q_CHUNK = 64


def _attend(q, k, v, scale, window: int = 0):
    """Causal attention of q [q, H, D] over k, v [KVH, ctx, D]; the last q keys are q's own.
    ``window`` > 0: query i (position first + i) sees only keys (first + i - window, first + i]."""
    ql, h, d = q.shape
    kvh, ctx, _ = k.shape
    g = h // kvh
    # Query heads that share a KV head are stacked: [KVH, G, q, D]; no KV expansion.
    qg = q.view(ql, kvh, g, d).permute(1, 2, 0, 3)
    kt = k.transpose(1, 2)  # [KVH, D, ctx]
    out = torch.empty(kvh, g, ql, d, dtype=q.dtype, device=q.device)
    first = ctx - ql  # absolute position of query 0
    for c0 in range(0, ql, _Q_CHUNK):
        c1 = min(ql, c0 + _Q_CHUNK)
        cq, end = c1 - c0, first + c1  # keys [0, end) are visible to this chunk
        start = max(0, first + c0 - window + 1) if window else 0  # and none before start
        qc = qg[:, :, c0:c1].reshape(kvh, g * cq, d)
        scores = torch.bmm(qc, kt[:, :, start:end]).mul_(scale)  # [KVH, G*cq, end - start]
        if cq > 1:
            # only the last cq keys can lie in a query's future: mask that square alone
            future = torch.ones(cq, cq, dtype=torch.bool, device=q.device).triu(1)
            scores.view(kvh, g, cq, end - start)[..., end - start - cq :].masked_fill_(future, float("-inf"))
            if window:  # and the keys before each query's window
                pos = torch.arange(first + c0, end, device=q.device).unsqueeze(1)
                keys = torch.arange(start, end, device=q.device).unsqueeze(0)
                scores.view(kvh, g, cq, end - start).masked_fill_(keys <= pos - window, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out[:, :, c0:c1] = torch.bmm(probs, v[:, start:end]).view(kvh, g, cq, d)
    return out.permute(2, 0, 1, 3).reshape(ql, h, d)
