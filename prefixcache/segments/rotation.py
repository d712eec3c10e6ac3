"""Moving cached K to new positions: RoPE re-rotation.

RoPE rotates each pair of dimensions (i, i + D/2) of K by the angle ``p * inv_freq[i]``; a
rotation by a then by b is a rotation by a + b. A segment's K computed at positions 0..n-1 is
``R(j) k_j``; rotating it once more by the segment's new start ``s`` gives ``R(s + j) k_j``, the
K that position ``s + j`` would compute for the same pre-rotation vector. The positional part is
therefore exact (to float32 rounding); what re-rotation cannot fix is that ``k_j`` itself was
computed without the context that now precedes it, which is what recomputation is for.

V carries no position and is copied unchanged.
"""

from __future__ import annotations

import torch

from prefixcache.model.llama import Rotary, rotate


def rerotate(k: torch.Tensor, shift: int, rotary: Rotary) -> torch.Tensor:
    """``k`` [..., n, head_dim] float32 rotated for positions p..p+n-1 -> rotated for
    p+shift..p+shift+n-1. A negative shift rotates back: R(-d) has cos(d) and -sin(d)."""
    if shift == 0:
        return k
    cos = rotary.cos[abs(shift)].to(k.dtype)  # [head_dim], the rotate-half convention (llama.py)
    sin = rotary.sin_signed[abs(shift)].to(k.dtype)
    return rotate(k, cos, sin if shift > 0 else -sin)
