"""CacheBlend-style recompute selection for segments (segment_selection "deviation" / "both",
segments/blend.py): the selection function, the probe's deviation against one computed
independently, the budget, and the segments invariants in the new modes (recompute everything
== cold, store hit == miss, deterministic, normal requests unchanged, every KV dtype). Shares
the session's engines and test_segments' prompts; short generations."""

from __future__ import annotations

import pytest
import torch
from _helpers import shared_default_weights
from test_segments import ALL, GREEDY, _messages, _tokens

from prefixcache import LLM, SamplingParams
from prefixcache.api.errors import InvalidRequestError
from prefixcache.api.segments import SegmentOptions
from prefixcache.kv.pool import KVCache, KVLayout
from prefixcache.model.attention import build_metadata
from prefixcache.model.decode_attention import slots_of
from prefixcache.segments import assembler, blend
from prefixcache.server.edge.errors import APIError
from prefixcache.server.openai.prompt import segment_request
from prefixcache.server.openai.protocol import ChatCompletionRequest

MODES = ("deviation", "both")


def test_select_and_runs():
    dev = torch.tensor([0.0, 5.0, 1.0, 9.0, 9.0, 2.0, 0.0, 3.0])
    assert blend.select(dev, 0, 3) == [1, 3, 4]  # the largest, ascending
    assert blend.select(dev, 2, 2) == [0, 1, 3, 4]  # first 2 forced, then the largest of the rest
    assert blend.select(dev, 4, 2) == [0, 1, 2, 3, 4, 7]  # 4 is forced: 7 and 5 come next
    assert blend.select(dev, 0, 0) == []
    assert blend.select(torch.zeros(6), 0, 3) == [0, 1, 2]  # ties: the earlier token
    for first, count in ((0, 5), (3, 2), (8, 0), (1, 7)):  # exactly the budget
        assert len(blend.select(dev, first, count)) == first + count
    assert blend.runs([0, 1, 2, 5, 7, 8], 10) == [(10, 13), (15, 16), (17, 19)]
    assert blend.runs([], 10) == []


def test_options_budget_and_validation(llm):
    # the budget is B = min(n, max(k, ceil(ratio n))) in every mode; the modes split it
    for n, k, ratio, want in ((40, 6, 0.0, {"first": (6, 0), "deviation": (0, 6), "both": (3, 3)}),
                              (40, 4, 0.25, {"first": (10, 0), "deviation": (0, 10), "both": (5, 5)}),
                              (5, 7, 0.0, {"first": (5, 0), "deviation": (0, 5), "both": (3, 2)})):  # fmt: skip
        for mode, split in want.items():
            opts = SegmentOptions(k, ratio, mode)
            assert opts.split(n) == split and sum(split) == opts.recompute_for(n)
            assert opts.probes == (mode != "first")
    assert SegmentOptions().selection == "first"  # the default: unchanged behaviour
    for bad in ("blend", "", None, 1, "Deviation"):
        with pytest.raises(InvalidRequestError) as e:
            SegmentOptions(selection=bad)
        assert e.value.param == "segment_selection"
    with pytest.raises(InvalidRequestError):
        llm.chat(_messages(["Alice"]), GREEDY, cache_mode="segments", segment_selection="top")
    # the server: 400 naming the field; absent means "first"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                segment_selection="random")  # fmt: skip
    with pytest.raises(APIError) as e:
        segment_request(req, [(1, 3)])
    assert e.value.status == 400 and e.value.param == "segment_selection"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert segment_request(req, [(1, 3)]).options.selection == "first"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                segment_selection="both", segment_recompute_tokens=8)  # fmt: skip
    assert segment_request(req, [(1, 3)]).options == SegmentOptions(8, 0.0, "both")


