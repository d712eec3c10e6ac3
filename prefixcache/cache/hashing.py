"""Content-addressed block keys: the hash chain of DESIGN.md §3.

    root   = H("prefixcache-root", model_fingerprint, namespace)
    key_0  = H(root,  tokens[0:B],   extra)
    key_i  = H(key_{i-1}, tokens[iB:(i+1)B], extra)

A key names the KV of a block exactly: it depends on the model, the namespace and every token
before and in the block. Keys are sha256 digests truncated to 128 bits over a canonical byte
encoding (little-endian uint32 token ids), so they are stable across processes and restarts;
no Python ``hash()``, no random seed.

No torch here: this module is shared by the engine, the analyzer and the benchmark.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

_KEY_BYTES = 16
_ROOT_TAG = b"prefixcache-root-v1"


def _digest(*parts: bytes) -> BlockHash:
    h = hashlib.sha256()
    for p in parts:
        # Length-prefix each part so that concatenations cannot collide ("ab"+"c" vs "a"+"bc").
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.digest()[:_KEY_BYTES]


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Canonical byte encoding of token ids (little-endian uint32)."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def root_hash(model_fingerprint: str, namespace: str | None = None) -> BlockHash:
    """Parent of the first block. Different models or namespaces never share a chain."""
    ns = b"" if namespace is None else b"ns:" + namespace.encode("utf-8")
    return _digest(_ROOT_TAG, model_fingerprint.encode("utf-8"), ns)


def block_hash(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Key of one full block given its parent's key."""
    return _digest(parent, encode_tokens(token_ids), extra)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids`` (a partial tail block gets no key).

    With ``start_block``/``parent`` the chain is extended from an already hashed prefix, so a
    growing sequence is hashed once per block, never from the start again.

    Equal to calling ``block_hash`` block by block; the token ids are encoded once and sliced,
    which is what makes a 32k-token prompt cheap to key (one sha256 call per block).
    """
    n_full = len(token_ids) // block_size
    if n_full <= start_block:
        return []
    lo, hi = start_block * block_size, n_full * block_size
    buf = encode_tokens(token_ids[lo:hi])
    step = 4 * block_size
    # The same length-prefixed framing as _digest(parent, block, b""), spelled out inline.
    head_parent = struct.pack("<I", _KEY_BYTES)
    head_block = struct.pack("<I", step)
    tail = struct.pack("<I", 0)
    sha = hashlib.sha256
    keys: list[BlockHash] = []
    prev = root if parent is None else parent
    for off in range(0, hi - lo, block_size):
        o = off * 4
        prev = sha(head_parent + prev + head_block + buf[o : o + step] + tail).digest()[:_KEY_BYTES]
        keys.append(prev)
    return keys
