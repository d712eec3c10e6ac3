"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-k logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.request import SamplingParams


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprobs: dict[int, float] | None  # chosen token and the top-k, when asked for


def make_generator(params: SamplingParams, engine_seed: int, request_index: int) -> torch.Generator:
    """A request with a seed samples the same tokens wherever it runs in a batch."""
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else engine_seed * 1_000_003 + request_index)
    return g


def sample(
    logits: torch.Tensor,  # [N, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Sampled]:
    logits = logits.cpu()
    out: list[Sampled] = []
    logprobs_all = None
    if any(p.logprobs is not None for p in params):
        logprobs_all = torch.log_softmax(logits, dim=-1)
    for i, p in enumerate(params):
        row = logits[i]
        if p.greedy:
            tok = int(torch.argmax(row))
        else:
            row = row / p.temperature
            if p.top_k > 0:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = (sp.cumsum(0) - sp) < p.top_p  # always keeps the most likely token
                probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
            tok = int(torch.multinomial(probs, 1, generator=generators[i]))
        lp = None
        if p.logprobs is not None and logprobs_all is not None:
            lrow = logprobs_all[i]
            lp = {tok: float(lrow[tok])}
            if p.logprobs > 0:
                vals, ids = torch.topk(lrow, p.logprobs)
                for v, t in zip(vals.tolist(), ids.tolist()):
                    lp.setdefault(t, v)
        out.append(Sampled(tok, lp))
    return out
