"""Probe: what integer attention would cost in quality at long contexts, emulated in torch.

The engine's attention (kernels.paged_attention) is replaced, for every layer, by a torch
emulation of an integer scheme, and the next-token distribution at the last ``--tail``
positions of long real texts (ShareGPT conversations joined in file order, ``--lengths``
tokens) is compared with the engine's own (float32 KV, float32 attention): KL mean / max,
top-1 agreement. Schemes (each a column of the emulation):

- ``kv8``:  K and V stored as int8 per (token, KV head) (the int8 KV dtype), float attention
- ``q8``:   + q rounded to int8 per (token, head): scores from integer dot products
- ``q16``:  + q rounded to int16 instead
- ``pN``:   + the value sums in integers: per query and block of 32 keys, w_j = p_j sv_j
            rounded to N-bit unsigned integers against the block's largest w
            (scale max w / (2^N - 1)), times V's int8 values
- ``ks``:   K smoothed before its rounding by constants of the model (calibrated once on another
            text, never on the data attended over, so a token's stored values stay its own):
            per (layer, KV head, channel) a mean m subtracted (q . m is the same for every key
            of a query, so the softmax is unchanged) and a scale c = sqrt(max|k - m| / max|q|)
            divided out of K and multiplied into q (q . k unchanged); ``km``: the mean alone

Usage: .venv/bin/python benchmarks/probes/attention_quant_quality.py [--lengths 2048,4096,8192]
       [--texts 2] [--tail 256] [--schemes kv8,kv8+q8,kv8+q8+p8,...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prefixcache import LLM, kernels
from prefixcache.bench.sharegpt import default_sharegpt_path, iter_conversations

BLOCK = 32


def long_texts(tok, length: int, n: int, skip: int) -> list[list[int]]:
    """n texts of `length` tokens: the turns of consecutive conversations joined."""
    out: list[list[int]] = []
    ids: list[int] = []
    with default_sharegpt_path() as path:
        for i, rec in enumerate(iter_conversations(path)):
            if i < skip:
                continue
            for turn in rec.get("conversations") or []:
                if isinstance(turn, dict) and isinstance(turn.get("value"), str):
                    ids.extend(tok.encode(turn["value"] + "\n\n"))
            if len(ids) >= length:
                out.append(ids[:length])
                ids = []
                if len(out) == n:
                    return out
    return out


def quant_rows(x: torch.Tensor, qmax: float):
    """Per-row absmax rounding to integers (float64 values that are integers) and the scale."""
    amax = x.abs().amax(-1, keepdim=True)
    s = (amax / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(x / s).clamp(-qmax, qmax), s


ALIASES = {"kv8": ("k127", "v127"), "q8": ("q127",), "q16": ("q32767",), "p8": ("p255",),
           "p16": ("p65535",), "k8": ("k127",), "v8": ("v127",)}


def parse(scheme: set[str]) -> dict[str, float]:
    """{"k"|"v"|"q"|"p": largest integer magnitude}: k127 = K in int8, p16383 = 14-bit weights."""
    out = {}
    for tok in scheme:
        for t in ALIASES.get(tok, (tok,)):
            out[t[0]] = float(t[1:])
    return out


def emulate(q, k, v, scale, scheme: set[str], first: int, smooth=None):
    """q [T, H, D] at positions first.. ; k, v [KVH, C, D] float32 (C = first + T); smooth:
    (m, c) [KVH, D] each, the layer's K mean and channel scale (``ks``/``km``)."""
    t, h, d = q.shape
    kvh, c, _ = k.shape
    g = h // kvh
    q = q.double()
    k = k.double()
    v = v.double()
    if smooth is not None:
        m, cs = (x.double() for x in smooth)
        k = (k - m[:, None, :]) / cs[:, None, :]
        q = (q.view(t, kvh, g, d) * cs[None, :, None, :]).view(t, h, d)
    spec = parse(scheme)
    one = torch.ones(kvh, c, 1, dtype=torch.float64)
    k8, sk = quant_rows(k, spec["k"]) if "k" in spec else (k, one)
    v8, sv = quant_rows(v, spec["v"]) if "v" in spec else (v, one)
    if "q" in spec:
        q, sq = quant_rows(q, spec["q"])
    else:
        sq = torch.ones(t, h, 1, dtype=torch.float64)
    pmax = spec.get("p")
    out = torch.empty(t, h, d, dtype=torch.float64)
    nb = (c + BLOCK - 1) // BLOCK
    pad = nb * BLOCK - c
    for i0 in range(0, t, 128):
        i1 = min(t, i0 + 128)
        pos = torch.arange(first + i0, first + i1)
        qg = q[i0:i1].view(i1 - i0, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, n, D]
        dots = torch.einsum("kgnd,kcd->kgnc", qg, k8)
        sqg = sq[i0:i1].view(i1 - i0, kvh, g, 1).permute(1, 2, 0, 3)
        s = dots * sqg * sk.view(kvh, 1, 1, c) * scale
        mask = torch.arange(c)[None, :] > pos[:, None]
        s = s.masked_fill(mask, float("-inf"))
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        sb = s.view(kvh, g, i1 - i0, nb, BLOCK)
        bmax = sb.amax(-1)  # [.., nb]
        run = torch.cummax(bmax, -1).values  # running max after each block
        p = torch.exp(sb - run[..., None])  # 0 where masked
        final = run[..., -1:]
        resc = torch.exp(run - final)  # each block's weight at the end
        l = (p.sum(-1) * resc).sum(-1)  # [.., n]
        vv = torch.nn.functional.pad(v8, (0, 0, 0, pad)).view(kvh, nb, BLOCK, d)
        svv = torch.nn.functional.pad(sv.squeeze(-1), (0, pad)).view(kvh, nb, BLOCK)
        w = p * svv[:, None, None]
        if pmax is not None:
            sw = (w.amax(-1, keepdim=True) / pmax).clamp(min=1e-300)
            w = torch.round(w / sw) * sw
        contrib = torch.einsum("kgnbj,kbjd->kgnbd", w, vv)
        o = (contrib * resc[..., None]).sum(-2) / l[..., None]
        out[i0:i1] = o.permute(2, 0, 1, 3).reshape(i1 - i0, h, d)
    return out.float()


