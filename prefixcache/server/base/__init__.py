"""What every API shares, importing none of them: the app factory (app.py: ``build_app`` takes
each API as a ``Surface``), the server's state and the running of an engine request
(serving.py, run.py), tenants and keys (auth.py), reading a body as a model (protocol.py), the
cache routes' threads (cache_gate.py), prompts compared with an earlier response's
(comparison.py)."""
