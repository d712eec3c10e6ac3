"""prefixcache: an LLM inference engine and OpenAI-compatible server built around a prefix cache."""

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
