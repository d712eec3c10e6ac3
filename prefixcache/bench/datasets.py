"""Benchmark workloads: the requests a benchmark sends, built once before it starts.

``sample_requests(name, tokenizer, num_prompts, seed, **options)`` is the one entry point; the
options are the CLI's dataset flags with dashes as underscores (``random_input_len=...``), listed
with their defaults in :data:`DATASET_OPTIONS`. Synthetic text comes from
:class:`~prefixcache.bench.text.SyntheticText`, so every length is exact in the tokenizer's tokens
and every dataset is the same for the same seed.

Multi-turn returns one :class:`SampleRequest` per turn. Only the *new* messages of a turn are in
the request (``messages``): the prompt of turn ``k`` is every earlier turn's messages, each
followed by the server's answer to it, then this turn's messages. The requests of a conversation
share ``conversation_id`` and are numbered by ``turn``; the benchmark replays them in order and
``conversation_histories`` rebuilds the full prompts offline with synthetic answers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefixcache.bench.mooncake import TRACE_BLOCK_TOKENS, TraceFormatError, read_trace
from prefixcache.bench.sharegpt import default_sharegpt_path, first_exchange, iter_conversations
from prefixcache.bench.text import SyntheticText


class DatasetError(ValueError):
    """A dataset that cannot be built from these options or files; the message says why."""


@dataclass
class SampleRequest:
    """One request of a workload.

    ``prompt``: the text (or token ids) sent to ``/v1/completions``. ``prompt_len``: its length in
    tokens (for multi-turn: of this turn's new messages only). ``messages``: what
    ``/v1/chat/completions`` gets instead; ``None`` means one user message holding ``prompt``.
    ``group``: which shared prefix the request was built on (a prefix, a system prompt), for
    analysis; ``None`` where the dataset has no such structure.
    """

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    messages: list[dict] | None = None
    request_id: str | None = None
    conversation_id: str | None = None
    turn: int = 0
    group: int | None = None
    extra: dict = field(default_factory=dict)

    def chat_messages(self) -> list[dict]:
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt}]


# name -> {option: default}. The CLI turns each option into a flag (--random-input-len).
DATASET_OPTIONS: dict[str, dict[str, object]] = {
    "random": {
        "random_input_len": 1024,
        "random_output_len": 128,
        "random_range_ratio": 0.0,
        "random_prefix_len": 0,
    },
    "prefix_repetition": {
        "prefix_repetition_prefix_len": 256,
        "prefix_repetition_suffix_len": 256,
        "prefix_repetition_num_prefixes": 10,
        "prefix_repetition_output_len": 128,
    },
    "generated-shared-prefix": {
        "gsp_num_groups": 64,
        "gsp_prompts_per_group": None,  # None: num_prompts spread over the groups
        "gsp_system_prompt_len": 2048,
        "gsp_question_len": 128,
        "gsp_output_len": 256,
    },
    "sharegpt": {
        "dataset_path": None,
        "sharegpt_output_len": None,
        "sharegpt_max_prompt_len": 1024,
        "sharegpt_max_total_len": 2048,
    },
    "multi-turn": {
        "multi_turn_num_turns": 4,
        "multi_turn_system_prompt_len": 256,
        "multi_turn_user_len": 64,
        "multi_turn_output_len": 64,
    },
    "rag": {
        "rag_num_documents": 32,
        "rag_docs_per_prompt": 3,
        "rag_doc_len": 256,
        "rag_system_prompt_len": 64,
        "rag_question_len": 32,
        "rag_output_len": 64,
        "rag_zipf": 1.0,
        "rag_order": "pool",
        "rag_messages": "user",
    },
    "custom": {
        "dataset_path": None,
        "custom_output_len": 256,
    },
    "mooncake-trace": {
        "dataset_path": None,
        "block_tokens": 16,
        "time_scale": 1.0,
        "max_requests": 0,
        "trace_start_s": 0.0,
        "trace_duration_s": 0.0,
    },
}

DATASET_NAMES = tuple(DATASET_OPTIONS)
# Datasets whose text is random: generation runs to the requested length (vLLM does it for random).
IGNORE_EOS_DATASETS = ("random",)

_synthetic_cache: dict[int, SyntheticText] = {}


def synthetic_text(tokenizer) -> SyntheticText:
    """One :class:`SyntheticText` per tokenizer object (scanning the vocabulary takes seconds)."""
    key = id(tokenizer)
    st = _synthetic_cache.get(key)
    if st is None or st.tokenizer is not tokenizer:
        st = _synthetic_cache[key] = SyntheticText(tokenizer)
    return st


def sample_requests(
    name: str, tokenizer, num_prompts: int, seed: int = 0, **options
) -> list[SampleRequest]:
    """The requests of dataset ``name``; ``options`` are that dataset's keys in DATASET_OPTIONS."""
    if name not in DATASET_OPTIONS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASET_NAMES)}")
    if num_prompts < 1:
        raise DatasetError("num_prompts must be at least 1")
    known = DATASET_OPTIONS[name]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"dataset {name!r} has no option(s) {unknown}; it takes {sorted(known)}")
    opts = {**known, **options}
    rng = np.random.default_rng(seed)
    requests = _BUILDERS[name](tokenizer, num_prompts, rng, **opts)
    for i, r in enumerate(requests):
        if r.request_id is None:
            r.request_id = f"{name}-{seed}-{i}"
    return requests


