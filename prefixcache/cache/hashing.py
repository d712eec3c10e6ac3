"""Content-addressed block keys, format v2: the hash chain of docs/design.md §3.

A key names the KV of a block exactly: it depends on the model fingerprint, the namespace, the
block size and every token before and in the block. Keys are stable across processes and
restarts (no Python ``hash()``, no random seed), so they can be written to disk or Redis and
compared with keys computed by another process or another implementation.

Byte layout (also in docs/design.md, "Cache keys (format v2)")::

    H(x)      = XXH3-128 of the bytes x, seed 0, default secret, as its 16-byte canonical form
                (high 64 bits big-endian, then low 64 bits big-endian) = xxhash.xxh3_128_digest
    u32(n)    = n as 4 bytes little-endian
    str(s)    = u32(len(utf8(s))) || utf8(s)

    root      = H( b"prefixcache/block-key"          21 ASCII bytes
                   || u32(KEY_FORMAT_VERSION)         = 2
                   || u32(block_size)
                   || str(model_fingerprint)
                   || ns )                            ns = b"\\x00" if namespace is None,
                                                           b"\\x01" || str(namespace) otherwise
    key_0     = H( root      || u32(t[0])  || ... || u32(t[B-1]) )
    key_i     = H( key_{i-1} || u32(t[iB]) || ... || u32(t[iB+B-1]) )       B = block_size

    A request with a shared prefix of k blocks (request.SharedPrefix): blocks 0..k-1 are the
    chain of the shared namespace's root; block k's parent is not key_{k-1} but

    join      = H( b"prefixcache/shared-join"        23 ASCII bytes
                   || u32(KEY_FORMAT_VERSION)
                   || key_{k-1}                       the shared prefix's last key
                   || root(owner's namespace) )

Only full blocks get a key. The input of a block key (16 + 4·B bytes: parent key, then the
block's token ids) is also what the prefix index stores and compares on a hit, so a hash
collision can never serve the KV of other tokens or of another prefix. A growing sequence
extends its chain from its last key: each new full block is hashed once.

Why this shape (measured on the 2-core dev machine, 32,000-token prompt, 2,000 blocks): one
XXH3-128 call per block over ``parent || block`` costs about as much as a streaming prefix hash
(``update`` + ``digest`` per block) and, unlike it, can be extended from any key alone (no
hasher state to keep, the analyzer's chain reuse keeps working); encoding with ``array("I")``
is ~2x faster than ``struct.pack``, and numpy cuts the encoded ids into per-block ``bytes`` ~5x
faster than slicing in a Python loop.

No torch here: this module is shared by the engine, the analyzer and the benchmark.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
from xxhash import xxh3_128_digest

from prefixcache.api.keys import BlockHash

KEY_FORMAT_VERSION = 2
KEY_BYTES = 16
_ROOT_TAG = b"prefixcache/block-key"
# 23 bytes: a join input (23 + 4 + 16 + 16 = 59 bytes) is never a block input (16 + 4·B bytes).
_JOIN_TAG = b"prefixcache/shared-join"
_MAX_U32 = 2**32 - 1

# H(x): the one hash of the format. The prefix index calls it on the block inputs it builds.
key_hash = xxh3_128_digest

_U32_CODE = "I" if array("I").itemsize == 4 else "L"
assert array(_U32_CODE).itemsize == 4, "no 4-byte unsigned array type on this platform"
_SWAP = sys.byteorder != "little"


def _u32(n: int) -> bytes:
    if not 0 <= n <= _MAX_U32:
        raise ValueError(f"{n} does not fit in uint32")
    return struct.pack("<I", n)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _u32(len(b)) + b


def _u32_array(token_ids: Sequence[int]) -> array:
    try:
        a = array(_U32_CODE, token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t <= _MAX_U32)
        raise ValueError(f"token id {bad} is out of range: ids must be in [0, 2**32)") from None
    if _SWAP:
        a.byteswap()
    return a


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Canonical byte encoding of token ids: uint32 little-endian each.

    Raises ValueError for an id < 0 or >= 2**32 (it has no encoding; never wrapped).
    """
    return _u32_array(token_ids).tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of ``encode_tokens``."""
    a = array(_U32_CODE)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def root_hash(
    model_fingerprint: str, namespace: str | None = None, *, block_size: int
) -> BlockHash:
    """Parent of the first block. Different models, namespaces or block sizes never share a
    chain; ``None`` (no namespace) and ``""`` are different namespaces."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ns = b"\x00" if namespace is None else b"\x01" + _str(namespace)
    return key_hash(
        _ROOT_TAG + _u32(KEY_FORMAT_VERSION) + _u32(block_size) + _str(model_fingerprint) + ns
    )


