"""A benchmark model with Llama-3.2-1B's shapes and random bf16 weights, as a Hugging Face
directory (config.json, tokenizer files, model.safetensors), written here: nothing is downloaded.

Shapes: hidden 2048, 16 layers, 32 query / 8 KV heads (head_dim 64), intermediate 8192, tied
embeddings, rope theta 500,000; the default model's tokenizer (vocabulary 49,152, so the
embedding is smaller than Llama's 128k). Its text is noise: use it for speed and memory figures
only (docs/benchmarks.md), quality comes from the default model.

Usage: .venv/bin/python benchmarks/make_1b_model.py [--out .bench/models/llama-1b-shaped]
then e.g. .venv/bin/prefixcache serve --model .bench/models/llama-1b-shaped
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".bench/models/llama-1b-shaped")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from prefixcache.model.paths import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    vocab = len(tok)

    h, n_layers = SHAPES["hidden_size"], SHAPES["num_hidden_layers"]
    heads, kv_heads, inter = SHAPES["num_attention_heads"], SHAPES["num_key_value_heads"], SHAPES["intermediate_size"]
    d = h // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "head_dim": d, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **SHAPES,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))

    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape: int) -> torch.Tensor:  # the scale of a trained model's weights
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    n = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, {2 * n / 1e9:.2f} GB bf16")


if __name__ == "__main__":
    main()
