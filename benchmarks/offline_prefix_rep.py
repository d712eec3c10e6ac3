"""The serving benchmark's prefix_repetition workload offline: 64 prompts of 4 shared 512-token
prefixes + 64 tokens each, 32 tokens out, at most 8 sequences a step (the server's c8), through
``LLM.generate`` after a warm-up; prints the wall time and output tokens per second. With
PYTHONPATH pointing at another checkout it measures that build (alternate runs to compare).

    .venv/bin/python benchmarks/offline_prefix_rep.py
"""

import random
import time

import prefixcache
from prefixcache import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_num_seqs=8)
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(4)]

    def prompts():
        return [prefixes[i % 4] + [rng.randrange(100, 40000) for _ in range(64)] for i in range(64)]

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompts()[:8], params)  # warm-up: the prefixes are cached from here on
    batch = prompts()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    dt = time.perf_counter() - t0
    print(f"{prefixcache.__file__}: {dt:.2f} s, {64 * 32 / dt:.1f} output tok/s, "
          f"{sum(o.num_cached_tokens for o in outs)} prompt tokens cached")


if __name__ == "__main__":
    main()
