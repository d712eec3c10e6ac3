"""llama.cpp's own llama-server on Gemma 3 270M Q4_K_M, the workload of benchmarks/gemma_bench.py (a
1,024-token prefix of the README cold, then hit with 32 new tokens, then 64 decoded), its own
timings (predicted_per_token_ms) for the decode; needs `make gemma` and the llama-server build
under .bench/ (docs/benchmarks-journal.md).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/peers/gemma_llama_server.py
"""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, ".")
from prefixcache.model.paths import resolve_model_path
from prefixcache.tokenizer.tokenizer import load_tokenizer

path = resolve_model_path("gemma-3-270m")
tok = load_tokenizer(str(path))
ids = [2] + tok.encode(Path("README.md").read_text() * 8)
srv = subprocess.Popen([".bench/build/llama.cpp-0.3.36/bin/llama-server", "-m", str(path), "-t", "2", "-c", "8192", "-np", "1",
                        "--port", "8931", "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
c = httpx.Client(base_url="http://127.0.0.1:8931", timeout=600)
for _ in range(120):
    try:
        if c.get("/health").status_code == 200:
            break
    except httpx.TransportError:  # not listening yet
        pass
    time.sleep(1)
def run(p, n):
    t = time.perf_counter()
    r = c.post("/completion", json={"prompt": p, "n_predict": n, "temperature": 0, "cache_prompt": True, "ignore_eos": True}).json()
    return time.perf_counter() - t, r["timings"]
cold, warm, tpot = [], [], []
P, S = 1024, 32
for r in range(3):
    c.post("/slots/0?action=erase")
    prefix = ids[r*7: r*7 + P]  # a different prefix each repeat (the slot keeps the last prompt)
    w, tm = run(prefix, 1); cold.append(w)
    tail = ids[P + 100 + r * S: P + 100 + (r + 1) * S]
    w, tm = run(prefix + tail, 1); warm.append(w); print("hit prompt_n", tm["prompt_n"])
    w, tm = run(prefix + tail + ids[5000:5001], 65); tpot.append(tm["predicted_per_token_ms"])
print(json.dumps({"cold_prefill_tok_s": round(P / statistics.median(cold), 1), "cold_ttft_ms": round(1000*statistics.median(cold),1),
  "hit_ttft_ms": round(1000*statistics.median(warm),1), "tpot_ms": round(statistics.median(tpot),2)}))
srv.terminate()
