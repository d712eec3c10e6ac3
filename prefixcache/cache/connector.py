"""The KV connector protocol: the only way a feature touches the KV lifecycle.

The engine's step is schedule, run, sample, commit; everything else that reads or fills the KV
cache (the persistent tiers, segment caching, KV events) is a ``KVConnector`` and is reached
only through these hooks, in this order within a request's life and a step:

- ``check(token_ids, request)``: refuse what the connector can never run (pure, no lock);
- ``on_arrival(seq, request)``: the request entered the engine; a connector may start work for
  it (a restore) and answer ``pending(seq)`` True until it is done: the scheduler does not admit
  a sequence while any connector has work pending for it (status ``RequestStatus.LOADING``,
  set and cleared by ``ConnectorSet`` alone);
- per step, ``before_step()`` (install finished work; returns the sequences whose pending work
  changed), then the scheduler (which asks ``wants(seq)``: the most tokens a running sequence's
  connector work can spend this step, None where the connector has no plan for it, so a grant
  it cannot spend goes to other sequences), then ``prefill(s)`` for each scheduled sequence (a connector
  may spend the tokens granted to it on pieces of its own prefill plan, ``Prefill``: they run
  in the step's one forward in place of the sequence's chunk, and it says how many tokens of
  work they are: the step's pace counts those, not what was granted), then the forward and
  ``after_forward(output, prefill_tokens, seconds)`` (a connector reads what its pieces
  computed; it returns the sequences it finished), then per
  sequence ``after_commit(seq, first_block)`` (the blocks registered from ``first_block`` on),
  then ``on_events(events)`` with what the prefix index recorded during the step
  (kv_events.py; only connectors with ``wants_events``);
- ``idle_wait(timeout)`` when nothing was scheduled (pending work may finish meanwhile);
- ``on_finish(seq)``: finished, aborted or failed: its pending work installs nothing;
- ``start_invalidate`` / ``wait``: a namespace dropped (the RAM part under the engine lock, the
  slow part, e.g. tier deletion, waited for outside it);
- ``held(token_ids, request)``: how much of a request the connector holds now, in its own unit
  (segments: the request's documents in the RAM store), None where the question does not
  apply; the caller reads it under the connector's ``name`` (a warm's "already cached");
- ``stats()`` / ``tenant_stats(tenant)``: the connector's figures, under its ``name``;
- ``flush``, ``check_integrity``, ``close``.

Every hook is a no-op by default, so a connector implements only what it does. Torch-free: a
connector's own module may use torch; the protocol and the set do not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prefixcache.api.request import RequestStatus
from prefixcache.cache.kv_events import KVEvent
from prefixcache.sequence import Piece, ScheduledSeq, Sequence

IDLE_WAIT = 0.005  # seconds a step with nothing scheduled waits for a connector's pending work


@dataclass(frozen=True)
class Prefill:
    """A connector's use of one scheduled sequence's grant (``KVConnector.prefill``): its
    ``pieces`` run in the step's forward in place of the sequence's chunk (the engine samples
    and commits nothing of it), and count ``tokens`` of work: at most the grant, less when the
    connector's work ended or must wait for this forward before it can go on."""

    pieces: list[Piece]
    tokens: int


class KVConnector:
    name = "connector"
    wants_events = False  # on_events is called (the index records events only if one wants them)

    def check(self, token_ids: list[int], request) -> None: ...
    def on_arrival(self, seq: Sequence, request) -> None: ...
    def pending(self, seq: Sequence) -> bool:
        return False

    def before_step(self) -> Iterable[Sequence]:
        return ()

    def wants(self, seq: Sequence) -> int | None:
        """The most tokens ``prefill`` can spend for running ``seq`` in the next step (at
        least 1), or None: no cap (it runs as an ordinary chunk, or the connector cannot say)."""
        return None

    def prefill(self, s: ScheduledSeq) -> Prefill | None:
        """None: ``s``'s chunk runs as scheduled; else what the connector makes of its grant."""
        return None

    def after_forward(self, output: object | None, prefill_tokens: int, seconds: float) -> Iterable[Sequence]:
        """The step's forward ran (``output``: model.runner.StepOutput; None when the step had
        no pieces to run); ``prefill_tokens`` prompt tokens in ``seconds``. Returns the
        sequences this connector finished (nothing sampled: a warm that kept its documents)."""
        return ()

    def after_commit(self, seq: Sequence, first_block: int) -> None: ...
    def on_events(self, events: list[KVEvent]) -> None: ...
    def has_pending(self) -> bool:
        return False

    def idle_wait(self, timeout: float) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def start_invalidate(self, namespace: str | None, all_namespaces: bool) -> object | None:
        return None

    def wait(self, ticket: object) -> None: ...
    def held(self, token_ids: list[int], request) -> int | None:
        return None

    def stats(self) -> object | None:
        return None

    def tenant_stats(self, tenant: str | None) -> object | None:
        return None

    def flush(self, timeout: float = 30.0) -> bool:
        return True

    def check_integrity(self) -> None: ...
    def close(self) -> None: ...