def _lens(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """vLLM's random lengths: uniform integers in [mean*(1-ratio), mean*(1+ratio)]."""
    if not 0.0 <= ratio < 1.0:
        raise DatasetError("random_range_ratio must be in [0, 1)")
    lo, hi = max(math.floor(mean * (1 - ratio)), 1), math.ceil(mean * (1 + ratio))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _random(tok, n, rng, *, random_input_len, random_output_len, random_range_ratio,
            random_prefix_len):
    st = synthetic_text(tok)
    prefix = st.text(random_prefix_len, rng)
    in_lens = _lens(rng, random_input_len, random_range_ratio, n)
    out_lens = _lens(rng, random_output_len, random_range_ratio, n)
    return [
        SampleRequest(prefix + st.text(i, rng), random_prefix_len + i, o,
                      group=0 if random_prefix_len else None)
        for i, o in zip(in_lens, out_lens)
    ]


def _prefix_repetition(tok, n, rng, *, prefix_repetition_prefix_len,
                       prefix_repetition_suffix_len, prefix_repetition_num_prefixes,
                       prefix_repetition_output_len):
    st = synthetic_text(tok)
    k = max(1, prefix_repetition_num_prefixes)
    prefixes = [st.text(prefix_repetition_prefix_len, rng) for _ in range(k)]
    plen = prefix_repetition_prefix_len + prefix_repetition_suffix_len
    requests = [
        SampleRequest(prefixes[i % k] + st.text(prefix_repetition_suffix_len, rng), plen,
                      prefix_repetition_output_len, group=i % k)
        for i in range(n)
    ]
    return [requests[j] for j in rng.permutation(n)]


def _generated_shared_prefix(tok, n, rng, *, gsp_num_groups, gsp_prompts_per_group,
                             gsp_system_prompt_len, gsp_question_len, gsp_output_len):
    st = synthetic_text(tok)
    groups = max(1, gsp_num_groups)
    total = groups * gsp_prompts_per_group if gsp_prompts_per_group else n
    systems = [st.text(gsp_system_prompt_len, rng) for _ in range(groups)]
    requests = []
    for i in range(total):
        g = i % groups
        question = st.text(gsp_question_len, rng)
        requests.append(SampleRequest(
            systems[g] + question, gsp_system_prompt_len + gsp_question_len, gsp_output_len,
            messages=[{"role": "system", "content": systems[g]},
                      {"role": "user", "content": question}],
            group=g))
    return [requests[j] for j in rng.permutation(total)]


RAG_ORDERS = ("pool", "random")
RAG_MESSAGES = ("user", "documents")


def _rag(tok, n, rng, *, rag_num_documents, rag_docs_per_prompt, rag_doc_len,
         rag_system_prompt_len, rag_question_len, rag_output_len, rag_zipf, rag_order,
         rag_messages):
    """System prompt + k documents drawn by Zipf popularity + question.

    ``rag_order``: "pool" lists the documents in pool order (most popular first: prompts that
    drew the same documents share a prefix), "random" in a random order (what a retriever
    ranking by query does: after the system prompt, prefixes rarely agree). ``rag_messages``:
    "user" puts the documents and the question in one user message (any server), "documents"
    sends each document as a ``document`` message (prefixcache's segment caching,
    docs/segments.md; other servers refuse the role)."""
    if rag_order not in RAG_ORDERS:
        raise DatasetError(f"rag_order must be one of {', '.join(RAG_ORDERS)}, got {rag_order!r}")
    if rag_messages not in RAG_MESSAGES:
        raise DatasetError(
            f"rag_messages must be one of {', '.join(RAG_MESSAGES)}, got {rag_messages!r}")
    st = synthetic_text(tok)
    pool = max(1, rag_num_documents)
    k = min(max(1, rag_docs_per_prompt), pool)
    system = st.text(rag_system_prompt_len, rng)
    docs = [st.text(rag_doc_len, rng) for _ in range(pool)]
    weights = 1.0 / np.arange(1, pool + 1, dtype=np.float64) ** rag_zipf
    weights /= weights.sum()
    plen = rag_system_prompt_len + k * rag_doc_len + rag_question_len
    requests = []
    for _ in range(n):
        chosen = rng.choice(pool, size=k, replace=False, p=weights).tolist()
        # the draw itself lists popular documents first: shuffle for "random"
        chosen = sorted(chosen) if rag_order == "pool" else rng.permutation(chosen).tolist()
        context = "".join(docs[d] for d in chosen)
        question = st.text(rag_question_len, rng)
        if rag_messages == "documents":
            messages = [{"role": "system", "content": system},
                        *({"role": "document", "content": docs[d]} for d in chosen),
                        {"role": "user", "content": question}]
        else:
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": context + question}]
        requests.append(SampleRequest(
            system + context + question, plen, rag_output_len, messages=messages,
            group=chosen[0], extra={"documents": chosen}))
    return requests


def _multi_turn(tok, n, rng, *, multi_turn_num_turns, multi_turn_system_prompt_len,
                multi_turn_user_len, multi_turn_output_len):
    st = synthetic_text(tok)
    turns = max(1, multi_turn_num_turns)
    n_conv = math.ceil(n / turns)
    requests: list[SampleRequest] = []
    last_turns = n - (n_conv - 1) * turns  # the last conversation is shorter: exactly n
    for t in range(turns):  # turn-major, so the list reads like the arrival order
        for c in range(n_conv):
            if c == n_conv - 1 and t >= last_turns:
                continue
            if t == 0:
                system = st.text(multi_turn_system_prompt_len, rng)
            user = st.text(multi_turn_user_len, rng)
            msgs = [{"role": "user", "content": user}]
            plen = multi_turn_user_len
            if t == 0 and multi_turn_system_prompt_len > 0:
                msgs.insert(0, {"role": "system", "content": system})
                plen += multi_turn_system_prompt_len
            requests.append(SampleRequest(
                "".join(m["content"] for m in msgs), plen, multi_turn_output_len,
                messages=msgs, conversation_id=f"conv-{c}", turn=t, group=c))
    return requests


def _sharegpt(tok, n, rng, *, dataset_path, sharegpt_output_len, sharegpt_max_prompt_len,
              sharegpt_max_total_len):
    """vLLM's sampling: shuffled first exchanges, lengths filtered as vLLM filters them."""
    if dataset_path is None:
        with default_sharegpt_path() as path:
            records = list(iter_conversations(path))
    else:
        records = list(iter_conversations(dataset_path))
    exchanges = [e for e in map(first_exchange, records) if e is not None]
    requests = []
    for j in rng.permutation(len(exchanges)):
        prompt, completion = exchanges[j]
        prompt_len = len(tok.encode(prompt))
        out_len = sharegpt_output_len or len(tok.encode(completion))
        if prompt_len < 4 or (sharegpt_output_len is None and out_len < 4):
            continue
        if prompt_len > sharegpt_max_prompt_len:
            continue
        if sharegpt_output_len is None and prompt_len + out_len > sharegpt_max_total_len:
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
        if len(requests) == n:
            break
    if len(requests) < n:
        raise DatasetError(f"sharegpt: only {len(requests)} conversations pass the length filters")
    return requests


def _custom(tok, n, rng, *, dataset_path, custom_output_len):
    """JSONL, one ``{"prompt": str, "output_tokens": int}`` a line, in file order, cycled to n."""
    if dataset_path is None:
        raise DatasetError("custom needs --dataset-path FILE.jsonl")
    rows = []
    for lineno, line in enumerate(Path(dataset_path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str):
            raise DatasetError(
                f"{dataset_path}:{lineno}: expected an object with a 'prompt' string")
        rows.append(row)
    if not rows:
        raise DatasetError(f"{dataset_path}: no prompts")
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        out_len = int(row.get("output_tokens") or custom_output_len)
        out.append(SampleRequest(row["prompt"], len(tok.encode(row["prompt"])), out_len))
    return out


def _mooncake_trace(tok, n, rng, *, dataset_path, block_tokens, time_scale, max_requests,
                    trace_start_s, trace_duration_s):
    """A Mooncake trace (``bench/mooncake.py``) replayed with synthetic token ids.

    Each 512-token hash block becomes ``block_tokens`` word-token ids drawn from a generator
    seeded by the hash id alone, so equal ids give equal tokens in every request (a partial last
    block is the first tokens of its id's); input and output lengths shrink by the same factor
    ``block_tokens / 512``. Requests of the window ``[trace_start_s, + trace_duration_s)`` (0:
    to the end), at most ``n`` (and ``max_requests`` when set), arrive at their timestamps
    divided by ``time_scale`` (``extra["arrival_s"]``; the runner honours it over
    ``--request-rate``). ``extra["ideal_cached_tokens"]``: what an infinite cache of the
    replayed window would serve, for the trace's own ideal hit rate next to the measured one.
    """
    if dataset_path is None:
        raise DatasetError("mooncake-trace needs --dataset-path TRACE.jsonl")
    if block_tokens < 1 or time_scale <= 0:
        raise DatasetError("block_tokens must be >= 1 and time_scale > 0")
    limit = min(n, max_requests) if max_requests else n
    start_ms = trace_start_s * 1000.0
    end_ms = start_ms + trace_duration_s * 1000.0 if trace_duration_s > 0 else None
    try:
        trace = read_trace(dataset_path, limit, start_ms or None, end_ms)
    except TraceFormatError as e:
        raise DatasetError(str(e)) from e
    if not trace:
        raise DatasetError(f"{dataset_path}: no request in the window")
    word_ids = synthetic_text(tok).word_ids
    scale = block_tokens / TRACE_BLOCK_TOKENS
    blocks: dict[int, list[int]] = {}
    seen: set[int] = set()
    t0 = trace[0].timestamp_ms
    out = []
    for i, r in enumerate(trace):
        ids: list[int] = []
        ideal = 0
        leading = True
        for h, m in zip(r.hash_ids, r.scaled_block_lengths(block_tokens)):
            toks = blocks.get(h)
            if toks is None:
                toks = blocks[h] = np.random.default_rng([h, 0x6D6F6F6E]).choice(
                    word_ids, size=block_tokens).tolist()
            ids.extend(toks[:m])
            if leading and h in seen:
                ideal += m
            else:
                leading = False
        seen.update(r.hash_ids)
        out.append(SampleRequest(
            ids, len(ids), max(1, round(r.output_length * scale)),
            request_id=f"mooncake-{i}",
            extra={"arrival_s": (r.timestamp_ms - t0) / 1000.0 / time_scale,
                   "hash_ids": list(r.hash_ids), "ideal_cached_tokens": ideal}))
    return out


def trace_ideal_hit_rate(requests: list[SampleRequest]) -> float | None:
    """The replayed trace's infinite-cache hit rate in its synthetic tokens (None: no trace)."""
    if not requests or any("ideal_cached_tokens" not in r.extra for r in requests):
        return None
    total = sum(r.prompt_len for r in requests)
    return sum(r.extra["ideal_cached_tokens"] for r in requests) / total if total else 0.0


_BUILDERS: dict[str, Callable[..., list[SampleRequest]]] = {
    "random": _random,
    "prefix_repetition": _prefix_repetition,
    "generated-shared-prefix": _generated_shared_prefix,
    "sharegpt": _sharegpt,
    "multi-turn": _multi_turn,
    "rag": _rag,
    "custom": _custom,
    "mooncake-trace": _mooncake_trace,
}


def conversation_histories(
    requests: list[SampleRequest], tokenizer, seed: int = 0
) -> list[list[dict]]:
    """For each request, the full message list the server would see, with synthetic answers of
    ``expected_output_len`` tokens standing in for the server's; same order as ``requests``.

    For requests without ``conversation_id`` the history is just the request's own messages.
    """
    st = synthetic_text(tokenizer)
    rng = np.random.default_rng(seed)
    history: dict[str, list[dict]] = {}
    out = []
    for r in sorted(requests, key=lambda r: r.turn):
        if r.conversation_id is None:
            out.append((r, list(r.chat_messages())))
            continue
        msgs = history.setdefault(r.conversation_id, [])
        msgs.extend(r.chat_messages())
        out.append((r, list(msgs)))
        msgs.append({"role": "assistant", "content": st.text(r.expected_output_len, rng)})
    by_id = {id(r): m for r, m in out}
    return [by_id[id(r)] for r in requests]