def join_hash(shared_key: BlockHash, own_root: BlockHash) -> BlockHash:
    """Parent of the first block after a shared prefix whose last key is ``shared_key``, for
    the owner whose namespace has root ``own_root``: the chain goes on from the shared prefix
    but salted with the owner's namespace, so the owner's later blocks are reachable only by
    the same owner after the same shared prefix (docs/design.md §3, "Shared prefixes")."""
    return key_hash(_JOIN_TAG + _u32(KEY_FORMAT_VERSION) + shared_key + own_root)


def block_hash(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Key of one full block given its parent's key: ``H(parent || u32(t)...)``.

    ``extra`` (empty in format v2 chains; reserved for per-block inputs such as an adapter id)
    is appended as ``extra || u32(len(extra))`` when not empty, so a block with extra bytes never
    has the input of a block without.
    """
    data = parent + encode_tokens(token_ids)
    if extra:
        data += extra + _u32(len(extra))
    return key_hash(data)


def block_chunks(
    token_ids: Sequence[int],
    block_size: int,
    start_block: int = 0,
    num_tokens: int | None = None,
) -> list[bytes]:
    """The encoded token ids of full blocks ``start_block, start_block + 1, ...`` of
    ``token_ids[:num_tokens]``, one ``bytes`` of ``4 * block_size`` per block (a partial tail is
    left out).

    Raises ValueError for an out-of-range id among those blocks.
    """
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    n_full = n // block_size
    if n_full <= start_block:
        return []
    lo, hi = start_block * block_size, n_full * block_size
    a = None
    if lo == 0 and 2 * hi >= len(token_ids):  # converting it all and cutting beats copying
        try:
            a = array(_U32_CODE, token_ids)
        except OverflowError:
            pass  # maybe only in the partial tail: the slice below tells (and raises if not)
        else:
            del a[hi:]
            if _SWAP:
                a.byteswap()
    if a is None:
        a = _u32_array(token_ids[lo:hi])
    # One bytes object per block, cut in C: a void dtype of one block's width.
    return np.frombuffer(a, dtype=f"V{4 * block_size}").tolist()


def chain_keys(chunks: Sequence[bytes], parent: BlockHash) -> list[BlockHash]:
    """Keys of consecutive encoded blocks (``block_chunks``) following ``parent``."""
    h = key_hash
    keys: list[BlockHash] = []
    append = keys.append
    for c in chunks:
        parent = h(parent + c)
        append(parent)
    return keys


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids`` (a partial tail block gets no key).

    With ``start_block``/``parent`` the chain is extended from an already hashed prefix (the
    key of block ``start_block - 1``), so a growing sequence is hashed once per block, never
    from the start again. Equal to calling ``block_hash`` block by block.
    """
    return chain_keys(
        block_chunks(token_ids, block_size, start_block), root if parent is None else parent
    )


def hash_blocks_after_shared(
    token_ids: Sequence[int],
    block_size: int,
    shared_root: BlockHash,
    num_shared_blocks: int,
    own_root: BlockHash,
) -> list[BlockHash]:
    """Keys of the full blocks of a prompt whose first ``num_shared_blocks`` blocks are a
    shared prefix (the chain of ``shared_root``) and whose later blocks are its owner's (the
    chain goes on from the join of the last shared key and ``own_root``)."""
    k = num_shared_blocks
    if k <= 0:
        return hash_blocks(token_ids, block_size, own_root)
    keys = hash_blocks(token_ids[: k * block_size], block_size, shared_root)
    if len(keys) == k and len(token_ids) >= (k + 1) * block_size:
        keys += hash_blocks(token_ids, block_size, own_root, k, join_hash(keys[-1], own_root))
    return keys
