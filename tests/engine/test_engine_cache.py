"""Cold == warm on the real model: caching never changes greedy outputs (float32, exact).

Each test uses its own cache_salt so that tests sharing the session engine stay independent.
"""

from __future__ import annotations

import pytest
from _helpers import BYTES_PER_TOKEN, PROSE

from prefixcache import LLM, SamplingParams

B = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

TEXT = PROSE


def _doc_ids(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT * 20)
    assert len(ids) >= n
    return ids[:n]


def _outputs(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_cold_equals_warm_around_block_boundaries(llm, llm_cold, k):
    tok = llm.get_tokenizer()
    salt = f"boundary-{k}"
    for shared in (k * B - 1, k * B, k * B + 1):
        prefix = _doc_ids(tok, shared)
        suffixes = [tok.encode(" Question: what is cached?"), tok.encode(" Which city is in Spain?")]
        prompts = [prefix + s for s in suffixes]
        first = llm.generate([prompts[0]], GREEDY, cache_salt=f"{salt}-{shared}")[0]
        second = llm.generate([prompts[1]], GREEDY, cache_salt=f"{salt}-{shared}")[0]
        cold = llm_cold.generate(prompts, GREEDY)
        assert first.outputs[0].token_ids == cold[0].outputs[0].token_ids
        assert second.outputs[0].token_ids == cold[1].outputs[0].token_ids
        # The whole shared part is a hit (the suffixes differ from token 0): its full blocks,
        # then the tokens of the next block that the first prompt computed (token-exact reuse).
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == shared
        assert cold[1].num_cached_tokens == 0
        llm.check_integrity()


def test_fully_cached_prompt_recomputes_last_token(llm, llm_cold):
    tok = llm.get_tokenizer()
    prompt = _doc_ids(tok, 4 * B)  # exactly four blocks
    a = llm.generate([prompt], GREEDY, cache_salt="full")[0]
    b = llm.generate([prompt], GREEDY, cache_salt="full")[0]
    c = llm_cold.generate([prompt], GREEDY)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    # The last token must be computed for its logits, so the block holding it is not a whole
    # hit: its first 15 tokens are copied (token-exact reuse), the last is computed.
    assert b.num_cached_tokens == 4 * B - 1
    # One more token: the four full blocks of the earlier prompt (and its decode) are hits.
    d = llm.generate([prompt + [tok.encode(" Next")[0]]], GREEDY, cache_salt="full")[0]
    assert d.num_cached_tokens == 4 * B


def test_three_turn_chat_hits_on_previous_answer(llm, llm_cold):
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    msgs = [
        {"role": "system", "content": "You are a geography assistant."},
        {"role": "user", "content": "Describe France in three sentences."},
    ]
    outs = []
    for turn, question in enumerate(["Describe Germany in three sentences.", None]):
        warm = llm.chat(msgs, sp, cache_salt="chat3")[0]
        cold = llm_cold.chat(msgs, sp)[0]
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids, f"turn {turn + 1}"
        outs.append(warm)
        msgs = msgs + [
            {"role": "assistant", "content": warm.outputs[0].text},
            {"role": "user", "content": question or "And Spain?"},
        ]
    turn3 = llm.chat(msgs, sp, cache_salt="chat3")[0]
    assert turn3.outputs[0].token_ids == llm_cold.chat(msgs, sp)[0].outputs[0].token_ids
    turn2 = outs[1]
    assert outs[0].num_cached_tokens == 0
    assert turn2.num_cached_tokens > 0
    # Turn 3 hits past the end of turn 2's prompt: on blocks computed while decoding its
    # answer (48 generated tokens hold at least two full blocks).
    assert turn3.num_cached_tokens > (len(turn2.prompt_token_ids) // B) * B + B
    llm.check_integrity()


def test_namespaces_never_share(llm):
    tok = llm.get_tokenizer()
    prompt = _doc_ids(tok, 5 * B + 3)
    a = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    a2 = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 0  # same tokens, other namespace: no hit
    assert a2.num_cached_tokens == 5 * B
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids


def test_batch_of_prompts_sharing_a_prefix(llm, llm_cold):
    tok = llm.get_tokenizer()
    prefix = _doc_ids(tok, 6 * B + 5)
    prompts = [prefix + tok.encode(f" Item number {i} is") for i in range(5)]
    warm = llm.generate(prompts, GREEDY, cache_salt="batch")
    cold = llm_cold.generate(prompts, GREEDY)
    assert _outputs(warm) == _outputs(cold)
    # Submitted together: the first computes the prefix, the others wait for it and hit.
    assert warm[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 6 * B for o in warm[1:])


@pytest.fixture(scope="module")
def llm_f32():
    """The float32 path (``activations="float32"``), whose decode-only steps use the cascade
    kernel; the exact path (the default) keeps it out (test_exact.py)."""
    return LLM(kv_cache_memory="64MiB", activations="float32", seed=0)


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_decodes_sharing_a_prefix_attend_it_once_and_equal_cold(llm, llm_f32, monkeypatch, delta):
    """On the float32 path, running decodes that hold the same cached blocks attend them as one
    shared segment (decode_attention.py); greedy outputs stay those of each prompt run alone,
    with the shared prefix ending before, on and after a block boundary. The exact path plans
    no segment (the cascade merge order depends on the companions)."""
    from prefixcache.model import attention

    segments = []
    real = attention.build_decode_batch

    def spy(*args, **kwargs):
        batch = real(*args, **kwargs)
        segments.extend(batch.segment_sizes())
        return batch

    monkeypatch.setattr(attention, "build_decode_batch", spy)
    tok = llm_f32.get_tokenizer()
    prefix = _doc_ids(tok, 8 * B + delta)
    prompts = [prefix + tok.encode(f" Question {i}: which city is named here{'?' * i}") for i in range(6)]
    warm = llm_f32.generate(prompts, GREEDY, cache_salt=f"decode-share-{delta}")
    assert segments and max(segments) >= 5  # most of the batch shared one segment
    segments.clear()
    alone = [llm_f32.generate([p], GREEDY, cache_salt=f"decode-alone-{delta}-{i}")[0]
             for i, p in enumerate(prompts)]  # fmt: skip
    assert segments == []  # one sequence at a time: nothing is shared
    assert _outputs(warm) == _outputs(alone)
    llm.generate(prompts, GREEDY, cache_salt=f"decode-share-exact-{delta}")
    assert segments == []


@pytest.fixture(scope="module", params=["lru", "lru-demote", "hit-density", "adaptive"])
def tiny_pool_llm(request):
    # 24 blocks of 16 tokens: a few prompts of ~100 tokens force eviction. Every eviction
    # policy (a policy that evicted a block in use would hand a running request's KV to another).
    return LLM(kv_cache_memory=24 * B * BYTES_PER_TOKEN, seed=0, eviction_policy=request.param)


def test_cold_equals_warm_under_eviction(tiny_pool_llm, llm_cold):
    llm = tiny_pool_llm
    assert llm.engine.kv.pool.eviction_policy in ("lru", "lru-demote", "hit-density", "adaptive")
    tok = llm.get_tokenizer()
    base = tok.encode(TEXT * 3)
    # Eight prompts: a shared 48-token head (stays hot) + distinct 60-token tails. Their full
    # blocks (3 shared + 8 x 4 own) outnumber the pool's 24, so tails get evicted.
    prompts = [base[:48] + base[60 + i * 30 : 120 + i * 30] for i in range(8)]
    for _round in range(2):
        for p in prompts:
            warm = llm.generate([p], GREEDY)[0]
            cold = llm_cold.generate([p], GREEDY)[0]
            assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
            llm.check_integrity()
    stats = llm.cache_stats()
    assert stats["evicted_blocks"] > 0
    assert stats["hit_tokens"] > 0
    # A prompt evicted and recomputed still matches.
    again = llm.generate([prompts[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == llm_cold.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids


def test_cache_stats_fields(llm):
    s = llm.cache_stats()
    for key in ("query_tokens", "hit_tokens", "hit_rate", "cached_blocks", "used_bytes",
                "capacity_bytes", "evicted_blocks"):  # fmt: skip
        assert key in s
    assert 0 <= s["hit_rate"] <= 1
    assert s["used_bytes"] <= s["capacity_bytes"]


def test_the_choices_of_one_prompt_are_explained_once(llm, monkeypatch):
    # A request's n choices share its prompt: one explanation (hashes, for admins a match per
    # namespace) under the engine lock, not n. A step may change the index: explained afresh.
    eng, tok = llm.engine, llm.get_tokenizer()
    calls = []
    real = eng.kv.explain
    monkeypatch.setattr(eng.kv, "explain", lambda *a: calls.append(a) or real(*a))
    prompt = _doc_ids(tok, 3 * B + 1)  # its 3 full blocks are cached after it ran
    sp = SamplingParams(max_tokens=1, temperature=0)

    def add(rid, ids, across=False):
        return eng.add_request(rid, ids, sp, namespace="explain-once", explain=True,
                               explain_across_namespaces=across)  # fmt: skip

    def run(seqs):
        while any(not s.finished for s in seqs):
            eng.step()

    seqs = [add(f"once-{i}", prompt) for i in range(8)]
    assert len(calls) == 1 and {s.cache.cache_info for s in seqs} == {real(prompt, "explain-once", ())}
    assert seqs[0].cache.cache_info.reason == "no_prior_request"
    seqs += [add("once-other", prompt[:-1]), add("once-admin", prompt, across=True)]
    assert len(calls) == 3  # another prompt, another scope: each its own explanation
    run(seqs)
    again = [add(f"once-again-{i}", prompt) for i in range(3)]
    assert len(calls) == 4 and {s.cache.cache_info.reason for s in again} == {"full_hit"}
    run(again)
