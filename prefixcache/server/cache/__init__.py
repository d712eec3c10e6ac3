"""The cache control routes, ``/v1/cache/...``: warm, lookup, invalidate, stats (routes.py) and
their bodies (protocol.py)."""
