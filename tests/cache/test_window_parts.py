"""Window parts (cache/window.py): the sliding-window layers' K/V of blocks, held a window back.
Pure bookkeeping here; the engine's bitwise tests over them are in tests/model/test_gemma3.py."""

from __future__ import annotations

import pytest

from prefixcache.cache.window import WindowParts, first_needed

BS, W = 16, 40  # a query at p reads keys (p - 40, p]: blocks from (p - 39) // 16


def test_first_needed_is_the_block_of_the_windows_first_key():
    assert [first_needed(p, W, BS) for p in (0, 1, 39, 40, 55, 56, 64)] == [0, 0, 0, 0, 1, 1, 1]
    assert first_needed(71, W, BS) == 2  # key 32 is block 2's first
    assert first_needed(5, 0 + 1, BS) == 0 and first_needed(16, 1, BS) == 1  # a window of one key


def test_hold_release_idle_and_eviction_oldest_first():
    w = WindowParts(4, W, BS)  # parts 1..3
    cached = {10, 11, 12}.__contains__
    assert w.hold([10, 11, 12]) and w.num_available == 0
    assert not w.hold([13]), "no part free nor idle"
    w.release([10, 11], cached)  # idle, 10 the oldest
    w.check_integrity({10, 11, 12}, [12])
    assert w.num_available == 2 and w.num_missing([11, 13]) == 2
    assert w.hold([13]) and w.part_of(10) is None and w.evicted_parts == 1
    assert w.part_of(11) is not None  # the younger idle part stayed
    w.release([12, 13], lambda b: False)  # not cached: back free at once
    assert w.part_of(13) is None and w.num_available == 3
    w.check_integrity({10, 11, 12}, [])


def test_a_held_part_is_never_evicted_and_holds_count():
    w = WindowParts(3, W, BS)
    assert w.hold([1]) and w.hold([1]) and w.hold([2])  # block 1 held twice
    w.release([1], lambda b: True)
    assert w.num_available == 0 and not w.hold([3])
    w.check_integrity({1, 2}, [1, 2])
    w.release([1, 2], lambda b: True)
    assert w.num_available == 2
    w.check_integrity({1, 2}, [])


def test_forget_and_adopt():
    w = WindowParts(3, W, BS)
    assert w.hold([5])
    w.forget(5)  # held (an in-use block invalidated): the part stays with its holder
    assert w.part_of(5) is not None
    w.release([5], lambda b: False)  # ... whose release frees it, the block no longer cached
    assert w.part_of(5) is None
    assert w.hold([5])
    w.release([5], lambda b: True)
    w.forget(5)
    w.forget(6)  # a block without a part: nothing to do
    assert w.part_of(5) is None and w.num_available == 2
    p = w.adopt(7)
    assert p is not None and w.part_of(7) == p
    w.check_integrity({7}, [])
    assert w.adopt(8) is not None and w.adopt(9) is not None  # evicts 7's, the oldest idle
    assert w.part_of(7) is None and w.evicted_parts == 1
    full = WindowParts(2, W, BS)
    assert full.hold([1]) and full.adopt(2) is None


def test_move_keeps_the_holds():
    w = WindowParts(3, W, BS)
    assert w.hold([1])
    p = w.part_of(1)
    w.move(1, 2)
    assert w.part_of(2) == p and w.part_of(1) is None
    w.check_integrity(set(), [2])


def test_usable_hit_needs_the_parts_of_the_window_before_it():
    w = WindowParts(16, W, BS)
    blocks = list(range(100, 108))  # 8 cached blocks: a match of 128 tokens
    assert w.usable_hit(blocks) == 0  # no part at all: only a hit of nothing
    assert w.hold(blocks[:8])
    assert w.usable_hit(blocks) == 8
    w.release(blocks, lambda b: True)
    w.forget(blocks[7])  # the last block's part gone: its end needs it
    # 7 blocks end at 112: the window of a query at 112 is keys 73.. -> blocks 4, 5, 6
    assert w.usable_hit(blocks) == 7
    w.forget(blocks[5])
    # ending at 96 (6 blocks) needs blocks 3, 4, 5; at 80 (5 blocks) blocks 2, 3, 4
    assert w.usable_hit(blocks) == 5
    w.forget(blocks[0])  # a hit at 16 or 32 needs block 0 (keys 0..): 5 still needs 2..4
    assert w.usable_hit(blocks) == 5
    w.forget(blocks[3])
    # 5 needs block 3 now missing -> 3, whose window (keys 9..) starts in block 0, gone -> 0
    assert w.usable_hit(blocks) == 0


def test_check_integrity_catches_drift():
    w = WindowParts(4, W, BS)
    assert w.hold([1, 2])
    with pytest.raises(AssertionError):
        w.check_integrity(set(), [1])  # a hold the live sequences do not have
    w.release([2], lambda b: True)
    with pytest.raises(AssertionError):
        w.check_integrity(set(), [1])  # an idle part whose block is not cached
    w._free.append(w.part_of(1))  # a part both free and given
    with pytest.raises(AssertionError):
        w.check_integrity({2}, [1])
    with pytest.raises(ValueError):
        WindowParts(1, W, BS)
