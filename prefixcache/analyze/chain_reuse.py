"""Hash a prompt's block chain, reusing the keys of a recent prompt that starts the same way.

Hashing every block is a large part of the cost of a scan, yet in real traffic most blocks
were hashed moments ago: the same system prompt, document or conversation history. The chain
can be extended from any hashed prefix (``hash_blocks(..., start_block=k, parent=key)``), so
only the part after the longest prefix shared with a recent prompt is hashed here. The keys are
exactly those of hashing from scratch: a candidate is only *proposed* by a cheap lookup and its
shared prefix is then confirmed token by token.

    lookup: hash(tokens[:m·B]) for m = 512, 256, ..., 2, 1 blocks → the most recent prompt
            that starts with those m blocks (and the same root, i.e. namespace)
    confirm: compare token arrays → k full blocks in common
    hash:   keys[:k] from that prompt + hash_blocks(tokens, start_block=k, parent=keys[k-1])

Memory is bounded: at most ``max_keys`` lookup keys, each pointing at a recent prompt's tokens
(uint32) and keys.
"""

from __future__ import annotations

import numpy as np

from prefixcache.api.keys import BlockHash
from prefixcache.cache.hashing import hash_blocks

_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ChainReuse:
    def __init__(self, block_size: int, max_keys: int = 16_384) -> None:
        self.block_size = block_size
        self.max_keys = max_keys
        self._recent: dict[int, tuple[bytes, np.ndarray, list[BlockHash]]] = {}
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def hash(self, root: BlockHash, arr: np.ndarray) -> list[BlockHash]:
        """``hash_blocks(arr.tolist(), block_size, root)``, computed with less hashing."""
        bs = self.block_size
        n_full = len(arr) // bs
        if n_full == 0:
            return []
        tokens = arr.astype("<u4", copy=False)
        raw = tokens[: n_full * bs].tobytes()
        levels = [m for m in _LEVELS if m <= n_full]
        keys = [hash((root, raw[: m * bs * 4])) for m in levels]
        recent = self._recent
        k = 0
        base: list[BlockHash] = []
        for key in reversed(keys):
            hit = recent.get(key)
            if hit is None or hit[0] != root:
                continue
            _, other, other_keys = hit
            n = min(len(other), len(tokens))
            diff = np.flatnonzero(other[:n] != tokens[:n])
            common = int(diff[0]) if len(diff) else n
            k = min(common // bs, len(other_keys), n_full)
            base = other_keys[:k]
            break
        # Only the tail becomes a list: the chain restarts from the last shared key.
        tail = arr[k * bs : n_full * bs].tolist()
        hashes = base + hash_blocks(tail, bs, root, parent=base[-1] if k else None)
        self.reused_blocks += k
        self.hashed_blocks += n_full - k
        entry = (root, tokens[: n_full * bs].copy(), hashes)
        for key in keys:
            recent.pop(key, None)  # re-insert: the dict's order is the eviction order
            recent[key] = entry
        while len(recent) > self.max_keys:
            del recent[next(iter(recent))]
        return hashes
