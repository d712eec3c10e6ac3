"""Attention over the paged KV cache for a flat batch of sequences (prefill chunks and decodes).

The batch is flat: the new tokens of every scheduled sequence, concatenated.

    tokens:  [ s0: q0 q1 q2 | s1: q0 | s2: q0 q1 ]       T = 6 new tokens
    s0 has 32 earlier tokens in the cache, so its context is 35 slots and query i sees slots
    [0, 32 + i]; s1 is a decode (context = everything before + itself).

Per layer: the new K/V are written to their slots first, then each sequence attends to its
context gathered from the cache (slot ids computed once per step and shared by all layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqAttention:
    q_start: int  # offset of this sequence's new tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens in the context including the new ones
    ctx_slots: torch.Tensor | None  # [ctx_len] long; None when the context is only the new tokens
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None when not needed


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    seqs: list[SeqAttention]


def build_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Slot ids and masks for one step. ``num_computed[i]`` tokens of sequence i are cached;
    its ``num_new[i]`` new tokens follow them."""
    slots: list[torch.Tensor] = []
    seqs: list[SeqAttention] = []
    q_start = 0
    for table, done, new in zip(block_tables, num_computed, num_new):
        ctx = done + new
        table_t = torch.tensor(table, dtype=torch.long)
        pos = torch.arange(ctx, dtype=torch.long)
        ctx_slots = table_t[pos // block_size] * block_size + pos % block_size
        slots.append(ctx_slots[done:])
        mask = None
        if new > 1 and done > 0:
            # query i (absolute position done + i) sees keys 0 .. done + i
            q_pos = torch.arange(done, ctx).unsqueeze(1)
            mask = (pos.unsqueeze(0) <= q_pos).to(device)
        seqs.append(
            SeqAttention(q_start, new, ctx, None if done == 0 else ctx_slots.to(device), mask)
        )
        q_start += new
    slot_mapping = torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long)
    return AttentionMetadata(slot_mapping, seqs)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_new: torch.Tensor,  # [T, KVH, D]
    v_new: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [slots, KVH, D] (one layer)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)
    out = torch.empty_like(q)
    for s in meta.seqs:
        qs = q[s.q_start : s.q_start + s.q_len]  # [q, H, D]
        if s.ctx_slots is None:  # the context is exactly the new tokens: no gather
            ks = k_new[s.q_start : s.q_start + s.q_len]  # [ctx, KVH, D]
            vs = v_new[s.q_start : s.q_start + s.q_len]
        else:
            ks = k_cache.index_select(0, s.ctx_slots)
            vs = v_cache.index_select(0, s.ctx_slots)
        out[s.q_start : s.q_start + s.q_len] = _attend(qs, ks, vs, s.mask, scale)
    return out


# Below this many query rows, grouped batched matmuls beat SDPA on CPU (SDPA's per-call
# overhead and its GQA expansion dominate short queries such as decodes).
_SMALL_Q = 64


def _attend(q, k, v, mask, scale):
    """Causal attention of q [q, H, D] over k, v [ctx, KVH, D]; the last q keys are q's own."""
    ql, h, d = q.shape
    ctx, kvh, _ = k.shape
    g = h // kvh
    if ql <= _SMALL_Q:
        # Query heads that share a KV head are stacked: [KVH, G*q, D] @ [KVH, D, ctx].
        qg = q.view(ql, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * ql, d)
        scores = torch.bmm(qg, k.permute(1, 2, 0)) * scale  # [KVH, G*q, ctx]
        if ql > 1:
            causal = mask if mask is not None else _causal_mask(ql, ctx, q.device)
            scores = scores.view(kvh, g, ql, ctx).masked_fill(~causal, float("-inf"))
            scores = scores.view(kvh, g * ql, ctx)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        o = torch.bmm(probs, v.transpose(0, 1))  # [KVH, G*q, D]
        return o.view(kvh, g, ql, d).permute(2, 0, 1, 3).reshape(ql, h, d)
    kx = k.transpose(0, 1).repeat_interleave(g, dim=0)  # [H, ctx, D]
    vx = v.transpose(0, 1).repeat_interleave(g, dim=0)
    if mask is None:  # no earlier context: plain causal
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kx, vx, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kx, vx, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _causal_mask(ql: int, ctx: int, device) -> torch.Tensor:
    return torch.ones(ql, ctx, dtype=torch.bool, device=device).tril(ctx - ql)
