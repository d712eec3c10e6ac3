#!/bin/bash
# Serving figures of two builds on one host, alternated run by run (this VM's speed drifts
# 15-40% within minutes, so a before/after is only read from interleaved runs).
#   benchmarks/alternate_builds.sh BASE_REV [PAIRS] [WORKLOADS]
# SBS_ARGS adds side_by_side.py arguments to every run (e.g. SBS_ARGS="--gguf-model gemma-3-270m").
# BASE_REV is checked out in a git worktree (/tmp/alt_base) and served through PYTHONPATH;
# "head" is this checkout, or with HEAD_REV=REV another worktree (/tmp/alt_head), so this
# checkout can be edited while the runs go on (a server started from it would load whatever its
# sources are at that moment). Each run: ours only, side_by_side.py (vLLM's bench client),
# results under .bench/results/alt_{base,head}_N.{md,json}; one line per run and workload on
# stdout: output tok/s, median TTFT, the hits' median TTFT (requests under 2 s: their prefix
# was cached, on the long-prefix workloads) and median TPOT.
set -euo pipefail
base=$1; pairs=${2:-3}; workloads=${3:-prefix_rep}
cd "$(dirname "$0")/.."
git worktree add -f /tmp/alt_base "$base" >/dev/null 2>&1 || git -C /tmp/alt_base checkout -q "$base"
if [ -n "${HEAD_REV:-}" ]; then
  git worktree add -f /tmp/alt_head "$HEAD_REV" >/dev/null 2>&1 || git -C /tmp/alt_head checkout -q "$HEAD_REV"
fi
n=0
for _ in $(seq "$pairs"); do
  for which in head base; do
    n=$((n + 1))
    if [ "$which" = base ]; then export PYTHONPATH=/tmp/alt_base
    elif [ -n "${HEAD_REV:-}" ]; then export PYTHONPATH=/tmp/alt_head
    else unset PYTHONPATH; fi
    rm -rf ".bench/results/alt_${which}_$n"  # an earlier run's files under the same name
    BENCH_DIR=$PWD/.bench .venv/bin/python benchmarks/side_by_side.py --servers ours:default \
      --workloads "$workloads" --repeats 1 --no-ours-client --lock /tmp/cpu.lock \
      --results .bench/results --name "alt_${which}_$n" ${SBS_ARGS:-} > "/tmp/alt_$n.log" 2>&1
    python3 - ".bench/results/alt_${which}_$n" "$which" "$n" <<'PY'
import glob, json, os, statistics, sys
d, which, n = sys.argv[1:]
for f in sorted(glob.glob(d + "/*-vllm-client-*.json")):
    j = json.load(open(f))
    t = sorted(1e3 * x for x in j["ttfts"])
    hits = [x for x in t if x < 2000] or [float("nan")]
    name = f.split("-vllm-client-")[1][:-5]
    print(f"{which} run {n} {name}: output tok/s {j['output_throughput']:.1f}, median TTFT ms "
          f"{statistics.median(t):.0f}, hits' median TTFT ms {statistics.median(hits):.0f} ({len(hits)}), "
          f"median TPOT ms {j['median_tpot_ms']:.1f}, load {' '.join(open('/proc/loadavg').read().split()[:3])}")
PY
  done
done
unset PYTHONPATH
git worktree remove --force /tmp/alt_base
if [ -n "${HEAD_REV:-}" ]; then git worktree remove --force /tmp/alt_head; fi
