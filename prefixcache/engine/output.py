"""Output processing: append sampled tokens, detokenize incrementally, decide when to stop.

Stop strings are matched on the detokenized text; while a request streams, the last
``max(len(stop)) - 1`` characters are held back so a client never sees the start of a stop
string that is then cut away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefixcache.api.request import CompletionOutput, RequestOutput, StreamDelta
from prefixcache.engine.sampler import Sampled
from prefixcache.sequence import Sequence
from prefixcache.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class Stop:
    """Why a sequence ends: ``reason`` ("stop", "length") and what stopped it (a stop token id
    or string; None for EOS and length)."""

    reason: str
    stop_reason: int | str | None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(tokenizer.stop_token_ids)

    def append(self, seq: Sequence, s: Sampled, now: float | None = None) -> bool:
        """Add one sampled token (``seq.out`` is this module's alone to write); returns why the
        sequence ends now (a ``Stop``), or None. The engine finishes it (its status has one
        writer per transition: the scheduler's queue states, the engine's ``_finish``)."""
        now = time.time() if now is None else now
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.out.output_token_ids.append(s.token_id)
        if s.logprobs is not None:
            seq.out.output_logprobs.append(s.logprobs)
        if seq.out.detok is None:
            seq.out.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        before = len(seq.out.text)
        seq.out.text += seq.out.detok.add([s.token_id])
        p = seq.params
        tok = s.token_id
        if tok in p.stop_token_ids:
            return Stop("stop", tok)
        if not p.ignore_eos and tok in self.eos_ids:
            return Stop("stop", None)
        for stop in p.stop:
            # Only the tail can hold a new match: the added text plus len(stop) - 1 before it.
            idx = seq.out.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                cut = idx + len(stop) if p.include_stop_str_in_output else idx
                seq.out.text = seq.out.text[:cut]
                return Stop("stop", stop)
        if len(seq.out.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            # A stream cut mid-character still hands over the bytes it has.
            seq.out.text += seq.out.detok.flush()
            return Stop("length", None)
        return None

    @staticmethod
    def finish(seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Record why ``seq`` ended (the engine's ``_finish``, which also sets its status)."""
        seq.out.finish_reason = reason
        seq.out.stop_reason = stop_reason

    # ---- views ------------------------------------------------------------------------------
    def stream_delta(self, seq: Sequence) -> StreamDelta:
        """What is new since the last delta of this sequence (and marks it as streamed)."""
        hold = 0
        if not seq.finished and seq.params.stop:
            hold = max(len(s) for s in seq.params.stop) - 1
        visible = max(seq.out.num_streamed_chars, len(seq.out.text) - hold)
        text_delta = seq.out.text[seq.out.num_streamed_chars : visible]
        new_ids = seq.out.output_token_ids[seq.out.num_streamed_tokens :]
        lps = seq.out.output_logprobs
        new_lps = lps[seq.out.num_streamed_tokens :] if lps else None
        first = seq.out.num_streamed_tokens == 0 and seq.out.num_streamed_chars == 0
        seq.out.num_streamed_chars = visible
        seq.out.num_streamed_tokens = len(seq.out.output_token_ids)
        return StreamDelta(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            text_delta=text_delta,
            finished=seq.finished,
            finish_reason=seq.out.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.out.output_token_ids),
            metrics=seq.metrics,
            cache=seq.cache.snapshot(),
            new_logprobs=new_lps,
            stop_reason=seq.out.stop_reason,
            first=first,
            prompt_token_ids=seq.prompt_token_ids if first else [],
        )

    @staticmethod
    def request_output(seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=seq.out.text,
                    token_ids=list(seq.out.output_token_ids),
                    finish_reason=seq.out.finish_reason,
                    stop_reason=seq.out.stop_reason,
                    logprobs=(
                        list(seq.out.output_logprobs) if seq.params.logprobs is not None else None
                    ),
                )
            ],
            finished=seq.finished,
            cache=seq.cache.snapshot(),
            metrics=seq.metrics,
        )
