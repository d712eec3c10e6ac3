"""The engine: the step loop (llm_engine.py), scheduler and fairness, sampling and output,
its figures (stats.py), the thread-safe async engine and the offline LLM."""
