#!/usr/bin/env bash
# Peer server for `prefixcache bench serve`: llama.cpp through llama-cpp-python, on the same
# GGUF file as our default model. It lives in its own venv under .bench/ (git-ignored) and is
# never a dependency of the project.
#
#   benchmarks/peers/llamacpp.sh install          # build llama-cpp-python[server] (~4 min)
#   benchmarks/peers/llamacpp.sh serve [PORT]     # start the server in the foreground
#   benchmarks/peers/llamacpp.sh                  # install if needed, then serve on 8001
#
# Environment: MODEL (GGUF path; default: the project's default model), N_THREADS (default: 2),
# N_CTX (default: 4096), PYTHON (interpreter for the venv; default: python3),
# EXTRA_ARGS (more flags for llama_cpp.server).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.bench/venvs/llamacpp"
PY="${PYTHON:-python3}"

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
        echo "llama-cpp-python already installed in $VENV"
        return
    fi
    mkdir -p "$ROOT/.bench/venvs"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/pip" install "llama-cpp-python[server]"
    "$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

LAUNCH='import runpy, sys
from starlette_context.plugins import base
base.PluginUUIDBase.__init__.__defaults__ = (False, 4, False, None)  # validate=False
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__")'

serve() {
    local port="${1:-8001}"
    local model="${MODEL:-$("$ROOT/.venv/bin/python" -c \
        'from prefixcache.model.paths import default_model_path; print(default_model_path())')}"
    # The model alias is what /v1/models reports and what clients send as "model".
    # --interrupt_requests False: by default a new request aborts the one being served, so any
    # benchmark with concurrency > 1 would see truncated answers; now they queue.
    # OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning; on a machine whose
    # cores are shared, spinning threads steal them (prefill measured 8 s vs 10-12 s, 544 tokens).
    OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" \
    # The launcher turns off starlette-context's check that an x-request-id header is a UUID:
    # with it every request of vLLM's bench client (x-request-id: bench-<hex>-<n>) is a bare 400.
    exec "$VENV/bin/python" -c "$LAUNCH" --model "$model" --port "$port" \
        --host 127.0.0.1 --n_threads "${N_THREADS:-2}" --n_ctx "${N_CTX:-4096}" \
        --interrupt_requests False \
        --model_alias "${MODEL_ALIAS:-SmolLM2-135M-Instruct}" ${EXTRA_ARGS:-}
}

case "${1:-all}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    all) install; serve "${2:-8001}" ;;
    *) echo "usage: $0 [install | serve [PORT]]" >&2; exit 2 ;;
esac
