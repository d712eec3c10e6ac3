"""Weight formats on the real model: what runs where, which modes are exact, cold == warm in each.

- ``auto`` (the default) runs the GGUF's own 4-bit layers on the exact integer path (mixed 8- or
  16-bit integer activations: test_exact.py), close to the dense float32 layers but other
  numbers, so other cache keys; ``int16`` closer still. With ``activations="float32"`` the group kernels compute the same numbers as
  the dense float32 layers (``none``): logits agree to float32 rounding, keys are shared.
- ``int8`` requantizes the 4-bit layers into 8-bit groups: other numbers, so other cache keys,
  close but not equal outputs (agreement threshold below), and cold == warm within the mode.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import PROSE, prefill_logits, shared_default_weights

from prefixcache import LLM, SamplingParams

pytestmark = pytest.mark.slow

B = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# int8 groups of the 4-bit weights vs those weights: share of prompts whose first 8 greedy
# tokens are identical (measured 20/24 on this set; docs/benchmarks-journal.md "Weight formats" has KL
# and agreement on a larger text set). Deterministic on one machine; the margin is for others.
INT8_AGREEMENT = 0.7


@pytest.fixture(scope="module")
def engines():
    """Dense float32, int8 with caching, int8 without (the cold reference)."""
    out = {}
    with shared_default_weights():
        for name, mode, caching in (("none", "none", True), ("int8", "int8", True),
                                    ("int8-cold", "int8", False)):  # fmt: skip
            out[name] = LLM(quantization=mode, kv_cache_memory="64MiB", seed=0,
                            enable_prefix_caching=caching)  # fmt: skip
        out["f32"] = LLM(activations="float32", kv_cache_memory="64MiB", seed=0)
        out["int16"] = LLM(activations="int16", kv_cache_memory="64MiB", seed=0)
    return out


def _prompts(tok, n: int) -> list[list[int]]:
    ids = tok.encode(PROSE * 4)
    return [ids[i * 11 : i * 11 + 40 + i] for i in range(n)]


def test_default_runs_the_files_groups(llm, engines):
    fmt = llm.engine.weights_format
    assert fmt.startswith("w4a8x16 layers") and "w8a8x16 head" in fmt, fmt
    assert not llm.engine.runner.model.requantized
    fmt = engines["int16"].engine.weights_format
    assert fmt.startswith("w4a16 layers") and "w8a16 head" in fmt, fmt  # int16: the head too
    fmt = engines["f32"].engine.weights_format
    assert fmt.startswith("q4 layers") and "q8 head" in fmt, fmt


def test_auto_is_close_to_dense_float32_and_float32_activations_equal_it(llm, engines):
    dense, f32 = engines["none"], engines["f32"]
    assert dense.engine.weights_format.startswith("dense")
    ids = llm.get_tokenizer().encode(PROSE)[:80]
    a, b, c = prefill_logits(f32, ids), prefill_logits(dense, ids), prefill_logits(llm, ids)
    assert float((a - b).abs().max()) < 1e-3  # float32 summation order only
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the same numbers, so the same cache keys (a disk or Redis tier may share them)
    assert f32.engine.fingerprint == dense.engine.fingerprint
    assert engines["int8"].engine.fingerprint != dense.engine.fingerprint
    # the exact path with 16-bit activations (measured 7.7e-3 max abs on logits of ~20, KL ~4e-8
    # over benchmarks/quality.py's texts), other numbers, other keys
    i16 = prefill_logits(engines["int16"], ids)
    assert float((i16 - b).abs().max()) < 3e-2
    assert torch.equal(i16.argmax(-1), b.argmax(-1))
    # the default, mixed 8/16-bit activations: measured KL 9.1e-4 here (4.3e-4 over the quality
    # texts), every argmax the same; its own numbers and keys
    lb, lc = torch.log_softmax(b, -1), torch.log_softmax(c, -1)
    assert float((lb.exp() * (lb - lc)).sum(-1).mean()) < 2e-3
    assert float((c.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.95
    assert len({llm.engine.fingerprint, dense.engine.fingerprint, engines["int16"].engine.fingerprint}) == 3


def test_int8_agrees_with_the_files_weights(engines, llm):
    prompts = _prompts(llm.get_tokenizer(), 24)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in engines["none"].generate(prompts, params, cache_salt="q")]
    got = [o.outputs[0].token_ids for o in engines["int8"].generate(prompts, params, cache_salt="q")]
    agree = sum(a == b for a, b in zip(ref, got)) / len(ref)
    print(f"int8 vs file weights: {agree:.2f} of prompts agree on 8 greedy tokens")
    assert agree >= INT8_AGREEMENT


def test_int4_requantizes_float_weights_close_to_the_files(engines, llm):
    """A checkpoint without 4-bit groups (float weights, as from a Hugging Face directory) gets
    min/max groups of 32 in int4 mode. On this model the float weights lie on the file's 4-bit
    grid already, so the requantized layers agree with the file's on most prompts."""
    import dataclasses
    from unittest import mock

    from _helpers import _default_weights

    floats = dataclasses.replace(_default_weights(), int4={}, int8={})
    with mock.patch("prefixcache.engine.llm_engine.load_weights", lambda model: floats):
        int4 = LLM(quantization="int4", activations="int16", kv_cache_memory="64MiB", seed=0)
    assert int4.engine.runner.model.requantized
    assert int4.engine.weights_format.startswith("w4a16 layers") and "w8a16 head" in int4.engine.weights_format
    assert int4.engine.fingerprint != engines["none"].engine.fingerprint
    prompts = _prompts(llm.get_tokenizer(), 24)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in engines["none"].generate(prompts, params, cache_salt="r")]
    got = [o.outputs[0].token_ids for o in int4.generate(prompts, params)]
    agree = sum(a == b for a, b in zip(ref, got)) / len(ref)
    print(f"int4 requantized vs file weights: {agree:.2f} of prompts agree on 8 greedy tokens")
    assert agree >= INT8_AGREEMENT