@pytest.mark.parametrize("mode", MODES)
def test_recompute_everything_equals_cold(llm, llm_cold, mode):
    msgs = _messages(["Chen", "Alice", "Bruno"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    cold = _tokens(llm_cold.generate([seg.token_ids], GREEDY))
    for opts in ({"segment_recompute_tokens": ALL}, {"segment_recompute_ratio": 1.0}):
        out = llm.chat(msgs, GREEDY, cache_salt=f"blend-all-{mode}", cache_mode="segments",
                       segment_selection=mode, **opts)  # fmt: skip
        assert _tokens(out) == cold
        assert out[0].num_segment_cached_tokens == 0
    llm.check_integrity()


def _cold_layer1_v(llm, ids: list[int]) -> torch.Tensor:
    """Layer-1 V of a cold prefill of ``ids`` on a private cache, [kv_heads, n, D] float32."""
    eng = llm.engine
    n, bs, dev = len(ids), eng.config.block_size, eng.runner.device
    nb = -(-n // bs)
    lay = eng.runner.kv.layout
    private = KVCache(eng.runner.config, KVLayout(nb, bs, lay.bytes_per_token, lay.kv_format), dev)
    meta = build_metadata([list(range(nb))], [0], [n], bs, dev, native=eng.runner.model.native,
                          exact=eng.runner.model.exact)  # fmt: skip
    rows = torch.arange(n, device=dev)
    eng.runner.model(torch.tensor(ids, device=dev), rows, private, meta, rows[-1:])
    return private.layer(1).gather(rows, torch.float32)[1].cpu()


def test_deviation_selects_the_true_top_deviation_tokens(llm, monkeypatch):
    """End to end: the probe's deviation of each document token equals the one computed
    independently (layer-1 V of a cold prefill vs the stored alone KV that was placed), the
    tokens recomputed are exactly the budget's top deviations of each document, and here they
    are not its first k (so first-k or a random pick would fail this test)."""
    k, msgs = 6, _messages(["Dara", "Alice", "Chen"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    seen, computed = [], []
    select = blend.select

    def spy_select(deviation, first, count):
        out = select(deviation, first, count)
        seen.append((deviation.clone(), first, count, out))
        return out

    monkeypatch.setattr(blend, "select", spy_select)
    asm = llm.engine.connectors.get("segments").assembler
    execute = asm.runner.execute
    lo, hi = seg.spans[0][0], seg.spans[-1][1]
    pool_v1, probed = [], []

    def spy_execute(pieces):  # the recompute forwards come after the probe's
        probed.extend(p for p in pieces if p.probe)
        mine = [p for p in pieces if not p.probe and p.start < hi]
        if probed and mine:
            if not pool_v1:  # before the first recompute forward: what the probe left
                slots = slots_of(mine[0].block_table, lo, hi, asm.block_size)
                pool_v1.append(asm.runner.kv.layer(1).gather(slots.to(asm.runner.device), torch.float32)[1])
            computed.extend((p.start, p.start + p.n) for p in mine)
        return execute(pieces)

    monkeypatch.setattr(asm.runner, "execute", spy_execute)
    out = llm.chat(msgs, GREEDY, cache_salt="blend-true-top", cache_mode="segments",
                   segment_recompute_tokens=k, segment_selection="deviation")[0]  # fmt: skip
    assert len(seen) == len(seg.spans)
    cold_v1 = _cold_layer1_v(llm, seg.token_ids)
    sink = tuple(seg.token_ids[:1])
    recomputed = {p for a, b in computed for p in range(a, b)}
    not_first_k = 0
    for (a, b), (dev, first, count, chosen) in zip(seg.spans, seen):
        assert (first, count) == (0, k) and len(chosen) == k  # the budget exactly
        ids = seg.token_ids[a:b]  # what was computed alone, kept, and placed
        ns = "blend-true-top"  # (the request's namespace: its cache_salt)
        placed_v1 = asm.store.get(asm.key(ids, ns, sink), ids, ns, sink).v[1]  # [KVH, n, D]
        ref = (cold_v1[:, a:b] - placed_v1).square().sum((0, 2))
        torch.testing.assert_close(dev, ref, rtol=1e-3, atol=1e-4 * ref.max().item())
        # the chosen are the top k of the independent deviation (no near-tie at the cut here)
        top = torch.sort(ref, descending=True, stable=True).indices[:k].sort().values.tolist()
        assert chosen == top
        assert {a + o for o in chosen} == recomputed & set(range(a, b))  # what was recomputed
        not_first_k += chosen != list(range(k))
    assert not_first_k > 0
    # the probe left every document token's layer-1 K/V as a cold prefill computes them
    torch.testing.assert_close(pool_v1[0].cpu(), cold_v1[:, lo:hi], rtol=1e-4, atol=1e-4)
    assert out.num_segment_cached_tokens == 0  # first sight: computed alone (a miss)
    llm.check_integrity()


@pytest.mark.parametrize("mode", MODES)
def test_hit_equals_miss_and_deterministic(llm, mode):
    """The output does not depend on the store's content: a miss (computed alone now), a hit,
    and a miss again after invalidation give the same tokens."""
    salt, k = f"blend-hit-miss-{mode}", 5
    msgs = _messages(["Bruno", "Dara", "Chen"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    opts = {"cache_mode": "segments", "segment_recompute_tokens": k, "segment_selection": mode}
    miss = llm.chat(msgs, GREEDY, cache_salt=salt, **opts)[0]
    hit = llm.chat(msgs, GREEDY, cache_salt=salt, **opts)[0]
    assert miss.num_segment_cached_tokens == 0
    assert hit.num_segment_cached_tokens == sum(b - a - k for a, b in seg.spans)
    llm.engine.invalidate(salt)
    again = llm.chat(msgs, GREEDY, cache_salt=salt, **opts)[0]
    assert again.num_segment_cached_tokens == 0
    assert miss.outputs[0].token_ids == hit.outputs[0].token_ids == again.outputs[0].token_ids
    llm.check_integrity()


def test_requests_without_cache_mode_are_unchanged(llm, llm_cold):
    salt = "blend-isolated-from-prefix"
    msgs = _messages(["Alice", "Dara"])
    seg = llm.get_tokenizer().encode_chat_segments(msgs)
    for mode in MODES:
        for _ in range(2):
            llm.chat(msgs, GREEDY, cache_salt=salt, cache_mode="segments",
                     segment_recompute_tokens=3, segment_selection=mode)  # fmt: skip
    normal = llm.generate([seg.token_ids], GREEDY, cache_salt=salt)[0]
    assert normal.num_cached_tokens <= seg.spans[0][0]  # nothing past the first document
    assert _tokens([normal]) == _tokens(llm_cold.generate([seg.token_ids], GREEDY))
    llm.check_integrity()


def test_scattered_pieces_in_one_forward_equal_one_by_one(llm, monkeypatch):
    """Deviation-selected tokens are scattered: many 1-token pieces of one sequence in one
    forward (the decode path, prefix-shared blocks included). Forwards of one token each (the
    probe too) give the same outputs."""
    msgs = _messages(["Chen", "Bruno", "Alice", "Dara"])
    lp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    opts = {"cache_mode": "segments", "segment_recompute_tokens": 7, "segment_selection": "both"}
    one = llm.chat(msgs, lp, cache_salt="blend-one-forward", **opts)[0].outputs[0]
    monkeypatch.setattr(llm.engine.connectors.get("segments").assembler, "max_chunk", 1)
    split = llm.chat(msgs, lp, cache_salt="blend-split", **opts)[0].outputs[0]
    assert one.token_ids == split.token_ids
    for a, b in zip(one.logprobs, split.logprobs):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a.keys() & b.keys())


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_quantized_kv(kv_dtype, monkeypatch):
    """Every KV format: recompute everything is the cold run of that format, a partial budget
    gives the same tokens on a miss and a hit, and the probe's deviations are finite."""
    with shared_default_weights():
        eng = LLM(kv_cache_dtype=kv_dtype, kv_cache_memory="32MiB", segment_cache_memory="64MiB")
    msgs = _messages(["Bruno", "Alice"])
    seg = eng.get_tokenizer().encode_chat_segments(msgs)
    g = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cold = _tokens(eng.generate([seg.token_ids], g, cache_salt="cold"))
    full = eng.chat(msgs, g, cache_mode="segments", segment_recompute_tokens=ALL,
                    segment_selection="deviation")  # fmt: skip
    assert _tokens(full) == cold
    devs = []
    blend_pieces = assembler.blend_pieces

    def spy(options, pieces, probed, deviation, start):
        devs.append(deviation)  # deviations of the tokens up to the end of the last span
        return blend_pieces(options, pieces, probed, deviation, start)

    monkeypatch.setattr(assembler, "blend_pieces", spy)
    opts = {"cache_mode": "segments", "segment_recompute_tokens": 4, "segment_selection": "deviation"}
    miss = eng.chat(msgs, g, cache_salt="q", **opts)[0]
    hit = eng.chat(msgs, g, cache_salt="q", **opts)[0]
    assert hit.num_segment_cached_tokens == sum(b - a - 4 for a, b in seg.spans)
    assert miss.outputs[0].token_ids == hit.outputs[0].token_ids
    assert len(devs) == 2
    for d in devs:
        placed = d[-(seg.spans[-1][1] - seg.spans[0][0]) :]  # the documents' tokens
        assert torch.isfinite(placed).all() and placed.max() > 0
    eng.check_integrity()
