"""A data-parallel client's router (dp_client.py): which engine an ADD goes to, which
incarnation each live request was sent to, and the load figures the choice reads.

Routing: an ADD goes to ``EngineCoreRequest.data_parallel_rank`` when set, else to the
serving engine with the lowest load, ``4 * waiting + running`` as the engine last reported
them (``SchedulerStats`` on its step batches), with the ADDs sent since that report counted
as waiting, each term capped by the requests in flight there (a report taken just before the
last request finished does not make an idle engine look busy). Ties go to fewer requests in
flight, then round robin, so N idle engines fill evenly.

The router keeps no request lifecycle: the client tracks each request once. It keeps, per
incarnation, the ids it routed there and has not seen finished: how many are in flight, and
which ids that incarnation may send outputs for (an engine is never believed about another's
request). Everything here runs under the client's state lock.
"""

from __future__ import annotations

import operator
from collections.abc import Container, Sequence
from typing import Any

from ..protocol.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from ..spec.errors import EngineDeadError
from ..spec.membership import MEMBER_ROUTABLE
from ._dp_membership import Slot

__all__ = ["Router"]

_finish_reason = operator.attrgetter("finish_reason")
_request_id = operator.attrgetter("request_id")


class Router:
    """Routing state of one data-parallel client over ``size`` engine indexes."""

    __slots__ = ("_owner", "_running", "_sent", "_sent_ids", "_size", "_turn", "_waiting",
                 "last_routed")

    def __init__(self, size: int) -> None:
        self._size = size
        # Per index, of its current incarnation: the engine's last report and the ADDs sent
        # since it.
        self._waiting = [0] * size
        self._running = [0] * size
        self._sent = [0] * size
        self._turn = 0  # where the round robin starts
        self.last_routed = 0
        # request id -> the incarnation it was sent to; entries of finished requests are
        # dropped in bulk (``routed``), not per output: aborts and deaths read live ones only.
        self._owner: dict[str, Any] = {}
        # Per incarnation, the ids sent to it and not yet seen finished: what it may send
        # outputs for (``foreign``), and its count in flight.
        self._sent_ids: dict[Any, set[str]] = {}

    def in_flight(self, client: Any) -> int:
        ids = self._sent_ids.get(client)
        return 0 if ids is None else len(ids)

    def grow(self, size: int) -> None:
        """Room for indexes up to ``size`` (a scale-up); a reused index starts from nothing."""
        extra = size - self._size
        if extra > 0:
            for figures in (self._waiting, self._running, self._sent):
                figures.extend([0] * extra)
            self._size = size

    def load(self, index: int, client: Any) -> tuple[int, int]:
        n = self.in_flight(client)
        return (4 * min(self._waiting[index] + self._sent[index], n)
                + min(self._running[index], n), n)

    def pick(self, request: EngineCoreRequest, slots: Sequence[Slot], tried: Container[int]
             ) -> Slot | None:
        """The slot ``request`` goes to; None when no engine serves. ``tried``: indexes whose
        send failed for this request already. A rank that is not serving is an error."""
        rank = request.data_parallel_rank
        n = len(slots)
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
                raise ValueError(f"data_parallel_rank={rank!r}: must be None or an engine"
                                 f" index in [0, {n})")
            s = slots[rank]
            if not s.routable or rank in tried:
                raise EngineDeadError(f"engine {rank} (the request's data_parallel_rank) is"
                                      f" {s.lifecycle.state.value}")
            return s
        # ``Slot.routable`` and ``load`` written out: this runs once per ADD.
        best: Slot | None = None
        best_key: tuple[int, int, int] | None = None
        turn = self._turn
        sent_ids, waiting, running, sent = self._sent_ids, self._waiting, self._running, self._sent
        for k in range(n):
            s = slots[(turn + k) % n]
            client = s.client
            i = s.index
            if (client is None or i in tried or s.lifecycle.state not in MEMBER_ROUTABLE
                    or client.is_dead):
                continue
            ids = sent_ids.get(client)
            f = 0 if ids is None else len(ids)
            w, r = waiting[i] + sent[i], running[i]
            key = (4 * (w if w < f else f) + (r if r < f else f), f, k)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best is not None:
            self._turn = (best.index + 1) % n
        return best

    def routed(self, request_id: str, index: int, client: Any, live: Container[str],
               n_live: int) -> None:
        """``request_id`` went to ``client``, engine ``index``'s current incarnation.
        ``live``/``n_live``: the client's live requests, to drop finished entries in bulk."""
        owner = self._owner
        owner[request_id] = client
        ids = self._sent_ids.get(client)
        if ids is None:
            ids = self._sent_ids[client] = set()
        ids.add(request_id)
        self.last_routed = index
        self._sent[index] += 1
        if len(owner) > 2 * n_live + 64:
            self._owner = {r: c for r, c in owner.items() if r in live}

    def owner(self, request_id: str) -> Any:
        return self._owner.get(request_id)

    def foreign(self, client: Any, stream_ids: list[str], outputs: list[EngineCoreOutput]
                ) -> tuple[list[int], list[int]] | None:
        """The positions of the stream ids and outputs in a batch of ``client`` for requests
        not sent to it (or finished there already); None when there are none (the common
        case: two C-level subset checks)."""
        ids = self._sent_ids.get(client, _NONE)
        if ((not stream_ids or ids.issuperset(stream_ids))
                and (not outputs or ids.issuperset(map(_request_id, outputs)))):
            return None
        return ([i for i, r in enumerate(stream_ids) if r not in ids],
                [i for i, o in enumerate(outputs) if o.request_id not in ids])

    def delivered(self, index: int, client: Any, current: bool,
                  outputs: list[EngineCoreOutput], stats: SchedulerStats | None) -> None:
        """A batch of ``client`` (engine ``index``'s current incarnation if ``current``)
        reached the caller: its finished requests leave the incarnation's count."""
        if outputs and operator.countOf(map(_finish_reason, outputs), None) != len(outputs):
            ids = self._sent_ids.get(client)
            if ids is not None:
                for o in outputs:
                    if o.finish_reason is not None:
                        ids.discard(o.request_id)
        if stats is not None and current:
            self._waiting[index], self._running[index] = stats.num_waiting, stats.num_running
            self._sent[index] = 0

    def reset(self, index: int) -> None:
        """Engine ``index``'s incarnation is gone: its figures start again from nothing."""
        self._waiting[index] = self._running[index] = self._sent[index] = 0

    def release(self, client: Any) -> list[str]:
        """Forget every request sent to incarnation ``client``; their ids."""
        self._sent_ids.pop(client, None)
        owner = self._owner
        rids = [rid for rid, c in owner.items() if c is client]
        for rid in rids:
            del owner[rid]
        return rids

    def sent_to(self, client: Any, live: Container[str]) -> list[str]:
        """The live requests sent to incarnation ``client``."""
        return [rid for rid, c in self._owner.items() if c is client and rid in live]


# A shared empty set for an incarnation that was sent nothing (never written to).
_NONE: frozenset[str] = frozenset()
