#!/usr/bin/env bash
# Peer server for `prefixcache bench serve` and benchmarks/side_by_side.py: llama.cpp's own
# `llama-server`, built natively from the llama.cpp source vendored in the llama-cpp-python
# 0.3.36 sdist (a pinned llama.cpp that PyPI serves; no other host is reachable here), serving the
# same GGUF file as our default model. It lives under .bench/ (git-ignored) and is never a
# dependency of the project.
#
#   benchmarks/peers/llamacpp.sh install          # download the sdist, build llama-server (~6 min)
#   benchmarks/peers/llamacpp.sh serve [PORT]     # start the server in the foreground
#   benchmarks/peers/llamacpp.sh quantize [TYPE]  # the default model requantized to TYPE (default
#       Q4_K_M: Q4_K layers, Q6_K for half of ffn_down and attn_v and for the embedding) with
#       llama.cpp's own llama-quantize (built on first use), written to
#       $BENCH_DIR/models/SmolLM2-135M-Instruct-TYPE.gguf; the default GGUF is Q4_1/Q8_0, so
#       this is a requantization (--allow-requantize): a k-quant file for the k-quant figures, not
#       a better model
#   benchmarks/peers/llamacpp.sh                  # install if needed, then serve on 8001
#
# Environment: BENCH_DIR (default $ROOT/.bench; several worktrees can share one, e.g.
# BENCH_DIR=/work/main/.bench), MODEL (GGUF path; default: the project's default model),
# N_PARALLEL (-np, slots decoding together; default 4), N_CTX (-c, the KV cache of all slots
# together: each slot gets N_CTX / N_PARALLEL tokens; default 32768, so 8192 a slot, the default
# model's context), N_THREADS (-t; default 2), MODEL_ALIAS (the id /v1/models reports and
# clients send; default SmolLM2-135M-Instruct), EXTRA_ARGS (more llama-server flags),
# PROJECT_PYTHON (the interpreter that knows the default model's path; default
# $ROOT/.venv/bin/python), LLAMA_CPP_PYTHON_VERSION (the sdist; default 0.3.36).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BENCH="${BENCH_DIR:-$ROOT/.bench}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC="$BENCH/src/llama_cpp_python-$VERSION"
BUILD="$BENCH/build/llama.cpp-$VERSION"
BIN="$BUILD/bin/llama-server"
QUANTIZE="$BUILD/bin/llama-quantize"
PROJECT_PY="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"

install() {
    if [ -x "$BIN" ]; then
        echo "llama-server already built: $BIN"
        return
    fi
    mkdir -p "$BENCH/src" "$BENCH/build"
    if [ ! -d "$SRC/vendor/llama.cpp" ]; then
        local tarball="$BENCH/src/llama_cpp_python-$VERSION.tar.gz"
        if [ ! -f "$tarball" ]; then
            "$PROJECT_PY" -m pip download --no-binary :all: --no-deps \
                "llama-cpp-python==$VERSION" -d "$BENCH/src"
        fi
        tar xzf "$tarball" -C "$BENCH/src"
    fi
    # GGML_NATIVE: -march=native (AVX-512, VNNI, BF16 where the CPU has them). No web UI (its
    # prebuilt assets would be downloaded from a host that is not reachable here), no TLS, no
    # tests or examples: the server alone.
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        $(command -v ninja >/dev/null && echo -G Ninja) \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF
    cmake --build "$BUILD" --target llama-server -j "$(nproc)"
    "$BIN" --version
}

serve() {
    local port="${1:-8001}"
    [ -x "$BIN" ] || { echo "no $BIN: run $0 install first" >&2; exit 1; }
    local model="${MODEL:-$("$PROJECT_PY" -c \
        'from prefixcache.model.paths import default_model_path; print(default_model_path())')}"
    # -np 4: four slots decode together (continuous batching); -c is shared by them, so each
    # slot holds N_CTX / N_PARALLEL tokens. Its prompt cache reuses a slot's common prefix (and,
    # with --cache-ram, saved prompts) without extra flags.
    # ggml runs its threads through OpenMP (GGML_OPENMP is on by default), so the
    # OMP_WAIT_POLICY=PASSIVE that benchmarks/servers.py gives every server applies here too.
    exec "$BIN" -m "$model" --host 127.0.0.1 --port "$port" \
        -np "${N_PARALLEL:-4}" -c "${N_CTX:-32768}" -t "${N_THREADS:-2}" \
        --alias "${MODEL_ALIAS:-SmolLM2-135M-Instruct}" ${EXTRA_ARGS:-}
}

quantize() {
    local type="${1:-Q4_K_M}"
    install
    [ -x "$QUANTIZE" ] || cmake --build "$BUILD" --target llama-quantize -j "$(nproc)"
    local src out
    src="$("$PROJECT_PY" -c 'from prefixcache.model.paths import default_model_path; print(default_model_path())')"
    out="$BENCH/models/SmolLM2-135M-Instruct-$type.gguf"
    mkdir -p "$BENCH/models"
    [ -f "$out" ] || "$QUANTIZE" --allow-requantize "$src" "$out" "$type" "${N_THREADS:-2}"
    echo "$out"
}

case "${1:-all}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    quantize) shift; quantize "$@" ;;
    all) install; serve "${2:-8001}" ;;
    *) echo "usage: $0 [install | serve [PORT] | quantize [TYPE]]" >&2; exit 2 ;;
esac
