"""The sampler's draw: the distribution asked for, masked tokens never drawn, and a row's token
a function of its own logits, params and generator alone."""

from __future__ import annotations

import torch

from prefixcache import SamplingParams
from prefixcache.engine.sampler import _draw, make_generator, sample


def test_draws_follow_the_distribution_and_never_a_zero_probability_token():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.15, 0.05])
    g = torch.Generator().manual_seed(7)
    n = 20_000
    counts = torch.bincount(torch.tensor([_draw(probs, g) for _ in range(n)]), minlength=6)
    assert counts[1] == 0 and counts[3] == 0
    # 4.5 binomial standard deviations at most (sqrt(p(1-p)/n) <= 0.0036)
    assert torch.allclose(counts.double() / n, probs.double(), atol=0.016), counts
    # the last token is reachable and a one-hot row always gives its token
    assert _draw(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    assert _draw(torch.tensor([1.0, 0.0, 0.0]), g) == 0


def test_top_k_and_top_p_masks_hold_and_a_rows_token_is_its_own():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1000, generator=gen) * 4
    top2 = set(torch.topk(logits[0], 2).indices.tolist())
    params = [SamplingParams(temperature=1.0, top_k=2, seed=1), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=1.3, top_p=0.5, seed=3)]  # fmt: skip
    probs = torch.softmax(logits[2] / 1.3, -1)
    sp, si = torch.sort(probs, descending=True)
    nucleus = set(si[: int(((sp.cumsum(0) - sp) < 0.5).sum())].tolist())

    def draw(rows, ps, salt):
        gens = [make_generator(p, 0, salt) for p in ps]
        return [[s.token_id for s in sample(rows, ps, gens)] for _ in range(200)]

    batch = draw(logits, params, 0)
    assert {r[0] for r in batch} <= top2 and len({r[0] for r in batch}) == 2
    assert {r[2] for r in batch} <= nucleus
    # alone, row 1 draws exactly what it drew in the batch (its own seeded generator)
    alone = draw(logits[1:2], params[1:2], 0)
    assert [r[1] for r in batch] == [r[0] for r in alone]
