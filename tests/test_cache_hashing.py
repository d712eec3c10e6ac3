"""Cache keys (DESIGN.md §3): stable across processes, 128-bit, one key per full block, chained."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from prefixcache.cache.hashing import block_hash, encode_tokens, hash_blocks, root_hash

B = 16
FP = "smollm2-135m:q4_1:tok-abc:float32"


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


# The same computation, as text, so another interpreter can run it.
_CHILD = """
import random, sys
from prefixcache.cache.hashing import hash_blocks, root_hash
rng = random.Random(0)
toks = [rng.randrange(0, 50_000) for _ in range(70)]
root = root_hash(sys.argv[1], sys.argv[2])
print(root.hex())
for k in hash_blocks(toks, 16, root):
    print(k.hex())
"""


def test_keys_are_stable_across_processes():
    root = root_hash(FP, "tenant-a")
    here = [root.hex()] + [k.hex() for k in hash_blocks(_tokens(70), B, root)]
    assert len(here) == 1 + 70 // B
    outs = []
    # Different PYTHONHASHSEEDs: a key that used Python's hash() or a random seed would differ.
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, FP, "tenant-a"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        outs.append(proc.stdout.split())
    assert outs[0] == here
    assert outs[1] == here


def test_golden_keys_do_not_drift():
    # Guards the canonical encoding: a change here silently invalidates every persisted key
    # (disk/Redis tiers, keys in logs). Change these values only together with the version tag.
    root = root_hash(FP, "tenant-a")
    assert root.hex() == "0dafcbde1841e3c9538645d8404db484"
    assert block_hash(root, list(range(16))).hex() == "3e80d996328763278183fa02d1933f0a"
    assert root_hash(FP, None) != root_hash(FP, "")
    assert encode_tokens([1, 256, 2**32 - 1]) == bytes(
        [1, 0, 0, 0, 0, 1, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]
    )


def test_keys_are_16_bytes():
    root = root_hash(FP)
    assert isinstance(root, bytes) and len(root) == 16
    keys = hash_blocks(_tokens(64), B, root)
    assert len(keys) == 4
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 4


def test_root_depends_on_namespace_and_model():
    roots = {
        root_hash(FP),
        root_hash(FP, "a"),
        root_hash(FP, "b"),
        root_hash(FP + "x"),
        root_hash(FP + "x", "a"),
        root_hash("other-model", "a"),
    }
    assert len(roots) == 6


def test_block_keys_differ_by_namespace_model_tokens_parent():
    toks = _tokens(B)
    base = block_hash(root_hash(FP, "a"), toks)
    assert block_hash(root_hash(FP, "a"), toks) == base
    assert block_hash(root_hash(FP, "b"), toks) != base  # namespace
    assert block_hash(root_hash(FP, None), toks) != base  # no namespace
    assert block_hash(root_hash("other", "a"), toks) != base  # model fingerprint
    for i in (0, 7, B - 1):  # one token changed anywhere in the block
        t2 = list(toks)
        t2[i] += 1
        assert block_hash(root_hash(FP, "a"), t2) != base
    assert block_hash(root_hash(FP, "a"), list(reversed(toks))) != base
    parent = block_hash(root_hash(FP, "a"), _tokens(B, seed=9))
    assert block_hash(parent, toks) != base  # parent
    assert block_hash(root_hash(FP, "a"), toks, extra=b"lora:1") != base  # extra


def test_chain_key_depends_on_every_earlier_token():
    toks = _tokens(4 * B)
    root = root_hash(FP)
    keys = hash_blocks(toks, B, root)
    for pos in (0, B - 1, B, 2 * B + 3):
        t2 = list(toks)
        t2[pos] ^= 1
        k2 = hash_blocks(t2, B, root)
        changed_from = pos // B
        assert k2[:changed_from] == keys[:changed_from]
        assert all(a != b for a, b in zip(k2[changed_from:], keys[changed_from:]))


def test_chain_is_block_hash_of_parent():
    toks = _tokens(3 * B)
    root = root_hash(FP, "ns")
    keys = hash_blocks(toks, B, root)
    assert keys[0] == block_hash(root, toks[:B])
    assert keys[1] == block_hash(keys[0], toks[B : 2 * B])
    assert keys[2] == block_hash(keys[1], toks[2 * B :])


@pytest.mark.parametrize("n", [0, 1, B - 1, B, B + 1, 2 * B - 1, 2 * B, 5 * B + 7])
def test_partial_tail_block_gets_no_key(n):
    keys = hash_blocks(_tokens(n), B, root_hash(FP))
    assert len(keys) == n // B
    # The tail does not influence any key.
    if n % B:
        assert keys == hash_blocks(_tokens(n)[: (n // B) * B], B, root_hash(FP))


def test_incremental_extension_equals_from_scratch():
    rng = random.Random(7)
    root = root_hash(FP, "t")
    toks = _tokens(11 * B + 5, seed=3)
    full = hash_blocks(toks, B, root)
    # Grow a sequence by random amounts and extend the chain from what was already hashed.
    keys: list[bytes] = []
    n = 0
    while n < len(toks):
        n = min(len(toks), n + rng.randint(1, 2 * B + 3))
        start = len(keys)
        parent = keys[-1] if keys else None
        keys.extend(hash_blocks(toks[:n], B, root, start_block=start, parent=parent))
        assert keys == hash_blocks(toks[:n], B, root)
    assert keys == full
    # Extending from the middle with the right parent gives the tail of the full chain.
    assert hash_blocks(toks, B, root, start_block=4, parent=full[3]) == full[4:]
