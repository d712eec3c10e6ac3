"""KV events (prefixcache/events): vLLM's wire format, and a subscriber that rebuilds the
engine's block set from the stream agrees with the prefix index through stores, evictions,
invalidation and a late join (replay)."""

from __future__ import annotations

import socket

import msgpack
import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSetSubscriber,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    offset_endpoint,
)
from prefixcache.events.wire import WireFormatError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wire_format_is_vllms_tagged_arrays():
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    batch = EventBatch(
        12.5,
        (BlockStored((k1, k2), None, tuple(range(32)), 16), BlockRemoved((k1,)), AllBlocksCleared()),
        3,
    )
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [
        12.5,
        [["BlockStored", [k1, k2], None, list(range(32)), 16, None, "cpu"],
         ["BlockRemoved", [k1], "cpu"],
         ["AllBlocksCleared"]],
        3,
    ]  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch
    # vLLM's older, shorter forms decode with defaults; garbage is a typed error.
    short = msgpack.packb([1.0, [["BlockRemoved", [7]], ["BlockStored", [8], 7, [1, 2], 2]]])
    got = decode_batch(short)
    assert got.events == (BlockRemoved((7,), None), BlockStored((8,), 7, (1, 2), 2, None, None))
    assert got.data_parallel_rank is None
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]])):
        with pytest.raises(WireFormatError):
            decode_batch(bad)


def test_offset_endpoint():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev-1"


def test_bad_endpoint_is_a_config_error():
    from prefixcache.config import EngineConfig

    for bad in ("localhost:5557", "tcp://host", "http://x:1"):
        with pytest.raises(ValueError, match="endpoint"):
            EngineConfig(kv_events_endpoint=bad)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")


def _index_keys(llm) -> set[bytes]:
    return set(llm.engine.pool.index._entries)


def _settle(llm, sub) -> None:
    llm.engine.kv_events.flush()
    sub.poll(0.3)


@pytest.mark.slow
def test_subscriber_block_set_equals_the_index():
    pub, replay = _free_port(), _free_port()
    # 24 blocks of 16 tokens: eight ~100-token prompts force evictions.
    llm = LLM(
        kv_cache_memory=24 * 16 * 46080, seed=0,
        kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
        kv_events_rank=1,
    )  # fmt: skip
    tok = llm.get_tokenizer()
    base = tok.encode("The quick brown fox jumps over the lazy dog near the river bank. " * 30)
    prompts = [base[:48] + base[60 + i * 30 : 120 + i * 30] for i in range(8)]
    # The first batches are published before anyone listens: the subscriber joins late and
    # must get them from the replay socket.
    llm.generate(prompts[:2], GREEDY)
    llm.engine.kv_events.flush()
    sub = BlockSetSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        import time

        time.sleep(0.3)  # a SUB socket drops what is published before its connection is up
        for p in prompts[2:]:
            llm.generate([p], GREEDY)
        _settle(llm, sub)
        assert sub.replayed >= 1 and sub.rank == 1
        assert llm.cache_stats()["evicted_blocks"] > 0
        assert sub.blocks == _index_keys(llm) and len(sub.blocks) == llm.cache_stats()["cached_blocks"]
        # A namespace's invalidation is removals; the default namespace's blocks stay.
        llm.generate([prompts[0]], GREEDY, cache_salt="other")
        _settle(llm, sub)
        assert sub.blocks == _index_keys(llm)
        llm.engine.invalidate("other")
        _settle(llm, sub)
        assert sub.blocks == _index_keys(llm) and sub.blocks
        llm.engine.invalidate(None, all_namespaces=True)
        _settle(llm, sub)
        assert sub.blocks == set() == _index_keys(llm)
        assert sub.last_seq == llm.engine.kv_events.next_seq - 1
    finally:
        sub.close()
        llm.engine.kv_events.close()
