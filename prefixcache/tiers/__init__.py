"""Persistent KV tiers behind the RAM pool: a local disk store and a shared Redis store.

torch-free: blocks cross this package as bytes (``kv/pool.py`` reads and writes them), so the
stores, the codec and the I/O threads are tested without a model.
"""
