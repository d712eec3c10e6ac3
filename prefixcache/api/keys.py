"""The type of a block key: the 16 bytes that name a block's KV (docs/design.md §3), computed by
``cache/hashing.py``. It lives here, below the cache core, because ``sequence.py`` holds a
request's keys and the cache core imports ``sequence.py``."""

BlockHash = bytes  # 16 bytes
