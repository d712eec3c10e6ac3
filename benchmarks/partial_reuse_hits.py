"""Hit tokens with token-exact reuse on and off, and vLLM's whole-block rule, on the same requests
(docs/benchmarks-journal.md "Token-exact reuse: hit tokens").

Each workload's requests are rendered through the default model's chat template and served one
at a time (``bench serve --max-concurrency 1``), in arrival order, through the engine's own cache
core (``cache/manager.py`` and ``cache/block_pool.py``, torch-free): admission, the partial
block's planned copy, prefill, the decode of the answer, commit, free, exactly as the scheduler
drives them; the pool is large enough that nothing is evicted. Hits are decided by token ids
alone, so this is the count a live server reports in ``cached_tokens`` for these sequences
(tests/engine/test_partial_reuse.py holds the engine to it on the real model).

vLLM's column is computed, not measured: vLLM 0.32's prefix caching hashes full 16-token blocks
only (of prompt and generated tokens), and a request hits its longest run of cached full blocks
within its first ``len - 1`` tokens. The same rule is applied here to the same token sequences
(no vLLM server is started).

Workloads:
- ``multi-turn``: ``bench serve --dataset-name multi-turn`` (4 turns, 256-token system prompt,
  64-token user turns and answers). The histories it sends carry synthetic answers, not the
  server's, so the server's answer (a stand-in: other synthetic tokens) diverges from the next
  turn's history right after the generation prompt.
- ``sharegpt``: ``bench serve --dataset-name sharegpt``, vLLM's sampling of first exchanges,
  each as one user message.
- ``sharegpt-conversations``: whole ShareGPT conversations, every human turn a request whose
  history holds the dataset's answers, and the server's answer to a turn taken to be the
  dataset's (a client that sends back what it got).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from prefixcache.analyze.prompts import load_tokenizer
from prefixcache.api.request import SamplingParams
from prefixcache.bench.datasets import conversation_histories, sample_requests, synthetic_text
from prefixcache.bench.sharegpt import default_sharegpt_path, iter_conversations
from prefixcache.cache.block_pool import BlockPool
from prefixcache.cache.manager import kv_cache_manager
from prefixcache.sequence import Sequence

B = 16


def serve(requests: list[tuple[list[int], list[int]]], partial: bool) -> tuple[list[int], int]:
    """Each (prompt ids, answer ids) admitted, prefilled, decoded and freed in turn; the hit
    tokens of each, and those copied from partial blocks."""
    total = sum(len(p) + len(a) for p, a in requests)
    pool = BlockPool(total // B + 1024, B)
    kv = kv_cache_manager(pool, "partial-reuse-figure", partial_reuse=partial)
    root = kv.root(None)
    hits = []
    for i, (prompt, answer) in enumerate(requests):
        s = Sequence.of(f"r{i}", list(prompt), SamplingParams(max_tokens=len(answer), temperature=0),
                        root=root)  # fmt: skip
        m = kv.match(s)
        assert kv.admit(s, m, s.num_tokens - m.num_tokens)
        kv.copy_partial_blocks(lambda copies: None)  # no KV here: the engine's runner copies
        hits.append(s.num_cached_tokens)
        s.out.output_token_ids.extend(answer[:-1])  # every answer token but the last is computed
        assert kv.allocate_slots(s, s.num_tokens - s.kv.num_computed_tokens)
        kv.mark_computed(s, s.num_tokens)
        kv.commit(s)
        s.out.output_token_ids.append(answer[-1])
        kv.free(s)
    pool.check_integrity([])
    return hits, kv.partial_hit_tokens


def vllm_hits(requests: list[tuple[list[int], list[int]]]) -> list[int]:
    """vLLM's rule: full 16-token blocks of prompt and computed answer tokens are cached; a
    request hits its longest run of them within its first len - 1 tokens."""
    cached: set[int] = set()
    hits = []
    for prompt, answer in requests:
        h, k = 0, 0
        while (k + 1) * B <= len(prompt) - 1:
            h = hash((h, tuple(prompt[k * B : (k + 1) * B])))
            if h not in cached:
                break
            k += 1
        hits.append(k * B)
        seq = prompt + answer[:-1]
        h = 0
        for j in range(len(seq) // B):
            h = hash((h, tuple(seq[j * B : (j + 1) * B])))
            cached.add(h)
    return hits


def multi_turn(tok, n: int, seed: int):
    reqs = sample_requests("multi-turn", tok, n, seed=seed)
    histories = conversation_histories(reqs, tok, seed=seed)
    st, rng = synthetic_text(tok), np.random.default_rng(seed + 1)
    out = []
    for r, msgs in zip(reqs, histories):
        answer = tok.encode(st.text(r.expected_output_len, rng))[: r.expected_output_len]
        out.append((tok.encode_chat(msgs), answer))
    return out


def sharegpt(tok, n: int, seed: int):
    reqs = sample_requests("sharegpt", tok, n, seed=seed)
    st, rng = synthetic_text(tok), np.random.default_rng(seed + 1)
    return [(tok.encode_chat(r.chat_messages()),
             tok.encode(st.text(r.expected_output_len, rng))[: max(1, r.expected_output_len)])
            for r in reqs]  # fmt: skip


def sharegpt_conversations(tok, n: int, seed: int, max_tokens: int = 2048):
    role = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
    convs = []
    with default_sharegpt_path() as path:
        for rec in iter_conversations(path):
            turns = rec.get("conversations") or []
            msgs = [{"role": role.get(t.get("from")), "content": t.get("value")} for t in turns
                    if isinstance(t, dict)]  # fmt: skip
            ok = len(msgs) >= 4 and all(isinstance(m["content"], str) and m["content"] for m in msgs)
            ok = ok and all(m["role"] == ("user" if i % 2 == 0 else "assistant")
                            for i, m in enumerate(msgs))  # fmt: skip
            if ok:
                convs.append(msgs[: len(msgs) // 2 * 2])
            if len(convs) >= 5 * n:  # a sample of the file's first ones, shuffled below
                break
    order = np.random.default_rng(seed).permutation(len(convs))
    per_conv = []
    for j in order:
        msgs, reqs = convs[j], []
        for t in range(0, len(msgs), 2):
            prompt = tok.encode_chat(msgs[: t + 1])
            after = tok.encode_chat(msgs[: t + 2], add_generation_prompt=False)
            if len(after) > max_tokens:
                break
            if after[: len(prompt)] == prompt:  # the answer as the next turn renders it
                answer = after[len(prompt) :]
            else:
                answer = tok.encode(msgs[t + 1]["content"]) + [tok.eos_token_id]
            reqs.append((prompt, answer))
        if len(reqs) >= 2:
            per_conv.append(reqs)
        if len(per_conv) == n:
            break
    out = []  # turn-major: the arrival order of conversations served side by side
    for t in range(max(map(len, per_conv))):
        out += [c[t] for c in per_conv if t < len(c)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    tok = load_tokenizer(None)
    workloads = {
        "multi-turn": multi_turn(tok, args.num_prompts, args.seed),
        "sharegpt": sharegpt(tok, args.num_prompts, args.seed),
        "sharegpt-conversations": sharegpt_conversations(tok, args.conversations, args.seed),
    }
    rows = []
    print(f"{'workload':24} {'requests':>8} {'prompt tok':>10} {'vLLM 0.32 rule':>14} "
          f"{'whole blocks':>12} {'token-exact':>11} {'gain':>6} {'requests gaining':>16}")  # fmt: skip
    for name, reqs in workloads.items():
        query = sum(len(p) for p, _ in reqs)
        vllm = vllm_hits(reqs)
        before, _ = serve(reqs, partial=False)
        after, copied = serve(reqs, partial=True)
        assert all(b <= a < b + B for a, b in zip(after, before))
        row = {"workload": name, "requests": len(reqs), "prompt_tokens": query,
               "vllm_hit_tokens": sum(vllm), "whole_block_hit_tokens": sum(before),
               "token_exact_hit_tokens": sum(after), "copied_tokens": copied,
               "requests_gaining": sum(a > b for a, b in zip(after, before))}  # fmt: skip
        rows.append(row)
        print(f"{name:24} {len(reqs):8} {query:10} {sum(vllm):8} {sum(vllm) / query:5.1%} "
              f"{sum(before):6} {sum(before) / query:5.1%} {sum(after):5} {sum(after) / query:5.1%} "
              f"{(sum(after) - sum(before)) / max(1, sum(before)):+6.1%} {row['requests_gaining']:16}")  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "args": vars(args)}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