def install(scheme: set[str] | None, layers: int = 1, smooth=None, capture=None):
    """The patched attention; ``smooth``: per layer (m, c) for ``ks``/``km``; ``capture``: a
    dict filled with each layer's K and q (float attention, for the calibration)."""
    original = kernels.paged_attention
    calls = [0]

    def sequences(kv, paged):
        """Per sequence of the step: its query rows, context length and K, V [KVH, C, D]."""
        for s in range(paged.q_start.numel()):
            qs, ql, cx = int(paged.q_start[s]), int(paged.q_len[s]), int(paged.ctx[s])
            off = int(paged.slots_off[s])
            k, v = kv.gather(paged.slots[off : off + cx], torch.float32)
            yield slice(qs, qs + ql), ql, cx, k, v

    def patched(q, kv, paged, scale, isa="avx2", *rest):
        layer = calls[0] % layers
        calls[0] += 1
        if capture is not None:
            for rows, ql, cx, k, _ in sequences(kv, paged):
                capture.setdefault(layer, []).append((q[rows].clone(), k[:, cx - ql :].clone()))
        if scheme is None:
            return original(q, kv, paged, scale, isa, *rest)
        sm = None
        if smooth is not None and scheme & {"ks", "km"}:
            m, c = smooth[layer]
            sm = (m, c if "ks" in scheme else torch.ones_like(c))
        out = torch.empty_like(q)
        for rows, ql, cx, k, v in sequences(kv, paged):
            out[rows] = emulate(q[rows], k, v, scale, scheme - {"ks", "km"}, cx - ql, sm)
        return out

    return original, patched


def calibrate(runner, ids: list[int], layers: int) -> dict:
    """Per layer (m, c) [KVH, D]: K's mean over the calibration text's tokens and the channel
    scale sqrt(max|k - m| / max|q|) (max over tokens and the KV head's query heads), normalized
    to geometric mean 1."""
    import prefixcache.model.attention as attn_mod

    cap: dict = {}
    original, patched = install(None, layers, capture=cap)
    attn_mod.kernels.paged_attention = patched
    try:
        runner.all_logits(ids, last=1)
    finally:
        attn_mod.kernels.paged_attention = original
    out = {}
    for layer, parts in cap.items():
        q = torch.cat([p[0] for p in parts]).double()  # [T, H, D]
        k = torch.cat([p[1] for p in parts], dim=1).double()  # [KVH, T, D]
        kvh, _, d = k.shape
        m = k.mean(1)
        a = (k - m[:, None]).abs().amax(1).clamp(min=1e-6)
        b = q.view(q.shape[0], kvh, -1, d).abs().amax((0, 2)).clamp(min=1e-6)
        c = (a / b).sqrt()
        c = c / c.log().mean(-1, keepdim=True).exp()
        out[layer] = (m.float(), c.float())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--schemes", default="none,kv8,kv8+q8,kv8+q16,kv8+q8+p8,kv8+q8+p16,kv8+q16+p16")
    ap.add_argument("--json", default="results/attention_quant_quality.json")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="the ks/km calibration text's length")
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="256MiB", kv_cache_dtype="float32")  # the float attention reference
    tok = llm.get_tokenizer()
    runner = llm.engine.runner
    import prefixcache.model.attention as attn_mod

    layers = len(runner.model.layers)
    smooth = None
    if any(t in {"ks", "km"} for n in args.schemes.split(",") for t in n.split("+")):
        calib = long_texts(tok, args.calib_tokens, 1, skip=50)[0]  # a text the runs never see
        smooth = calibrate(runner, calib, layers)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        data = long_texts(tok, length, args.texts, skip=1000 + length // 16)
        ref = [torch.log_softmax(runner.all_logits(ids)[-args.tail :].float(), -1) for ids in data]
        for name in args.schemes.split(","):
            scheme = None if name == "none" else set(name.split("+")) - {"float"}
            original, patched = install(scheme, layers, smooth)
            attn_mod.kernels.paged_attention = patched
            t0 = time.time()
            try:
                got = [torch.log_softmax(runner.all_logits(ids)[-args.tail :].float(), -1) for ids in data]
            finally:
                attn_mod.kernels.paged_attention = original
            kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got)])
            top1 = torch.cat([(r.argmax(-1) == g.argmax(-1)).float() for r, g in zip(ref, got)])
            row = {"length": length, "scheme": name, "kl_mean": float(kl.mean()),
                   "kl_max": float(kl.max()), "top1": float(top1.mean()),
                   "seconds": round(time.time() - t0, 1)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    from pathlib import Path

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
