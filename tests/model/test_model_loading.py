"""Loading models: Hugging Face directories (Llama, Qwen2, llama3 rope scaling, tied or untied,
sharded) against transformers on the same random weights; the default GGUF; dtypes; the model
fingerprint that enters every cache key.

The tiny models use the default model's vocabulary, so its tokenizer.json serves them too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers import cold_equals_warm, prefill_logits, write_tiny_gguf

from prefixcache import LLM, SamplingParams
from prefixcache.tokenizer.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

TEXT = (
    "The quick brown fox jumps over the lazy dog. Prefix caching reuses the keys and values of "
    "a prompt that an earlier request already computed, so that only the new suffix is prefilled. "
)
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "initializer_range": 0.2, "rope_theta": 5000.0,
}  # fmt: skip
LOGIT_TOL = 1e-4


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # ours runs with ignore_eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=n, min_new_tokens=n,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the default model's; cached, so shared with the `llm` fixture


def save_tokenizer(tok, directory: Path) -> None:
    (directory / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    cfg = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


def make_hf_dir(tmp_path_factory, tok, cls_name: str, seed: int = 0, max_shard_size=None, **over):
    """A random tiny model saved with save_pretrained (safetensors) plus the tokenizer."""
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }
    config = config_cls[cls_name](**{**TINY, "vocab_size": tok.vocab_size, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).float().eval()
    directory = tmp_path_factory.mktemp(cls_name)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    save_tokenizer(tok, directory)
    return directory, model


def check_parity(directory: Path, ref, tok, n_prompt: int = 40, n_gen: int = 8) -> LLM:
    # quantization "none": the dense float32 reference (a float checkpoint's default is the
    # exact path on 8-bit groups, tested below)
    llm = LLM(model=str(directory), kv_cache_memory="4MiB", dtype="float32", quantization="none")
    ids = tok.encode(TEXT * 4)[:n_prompt]
    ours = prefill_logits(llm, ids)
    theirs = hf_logits(ref, ids)
    diff = (ours - theirs).abs().max().item()
    assert diff < LOGIT_TOL, f"{directory.name}: max abs logit difference {diff:.3g}"
    greedy = SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True)
    out = llm.generate([ids], greedy)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, n_gen), directory.name
    llm.check_integrity()
    return llm


# ---- Hugging Face directories ---------------------------------------------------------------
def test_llama_hf_dir_matches_transformers(tmp_path_factory, tokenizer):
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM")
    assert len(list(directory.glob("*.safetensors"))) == 1
    llm = check_parity(directory, ref, tokenizer)
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == 5000.0
    # Text prompts are tokenized with the directory's tokenizer.json.
    out = llm.generate("Hello there", SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == tokenizer.encode("Hello there", add_special_tokens=True)


def test_sharded_safetensors(tmp_path_factory, tokenizer):
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=1,
                                 max_shard_size="2MB")  # fmt: skip
    shards = list(directory.glob("*.safetensors"))
    assert len(shards) > 1, "expected a sharded checkpoint"
    check_parity(directory, ref, tokenizer)


def test_qwen2_with_qkv_bias(tmp_path_factory, tokenizer):
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "Qwen2ForCausalLM", seed=2)
    # Random init leaves biases at zero; make them matter.
    with torch.no_grad():
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(directory, safe_serialization=True)
    llm = check_parity(directory, ref, tokenizer)
    assert llm.engine.model_config.attention_bias


def write_qwen3_gguf(path: Path, ref) -> Path:
    """The random Qwen3 ``ref`` as a GGUF file (float32 tensors under llama.cpp's names, the
    default model's GPT-2 vocabulary copied from its GGUF), as llama.cpp's converter writes one."""
    cfg = ref.config
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
             "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm",
             "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down"}  # fmt: skip
    tensors = []
    for name, t in ref.state_dict().items():
        parts = name.split(".")
        if parts[0] == "lm_head":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif parts[1] == "layers":
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.{parts[-1]}"
        else:
            gname = f"{names[parts[1]]}.{parts[-1]}"
        tensors.append((gname, t.detach().float().numpy()))
    return write_tiny_gguf(path, "qwen3", cfg, cfg.rope_parameters["rope_theta"], tensors, pre="qwen2")


def test_qwen3_qk_norms_from_a_directory_and_a_gguf(tmp_path_factory, tokenizer):
    """Qwen3: each q and k head RMS-normed before rotary (weights made to matter), from its
    Hugging Face directory and from the same weights as a GGUF, against transformers; then the
    exact path's default on it, bit for bit the same cold, warm and batched."""
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "Qwen3ForCausalLM", seed=5, head_dim=16)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    ref.save_pretrained(directory, safe_serialization=True)
    llm = check_parity(directory, ref, tokenizer)
    cfg = llm.engine.model_config
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.attention_bias
    gguf_path = write_qwen3_gguf(tmp_path_factory.mktemp("qwen3-gguf") / "qwen3-tiny.gguf", ref)
    llm_gguf = check_parity(gguf_path, ref, tokenizer)
    assert llm_gguf.engine.model_config.qk_norm
    # The norms matter here: the same model without them is far from transformers.
    ids = tokenizer.encode(TEXT * 4)[:40]
    for layer in llm.engine.runner.model.layers:
        layer.qk_norms = None
    assert float((prefill_logits(llm, ids) - hf_logits(ref, ids)).abs().max()) > 100 * LOGIT_TOL
    exact = LLM(model=str(directory), kv_cache_memory="4MiB")
    assert exact.engine.runner.model.exact
    assert exact.engine.runner.model.exact_layers is not None  # decode in one native call
    ids = tokenizer.encode(TEXT * 4)[:70]
    cold = cold_equals_warm(exact, ids)
    # decoded (the native step, its q/k norms in C++) == prefilled (the layer loop): the 4th
    # token's distribution again as the first token after a prompt of the 3 before it
    gen = cold.outputs[0].token_ids
    again = exact.generate([ids + gen[:3]], SamplingParams(max_tokens=1, temperature=0, logprobs=2))[0]
    assert again.outputs[0].token_ids == gen[3:4]
    assert again.outputs[0].logprobs == cold.outputs[0].logprobs[3:4]
    exact.check_integrity()


