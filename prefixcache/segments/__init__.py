"""Segment caching (opt-in, ``cache_mode="segments"``): each document of a prompt keeps its own
KV, reusable wherever the document appears. See docs/segments.md.

- ``plan``       request options, spans and keys (no torch)
- ``store``      the size-bounded segment store (torch tensors, LRU by bytes)
- ``rotation``   moving cached K to new positions (RoPE re-rotation)
- ``assembler``  the engine side: place cached segments into a sequence, recompute a few tokens
- ``record``     a segment as the bytes of a disk/Redis tier record (connectors/segments.py moves them)
"""
