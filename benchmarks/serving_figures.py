"""The serving figures of docs/benchmarks-journal.md: our server with prefix caching on and off, and peer
servers, on ShareGPT (run twice: first pass, second pass) and generated-shared-prefix.

Each server runs alone (started here, stopped before the next), every workload goes through
`prefixcache bench serve` and its exact command is recorded; then `bench compare` tables
(Markdown) and `bench plot` PNGs are written.

    .venv/bin/python benchmarks/serving_figures.py                      # ours on/off + llama.cpp
    .venv/bin/python benchmarks/serving_figures.py --servers ours-on ours-off --num-prompts 16

Peers run from benchmarks/peers/*.sh, which install them into .bench/venvs/ first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import servers  # benchmarks/servers.py: start / wait / stop shared with side_by_side.py
from servers import ROOT, free_port, stop

PY = sys.executable


def server_command(name: str, port: int) -> list[str]:
    if name == "ours-on":
        return [PY, "-m", "prefixcache.cli", "serve", "--port", str(port), "--no-access-log",
                "--log-level", "warning"]
    if name == "ours-off":
        return server_command("ours-on", port) + ["--no-enable-prefix-caching"]
    if name == "llamacpp":
        return ["bash", str(ROOT / "benchmarks/peers/llamacpp.sh"), "serve", str(port)]
    if name in ("vllm-on", "vllm-off"):
        return ["env", f"CACHING={name[5:]}", "bash", str(ROOT / "benchmarks/peers/vllm_cpu.sh"),
                "serve", str(port)]
    raise ValueError(f"unknown server {name}")


def start(name: str, log: Path) -> tuple[servers.Server, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = servers.start(name, server_command(name, port), url, log)
    try:
        servers.wait_ready(server)
    except BaseException:
        stop(server)
        raise
    return server, url


# llama-cpp-python ignores "ignore_eos": ban SmolLM2's end tokens (<|endoftext|> 0, <|im_end|> 2)
# so that it generates as many tokens as the other servers.
SERVER_FLAGS = {"llamacpp": ["--extra-body", json.dumps({"logit_bias": {"0": -100, "2": -100}})]}


def workloads(args) -> dict[str, list[str]]:
    common = ["--num-prompts", str(args.num_prompts), "--max-concurrency",
              str(args.max_concurrency), "--seed", "0"]
    sharegpt = ["--dataset-name", "sharegpt", "--sharegpt-output-len", str(args.output_len),
                "--ignore-eos", *common]
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.gsp_groups),
           "--gsp-system-prompt-len", str(args.gsp_system_len), "--gsp-question-len",
           str(args.gsp_question_len), "--gsp-output-len", str(args.output_len), "--ignore-eos",
           *common]
    return {"sharegpt-pass1": sharegpt, "sharegpt-pass2": sharegpt, "gsp": gsp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", nargs="+",
                    default=["ours-on", "ours-off", "llamacpp", "vllm-on"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--gsp-groups", type=int, default=4)
    ap.add_argument("--gsp-system-len", type=int, default=512)
    ap.add_argument("--gsp-question-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; medians reported")
    ap.add_argument("--results", default=str(ROOT / "results/serving"))
    ap.add_argument("--img-dir", default=str(ROOT / "docs/img"))
    ap.add_argument("--only-plots", action="store_true", help="re-plot saved results")
    args = ap.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    loads = workloads(args)
    commands: dict[str, str] = {}
    if not args.only_plots:
        # Repetitions go round the servers, so that a slow spell of this shared machine hits
        # every server instead of one; each repetition starts every server anew (cold cache).
        for rep in range(args.repeats):
            for server in args.servers:
                running, url = start(server, results / f"{server}.log")
                try:
                    for wl, flags in loads.items():
                        name = f"{server}-{wl}-r{rep}.json"
                        cmd = ["prefixcache", "bench", "serve", "--base-url", url, *flags,
                               *SERVER_FLAGS.get(server, []),
                               "--label", f"{server}:{wl}", "--save-detailed", "--disable-tqdm",
                               "--result-dir", str(results), "--result-filename", name]
                        load = f"{os.getloadavg()[0]:.1f}"
                        print("$", shlex.join(cmd), flush=True)
                        rc = subprocess.call([PY, "-m", "prefixcache.cli", *cmd[1:],
                                              "--metadata", f"load_avg_before={load}"], cwd=ROOT)
                        if rc != 0:
                            print(f"{server} {wl}: exit {rc}", file=sys.stderr)
                        commands[f"{server}-{wl}"] = shlex.join(cmd).replace(url, "URL")
                finally:
                    stop(running)
        (results / "commands.json").write_text(json.dumps(commands, indent=1))
    for server in args.servers:
        for wl in loads:
            median_result(results, server, wl)
    report(args, results, loads)
    return 0


def median_result(results: Path, server: str, wl: str) -> None:
    """``{server}-{wl}.json``: the median of every number over the repetitions; the per-request
    lists (for the TTFT CDF) are those of the repetition with the median output throughput."""
    runs = [json.loads(p.read_text()) for p in sorted(results.glob(f"{server}-{wl}-r*.json"))]
    runs = [r for r in runs if r.get("completed")]
    if not runs:
        return
    runs.sort(key=lambda r: r["output_throughput"])
    out = dict(runs[len(runs) // 2])
    for key, value in out.items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
    out["repeats"] = len(runs)
    (results / f"{server}-{wl}.json").write_text(json.dumps(out, indent=1))


def report(args, results: Path, loads: dict[str, list[str]]) -> None:
    """Per workload: caching on vs off (ratio on/off), ours vs each peer (ratio ours/peer), and
    PNGs with every server."""
    from prefixcache.bench.compare import compare_table, load_results
    from prefixcache.bench.plot import plot_runs

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    img = Path(args.img_dir)
    md = [f"machine: {machine}", ""]
    for wl in loads:
        have = [s for s in args.servers if (results / f"{s}-{wl}.json").exists()]
        if not have:
            continue
        md += [f"### {wl}", ""]
        pairs = [("ours-off", "ours-on")] + [(peer, "ours-on") for peer in have
                                             if not peer.startswith("ours-")]
        for base, other in pairs:
            if base in have and other in have:
                runs = load_results([str(results / f"{x}-{wl}.json") for x in (base, other)],
                                    [base, other])
                md += [compare_table(runs, markdown=True), ""]
        runs = load_results([str(results / f"{s}-{wl}.json") for s in have], have)
        for p in plot_runs(runs, img, title=f"{wl}: SmolLM2-135M Q4_1, {machine}",
                           prefix=f"serving_{wl}_"):
            print("wrote", p)
    (results / "summary.md").write_text("\n".join(md) + "\n")
    print((results / "summary.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