def test_llama3_rope_scaling_past_original_context(tmp_path_factory, tokenizer):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=3,
                                 rope_scaling=rope, head_dim=32, num_attention_heads=2,
                                 num_key_value_heads=1)  # fmt: skip
    llm = check_parity(directory, ref, tokenizer, n_prompt=100, n_gen=8)
    rs = llm.engine.model_config.rope_scaling
    assert rs and (rs.get("rope_type") or rs.get("type")) == "llama3"


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tmp_path_factory, tokenizer, tied):
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=4,
                                 tie_word_embeddings=tied)  # fmt: skip
    if not tied:
        assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    llm = check_parity(directory, ref, tokenizer, n_gen=4)
    model = llm.engine.runner.model
    assert llm.engine.model_config.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.embed_weight.data_ptr()) is tied


def test_a_float_checkpoint_runs_exact_8_bit_groups_by_default(tmp_path_factory, tokenizer):
    """A Hugging Face float checkpoint gets the exact integer path without flags: its decoder
    weights quantized at load to symmetric 8-bit groups of 32 (w8a16), close to transformers'
    float32 logits, and bit for bit the same cold, warm and in a batch."""
    directory, ref = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=7)
    llm = LLM(model=str(directory), kv_cache_memory="4MiB")
    model = llm.engine.runner.model
    assert model.exact and model.requantized and model.arithmetic == "w8a16"
    assert llm.engine.weights_format.startswith("w8a16 layers"), llm.engine.weights_format
    ids = tokenizer.encode(TEXT * 4)[:70]
    ours = prefill_logits(llm, ids)
    # The same 8-bit weights with float32 activations: only the 16-bit activation rounding
    # differs (measured 1.7e-3 max abs on logits of range 8). The weights' own rounding vs
    # transformers (random weights of std 0.2: 0.04 mean abs) is benchmarks/quality.py's to judge.
    q8 = LLM(model=str(directory), kv_cache_memory="4MiB", quantization="int8", activations="float32")
    assert q8.engine.weights_format.startswith("q8 layers")
    near = prefill_logits(q8, ids)
    assert float((ours - near).abs().max()) < 1e-2
    assert torch.equal(ours.argmax(-1), near.argmax(-1))
    theirs = hf_logits(ref, ids)
    assert float((ours - theirs).abs().mean()) < 0.1 * float(theirs.std())
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    cold = llm.generate([ids], params)[0]
    warm, _companion = llm.generate([ids, ids[:33] + ids[40:60]], params)  # batched, warm
    assert warm.num_cached_tokens >= 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs  # floats compared exactly
    llm.check_integrity()


