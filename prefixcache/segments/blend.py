"""CacheBlend-style recompute selection (``segment_selection`` "deviation" / "both"): recompute
the tokens of a reused segment whose placed KV is furthest from what its new context gives.

Which layer to measure. Layer 0's K/V of a token depend on the token and its position only (its
input is the embedding), so a placed segment's layer-0 K/V already are what a cold prefill
computes (re-rotation makes the position exact): no deviation can show there, and recomputing a
token at layer 0 changes nothing. The first K/V that depend on the context are layer 1's, computed
from layer 0's output, i.e. from layer 0's attention over everything before the token.

The probe (a probe piece of the step's forward, ``sequence.Piece.probe``; model/llama.py
``ProbeRows``): layer 0 over every token from the first one not computed yet to the end of
the last probed segment, in order and in context, then layer 1's K/V
of its output (a projection, no attention). Since every layer-0 K/V that layer 0 attends over is
exact, its output is exactly a cold prefill's, and so are the layer-1 K/V it gives: the deviation
is the true one at layer 1, not an estimate. Those exact layer-0 and layer-1 K/V are written into
the pool for every probed token (layer 0 by the forward itself, layer 1 here: computed anyway),
so after assembly layers 0-1 are exact everywhere, deeper layers for the selected tokens only.
Cost: about one layer of the probed tokens (1/L of their cold prefill), a step before the
recompute's.

The measure: squared L2 norm of the layer-1 V difference, summed over KV heads. V rather than K
because V carries no position: its deviation is the missing context alone, while K's also holds
re-rotation rounding, which grows with the shift; and K's scale is several times V's in these
models, so a K+V sum would rank by K alone.

The selection is a pure function of the pool's content, which a store hit and a miss fill alike,
so the output still does not depend on the store's history; ties go to the earlier token.
"""

from __future__ import annotations

import torch

from prefixcache.api.segments import SegmentOptions
from prefixcache.segments.plan import SegmentSpan


def select(deviation: torch.Tensor, first: int, count: int) -> list[int]:
    """Offsets of the tokens to recompute in a segment of ``len(deviation)`` tokens, ascending:
    0..first-1, then the ``count`` largest deviations among the rest (ties: the earlier)."""
    rest = deviation[first:].double().cpu()
    order = torch.sort(rest, descending=True, stable=True).indices[:count]
    return list(range(first)) + sorted((order + first).tolist())


def runs(offsets: list[int], start: int) -> list[tuple[int, int]]:
    """Ascending offsets as ranges ``[a, b)`` of prompt positions ``start + offset``, consecutive
    ones merged: the pieces the assembly recomputes."""
    out: list[tuple[int, int]] = []
    for o in offsets:
        p = start + o
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def blend_pieces(
    options: SegmentOptions,
    pieces: list[tuple[int, int]],
    probed: list[tuple[int, SegmentSpan]],
    deviation: torch.Tensor,
    start: int,
) -> list[tuple[int, int]]:
    """``pieces`` (ordered token ranges to recompute) with each probed span's piece, at index
    i of ``probed``'s (i, span), replaced by the span's selected tokens; ``deviation``: the
    probe's, of the prompt tokens from ``start`` to the end of the last probed span."""
    chosen = {}
    for i, sp in probed:
        first, count = options.split(sp.length)
        chosen[i] = runs(select(deviation[sp.start - start : sp.end - start], first, count), sp.start)
    return [r for i, p in enumerate(pieces) for r in chosen.get(i, [p])]
