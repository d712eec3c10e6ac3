"""Segments (cache_mode="segments") in the persistent tiers: a document's KV computed alone is
written through to disk and Redis as a record of its own, and a new engine (a restart, another
replica) restores it instead of computing it again, with the same output as the engine that
computed it. Corrupt or foreign records are misses; tenants never restore each other's;
invalidation drops the records; a request whose documents are all recomputed reads nothing.
"""

from __future__ import annotations

import pytest
import redis
from _redis import RedisServer

from prefixcache import LLM, SamplingParams
from prefixcache.segments.record import entry_of, key_input, payload_bytes, payload_of
from prefixcache.tiers.disk import SUBDIR, SUFFIX
from prefixcache.tiers.keys import StoreLayout
from prefixcache.tiers.records import SEGMENTS
from prefixcache.tiers.redis_tier import PREFIX

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MEM = "24MiB"
K = 4  # tokens recomputed at the head of each document

SYSTEM = "Answer with the number only."
DOCS = {
    "Alice": "The access code of Alice is 4721. Alice lives in Lyon and bakes bread at dawn.",
    "Bruno": "The access code of Bruno is 9034. Bruno flies small planes over the Alps.",
    "Chen": "The access code of Chen is 1588. Chen is a nurse in Osaka and swims on Sundays.",
}


def _messages(names):
    docs = [{"role": "document", "title": n, "content": DOCS[n]} for n in names]
    return [{"role": "system", "content": SYSTEM}, *docs,
            {"role": "user", "content": "What is the access code of Bruno?"}]  # fmt: skip


def _chat(llm, names, salt=None, k=K):
    out = llm.chat(_messages(names), GREEDY, cache_salt=salt, cache_mode="segments",
                   segment_recompute_tokens=k)  # fmt: skip
    return out[0]


def _spans(llm, names):
    seg = llm.get_tokenizer().encode_chat_segments(_messages(names))
    return seg.token_ids, seg.spans


def _segment_file(llm, root, names, i, salt=None):
    """The disk file of document ``i`` of the prompt (names: tiers/keys.py)."""
    ids, spans = _spans(llm, names)
    eng = llm.engine
    a, b = spans[i]
    asm = eng.connectors.get("segments").assembler
    key = asm.key(ids[a:b], salt, asm.sink_of(ids, spans))
    m = eng.connectors.get("tiers").manager
    return root / SUBDIR / m.namespace_id(salt) / (m.record_name(key, SEGMENTS) + SUFFIX)


def _doc_tokens(llm, names):
    return [b - a for a, b in _spans(llm, names)[1]]


def test_record_round_trip_and_segment_store_id():
    """The record bytes give back the entry; the segment store id differs from the block one
    (a segment record never decodes as a block of the same layout, nor the reverse)."""
    import torch

    from prefixcache.segments.store import SegmentEntry

    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    e = SegmentEntry("t", (1, 2, 3, 4, 5), k, v, (9,), 1)
    back = entry_of(payload_of(e), "t", e.token_ids, e.sink, 2, 3, 8, torch.device("cpu"))
    assert torch.equal(back.k, k) and torch.equal(back.v, v) and back == SegmentEntry(
        "t", e.token_ids, back.k, back.v, (9,), 1)  # fmt: skip
    assert len(payload_of(e)) == payload_bytes(5, 2, 3, 8)
    with pytest.raises(ValueError):
        entry_of(payload_of(e)[:-4], "t", e.token_ids, e.sink, 2, 3, 8, torch.device("cpu"))
    assert key_input((9,), (1, 2)) != key_input((), (9, 1, 2))  # the sink is part of the name
    lay = StoreLayout("m", 16, 2, 3, 8, "float32", False, 16 * 2 * 2 * 3 * 8 * 4)
    assert lay.segment_store_id() != lay.store_id()