def test_auto_runs_mixed_activations_on_a_files_own_8bit_groups(tmp_path_factory, tokenizer):
    """auto: a file's own 8-bit groups (GGUF Q8_0) get mixed activations, whose rounding is the
    only one against the file's weights (KL 4.3e-4 on the default model's weights in 8-bit
    groups, docs/design.md section 2); 8-bit groups made at load from a float checkpoint keep
    16 bits (the test above)."""
    from prefixcache.model.linear import quantize_int8
    from prefixcache.model.llama import LlamaModel
    from prefixcache.model.loader import load_weights

    directory, _ = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=3)
    weights = load_weights(directory)
    stored = {n: quantize_int8(t) for n, t in weights.tensors.items()
              if n.startswith("model.layers.") and n.endswith("proj.weight")}  # fmt: skip
    weights.int8.update(stored)  # as if the file held them as Q8_0
    for n, g in stored.items():  # the float copies equal the groups, as the loader keeps them
        weights.tensors[n] = (g.q.float().view(g.q.shape[0], -1, 32) * g.scale.unsqueeze(-1)).view(g.q.shape)
    cpu = torch.device("cpu")
    model = LlamaModel(weights, 64, torch.float32, cpu, "file", "auto")
    assert model.exact and model.arithmetic == "w8a8x16"
    assert LlamaModel(weights, 64, torch.float32, cpu, "file", "int16").arithmetic == "w8a16"


# ---- the default GGUF, dtypes, fingerprints --------------------------------------------------
def test_default_gguf_config(llm):
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == (576, 64, 49152)
    assert cfg.tie_word_embeddings
    assert llm.engine.runner.dtype == torch.float32


def test_embedding_kept_as_the_files_groups(llm):
    """On the exact path the embedding stays in the file's groups (the default's Q8_0, 1.1
    bytes a weight, not 4; tied, read from the head's packed copy), each row looked up equal to
    the whole table dequantized at load; a copy of its own and 4-bit groups likewise."""
    from prefixcache.model.llama import GroupEmbedding
    from prefixcache.model.loader import Int4Groups, load_weights

    model = llm.engine.runner.model
    table = model.embed_weight
    assert model.exact and isinstance(table, GroupEmbedding)
    assert table.head is model.lm_head and table.q is None  # tied: the head's packed groups serve
    full = load_weights(None).tensors["model.embed_tokens.weight"]
    ids = torch.tensor([0, 5, 49151, 5, 1000])
    assert torch.equal(table.lookup(ids), full[ids])
    assert torch.equal(table.lookup(torch.arange(full.shape[0])), full)
    weights = load_weights(None)
    groups = weights.int8["model.embed_tokens.weight"]
    own = GroupEmbedding(groups, torch.device("cpu"), torch.float32)
    assert torch.equal(own.lookup(ids), full[ids])  # untied: a copy of the groups of its own
    from prefixcache.model.int_linear import IntLinear

    for mixed in (False, True):  # both packed layouts serve rows, whichever this host's head has
        head = IntLinear(groups, None, 16, "avx512-vnni", mixed)
        assert head.wq.dtype == (torch.uint8 if mixed else torch.int8)  # quads: q + 128; pairs
        assert torch.equal(GroupEmbedding(None, torch.device("cpu"), torch.float32, head=head).lookup(ids), full[ids])
    g = torch.Generator().manual_seed(0)
    q4 = Int4Groups(torch.randint(0, 16, (50, 64), generator=g, dtype=torch.uint8),
                    torch.rand(50, 2, generator=g) * 0.1, torch.randn(50, 2, generator=g) * 0.5, 32)  # fmt: skip
    four = GroupEmbedding(q4, torch.device("cpu"), torch.float32)
    assert torch.equal(four.lookup(torch.tensor([3, 49, 0, 3])), q4.dequantize()[[3, 49, 0, 3]])


def test_fingerprint_stable_and_sensitive_to_weights(tmp_path_factory, tokenizer):
    a, _ = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=5)
    b, _ = make_hf_dir(tmp_path_factory, tokenizer, "LlamaForCausalLM", seed=6)
    fa1 = LLM(model=str(a), kv_cache_memory="1MiB").engine.fingerprint
    fa2 = LLM(model=str(a), kv_cache_memory="1MiB").engine.fingerprint
    fb = LLM(model=str(b), kv_cache_memory="1MiB").engine.fingerprint
    fa_bf16 = LLM(model=str(a), kv_cache_memory="1MiB", dtype="bfloat16").engine.fingerprint
    fa_dense = LLM(model=str(a), kv_cache_memory="1MiB", quantization="none").engine.fingerprint
    assert fa1 == fa2, "same weights loaded twice must key the cache the same way"
    assert fa1 != fb, "different weight files must not share cache keys"
    assert fa1 != fa_bf16, "float32 and bfloat16 KV must not share cache keys"
    assert fa1 != fa_dense, "quantized weights compute other K/V: they must not share cache keys"
    assert len(fa1) >= 32


@pytest.mark.slow
def test_bfloat16_default_model(llm):
    bf = LLM(dtype="bfloat16", kv_cache_memory="32MiB", seed=0)
    assert bf.engine.runner.dtype == torch.bfloat16
    assert bf.engine.runner.kv.k.dtype == torch.bfloat16
    assert bf.engine.fingerprint != llm.engine.fingerprint
    out = bf.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.outputs[0].token_ids and out.outputs[0].text.strip()
    bf.check_integrity()
