"""Decode attention over the paged cache, computing each shared prefix once per step.

A decode step attends one query per sequence over its whole context. On CPU the cost of that is
moving K/V, not arithmetic: gathering a 1,000-token context for 30 layers reads ~46 MB per
sequence in float32, more than the weights' share of the step once a batch holds a few dozen
sequences. With a prefix cache many running sequences hold *the same physical blocks* for their
shared prefix (a system prompt, a document, a conversation's history), so the step gathers each
shared run of blocks once and attends all the queries that share it in one matmul ("cascade"
attention, as in vLLM and FlashInfer):

    seq a: [ S S S S | a a ]        S: blocks shared by a, b, c -> one segment, gathered once,
    seq b: [ S S S S | b ]             attended by the 3 x G query heads at once
    seq c: [ S S S S | T T | c ]    T: shared by c and d only -> a nested segment
    seq d: [ S S S S | T T | d d ]  tails (own blocks + the new token): padded batches of
                                    similar lengths

Each row's softmax is split across its segments and its tail and merged exactly with the
log-sum-exp rule (per part: max m, sum l, unnormalised output o; out = sum(o e^(m-M)) /
sum(l e^(m-M)) with M the row's overall max), so the result equals one softmax over the whole
context up to float rounding.

Segments are planned from the block tables alone (``plan_decodes``): equal block ids mean equal
content and position (the cache key is a hash chain over the whole prefix), so the planner needs
no token comparison. A segment holds only full blocks before the block of the new token, which
belong to the cache and are never written this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache import kernels
from prefixcache.kv.pool import LayerKV

# A segment is worth its fixed cost (about a dozen tensor ops per layer) only when it replaces a
# few gathers of a long run: at least this many sequences and blocks.
MIN_SEGMENT_SEQS = 2
MIN_SEGMENT_BLOCKS = 4
# Tails are padded to the longest in their batch. One long tail (a sequence that shares nothing)
# among many short ones would make every row gather its length (measured: 64 rows, one unshared
# 1.1k-token context, 1.6 s per step instead of 0.35 s), so tails are bucketed by length: a
# bucket's longest tail is at most this factor (plus one block) of its shortest.
TAIL_BUCKET_RATIO = 2


@dataclass(frozen=True)
class SharedSegment:
    rows: torch.Tensor  # [m] long: the decode rows (0..Bd-1) that share these slots
    slots: torch.Tensor  # [S] long: cache slots of the shared run, in position order


@dataclass(frozen=True)
class TailBucket:
    """Tails of similar length: the context of each row that no segment covers."""

    rows: torch.Tensor | None  # [b] long: decode rows; None = all rows in order
    slots: torch.Tensor  # [b, C] long, padded with slot 0
    pad: torch.Tensor | None  # [1, b, 1, C] bool, True = padding; None when none is padded


@dataclass(frozen=True)
class NativeParts:
    """The same plan for the native kernel (prefixcache/kernels/decode_attention.cpp), flat:
    part p is decode rows ``rows[rows_off[p]:rows_off[p+1]]`` (0..Bd-1) attending slots
    ``slots[slots_off[p]:slots_off[p+1]]``; segments first, then one part per row's tail. The
    kernel reads K/V where they lie, so tails need no padding and nothing is gathered."""

    rows_off: torch.Tensor  # [P + 1] long
    rows: torch.Tensor  # long
    slots_off: torch.Tensor  # [P + 1] long
    slots: torch.Tensor  # long


@dataclass(frozen=True)
class DecodeBatch:
    """All single-token decodes of a step."""

    rows: torch.Tensor  # [Bd] long: their rows in the flat batch
    tails: tuple[TailBucket, ...]  # every decode row is in exactly one (empty with native)
    segments: tuple[SharedSegment, ...]
    native: NativeParts | None = None

    def segment_sizes(self) -> list[int]:
        """Rows sharing each segment (either path). Tails are parts of one row; segments have
        at least MIN_SEGMENT_SEQS >= 2."""
        if self.native is None:
            return [len(s.rows) for s in self.segments]
        sizes = (self.native.rows_off[1:] - self.native.rows_off[:-1]).tolist()
        return [n for n in sizes if n >= MIN_SEGMENT_SEQS]


def plan_decodes(
    tables: list[list[int]],
    ctx_lens: list[int],
    block_size: int,
    share_prefixes: bool = True,
) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Split decode contexts into shared segments and tails.

    Returns (segments, tail_start) where each segment is (rows, block ids) and tail_start[i] is
    the first position of row i's context that no segment covers.
    """
    n = len(tables)
    # Only full blocks before the new token's block may be shared (it is the last position).
    full = [(c - 1) // block_size for c in ctx_lens]
    tail_block = [0] * n
    segments: list[tuple[list[int], list[int]]] = []
    if not share_prefixes:
        return segments, tail_block

    def split(rows: list[int], depth: int) -> None:
        by_block: dict[int, list[int]] = {}
        for r in rows:
            if full[r] > depth:
                by_block.setdefault(tables[r][depth], []).append(r)
        for group in by_block.values():
            if len(group) < MIN_SEGMENT_SEQS:
                continue
            end = min(full[r] for r in group)
            first = tables[group[0]]
            stop = depth + 1
            while stop < end and all(tables[r][stop] == first[stop] for r in group):
                stop += 1
            if stop - depth < MIN_SEGMENT_BLOCKS:
                continue  # too short to pay for itself; these rows keep it in their tails
            segments.append((group, first[depth:stop]))
            for r in group:
                tail_block[r] = stop
            split(group, stop)

    split(list(range(n)), 0)
    return segments, [b * block_size for b in tail_block]


def slots_of(table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, stop) of a sequence with this block table."""
    pos = torch.arange(start, stop, dtype=torch.long)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def build_decode_batch(
    rows: list[int],
    tables: list[list[int]],
    ctx_lens: list[int],
    block_size: int,
    device: torch.device,
    share_prefixes: bool = True,
    native: bool = False,
) -> DecodeBatch:
    segs, tail_start = plan_decodes(tables, ctx_lens, block_size, share_prefixes)
    tails = [slots_of(t, s, c, block_size) for t, s, c in zip(tables, tail_start, ctx_lens)]
    if native:
        return DecodeBatch(
            torch.tensor(rows, device=device), (), (), _native_parts(segs, tails, block_size)
        )
    buckets = bucket_by_length([len(x) for x in tails], block_size)
    offsets = torch.arange(block_size)
    segments = tuple(
        SharedSegment(
            torch.tensor(seg_rows, dtype=torch.long, device=device),
            (torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + offsets)
            .reshape(-1)
            .to(device),
        )
        for seg_rows, blocks in segs
    )
    return DecodeBatch(
        torch.tensor(rows, device=device),
        tuple(_tail_bucket(b, tails, len(buckets) == 1, device) for b in buckets),
        segments,
    )


def _native_parts(segs, tails: list[torch.Tensor], block_size: int) -> NativeParts:
    offsets = torch.arange(block_size)
    part_rows = [seg_rows for seg_rows, _ in segs] + [[r] for r in range(len(tails))]
    part_slots = [
        (torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + offsets).reshape(-1)
        for _, blocks in segs
    ] + tails

    def offs(sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0, *sizes], dtype=torch.long).cumsum(0)

    return NativeParts(
        offs([len(r) for r in part_rows]),
        torch.tensor([r for rs in part_rows for r in rs], dtype=torch.long),
        offs([len(x) for x in part_slots]),
        torch.cat(part_slots),
    )


def bucket_by_length(lengths: list[int], block_size: int) -> list[list[int]]:
    """Rows grouped so that padding each group to its longest wastes at most about half."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    for r in order:
        if buckets and lengths[r] <= TAIL_BUCKET_RATIO * lengths[buckets[-1][0]] + block_size:
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def _tail_bucket(rows: list[int], tails: list[torch.Tensor], only: bool, device) -> TailBucket:
    if only:
        rows = list(range(len(tails)))  # keep batch order: no scatter needed afterwards
    lens = torch.tensor([len(tails[r]) for r in rows])
    padded = torch.nn.utils.rnn.pad_sequence([tails[r] for r in rows], batch_first=True)
    pad = None
    if int(lens.min()) != padded.shape[1]:
        pad = torch.arange(padded.shape[1]).unsqueeze(0) >= lens.unsqueeze(1)
        pad = pad[None, :, None, :].to(device)
    idx = None if only else torch.tensor(rows, dtype=torch.long, device=device)
    return TailBucket(idx, padded.to(device), pad)


def attend_decodes(
    q: torch.Tensor,  # [T, H, D] the whole flat batch's queries
    kv: LayerKV,  # one layer's cache
    d: DecodeBatch,
    scale: float,
) -> torch.Tensor:  # [Bd, H, D]
    bd, (_, h, dim) = d.rows.shape[0], q.shape
    if d.native is not None:
        qd = q.index_select(0, d.rows)  # [Bd, H, D] contiguous
        return kernels.decode_attention(qd, kv, d.native, scale)
    kvh = kv.k.shape[0]
    g = h // kvh
    # Query heads that share a KV head side by side; the KV head is the batch dimension of
    # every matmul below, so no K/V is ever expanded to H heads.
    qd = q.index_select(0, d.rows).view(bd, kvh, g, dim).transpose(0, 1)  # [KVH, Bd, G, D]
    if not d.segments and len(d.tails) == 1:  # plain softmax: the whole context is the tail
        probs, vt = _tail_scores(qd, kv, d.tails[0], scale)
        probs = torch.softmax(probs, dim=-1).to(vt.dtype)
        return torch.matmul(probs, vt).transpose(0, 1).reshape(bd, h, dim)

    # Tail parts: max, sum and unnormalised output per row, [KVH, Bd, G(, D)].
    m_tail = torch.empty(kvh, bd, g, dtype=torch.float32, device=q.device)
    l_tail = torch.empty_like(m_tail)
    o_tail = torch.empty(kvh, bd, g, dim, dtype=torch.float32, device=q.device)
    for bucket in d.tails:
        scores, vt = _tail_scores(qd, kv, bucket, scale)
        m = scores.amax(-1)
        p = torch.exp(scores - m.unsqueeze(-1))
        l, o = p.sum(-1), torch.matmul(p.to(vt.dtype), vt).float()
        if bucket.rows is None:
            m_tail, l_tail, o_tail = m, l, o
        else:
            m_tail.index_copy_(1, bucket.rows, m)
            l_tail.index_copy_(1, bucket.rows, l)
            o_tail.index_copy_(1, bucket.rows, o)
    parts = []
    m_row = m_tail.clone()
    for seg in d.segments:
        m = seg.rows.shape[0]
        qs = qd.index_select(1, seg.rows).reshape(kvh, m * g, dim)  # [KVH, m G, D]
        ks, vs = kv.gather(seg.slots, q.dtype)  # [KVH, S, D]: gathered once for m rows
        s = torch.bmm(qs, ks.transpose(1, 2)).float().mul_(scale)  # [KVH, m G, S]
        ms = s.amax(-1)
        ps = torch.exp(s - ms.unsqueeze(-1))
        ls = ps.sum(-1)
        os_ = torch.bmm(ps.to(vs.dtype), vs).float()  # [KVH, m G, D]
        ms, ls, os_ = ms.view(kvh, m, g), ls.view(kvh, m, g), os_.view(kvh, m, g, dim)
        # rows are distinct within a segment, so a gather-max-scatter is exact
        m_row.index_copy_(1, seg.rows, torch.maximum(m_row.index_select(1, seg.rows), ms))
        parts.append((seg.rows, ms, ls, os_))
    # Exact merge: rescale every part to the row's overall max, then sum.
    w = torch.exp(m_tail - m_row)
    num = o_tail * w.unsqueeze(-1)
    den = l_tail * w
    for rows, ms, ls, os_ in parts:
        w = torch.exp(ms - m_row.index_select(1, rows))
        num.index_add_(1, rows, os_ * w.unsqueeze(-1))
        den.index_add_(1, rows, ls * w)
    out = num / den.unsqueeze(-1)  # [KVH, Bd, G, D]
    return out.to(q.dtype).transpose(0, 1).reshape(bd, h, dim)


def _tail_scores(qd, kv: LayerKV, bucket: TailBucket, scale):
    """Float32 scores [KVH, b, G, C] (padding at -inf) of a bucket's rows, and their V."""
    kvh, _, _, dim = qd.shape
    b, c = bucket.slots.shape
    if bucket.rows is not None:
        qd = qd.index_select(1, bucket.rows)
    kt, vt = kv.gather(bucket.slots.reshape(-1), qd.dtype)
    kt, vt = kt.view(kvh, b, c, dim), vt.view(kvh, b, c, dim)  # [KVH, b, C, D]
    scores = torch.matmul(qd, kt.transpose(-1, -2)).float().mul_(scale)
    if bucket.pad is not None:
        scores.masked_fill_(bucket.pad, float("-inf"))
    return scores, vt
