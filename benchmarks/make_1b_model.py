"""A benchmark model with Llama-3.2-1B's shapes and random bf16 weights, as a Hugging Face
directory (config.json, tokenizer files, model.safetensors), written here: nothing is downloaded.

Shapes (``--shape 1b``, the default): hidden 2048, 16 layers, 32 query / 8 KV heads (head_dim
64), intermediate 8192, tied embeddings, rope theta 500,000; the default model's tokenizer
(vocabulary 49,152, so the embedding is smaller than Llama's 128k). ``--shape default``: the
default model's own shapes (SmolLM2-135M: hidden 576, 30 layers, 9 / 3 heads, intermediate
1536, rope theta 100,000) with random weights, so that long contexts run in minutes on 2 cores.
``--context N`` sets the context (``max_position_embeddings``; default 8192, the default
model's), e.g. 16384 for 16k-token prefixes (benchmarks/side_by_side.py --workloads long16k).
Its text is noise: use it for speed and memory figures only (docs/benchmarks-journal.md), quality comes
from the default model.

Usage: .venv/bin/python benchmarks/make_1b_model.py [--shape 1b|default] [--context N] [--out DIR]
(default DIR: $BENCH_DIR/models/llama-1b-shaped for the 1B shape at 8192, else
$BENCH_DIR/models/SHAPE-shaped-ctxN; BENCH_DIR defaults to .bench), then e.g.
.venv/bin/prefixcache serve --model .bench/models/llama-1b-shaped
"""

from __future__ import annotations

import argparse
import json
import os
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
# The default model's shapes (read from its GGUF: llama.block_count 30, embedding_length 576, ...).
DEFAULT_SHAPES = {**SHAPES, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "intermediate_size": 1536, "rope_theta": 100000.0}
ALL_SHAPES = {"1b": SHAPES, "default": DEFAULT_SHAPES}


def default_out(shape: str, context: int) -> Path:
    bench = Path(os.environ.get("BENCH_DIR") or Path(__file__).resolve().parents[1] / ".bench")
    if shape == "1b" and context == SHAPES["max_position_embeddings"]:
        return bench / "models/llama-1b-shaped"  # the name docs/benchmarks-journal.md has used
    return bench / f"models/{shape}-shaped-ctx{context}"


def shapes_for(shape: str, context: int) -> dict:
    return {**ALL_SHAPES[shape], "max_position_embeddings": context}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(ALL_SHAPES), default="1b")
    ap.add_argument("--context", type=int, default=SHAPES["max_position_embeddings"],
                    help="max_position_embeddings (default %(default)s)")
    ap.add_argument("--out", default=None, help="directory (default: see above)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.context < 16:
        raise SystemExit("--context: at least 16 tokens")
    out = Path(args.out) if args.out else default_out(args.shape, args.context)
    out.mkdir(parents=True, exist_ok=True)
    shapes = shapes_for(args.shape, args.context)

    from transformers import AutoTokenizer

    from prefixcache.model.paths import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    vocab = len(tok)

    h, n_layers = shapes["hidden_size"], shapes["num_hidden_layers"]
    heads, kv_heads, inter = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["intermediate_size"]
    d = h // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "head_dim": d, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **shapes,
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