@pytest.mark.slow
def test_restart_restores_segments_from_disk(tmp_path, llm_cold):
    first = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    computed = _chat(first, ["Alice", "Bruno", "Chen"])
    assert computed.num_segment_cached_tokens == 0  # nothing anywhere yet: computed alone
    assert first.engine.connectors.flush()
    assert first.cache_stats()["tiers"]["disk"]["segment_written"] == 3
    del first

    second = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    lengths = _doc_tokens(second, ["Alice", "Bruno", "Chen"])
    warm = _chat(second, ["Alice", "Bruno", "Chen"])
    # every document came from disk: nothing computed alone, the same tokens as computed
    st = second.cache_stats()
    assert st["segments"]["computed_alone_tokens"] == 0
    assert st["tiers"]["disk"]["segment_hit_tokens"] == sum(lengths)
    assert warm.num_segment_cached_tokens == sum(n - K for n in lengths)
    assert warm.outputs[0].token_ids == computed.outputs[0].token_ids
    # and in another order, as from RAM
    moved = _chat(second, ["Chen", "Alice", "Bruno"])
    assert moved.num_segment_cached_tokens == sum(n - K for n in lengths)
    # recomputing everything needs no record and equals a cold prefill of the same ids
    ids, _ = _spans(second, ["Alice", "Bruno", "Chen"])
    full = _chat(second, ["Alice", "Bruno", "Chen"], k=10**6)
    assert full.outputs[0].token_ids == llm_cold.generate([ids], GREEDY)[0].outputs[0].token_ids
    second.check_integrity()

    # A segment store too small for the request's documents: restored ones evict each other
    # before the assembly, which computes the evicted alone again; the output is the same.
    cfg = second.engine.model_config
    per_token = payload_bytes(1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    small = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0,
                segment_cache_memory=max(lengths) * per_token + 4096)  # one document's K/V
    tight = _chat(small, ["Alice", "Bruno", "Chen"])
    st = small.cache_stats()
    assert st["segments"]["evicted"] >= 2 and st["segments"]["computed_alone_tokens"] > 0
    assert tight.outputs[0].token_ids == computed.outputs[0].token_ids
    small.check_integrity()
    del small

    # A corrupt record (a flipped byte) and a foreign one (another document's file under this
    # name) are rejected, removed and recomputed; the output does not change.
    third = LLM(kv_cache_memory=MEM, disk_cache_dir=tmp_path, seed=0)
    bad = _segment_file(third, tmp_path, ["Alice", "Bruno", "Chen"], 0)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    foreign = _segment_file(third, tmp_path, ["Alice", "Bruno", "Chen"], 2)
    foreign.write_bytes(_segment_file(third, tmp_path, ["Alice", "Bruno", "Chen"], 1).read_bytes())
    again = _chat(third, ["Alice", "Bruno", "Chen"])
    st = third.cache_stats()
    assert st["tiers"]["disk"]["rejected_by_reason"] == {"mac": 1, "foreign": 1}
    assert st["segments"]["computed_alone_tokens"] == lengths[0] + lengths[2]
    assert again.outputs[0].token_ids == computed.outputs[0].token_ids
    assert third.engine.connectors.flush()
    third.check_integrity()

    # Tenants: another namespace restores nothing of these; invalidation drops its records.
    hits = third.cache_stats()["tiers"]["disk"]["segment_hit_tokens"]
    assert hits == lengths[1]  # the one good record
    theirs = _chat(third, ["Alice", "Bruno", "Chen"], salt="tenant-b")
    assert theirs.num_segment_cached_tokens == 0
    assert third.cache_stats()["tiers"]["disk"]["segment_hit_tokens"] == hits
    assert third.engine.connectors.flush()
    ns_dir = tmp_path / SUBDIR / third.engine.connectors.get("tiers").manager.namespace_id("tenant-b")
    assert len(list(ns_dir.glob("*" + SUFFIX))) == 3
    third.engine.invalidate("tenant-b")
    assert not ns_dir.exists() or not list(ns_dir.glob("*" + SUFFIX))
    assert _segment_file(third, tmp_path, ["Alice", "Bruno", "Chen"], 1).exists()  # not ours


@pytest.mark.slow
def test_replica_restores_segments_from_redis():
    server = RedisServer().start()
    try:
        a = LLM(kv_cache_memory=MEM, remote_cache=server.url, seed=0)
        computed = _chat(a, ["Bruno", "Chen"], salt="team")
        assert a.engine.connectors.flush()
        assert a.cache_stats()["tiers"]["redis"]["segment_written"] == 2
        b = LLM(kv_cache_memory=MEM, remote_cache=server.url, seed=0)
        lengths = _doc_tokens(b, ["Bruno", "Chen"])
        warm = _chat(b, ["Bruno", "Chen"], salt="team")
        st = b.cache_stats()
        assert st["tiers"]["redis"]["segment_hit_tokens"] == sum(lengths)
        assert st["segments"]["computed_alone_tokens"] == 0
        assert warm.outputs[0].token_ids == computed.outputs[0].token_ids
        b.engine.invalidate("team")
        client = redis.Redis.from_url(server.url)
        ns = b.engine.connectors.get("tiers").manager.namespace_id("team")
        assert not list(client.scan_iter(match=f"{PREFIX}:{ns}:*"))
        client.close()
        dropped = _chat(b, ["Bruno", "Chen"], salt="team")
        assert dropped.num_segment_cached_tokens == 0  # RAM and Redis both dropped it
        assert b.cache_stats()["segments"]["computed_alone_tokens"] == sum(lengths)
        b.check_integrity()
    finally:
        server.close()
