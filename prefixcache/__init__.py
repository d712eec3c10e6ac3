"""prefixcache: an LLM inference engine and OpenAI-compatible server built around a prefix cache."""

import os as _os
import sys as _sys

# The native kernels run their work items on a thread pool of their own (kernels/parallel.h).
# OpenMP threads that spin after each torch op (libgomp's default) would fight its helpers for the
# cores: Gemma 3's closed loop took 13.4-14.3 s against 9.2-10.3 s on 2 cores. So OpenMP threads
# sleep between regions unless the user chose a policy, set only while torch is not loaded yet
# (libgomp reads the variable once, when it loads); the kernels use the pool only when the
# variable says PASSIVE, so it always describes what OpenMP does (docs/design.md section 6).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from prefixcache.api.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for, so the torch-free
    # parts (cache core, analyzer, benchmark client) stay light to import.
    if name == "LLM":
        from prefixcache.engine.llm import LLM

        return LLM
    raise AttributeError(name)
