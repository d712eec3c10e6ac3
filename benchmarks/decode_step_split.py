"""The output projection's share of a decode step of 8 sequences: 8 prompts of 200 random
tokens, 48 tokens each, ``max_num_seqs=8``; times every decode-only step of 8 rows and every
call of the head on 8 rows in it, and prints their medians. With PYTHONPATH pointing at another
checkout it measures that build (alternate runs to compare).

    .venv/bin/python benchmarks/decode_step_split.py [--model gemma-3-270m]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prefixcache import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    llm = LLM(model=a.model, max_num_seqs=8, kv_cache_memory="512MiB")
    runner, model = llm.engine.runner, llm.engine.runner.model
    vocab = model.config.vocab_size
    rng = random.Random(1)
    steps: list[tuple[bool, int, float]] = []
    heads: list[tuple[int, float]] = []
    execute, head = runner.execute, model.lm_head

    def timed_execute(pieces):
        t = time.perf_counter()
        out = execute(pieces)
        steps.append((all(p.n == 1 for p in pieces), len(pieces), time.perf_counter() - t))
        return out

    class TimedHead:  # the head as the model calls it, timed
        def __getattr__(self, name):
            return getattr(head, name)

        def __call__(self, x):
            t = time.perf_counter()
            y = head(x)
            heads.append((x.shape[0], time.perf_counter() - t))
            return y

    runner.execute, model.lm_head = timed_execute, TimedHead()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)

    def prompts():
        return [[rng.randrange(1000, vocab - 1) for _ in range(200)] for _ in range(8)]

    llm.generate(prompts(), params)  # warm-up
    steps.clear()
    heads.clear()
    llm.generate(prompts(), params)
    step8 = [t for decode, rows, t in steps if decode and rows == 8]
    head8 = [t for rows, t in heads if rows == 8]
    print(f"{llm.engine.weights_format}: head on 8 rows {statistics.median(head8) * 1e3:.2f} ms, "
          f"decode step of 8 {statistics.median(step8) * 1e3:.2f} ms (medians of {len(head8)} / {len(step8)})")


if __name__ == "__main__":
    main()