@pytest.mark.parametrize("k", [1, 3])
def test_int8_cold_equals_warm_around_block_boundaries(engines, k):
    warm, cold = engines["int8"], engines["int8-cold"]
    tok = warm.get_tokenizer()
    doc = tok.encode(PROSE * 10)
    for shared in (k * B - 1, k * B, k * B + 1):
        prefix = doc[:shared]
        prompts = [prefix + tok.encode(" Question: what is cached?"),
                   prefix + tok.encode(" Which city is in Spain?")]  # fmt: skip
        salt = f"int8-{shared}"
        first = warm.generate([prompts[0]], GREEDY, cache_salt=salt)[0]
        second = warm.generate([prompts[1]], GREEDY, cache_salt=salt)[0]
        ref = cold.generate(prompts, GREEDY)
        # the whole common prefix where the first request's blocks (its prompt and output,
        # less the last token's) hold it: partial blocks are reused token-exactly
        held = (len(prompts[0]) + len(first.outputs[0].token_ids) - 1) // B * B
        assert second.num_cached_tokens == min(shared, held)
        assert first.outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert second.outputs[0].token_ids == ref[1].outputs[0].token_ids
        warm.check_integrity()


def test_fused_decode_step_is_the_layer_by_layer_step_bit_for_bit(llm, monkeypatch):
    """Decode-only steps run every layer in one native call (kernels/decode_forward.cpp); it
    calls the same row and tile functions as the op-by-op path, so logprobs match exactly."""
    model = llm.engine.runner.model
    if model.fused_layers is None:
        pytest.skip("no fused decode path here (kernels unavailable)")
    tok = llm.get_tokenizer()
    shared = tok.encode(PROSE)[: 5 * B]
    prompts = [shared + tok.encode(f" Question {i}: which city?") for i in range(3)] + [
        tok.encode("A different prompt that shares nothing.")
    ]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    from prefixcache import kernels

    calls = []
    real = kernels.decode_forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "decode_forward", counted)
    fused = llm.generate(prompts, params, cache_salt="fused-on")
    assert calls and max(calls) == len(prompts)  # decode steps of the whole batch ran fused
    monkeypatch.setattr(model, "fused_layers", None)
    plain = llm.generate(prompts, params, cache_salt="fused-off")
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats equal, not close
