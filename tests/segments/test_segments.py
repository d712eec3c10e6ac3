"""Segment caching (cache_mode="segments", docs/segments.md): re-rotation, exactness when
everything is recomputed, hits across orders, isolation, invalidation, and that requests
without it are unchanged. Small prompts: the whole file runs in well under a minute."""

from __future__ import annotations

import pytest
import torch
from _helpers import BYTES_PER_TOKEN, shared_default_weights

from prefixcache import LLM, SamplingParams
from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.segments import SegmentOptions, SegmentRequest
from prefixcache.engine.scheduler import SchedulerOutput
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata
from prefixcache.model.llama import rerotate, rotate

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ALL = 10**6  # segment_recompute_tokens above any span: recompute everything

SYSTEM = (
    "You answer questions about the documents below. Answer with the number only, nothing "
    "else, and never explain the answer."
)
DOCS = {
    name: f"The access code of {name} is {code}. {name} lives in {city} and works as a "
    f"{job}; the office opens at {hour} in the morning and closes late."
    for name, code, city, job, hour in [
        ("Alice", 4721, "Lyon", "baker", 7),
        ("Bruno", 9034, "Turin", "pilot", 6),
        ("Chen", 1588, "Osaka", "nurse", 8),
        ("Dara", 6650, "Cork", "judge", 9),
    ]
}


def _messages(names, question="What is the access code of Bruno?"):
    docs = [{"role": "document", "title": n, "content": DOCS[n]} for n in names]
    return [{"role": "system", "content": SYSTEM}, *docs, {"role": "user", "content": question}]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm_int16():
    """16-bit activations: float32-like rounding. The default's 8-bit activation groups round a
    position-drifted input either way, which compounds over the layers into a drift (up to ~1%
    of V's scale, measured) that would hide what the test below checks; float32 K/V for the same
    reason (int16 K/V's 13-bit rounding and the integer attention's drift 2.5% of K's scale by
    layer 17, measured)."""
    from prefixcache import LLM

    return LLM(kv_cache_memory="64MiB", activations="int16", kv_cache_dtype="float32", seed=0)


