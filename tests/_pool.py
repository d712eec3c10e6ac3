"""Test steps on a bare BlockPool (torch-free, like the cache core)."""

from __future__ import annotations


def compute_missing(pool, matched: list[int], keys: list, tokens: list[int], root, ns, block_size: int,
                    **register_kw):
    """The engine's compute path on a bare pool: acquire the matched blocks, allocate and register
    the rest of ``keys`` as a chain. (table, holders) - holders are what ``register`` returned -
    or None, the matched blocks released, when the pool has too few free blocks."""
    pool.acquire(matched)
    new = pool.allocate(len(keys) - len(matched))
    if new is None:
        pool.release(matched)
        return None
    table, holders = list(matched), []
    for i in range(len(matched), len(keys)):
        b = new[i - len(matched)]
        holders.append(pool.register(b, keys[i], keys[i - 1] if i else root,
                                     tokens[i * block_size : (i + 1) * block_size], ns,
                                     parent_block=table[-1] if table else None, **register_kw))  # fmt: skip
        table.append(b)
    return table, holders
