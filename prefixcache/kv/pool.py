"""The KV tensors of the paged cache, sized from a byte budget.

Layout: one tensor per K and V, ``[num_layers, num_kv_heads, num_blocks * block_size, head_dim]``
(KV head before slot: a gather of a context's slots gives each head's keys contiguously).
A token's KV lives at slot ``block_id * block_size + offset``; the block ids come from the
torch-free block pool, so this module never decides which block holds what.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from prefixcache.config import parse_bytes
from prefixcache.model.loader import ModelConfig

log = logging.getLogger(__name__)

# Without an explicit budget: this share of available memory, capped, so a laptop stays usable.
_DEFAULT_SHARE = 0.25
_DEFAULT_CAP = 4 << 30


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def plan_kv_layout(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_memory: str | int | None,
    device: torch.device,
) -> KVLayout:
    per_token = config.kv_bytes_per_token(dtype)
    if kv_cache_memory is None:
        budget = min(int(_available_bytes(device) * _DEFAULT_SHARE), _DEFAULT_CAP)
    else:
        budget = parse_bytes(kv_cache_memory)
    num_blocks = budget // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no block: one block of {block_size} tokens "
            f"needs {per_token * block_size} bytes"
        )
    return KVLayout(num_blocks, block_size, per_token)


class KVCache:
    def __init__(self, config: ModelConfig, layout: KVLayout, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        shape = (config.num_layers, config.num_kv_heads, layout.capacity_tokens, config.head_dim)
        # Never read before written (attention reads only slots of computed tokens). empty, not
        # zeros: zeroing 4 GiB took 2-3 s of every start, and on CPU an allocation this size is
        # fresh pages the OS maps on first touch (they read as zero anyway).
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
