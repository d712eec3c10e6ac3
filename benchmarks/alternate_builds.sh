#!/bin/bash
# Serving figures of two builds on one host, alternated run by run (this VM's speed drifts
# 15-40% within minutes, so a before/after is only read from interleaved runs).
#   benchmarks/alternate_builds.sh BASE_REV [PAIRS] [WORKLOADS]
# SBS_ARGS adds side_by_side.py arguments to every run (e.g. SBS_ARGS="--gguf-model gemma-3-270m").
# BASE_REV is checked out in a git worktree (/tmp/alt_base) and served through PYTHONPATH;
# "head" is this checkout. Each run: ours only, side_by_side.py (vLLM's bench client), results
# under .bench/results/alt_{base,head}_N.{md,json}; one line per run on stdout.
set -euo pipefail
base=$1; pairs=${2:-3}; workloads=${3:-prefix_rep}
cd "$(dirname "$0")/.."
git worktree add -f /tmp/alt_base "$base" >/dev/null 2>&1 || git -C /tmp/alt_base checkout -q "$base"
n=0
for _ in $(seq "$pairs"); do
  for which in head base; do
    n=$((n + 1))
    if [ "$which" = base ]; then export PYTHONPATH=/tmp/alt_base; else unset PYTHONPATH; fi
    BENCH_DIR=$PWD/.bench .venv/bin/python benchmarks/side_by_side.py --servers ours:default \
      --workloads "$workloads" --repeats 1 --no-ours-client --lock /tmp/cpu.lock \
      --results .bench/results --name "alt_${which}_$n" ${SBS_ARGS:-} > "/tmp/alt_$n.log" 2>&1
    md=.bench/results/alt_${which}_$n.md
    tput=$(grep -m1 "prefix_repetition\|random" "$md" | awk -F'|' '{print $3}')
    tpot=$(grep -A4 "^### Median TPOT" "$md" | grep -m1 "prefix_repetition\|random" | awk -F'|' '{print $3}')
    ttft=$(grep -A4 "^### Median TTFT" "$md" | grep -m1 "prefix_repetition\|random" | awk -F'|' '{print $3}')
    echo "$which run $n: output tok/s$tput, median TTFT ms$ttft, median TPOT ms$tpot, load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
unset PYTHONPATH
git worktree remove --force /tmp/alt_base
