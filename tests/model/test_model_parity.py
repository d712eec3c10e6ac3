"""Logit parity with Hugging Face transformers on the default GGUF, float32.

transformers dequantizes the same file with its own GGUF reader, so these tests check our loader
(dequantization, the q/k head permutation, names, tied embeddings), the model (norms, rotary,
GQA attention over the paged cache) and the sampler's logprobs against an independent reference.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import prefill_logits

from prefixcache import LLM, SamplingParams
from prefixcache.model.paths import default_model_path

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers' GGUF load takes ~15 s

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within a few decades "
    "printing shops had spread to more than two hundred cities across Europe, and the price of "
    "books fell so far that ordinary merchants could afford them. Historians still argue about "
    "how quickly literacy followed, but nobody doubts that the spread of cheap pamphlets changed "
    "religion, science and politics for good."
)
PREFILL_TOL = 1e-3  # max abs logit difference, float32 (logits are O(10))
# The exact path with 16-bit integer activations against float32 transformers:
# measured 2.8e-3 on the last position here, 7.7e-3 over 80 positions (test_quantization.py).
EXACT_TOL = 3e-2
# the exact path (16-bit activations, the head included): measured 1.1e-3 over 16 steps with
# float32 K/V and the float attention; with int16 K/V (the exact path's default KV dtype:
# attention on the integer units, a 13-bit query and 14-bit softmax weights) 4.3e-3
LOGPROB_TOL = {"float32": 2e-3, "int16": 6e-3}


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def ids(llm):
    return llm.get_tokenizer().encode(TEXT)


def hf_generate(model, ids: list[int], n: int):
    """Greedy ids and the raw logits of each step (no logits processors applied)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=n, output_scores=True, output_logits=True,
            return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id,
        )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def llm_int16():
    """The exact path with 16-bit activations (float32-like quality); the default's mixed
    8/16-bit activations are checked for quality in test_quantization.py."""
    from prefixcache import LLM

    return LLM(kv_cache_memory="32MiB", activations="int16", seed=0)


@pytest.fixture(scope="module")
def llm_f32():
    """The float32 path: the model's implementation against transformers at float32 rounding."""
    from prefixcache import LLM

    return LLM(kv_cache_memory="32MiB", activations="float32", seed=0)


def test_prefill_logits_match_transformers(llm_int16, llm_f32, hf_model, ids):
    ids = ids[:60]
    assert len(ids) == 60
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    exact = prefill_logits(llm_int16, ids)
    assert (exact - theirs).abs().max().item() < EXACT_TOL
    assert torch.equal(exact.argmax(-1), theirs.argmax(-1))
    ours = prefill_logits(llm_f32, ids)  # [60, vocab]
    assert ours.shape == theirs.shape
    diff_last = (ours[-1] - theirs[-1]).abs().max().item()
    diff_all = (ours - theirs).abs().max().item()
    print(f"prefill max abs logit difference: last position {diff_last:.3g}, all {diff_all:.3g}")
    assert diff_last < PREFILL_TOL, f"last-position max abs logit difference {diff_last:.3g}"
    assert diff_all < PREFILL_TOL, f"max abs logit difference over all positions {diff_all:.3g}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kv", ["float32", "int16"])
def test_greedy_decode_and_logprobs_match_transformers(llm_int16, hf_model, ids, kv):
    prompt = ids[:60]
    sp = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    llm = llm_int16 if kv == "int16" else LLM(kv_cache_memory="32MiB", activations="int16", kv_cache_dtype=kv, seed=0)
    assert llm.engine.layout.kv_format.name == kv
    out = llm.generate([prompt], sp, cache_salt="parity-decode")[0].outputs[0]
    hf_ids, hf_logits = hf_generate(hf_model, prompt, 16)
    assert len(hf_ids) == 16, "the reference stopped early; pick a prompt that runs 16 tokens"
    assert out.token_ids == hf_ids
    hf_lp = torch.log_softmax(hf_logits, dim=-1)  # [16, vocab]
    diffs = []
    for step, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in lps and len(lps) >= 5
        # The chosen (greedy) token is the top-1, so its logprob is the largest in the dict.
        assert lps[tok] == max(lps.values())
        for t, lp in lps.items():  # the chosen token and the top 5
            diffs.append(abs(lp - hf_lp[step, t].item()))
        top5 = set(torch.topk(hf_lp[step], 5).indices.tolist())
        assert top5 <= set(lps), f"step {step}: top-5 ids differ"
    worst = max(diffs)
    print(f"decode max abs logprob difference over 16 steps: {worst:.3g}")
    assert worst < LOGPROB_TOL[kv], f"max abs logprob difference {worst:.3g}"


def test_chunked_prefill_matches_transformers(llm_int16, hf_model, ids):
    """Prefill in chunks of 16 tokens; a second prompt joins once the first decodes, so its
    chunks (15 tokens beside a decode) straddle block boundaries."""
    chunked = LLM(kv_cache_memory="16MiB", max_num_batched_tokens=16, activations="int16", seed=0)
    a, b = ids[:70], ids[5:55]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eng = chunked.engine
    sa = eng.add_request("a", a, sp)
    sb = eng.add_request("b", b, sp)
    steps = 0
    while eng.has_unfinished():
        for s in eng.step():
            assert len(s.out.output_token_ids) <= 16
        steps += 1
        if steps == 4:
            assert sa.kv.num_computed_tokens == 64 and not sa.out.output_token_ids, "prefill not chunked"
        chunked.check_integrity()
    assert steps >= 5 + 16  # five chunks for a, at least 16 decodes
    hf_a, _ = hf_generate(hf_model, a, 16)
    hf_b, _ = hf_generate(hf_model, b, 16)
    assert sa.out.output_token_ids == hf_a
    assert sb.out.output_token_ids == hf_b
    # Unchunked on the session engine: the same tokens.
    whole = llm_int16.generate([a, b], sp, cache_salt="parity-chunked")
    assert [o.outputs[0].token_ids for o in whole] == [hf_a, hf_b]
    assert chunked.engine.fingerprint == llm_int16.engine.fingerprint  # same weights, two loads