class ConnectorSet:
    """The engine's connectors, called in order (a later one may rely on what an earlier one
    did at arrival: segments plan a request before the tiers look up its blocks)."""

    def __init__(self, connectors: Iterable[KVConnector] = ()):
        self.connectors = tuple(connectors)
        names = [c.name for c in self.connectors]
        if len(set(names)) != len(names):
            raise ValueError(f"two connectors share a name: {names}")
        self.wants_events = any(c.wants_events for c in self.connectors)
        self._by_name = {c.name: c for c in self.connectors}

    def get(self, name: str) -> KVConnector | None:
        return self._by_name.get(name)

    def __iter__(self):
        return iter(self.connectors)

    # ---- a request ---------------------------------------------------------------------------
    def check(self, token_ids: list[int], request) -> None:
        for c in self.connectors:
            c.check(token_ids, request)

    def on_arrival(self, seq: Sequence, request) -> None:
        for c in self.connectors:
            c.on_arrival(seq, request)
        self._update(seq)

    def on_finish(self, seq: Sequence) -> None:
        for c in self.connectors:
            c.on_finish(seq)
        if seq.loading:  # the engine finishes it next
            seq.status = RequestStatus.WAITING

    def _update(self, seq: Sequence) -> None:
        """WAITING <-> LOADING as connectors have work pending for ``seq``; nothing else is
        touched (a sequence only loads while it waits, from its arrival)."""
        pending = any(c.pending(seq) for c in self.connectors)
        if pending and seq.status is RequestStatus.WAITING:
            seq.status = RequestStatus.LOADING
        elif not pending and seq.loading:
            seq.status = RequestStatus.WAITING

    # ---- a step ------------------------------------------------------------------------------
    def before_step(self) -> list[Sequence]:
        """Each connector installs its finished work; returns the sequences no connector is
        loading for any more (the engine re-explains those that asked: what they get now)."""
        loaded = []
        for c in self.connectors:
            for seq in c.before_step():
                was = seq.loading
                self._update(seq)
                if was and not seq.loading:
                    loaded.append(seq)
        return loaded

    def wants(self, seq: Sequence) -> int | None:
        """The first connector's cap on ``seq``'s next grant (``KVConnector.wants``)."""
        return next((w for c in self.connectors if (w := c.wants(seq)) is not None), None)

    def prefill(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[Piece], int]:
        """(the chunks that run as scheduled, the connectors' pieces for the others, the tokens
        of work those pieces are). A sequence's first connector to answer takes it."""
        ordinary: list[ScheduledSeq] = []
        pieces: list[Piece] = []
        worked = 0
        for s in scheduled:
            plan = next((p for c in self.connectors if (p := c.prefill(s)) is not None), None)
            if plan is None:
                ordinary.append(s)
            else:
                pieces.extend(plan.pieces)
                worked += plan.tokens
        return ordinary, pieces, worked

    def after_forward(self, output: object | None, prefill_tokens: int, seconds: float) -> list[Sequence]:
        return [seq for c in self.connectors for seq in c.after_forward(output, prefill_tokens, seconds)]

    def after_commit(self, seq: Sequence, first_block: int) -> None:
        for c in self.connectors:
            c.after_commit(seq, first_block)

    def on_events(self, events: list[KVEvent]) -> None:
        if events:
            for c in self.connectors:
                if c.wants_events:
                    c.on_events(events)

    def idle_wait(self, timeout: float) -> None:
        for c in self.connectors:
            if c.has_pending():
                c.idle_wait(timeout)
                return

    # ---- control and facts -------------------------------------------------------------------
    def start_invalidate(self, namespace: str | None, all_namespaces: bool) -> list:
        """Each connector's RAM part now; the tickets to ``wait`` for the rest."""
        tickets = []
        for c in self.connectors:
            t = c.start_invalidate(namespace, all_namespaces)
            if t is not None:
                tickets.append((c, t))
        return tickets

    @staticmethod
    def wait(tickets: list) -> None:
        """Any thread: the slow part of an invalidation; the first error after all are done."""
        error = None
        for c, t in tickets:
            try:
                c.wait(t)
            except Exception as e:  # noqa: BLE001 - raised after the others finished
                error = error or e
        if error is not None:
            raise error

    def held(self, token_ids: list[int], request) -> dict[str, int]:
        return {
            c.name: n for c in self.connectors if (n := c.held(token_ids, request)) is not None
        }

    def stats(self) -> dict:
        return {c.name: s for c in self.connectors if (s := c.stats()) is not None}

    def tenant_stats(self, tenant: str | None) -> dict:
        return {c.name: s for c in self.connectors if (s := c.tenant_stats(tenant)) is not None}

    def flush(self, timeout: float = 30.0) -> bool:
        flushed = [c.flush(timeout) for c in self.connectors]  # every one, even after a False
        return all(flushed)

    def check_integrity(self) -> None:
        for c in self.connectors:
            c.check_integrity()

    def close(self) -> None:
        for c in self.connectors:
            c.close()
