"""Synthetic prompt text made from the tokenizer's vocabulary, to exact token lengths.

Random token ids do not survive ``decode`` then ``encode``: a byte-level BPE merges neighbours
differently, and a sentencepiece tokenizer adds or drops spaces. So the text is built only from
*word tokens*: vocabulary entries that decode to a space followed by letters (``" cat"``) and
encode back to themselves. A pre-tokenizer splits text at every such space, so a string of ``n``
word tokens encodes to exactly those ``n`` ids, and two such strings concatenated encode to the
concatenation of their ids. That is what lets a shared prefix be shared token for token.

Every piece is checked by re-encoding; a piece that does not come back exact (a tokenizer this
reasoning does not hold for) is repaired by trimming or padding until it does, and a tokenizer with
too few word tokens is refused with a clear error.
"""

from __future__ import annotations

import numpy as np

MIN_WORD_TOKENS = 64  # below this the text would be too repetitive to mean anything


class SyntheticText:
    """Makes text of exact token lengths from a tokenizer, deterministically for a seed.

    ``tokenizer`` needs ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``vocab_size``.
    """

    def __init__(self, tokenizer, max_vocab_scan: int | None = None):
        self.tokenizer = tokenizer
        self.word_ids = _word_token_ids(tokenizer, max_vocab_scan)
        if len(self.word_ids) < MIN_WORD_TOKENS:
            raise ValueError(
                f"tokenizer has only {len(self.word_ids)} word tokens (' ' + letters that "
                "round-trip); synthetic datasets need a byte-level BPE or sentencepiece vocabulary"
            )

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A string that this tokenizer encodes to exactly ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return ""
        ids = rng.choice(self.word_ids, size=num_tokens).tolist()
        text = self.tokenizer.decode(ids)
        n = len(self.tokenizer.encode(text))
        # Repair the rare piece whose re-encoding differs (see the module docstring).
        while n != num_tokens:
            if n > num_tokens:
                ids = ids[: len(ids) - (n - num_tokens)]
            else:
                ids = ids + rng.choice(self.word_ids, size=num_tokens - n).tolist()
            text = self.tokenizer.decode(ids)
            n = len(self.tokenizer.encode(text))
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


def _word_token_ids(tokenizer, max_vocab_scan: int | None) -> np.ndarray:
    """Sorted ids of vocabulary entries that decode to ' ' + ASCII letters and round-trip."""
    vocab = int(tokenizer.vocab_size)
    limit = vocab if max_vocab_scan is None else min(vocab, max_vocab_scan)
    ids = []
    for i in range(limit):
        piece = tokenizer.decode([i])
        word = piece[1:]
        if len(piece) < 3 or piece[0] != " " or not (word.isascii() and word.isalpha()):
            continue
        if tokenizer.encode(piece) == [i]:
            ids.append(i)
    return np.asarray(ids, dtype=np.int64)
