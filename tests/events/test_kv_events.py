"""KV events (prefixcache/events): vLLM's wire format, and a subscriber that rebuilds the
engine's block set from the stream agrees with the prefix index through stores, evictions,
invalidation and a late join (replay). Who may read the stream (events/access.py): loopback
unless CURVE or an explicit flag, token ids only when asked for, CURVE keeps out subscribers
without the server's key, a replay answer is bounded."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq
from _helpers import BYTES_PER_TOKEN

from prefixcache import LLM, SamplingParams
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import KVCacheManager
from prefixcache.config import EngineConfig
from prefixcache.connectors.kv_events import build_kv_events
from prefixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSetSubscriber,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    offset_endpoint,
)
from prefixcache.events.access import write_keypair
from prefixcache.events.publisher import END_OF_REPLAY
from prefixcache.events.wire import WireFormatError
from prefixcache.sequence import Sequence

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
    for bad in ("localhost:5557", "tcp://host", "http://x:1"):
        with pytest.raises(ValueError, match="endpoint"):
            EngineConfig(kv_events_endpoint=bad)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")


def _index_keys(llm) -> set[bytes]:
    return set(llm.engine.kv.pool.index._entries)


def _settle(llm, sub) -> None:
    llm.engine.connectors.flush()
    sub.poll(0.3)


@pytest.mark.slow
def test_subscriber_block_set_equals_the_index():
    pub, replay = _free_port(), _free_port()
    # 24 blocks of 16 tokens: eight ~100-token prompts force evictions.
    llm = LLM(
        kv_cache_memory=24 * 16 * BYTES_PER_TOKEN, seed=0,
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
    llm.engine.connectors.flush()
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
        assert sub.last_seq == llm.engine.connectors.get("kv_events").publisher.next_seq - 1
    finally:
        sub.close()
        llm.engine.connectors.get("kv_events").close()


# -- who may read the stream ----------------------------------------------------------------------
def _tcp() -> str:
    return f"tcp://127.0.0.1:{_free_port()}"


def _until_received(sock: zmq.Socket, publisher: KVEventPublisher, timeout: float = 10.0) -> list:
    """Publish AllBlocksCleared batches until ``sock`` (a SUB) gets one; returns the messages
    read (none: never connected). A SUB drops what is sent before its connection is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        publisher.cleared()
        if sock.poll(50):
            return _drain(sock)
    return []


def _drain(sock: zmq.Socket, wait_ms: int = 200) -> list:
    got = []
    while sock.poll(wait_ms):
        got.append(sock.recv_multipart())
    return got


def _sub(endpoint: str, server_public: bytes | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.SUB)
    if server_public is not None:  # a client keypair of its own, as any subscriber has
        s.curve_serverkey = server_public
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def test_a_remote_bind_needs_curve_or_the_allow_remote_flag(tmp_path, capsys):
    from prefixcache.cli import build_parser, main
    from prefixcache.config import config_from_cli

    for remote in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://10.1.2.3:5557",
                   "tcp://eth0:5557", "tcp://127.0.0.1.evil.example:5557"):  # fmt: skip
        with pytest.raises(ValueError, match="not on loopback"):
            EngineConfig(kv_events_endpoint=remote)
        with pytest.raises(ValueError, match="not on loopback"):  # the replay socket too
            EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint=remote)
        EngineConfig(kv_events_endpoint=remote, kv_events_allow_remote=True)
    for local in ("tcp://127.0.0.1:5557", "tcp://127.9.0.1:5557", "tcp://[::1]:5557",
                  "tcp://localhost:5557", "ipc:///tmp/prefixcache-ev", "inproc://ev"):  # fmt: skip
        EngineConfig(kv_events_endpoint=local, kv_events_replay_endpoint=local)
    key = tmp_path / "ev.key"
    write_keypair(key)
    EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_curve_secret_file=key)
    (tmp_path / "bad.key").write_text("not a key\n")
    for bad in (tmp_path / "bad.key", tmp_path / "missing.key"):
        with pytest.raises(ValueError, match="CURVE"):
            EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_curve_secret_file=bad)
    with pytest.raises(ValueError, match="not on loopback"):  # the class on its own, too
        KVEventPublisher("tcp://*:5557", block_size=16)
    # `serve` stops with the message before it loads the model; the flags reach the config.
    assert main(["serve", "--kv-events-endpoint", "tcp://*:5557"]) == 2
    assert "not on loopback" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://*:5557",
        "--kv-events-allow-remote", "--kv-events-token-ids", "--kv-events-curve-secret-file", str(key)])  # fmt: skip
    cfg = config_from_cli(args)
    assert (cfg.kv_events_allow_remote, cfg.kv_events_token_ids) == (True, True)
    assert cfg.kv_events_curve_secret_file == str(key)


