"""Anthropic's Messages API: the routes, answer and event stream (messages.py), its bodies
(protocol.py), rendering and breakpoint positions (prompt.py), tool calls read back from the
output (tool_calls.py), breakpoints as leases, shared prefix and usage (cache_breakpoints.py),
its error dialect (errors.py) and comparison answer (diagnostics.py)."""
