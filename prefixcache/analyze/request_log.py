"""The server's request log: one JSON line per request, read back by `prefixcache analyze`.

Written by ``prefixcache serve --log-requests FILE``. By default a line holds no prompt content,
only what the analyzer needs to measure reuse::

    {"time": 1717171717.25, "tenant": "acme", "namespace": "acme", "num_prompt_tokens": 812,
     "num_cached_tokens": 768, "block_hashes": ["9f0c...", ...]}

``block_hashes`` are the cache keys of the prompt's full blocks (hex; docs/design.md §3), so the log
can be analysed without the tokenizer, and two prompts share a logged hash exactly when they
share the KV of that block. With ``include_text=True`` the prompt text and token ids are written
too (then the analyzer can re-block at another ``--block-size`` and find cache killers).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from os import PathLike
from typing import Any, Self


class RequestLogWriter:
    """Thread-safe JSONL writer; each ``log`` call appends one complete line and flushes it.

    Lines are written whole under a lock, so concurrent request handlers never interleave bytes
    and a crash loses at most the line being written. The file is opened for append, so a
    restarted server continues the same log.
    """

    def __init__(
        self,
        path: str | PathLike[str],
        include_text: bool = False,
        block_size: int | None = None,
    ) -> None:
        self.path = path
        self.include_text = include_text
        self.block_size = block_size
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(
        self,
        *,
        time: float,
        tenant: str | None,
        namespace: str | None,
        num_prompt_tokens: int,
        block_hashes: Sequence[bytes],
        num_cached_tokens: int | None = None,
        text: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "time": float(time),
            "tenant": tenant,
            "namespace": namespace,
            "num_prompt_tokens": int(num_prompt_tokens),
            "num_cached_tokens": None if num_cached_tokens is None else int(num_cached_tokens),
            "block_hashes": [bytes(h).hex() for h in block_hashes],
        }
        if self.block_size is not None:
            record["block_size"] = self.block_size
        if self.include_text:
            if text is not None:
                record["text"] = text
            if prompt_token_ids is not None:
                record["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"request log {self.path} is closed")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