def test_rerotation_is_exact(llm_int16):
    """K computed at positions 0.. and re-rotated by s equals K computed at s.. for the same
    tokens with nothing before them: RoPE makes the positional part a pure rotation."""
    llm = llm_int16
    # The identity itself: R(d) R(p) k == R(p + d) k.
    rot = llm.engine.runner.model.rotary
    k = torch.randn(5, 3, 64)
    p, d = torch.arange(3, 8), 40
    at_p = rotate(k, *(t.unsqueeze(1) for t in rot.rows(p)))
    at_pd = rotate(k, *(t.unsqueeze(1) for t in rot.rows(p + d)))
    torch.testing.assert_close(rerotate(at_p, d, rot), at_pd, atol=1e-5, rtol=1e-5)

    # Through the model: every layer's K, computed alone at 0 then moved, vs computed at s.
    eng = llm.engine
    ids = eng.tokenizer.encode("## Alice\n" + DOCS["Alice"])
    n, s, bs = len(ids), 57, eng.config.block_size
    nb = -(-n // bs)
    lay = eng.runner.kv.layout

    def computed_at(first: int):  # every layer's K, V of ids at positions first.., nothing before
        private = KVCache(eng.runner.config, KVLayout(nb, bs, lay.bytes_per_token, lay.kv_format), "cpu")
        meta = build_metadata([list(range(nb))], [0], [n], bs, "cpu", native=eng.runner.model.native,
                              exact=eng.runner.model.exact)  # fmt: skip
        eng.runner.model(torch.tensor(ids), torch.arange(first, first + n), private, meta,
                         torch.tensor([n - 1]))  # fmt: skip
        return [private.layer(i).gather(torch.arange(n), torch.float32) for i in range(len(eng.runner.model.layers))]

    at_0, at_s = computed_at(0), computed_at(s)
    moved = rerotate(torch.stack([k for k, _ in at_0]), s, rot)
    for i, (k_at_s, v_at_s) in enumerate(at_s):
        # float32 rounding differs with the positions (attention is shift-invariant only in
        # exact arithmetic), so deeper layers drift by ~1e-4 of the values' scale
        scale = k_at_s.abs().max().item()
        assert (moved[i] - k_at_s).abs().max().item() <= 2e-3 * scale, f"layer {i}"
        assert (at_0[i][1] - v_at_s).abs().max().item() <= 2e-3 * v_at_s.abs().max().item()
    # layer 0 depends on the token alone: exact to rounding
    torch.testing.assert_close(moved[0], at_s[0][0], atol=1e-5, rtol=1e-4)


def test_recompute_everything_equals_cold(llm, llm_cold):
    msgs = _messages(["Alice", "Bruno", "Chen"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    assert len(seg.spans) == 3
    cold = llm_cold.generate([seg.token_ids], GREEDY)
    out = llm.chat(msgs, GREEDY, cache_salt="seg-all", cache_mode="segments",
                   segment_recompute_tokens=ALL)  # fmt: skip
    assert _tokens(out) == _tokens(cold)
    assert out[0].num_segment_cached_tokens == 0
    llm.check_integrity()


def test_segment_hits_across_orders_and_within_mode_cold_equals_warm(llm):
    salt, k = "seg-orders", 4
    tok = llm.get_tokenizer()
    first = llm.chat(_messages(["Alice", "Bruno", "Chen"]), GREEDY, cache_salt=salt,
                     cache_mode="segments", segment_recompute_tokens=k)[0]  # fmt: skip
    assert first.num_segment_cached_tokens == 0  # nothing stored yet: computed alone, stored
    msgs = _messages(["Chen", "Dara", "Alice"])
    seg = tok.encode_chat_segments(msgs)
    second = llm.chat(msgs, GREEDY, cache_salt=salt, cache_mode="segments",
                      segment_recompute_tokens=k)[0]  # fmt: skip
    chen, _, alice = (b - a for a, b in seg.spans)
    assert second.num_segment_cached_tokens == (chen - k) + (alice - k)  # Dara was a miss
    assert second.num_cached_tokens >= 16  # the system prompt: exact prefix hits as always
    # The output does not depend on what the store held: the same request after dropping
    # the namespace (every segment a miss) gives the same tokens.
    llm.engine.invalidate(salt)
    again = llm.chat(msgs, GREEDY, cache_salt=salt, cache_mode="segments",
                     segment_recompute_tokens=k)[0]  # fmt: skip
    assert again.num_segment_cached_tokens == 0
    assert again.outputs[0].token_ids == second.outputs[0].token_ids
    llm.check_integrity()


def test_requests_without_cache_mode_are_unchanged(llm, llm_cold):
    """Blocks holding reused segment KV never enter the prefix index: a normal request for the
    very same ids afterwards hits only the exact part and gives the cold output."""
    salt = "seg-isolated-from-prefix"
    msgs = _messages(["Dara", "Bruno"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    for _ in range(2):  # the second one reuses both segments
        llm.chat(msgs, GREEDY, cache_salt=salt, cache_mode="segments", segment_recompute_tokens=2)
    normal = llm.generate([seg.token_ids], GREEDY, cache_salt=salt)[0]
    assert normal.num_cached_tokens <= seg.spans[0][0]  # nothing past the first document
    assert normal.outputs[0].token_ids == llm_cold.generate([seg.token_ids], GREEDY)[0].outputs[0].token_ids
    # and prefix-mode chat is the cold output of its own (prefix-mode) ids, as before
    ids = llm.get_tokenizer().encode_chat(msgs)
    warm = llm.chat(msgs, GREEDY, cache_salt=salt)[0]
    assert warm.outputs[0].token_ids == llm_cold.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert warm.num_segment_cached_tokens == 0
    llm.check_integrity()


def test_tenants_and_invalidation(llm):
    msgs = _messages(["Alice", "Chen"])
    opts = {"cache_mode": "segments", "segment_recompute_tokens": 0}
    llm.chat(msgs, GREEDY, cache_salt="seg-tenant-a", **opts)
    a = llm.chat(msgs, GREEDY, cache_salt="seg-tenant-a", **opts)[0]
    b = llm.chat(msgs, GREEDY, cache_salt="seg-tenant-b", **opts)[0]
    assert a.num_segment_cached_tokens > 0
    assert b.num_segment_cached_tokens == 0  # the namespace is in the segment key
    store = llm.engine.connectors.get("segments").store
    before = len(store)
    llm.engine.invalidate("seg-tenant-a")
    assert len(store) == before - 2  # tenant b's two segments stay
    assert llm.chat(msgs, GREEDY, cache_salt="seg-tenant-a", **opts)[0].num_segment_cached_tokens == 0
    llm.check_integrity()


def test_bad_options_are_refused(llm):
    with pytest.raises(InvalidRequestError) as e:
        SegmentOptions(recompute_tokens=-1)
    assert e.value.param == "segment_recompute_tokens"
    with pytest.raises(InvalidRequestError):
        SegmentOptions(recompute_ratio=1.5)
    with pytest.raises(ValueError):
        llm.chat(_messages(["Alice"]), GREEDY, cache_mode="blend")
    # k per document: the larger of the token count and the ratio's share, at most all of it
    opts = SegmentOptions(recompute_tokens=4, recompute_ratio=0.5)
    assert [opts.recompute_for(n) for n in (3, 6, 10, 11)] == [3, 4, 5, 6]


def test_int8_kv_segments(llm):
    """Quantized KV: segments are placed through the pool's own quantizer; recomputing
    everything is the cold int8 run, and a reused segment serves tokens."""
    with shared_default_weights():
        eng8 = LLM(kv_cache_dtype="int8", kv_cache_memory="32MiB", segment_cache_memory="64MiB")
    msgs = _messages(["Bruno", "Alice"])
    seg = eng8.get_tokenizer().encode_chat_segments(msgs)
    cold = eng8.generate([seg.token_ids], GREEDY, cache_salt="cold")
    full = eng8.chat(msgs, GREEDY, cache_mode="segments", segment_recompute_tokens=ALL)
    assert _tokens(full) == _tokens(cold)
    eng8.chat(msgs, GREEDY, cache_mode="segments", segment_recompute_tokens=4)
    reused = eng8.chat(msgs, GREEDY, cache_mode="segments", segment_recompute_tokens=4)[0]
    assert reused.num_segment_cached_tokens == sum(b - a - 4 for a, b in seg.spans)
    eng8.check_integrity()


def test_pieces_in_one_forward_equal_pieces_one_by_one(llm, monkeypatch):
    """The assembly computes every document's recomputed tokens in one forward; with forwards
    of one token each (max_chunk 1: every piece alone, in order) the outputs are the same."""
    msgs = _messages(["Chen", "Alice", "Dara"])
    lp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    one = llm.chat(msgs, lp, cache_salt="seg-one-forward", cache_mode="segments",
                   segment_recompute_tokens=3)[0].outputs[0]  # fmt: skip
    monkeypatch.setattr(llm.engine.connectors.get("segments").assembler, "max_chunk", 1)
    split = llm.chat(msgs, lp, cache_salt="seg-split", cache_mode="segments",
                     segment_recompute_tokens=3)[0].outputs[0]  # fmt: skip
    assert one.token_ids == split.token_ids
    for a, b in zip(one.logprobs, split.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a.keys() & b.keys())


@pytest.mark.parametrize("step_tokens", [2048, 100], ids=["full-steps", "between-chunks"])
def test_preempted_segments_requests_are_rebuilt_and_equal_running_alone(llm, step_tokens):
    """Four segments requests in a pool of 26 blocks: some are preempted (their blocks freed,
    the segment KV gone with them) and re-assembled on readmission; each output equals the same
    request run alone in a roomy pool. With 100-token steps they are preempted between the
    chunks of their assembly: readmitted with room for one chunk only, an assembly used to find
    no room for its documents and compute that chunk exactly (the third conversation's output
    differed); the scheduler now allocates up to the last document whenever it schedules a
    segments request (Sequence.reserve_until), preempting as for any allocation. (26 blocks and
    96 tokens out, where it was 20 and 48: an assembling request also holds scratch blocks for
    its documents computed alone, so the requests overlap less and must grow more to preempt.
    Each phase of an assembly preempted on purpose: the test after this one.)"""
    g = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    convs = [_messages(o) for o in (["Alice", "Bruno", "Chen"], ["Dara", "Alice"],
                                    ["Chen", "Dara", "Bruno"], ["Bruno", "Chen", "Alice", "Dara"])]  # fmt: skip
    opts = {"cache_mode": "segments", "segment_recompute_tokens": 3}
    alone = [llm.chat(c, g, cache_salt="preempt-alone", **opts)[0].outputs[0].token_ids for c in convs]
    with shared_default_weights():
        small = LLM(kv_cache_memory=26 * 16 * BYTES_PER_TOKEN, seed=0, pin_budget_fraction=0.0,
                    busy_step_ms=0, max_num_batched_tokens=step_tokens)  # fmt: skip
    outs = small.chat(convs, g, **opts)
    assert small.engine.scheduler.counters.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    small.check_integrity()


@pytest.fixture(scope="module")
def llm_small_steps():
    with shared_default_weights():
        return LLM(kv_cache_memory="16MiB", seed=0, busy_step_ms=0, max_num_batched_tokens=16)


@pytest.mark.parametrize("phase", ["alone", "probe", "compute"])
def test_a_request_preempted_in_each_phase_of_its_assembly_is_rebuilt_exactly(llm_small_steps, phase):
    """An assembly runs in phases over several steps (16-token steps here): documents computed
    alone in scratch blocks, the probe, the recompute. Preempted in the middle of each (its
    blocks and scratch freed, the job void), the request is readmitted, assembles again and
    gives the same logprobs as the same request never preempted; nothing leaks (integrity at
    every step: scratch blocks are counted references)."""
    eng = llm_small_steps.engine
    seg = eng.tokenizer.encode_chat_segments(_messages(["Alice", "Bruno", "Chen"]))
    segments = SegmentRequest(seg.spans, SegmentOptions(recompute_tokens=3, selection="deviation"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(rid: str, preempt_in: str | None):
        seq = eng.add_request(rid, seg.token_ids, params, namespace=rid, segments=segments)
        seen, preempted = [], False
        asm = eng.connectors.get("segments").assembler
        while not seq.finished:
            eng.step()
            eng.check_integrity()
            job = asm.jobs.get(rid)
            seen.append(None if job is None else job.phase)
            if preempt_in and not preempted and seen[-1] == preempt_in:
                assert job.inflight == [] and seq.kv.block_table  # between two forwards
                eng.scheduler._preempt(seq, SchedulerOutput())  # as memory pressure would
                eng.check_integrity()
                assert not seq.kv.scratch and not seq.kv.block_table
                preempted = True
        assert preempt_in is None or preempted
        return seq, seen

    ref, phases = run(f"phase-ref-{phase}", None)
    assert {"alone", "probe", "compute"} <= set(phases)  # each phase spans steps here
    got, _ = run(f"phase-{phase}", phase)
    assert got.num_preemptions == 1
    assert got.out.output_token_ids == ref.out.output_token_ids
    assert got.out.output_logprobs == ref.out.output_logprobs  # bit for bit


def test_the_segment_store_is_shared_by_tenants_as_the_tiers_are():
    """Issue #37: the store was one LRU, so one tenant's stream of new documents evicted every
    tenant's. Past its capacity the owner holding the most bytes gives way (cache/shares.py):
    alice evicts her own entries, and bob's only while he holds more than she does."""
    from prefixcache.segments.store import SegmentEntry, SegmentStore

    def entry(ns: str, i: int) -> SegmentEntry:
        kv = torch.zeros(1, 1, 4, 8)  # 128 bytes each
        return SegmentEntry(ns, (i, i + 1, i + 2, i + 3), kv, kv.clone())

    size = 2 * 4 * 8 * 4
    store = SegmentStore(6 * size)
    bob = [i.to_bytes(16, "big") for i in range(100, 103)]
    for i, k in enumerate(bob):
        assert store.put(k, entry("bob/docs", i))
    for i in range(10):  # alice's stream of new documents
        assert store.put(i.to_bytes(16, "big"), entry("alice", 10 + i))
        store.check_integrity()
    assert all(store.contains(k) for k in bob)  # bob holds 3 of 6: within his share
    assert sum(store.contains(i.to_bytes(16, "big")) for i in range(10)) == 3  # alice's newest
    assert store.evicted == 7 and store.used_bytes == 6 * size
    # Bob over his share (alice below it) gives way to her.
    for i in range(3, 6):
        assert store.put((100 + i).to_bytes(16, "big"), entry("bob", i))
    assert sum(store.contains((100 + i).to_bytes(16, "big")) for i in range(6)) == 3
    store.check_integrity()
    # The offline API's namespace (None) is an owner like any: its entries give way too.
    offline = SegmentStore(2 * size)
    for i in range(5):
        assert offline.put((200 + i).to_bytes(16, "big"), entry(None, i))
    assert len(offline) == 2 and offline.evicted == 3
    offline.check_integrity()
