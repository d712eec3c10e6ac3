"""The OpenAI API: completions and chat completions (completions.py), models, their bodies
(protocol.py), prompts and sampling (prompt.py), the comparison answer (diagnostics.py)."""
