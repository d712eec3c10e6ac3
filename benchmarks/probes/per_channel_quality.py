"""Probe: would per-channel int8 weights pass the quality floor? They are the scheme
torch._int_mm (AMX/VNNI at full rate, whole-K int32 sums, one epilogue per output) can run.
Simulated in float32 on the default model: the decoder's weights (the GGUF's Q4_1 values)
requantized per output channel to int8, activations rounded per token (or per group) to 16 or
8 bits; KL of the next-token distribution against the dense float32 model, 8 texts
(benchmarks/quality.py's). Results in docs/benchmarks-journal.md ("Where a cold prefill goes").

Usage: .venv/bin/python benchmarks/probes/per_channel_quality.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality import logits_of, texts

from prefixcache import LLM

ref = LLM(quantization="none", kv_cache_memory="256MiB")
ts = texts(ref.get_tokenizer(), 8)
refl = [torch.log_softmax(logits_of(ref, t), -1) for t in ts]
model = ref.engine.runner.model
lins = [(layer, name) for layer in model.layers for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
orig = {(id(l), n): getattr(l, n) for l, n in lins}
print("weights kept:", all(getattr(l, n).weight is not None for l, n in lins))

class Fake:
    def __init__(self, w, bits_a, bits_w=8, group_a=None, group_w=None):
        qmax = 2 ** (bits_w - 1) - 1
        ws = w.view(w.shape[0], -1, group_w or w.shape[1])
        s = ws.abs().amax(-1, keepdim=True) / qmax
        self.w = (torch.round(ws / s.clamp_min(1e-30)).clamp(-qmax, qmax) * s).view_as(w)
        self.qa = 2 ** (bits_a - 1) - 1 - (128 if bits_a == 16 else 0)  # 32639 as ours
        self.group_a = group_a

    def __call__(self, x):
        if self.group_a:
            xs = x.view(x.shape[0], -1, self.group_a)
            s = xs.abs().amax(-1, keepdim=True) / self.qa
            xq = (torch.round(xs / s.clamp_min(1e-30)) * s).view_as(x)
        else:
            s = x.abs().amax(-1, keepdim=True) / self.qa
            xq = torch.round(x / s.clamp_min(1e-30)) * s
        return xq @ self.w.T


def kl_of(tag):
    kls, top = [], []
    for t, r in zip(ts, refl):
        lp = torch.log_softmax(logits_of(ref, t), -1)
        kls.append((r.exp() * (r - lp)).sum(-1)); top.append((r.argmax(-1) == lp.argmax(-1)).float())
    print(tag, f"KL {torch.cat(kls).mean().item():.3e}", f"top1 {torch.cat(top).mean().item():.4f}", flush=True)

for tag, kw in [
    ("w8 per-channel, a16 per-token", {"bits_a": 16}),
    ("w8 per-channel, a8 per-token", {"bits_a": 8}),
    ("w8 per-channel, a16 per-192", {"bits_a": 16, "group_a": 192}),
    ("w8 per-channel, a8 per-32 (reference point)", {"bits_a": 8, "group_a": 32}),
    ("w8 per-192, a16 per-192", {"bits_a": 16, "group_a": 192, "group_w": 192}),
    ("w8 per-64, a16 per-64", {"bits_a": 16, "group_a": 64, "group_w": 64}),
]:
    for l, n in lins:
        setattr(l, n, Fake(orig[(id(l), n)].weight.float(), **kw))
    kl_of(tag)
for l, n in lins:
    setattr(l, n, orig[(id(l), n)])
kl_of("restored (must be 0)")
