"""Cache keys, format v2 (docs/design.md §3, docs/design.md): stable across processes, 128-bit, one
key per full block, chained; a fixed byte layout that another implementation can reproduce."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys

import pytest
import xxhash

from prefixcache.cache.hashing import (
    KEY_FORMAT_VERSION,
    block_chunks,
    block_hash,
    chain_keys,
    decode_tokens,
    encode_tokens,
    hash_blocks,
    root_hash,
)

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # the property tests need hypothesis (dev extras); the rest run without
    given = None

B = 16
FP = "smollm2-135m:q4_1:tok-abc:float32"


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


def _root(fp: str = FP, ns: str | None = None, bs: int = B) -> bytes:
    return root_hash(fp, ns, block_size=bs)


# The same computation, as text, so another interpreter can run it.
_CHILD = """
import random, sys
from prefixcache.cache.hashing import hash_blocks, root_hash
rng = random.Random(0)
toks = [rng.randrange(0, 50_000) for _ in range(70)]
root = root_hash(sys.argv[1], sys.argv[2], block_size=16)
print(root.hex())
for k in hash_blocks(toks, 16, root):
    print(k.hex())
"""


def test_keys_are_stable_across_processes():
    root = _root(FP, "tenant-a")
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
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        outs.append(proc.stdout.split())
    assert outs[0] == here
    assert outs[1] == here


# ---- format v2: the documented byte layout and known answers ------------------------------------
def test_known_answer_keys_do_not_drift():
    # The example of docs/design.md "Cache keys (format v2)", checked there against the reference
    # xxh128sum CLI. A change here silently invalidates every persisted key (disk/Redis tiers,
    # keys in logs): change these values only together with KEY_FORMAT_VERSION and the doc.
    assert KEY_FORMAT_VERSION == 2
    root = root_hash("example-model", "tenant-a", block_size=4)
    assert root.hex() == "1871af83dbb7e3b9280312d88f61bab8"
    keys = hash_blocks(list(range(1, 10)), 4, root)
    assert [k.hex() for k in keys] == [
        "8d0aace2ad3f228ac4f8f59195310eac",
        "51c91ece31987b5a625801ac089a6ec6",
    ]
    # And one at the engine's block size, with no namespace.
    root16 = _root(FP, None)
    assert root16.hex() == "6e0f6e074b3f4cdd33c6663b393fef95"
    assert block_hash(root16, list(range(16))).hex() == "19cbe6372b91cf6ea5fd7c6ff815b23a"


def test_root_and_block_inputs_follow_the_documented_layout():
    def u32(n: int) -> bytes:
        return struct.pack("<I", n)

    def s(x: str) -> bytes:
        return u32(len(x.encode())) + x.encode()

    fp, ns = "módel-é", "tenant/ü"  # UTF-8, not ASCII
    head = b"prefixcache/block-key" + u32(KEY_FORMAT_VERSION) + u32(32) + s(fp)
    assert _root(fp, ns, 32) == xxhash.xxh3_128_digest(head + b"\x01" + s(ns))
    assert _root(fp, None, 32) == xxhash.xxh3_128_digest(head + b"\x00")
    assert _root(fp, None, 32) == xxhash.xxh3_128_intdigest(head + b"\x00").to_bytes(16, "big")
    toks = _tokens(2 * B, seed=5)
    root = _root()
    k0 = xxhash.xxh3_128_digest(root + struct.pack(f"<{B}I", *toks[:B]))
    k1 = xxhash.xxh3_128_digest(k0 + struct.pack(f"<{B}I", *toks[B:]))
    assert hash_blocks(toks, B, root) == [k0, k1]
    assert block_hash(root, toks[:B], extra=b"ab") == xxhash.xxh3_128_digest(
        root + encode_tokens(toks[:B]) + b"ab" + u32(2)
    )


def test_encoding_is_uint32_little_endian_and_round_trips():
    assert encode_tokens([1, 256, 2**32 - 1]) == bytes(
        [1, 0, 0, 0, 0, 1, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]
    )
    assert encode_tokens([]) == b""
    toks = _tokens(50) + [0, 2**32 - 1]
    assert decode_tokens(encode_tokens(toks)) == toks
    chunks = block_chunks(toks, B)
    assert chunks == [encode_tokens(toks[i * B : (i + 1) * B]) for i in range(len(toks) // B)]
    assert all(type(c) is bytes for c in chunks)
    assert block_chunks(toks, B, start_block=2) == chunks[2:]
    assert block_chunks(toks, B, num_tokens=2 * B + 3) == chunks[:2]
    assert block_chunks(toks, B, num_tokens=B) == chunks[:1]
    assert block_chunks(toks, B, start_block=1, num_tokens=3 * B) == chunks[1:3]
    assert chain_keys(chunks, _root()) == hash_blocks(toks, B, _root())


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, -(2**31)])
def test_out_of_range_ids_are_rejected(bad):
    toks = _tokens(3 * B)
    toks[B + 3] = bad
    with pytest.raises(ValueError, match="out of range"):
        encode_tokens(toks)
    with pytest.raises(ValueError, match="out of range"):
        hash_blocks(toks, B, _root())
    with pytest.raises(ValueError, match="out of range"):
        hash_blocks(toks, B, _root(), start_block=1, parent=hash_blocks(toks[:B], B, _root())[0])
    with pytest.raises(ValueError):
        block_hash(_root(), toks[B : 2 * B])
    # An id in a partial tail that gets no key is not hashed, so it does not raise.
    assert len(hash_blocks(_tokens(2 * B) + [bad], B, _root())) == 2


def test_root_rejects_a_bad_block_size():
    with pytest.raises(ValueError):
        root_hash(FP, None, block_size=0)
    with pytest.raises(TypeError):
        root_hash(FP, None)  # the block size is part of the root: never implied


# ---- what a key depends on ----------------------------------------------------------------------
def test_keys_are_16_bytes():
    root = _root()
    assert isinstance(root, bytes) and len(root) == 16
    keys = hash_blocks(_tokens(64), B, root)
    assert len(keys) == 4
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 4


def test_root_depends_on_namespace_model_and_block_size():
    roots = {
        _root(FP),
        _root(FP, ""),
        _root(FP, "a"),
        _root(FP, "b"),
        _root(FP + "x"),
        _root(FP + "x", "a"),
        _root("other-model", "a"),
        _root(FP, None, 32),
        _root(FP, "a", 32),
    }
    assert len(roots) == 9
    # Length-prefixed fields: moving bytes between fingerprint and namespace changes the root.
    assert _root("ab", "c") != _root("a", "bc")


def test_same_prefix_at_two_block_sizes_never_shares_a_key():
    toks = _tokens(64)
    k16 = hash_blocks(toks, 16, _root(bs=16))
    k32 = hash_blocks(toks, 32, _root(bs=32))
    assert not set(k16) & set(k32)


def test_block_keys_differ_by_namespace_model_tokens_parent():
    toks = _tokens(B)
    base = block_hash(_root(FP, "a"), toks)
    assert block_hash(_root(FP, "a"), toks) == base
    assert block_hash(_root(FP, "b"), toks) != base  # namespace
    assert block_hash(_root(FP, None), toks) != base  # no namespace
    assert block_hash(_root("other", "a"), toks) != base  # model fingerprint
    for i in (0, 7, B - 1):  # one token changed anywhere in the block
        t2 = list(toks)
        t2[i] += 1
        assert block_hash(_root(FP, "a"), t2) != base
    assert block_hash(_root(FP, "a"), list(reversed(toks))) != base
    parent = block_hash(_root(FP, "a"), _tokens(B, seed=9))
    assert block_hash(parent, toks) != base  # parent
    assert block_hash(_root(FP, "a"), toks, extra=b"lora:1") != base  # extra


def test_chain_key_depends_on_every_earlier_token():
    toks = _tokens(4 * B)
    root = _root()
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
    root = _root(FP, "ns")
    keys = hash_blocks(toks, B, root)
    assert keys[0] == block_hash(root, toks[:B])
    assert keys[1] == block_hash(keys[0], toks[B : 2 * B])
    assert keys[2] == block_hash(keys[1], toks[2 * B :])


@pytest.mark.parametrize("n", [0, 1, B - 1, B, B + 1, 2 * B - 1, 2 * B, 5 * B + 7])
def test_partial_tail_block_gets_no_key(n):
    keys = hash_blocks(_tokens(n), B, _root())
    assert len(keys) == n // B
    # The tail does not influence any key.
    if n % B:
        assert keys == hash_blocks(_tokens(n)[: (n // B) * B], B, _root())


def test_incremental_extension_equals_from_scratch():
    rng = random.Random(7)
    root = _root(FP, "t")
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


# ---- property tests (hypothesis) ----------------------------------------------------------------
if given is not None:
    _ids = st.integers(min_value=0, max_value=2**32 - 1)
    _small_ids = st.integers(min_value=0, max_value=7)  # few values: near-equal prompts are common
    _bs = st.sampled_from([1, 2, 4, 16])
    _cuts = st.lists(st.integers(0, 200), max_size=6)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(_ids | _small_ids, max_size=200), _bs, _cuts)
    def test_prop_incremental_equals_from_scratch(toks, bs, cuts):
        root = _root(FP, "p", bs)
        full = hash_blocks(toks, bs, root)
        keys: list[bytes] = []
        for n in sorted(min(c, len(toks)) for c in cuts) + [len(toks)]:
            parent = keys[-1] if keys else None
            keys.extend(hash_blocks(toks[:n], bs, root, start_block=len(keys), parent=parent))
            assert keys == full[: n // bs]
        assert keys == full

    @settings(max_examples=200, deadline=None)
    @given(st.lists(_ids | _small_ids, min_size=1, max_size=64), _bs, st.data())
    def test_prop_any_single_token_change_changes_its_key_and_later(toks, bs, data):
        root = _root(FP, None, bs)
        n_full = len(toks) // bs
        keys = hash_blocks(toks, bs, root)
        pos = data.draw(st.integers(0, len(toks) - 1))
        new = data.draw(_ids.filter(lambda v: v != toks[pos]))
        t2 = list(toks)
        t2[pos] = new
        k2 = hash_blocks(t2, bs, root)
        first = pos // bs
        assert k2[:first] == keys[:first]  # earlier blocks keep their keys
        assert all(a != b for a, b in zip(k2[first:n_full], keys[first:n_full]))

    @settings(max_examples=100, deadline=None)
    @given(
        st.lists(_small_ids, min_size=16, max_size=64),
        st.text(max_size=8),
        st.text(max_size=8),
        st.one_of(st.none(), st.text(max_size=8)),
        st.one_of(st.none(), st.text(max_size=8)),
        _bs,
        _bs,
    )
    def test_prop_keys_differ_across_fingerprint_namespace_block_size(
        toks, fp1, fp2, ns1, ns2, bs1, bs2
    ):
        k1 = hash_blocks(toks, bs1, _root(fp1, ns1, bs1))
        k2 = hash_blocks(toks, bs2, _root(fp2, ns2, bs2))
        if (fp1, ns1, bs1) == (fp2, ns2, bs2):
            assert k1 == k2
        else:
            assert not set(k1) & set(k2)

    @settings(max_examples=100, deadline=None)
    @given(st.lists(_ids, max_size=40), st.integers(0, 39), st.one_of(
        st.integers(max_value=-1), st.integers(min_value=2**32)))
    def test_prop_out_of_range_ids_are_rejected(toks, pos, bad):
        toks = toks + [0] * max(0, pos + 1 - len(toks))
        toks[pos] = bad
        with pytest.raises(ValueError):
            encode_tokens(toks)
        with pytest.raises(ValueError):
            hash_blocks(toks, 1, _root(bs=1))
