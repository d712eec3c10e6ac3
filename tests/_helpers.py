"""Helpers shared by several test modules (imported as ``_helpers``; pytest puts tests/ on the path)."""

from __future__ import annotations

import functools
from unittest import mock

import torch

from prefixcache.model.loader import load_weights


@functools.cache
def _default_weights():
    return load_weights(None)


def shared_default_weights():
    """A context in which engines read the default model's weights once per test process, not
    once per engine (dequantizing the GGUF takes seconds)."""
    return mock.patch("prefixcache.engine.load_weights", lambda model: _default_weights())


def prefill_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill (ModelRunner.all_logits). [len(ids), vocab]."""
    return llm.engine.runner.all_logits(ids)


# English prose the cold == warm tests cut prompts from: long enough for many blocks.
PROSE = (
    "Prefix caching stores the attention keys and values of a prompt so that a later request "
    "which starts with the same tokens does not compute them again. Retrieval augmented "
    "generation places long documents at the start of every prompt; chat applications resend "
    "the whole conversation at every turn. The cache is organised in blocks of sixteen tokens, "
    "each named by a hash of every token before and in it, and blocks that nobody uses are "
    "evicted in least recently used order when memory runs out. Paris is the capital of "
    "France, Berlin is the capital of Germany, and Madrid is the capital of Spain. "
)
