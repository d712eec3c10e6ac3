#!/usr/bin/env bash
# Segment caching through the server, measured by `prefixcache bench serve` (docs/benchmarks-journal.md,
# "Segment caching through the server"). One `prefixcache serve` with default settings; the rag
# dataset with documents in random order, each a `document` message; the same requests sent in
# cache_mode prefix (the default) and segments: prefix, segments (every document's first sight:
# computed alone), segments again (steady state), prefix again.
#
# Usage: benchmarks/segments_serve.sh [results dir]   (~6 min on the 2-core dev VM)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/segments_serve}
PORT=${PORT:-8437}
mkdir -p "$OUT"
.venv/bin/prefixcache serve --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 1
done
common=(--base-url "http://127.0.0.1:$PORT" --backend openai-chat --dataset-name rag
        --rag-num-documents 20 --rag-docs-per-prompt 4 --rag-doc-len 300
        --rag-system-prompt-len 64 --rag-question-len 32 --rag-output-len 16
        --rag-order random --rag-messages documents --num-prompts 24 --max-concurrency 4
        --ignore-eos --save-result --result-dir "$OUT")
# prefix runs each in a fresh namespace (the same requests must not hit an earlier run's whole
# prompts); both segments runs in one: the second reuses what the first computed alone
for spec in prefix:p1 segments:s segments:s prefix:p2; do
    mode=${spec%%:*} salt=${spec##*:}
    label="$mode-$salt-$(date +%s)"
    echo "== $mode (cache_salt $salt), load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/prefixcache bench serve "${common[@]}" --label "$label" \
        --extra-body "{\"cache_mode\": \"$mode\", \"cache_salt\": \"$salt\"}" \
        --result-filename "$label.json" \
        | grep -E "requests:|duration|throughput|TTFT|TPOT|Cached" || true
done
echo "== segment store: $(curl -s "http://127.0.0.1:$PORT/v1/cache/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["segments"])')"