def _store_prompt(kv: KVCacheManager, tokens: list[int], namespace: str, events) -> None:
    """The engine's path into the index, without the model: admit, compute, commit, free; then,
    as the step does, the events the index recorded go to the connector."""
    seq = Sequence.of("r", list(tokens), SamplingParams(max_tokens=1), root=kv.root(namespace),
                      namespace=namespace)  # fmt: skip
    assert kv.admit(seq, kv.match(seq), len(tokens))
    seq.kv.num_computed_tokens = len(tokens)
    kv.commit(seq)
    kv.free(seq)
    events.on_events(kv.pool.index.take_events())


def _kv_events(config, kv):
    """The KV events connector of an engine with ``config``, on ``kv``'s index."""
    kv.pool.index.record_events()
    return build_kv_events(config, kv)


@pytest.mark.parametrize("token_ids", [False, True])
def test_token_ids_are_sent_only_when_asked_for(token_ids):
    endpoint = _tcp()
    config = EngineConfig(block_size=4, kv_events_endpoint=endpoint, kv_events_token_ids=token_ids)
    kv = KVCacheManager(BlockPool(8, 4), "fp")
    events = _kv_events(config, kv)
    publisher = events.publisher
    sub = _sub(endpoint)
    try:
        assert _until_received(sub, publisher)
        prompt = list(range(100, 113))  # three full blocks and one token
        _store_prompt(kv, prompt, "tenant-a", events)
        publisher.flush()
        stored = [e for m in _drain(sub) for e in decode_batch(m[2]).events
                  if isinstance(e, BlockStored)]  # fmt: skip
    finally:
        sub.close(linger=0)
        publisher.close()
    assert [h for e in stored for h in e.block_hashes] == kv.keys_for(prompt, "tenant-a")
    assert [t for e in stored for t in e.token_ids] == (prompt[:12] if token_ids else [])
    for m in stored:  # vLLM's shape either way: an array of token ids, maybe empty
        assert isinstance(m.token_ids, tuple) and m.block_size == 4


def test_curve_keeps_out_subscribers_without_the_server_key(tmp_path):
    from prefixcache.cli import main

    key = tmp_path / "ev.key"
    assert main(["events", "keygen", str(key)]) == 0
    assert key.stat().st_mode & 0o077 == 0 and main(["events", "keygen", str(key)]) == 2  # kept
    server_public = (tmp_path / "ev.key.pub").read_bytes().strip()
    endpoint, replay = _tcp(), _tcp()
    config = EngineConfig(block_size=4, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
                          kv_events_curve_secret_file=key)  # fmt: skip
    kv = KVCacheManager(BlockPool(8, 4), "fp")
    events = _kv_events(config, kv)
    publisher = events.publisher
    plain, wrong = _sub(endpoint), _sub(endpoint, zmq.curve_keypair()[0])
    plain_replay = zmq.Context.instance().socket(zmq.DEALER)
    plain_replay.connect(replay)
    good = None
    try:
        _store_prompt(kv, list(range(8)), "tenant-a", events)  # before the good one joins: replayed
        publisher.flush()
        good = BlockSetSubscriber(endpoint, replay, server_public_key=server_public)
        deadline = time.monotonic() + 10.0
        while good.batches == 0 and time.monotonic() < deadline:
            publisher.cleared()
            good.poll(0.05)
        # The others were connected all along, while those batches went out.
        assert _drain(plain) == [] and _drain(wrong) == []
        assert good.batches and good.replayed  # the PUB and the replay ROUTER both answered it
        _store_prompt(kv, list(range(50, 58)), "tenant-a", events)
        publisher.flush()
        good.poll(0.3)
        assert good.blocks == set(kv.keys_for(list(range(50, 58)), "tenant-a"))
        # Its handshake was refused, so it may have no pipe at all: a send must not wait for one.
        try:
            plain_replay.send_multipart([b"", (0).to_bytes(8, "big", signed=True)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        time.sleep(0.3)
        assert _drain(plain) == [] and _drain(wrong) == [] and _drain(plain_replay) == []
    finally:
        for s in (plain, wrong, plain_replay):
            s.close(linger=0)
        if good is not None:
            good.close()
        publisher.close()


def test_a_replay_answer_is_bounded():
    endpoint, replay = _tcp(), _tcp()
    publisher = KVEventPublisher(endpoint, replay_endpoint=replay, block_size=4, replay_max_batches=3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    sub = None
    try:
        for _ in range(10):
            publisher.cleared()
            publisher.flush()
        assert publisher.next_seq >= 10
        dealer.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        answer = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[-2] == END_OF_REPLAY:
                break
            answer.append(int.from_bytes(frames[-2], "big", signed=True))
        assert answer == [0, 1, 2]
        # A subscriber that missed more asks again from where each answer stopped.
        sub = BlockSetSubscriber(endpoint, replay)
        deadline = time.monotonic() + 10.0
        while sub.batches == 0 and time.monotonic() < deadline:
            publisher.cleared()
            sub.poll(0.05)
        assert sub.replayed >= 10 and sub.batches == sub.last_seq + 1  # nothing skipped
    finally:
        dealer.close(linger=0)
        if sub is not None:
            sub.close()
        publisher.close()
