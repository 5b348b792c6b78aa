"""Continuous-batching scheduler: chunked prefill, priority order, preemption by recompute.

Order. Every request has a rank ``(priority, arrival_time, seq)``: a lower priority value goes
first (as in vLLM), then the earlier ``arrival_time`` the front end stamped, then the order the
engine received it (``seq``), so requests that carry no arrival time are first come, first
served. A preempted request keeps its rank, so it goes back ahead of later arrivals.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in
order: a decode takes one token, an unfinished prefill takes the next chunk that fits. When
a running request needs a block and none is free, the worst-ranked request not yet scheduled
this step (possibly the request itself) is preempted: its blocks are freed and it goes back
to the waiting queue to recompute from scratch (vLLM v1's recompute policy). Only in a step
without such preemption are waiting requests admitted, best rank first, while the budget,
``max_num_seqs`` and the pool allow.

Priority preemption (policy ``priority``, vLLM's priority policy). When the best waiting
request cannot be admitted because every slot (``max_num_seqs``) or every free block is taken,
and some running request has a strictly worse (higher) priority value, the worst-ranked
running request is preempted by recompute to make room, and again until the waiting one fits
or no running request ranks below it. A victim already picked for this step leaves the batch
and gives its tokens back to the budget. Equal priorities never preempt each other, so
requests of one priority cannot thrash. Under ``fcfs`` a waiting request never preempts.

Every request state change fires an ``ENGINE_REQUEST`` event; a request's lifecycle is the
only record of its state.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from ..protocol.records import SchedulerAudit
from ..spec.machine import Lifecycle, TraceEntry
from ..spec.request import ENGINE_REQUEST, EngineRequestEvent, EngineRequestState
from .kv_cache import KVCacheManager

if TYPE_CHECKING:  # annotations only: a null-model engine never loads torch
    import torch

__all__ = ["Request", "Scheduler"]

RE = EngineRequestEvent

# Stop sets shared between requests: the stop check touches one hot object instead of a
# cold one per request (measured 4-10 % of a step after a 5 ms device wait). Keyed by the
# model's EOS id only, so the cache stays as small as the set of models served.
_NO_STOPS: frozenset[int] = frozenset()
_EOS_ONLY: dict[int, frozenset[int]] = {}


class Request:
    """Engine-side state of one request; plain slots because the step loop reads them hot."""

    __slots__ = (
        "all_token_ids", "arrival_time", "block_hashes", "block_ids", "client_index", "draining",
        "eos", "finished", "generator", "in_waiting", "lifecycle", "max_tokens",
        "num_cached_tokens", "num_computed_tokens", "num_prompt_tokens", "num_registered_blocks",
        "num_tokens", "priority", "request_id", "seed", "sort_key", "stop_ids", "stop_len",
        "stops", "temperature", "top_k", "top_p",
    )

    def __init__(
        self,
        req: EngineCoreRequest,
        seq: int,
        eos_token_id: int,
        default_seed: int,
        max_model_len: int,
        trace: list[TraceEntry] | None,
        *,
        own_ids: bool = False,
    ) -> None:
        sp = req.sampling_params
        self.request_id = req.request_id
        self.client_index = req.client_index
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        # The rank (module docstring). ``seq`` is unique, so a heap never compares Requests.
        self.sort_key = (req.priority, req.arrival_time, seq)
        # ``own_ids``: the list is the engine's already (a decoded ADD's) and becomes the
        # history as it is; a caller's is copied, as tokens are appended to it.
        self.all_token_ids = req.prompt_token_ids if own_ids else list(req.prompt_token_ids)
        # len(all_token_ids), kept beside the hot fields: the scheduler and the model read the
        # length of every running request each step without touching the (cold) list.
        self.num_tokens = len(self.all_token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.max_tokens = sp.max_tokens
        # Length at which it finishes with LENGTH: one comparison per token in update().
        self.stop_len = min(self.num_prompt_tokens + sp.max_tokens, max_model_len)
        self.temperature = sp.temperature
        self.top_k = sp.top_k
        self.top_p = sp.top_p
        self.seed = default_seed if sp.seed is None else sp.seed
        self.generator: torch.Generator | None = None
        self.stop_ids = frozenset(sp.stop_token_ids) if sp.stop_token_ids else _NO_STOPS
        self.eos = -1 if sp.ignore_eos else eos_token_id  # -1 never matches a token
        # Every token that ends the request: one set lookup per token in update().
        if self.eos < 0:
            self.stops = self.stop_ids
        elif self.stop_ids:
            self.stops = self.stop_ids | {self.eos}
        else:
            self.stops = _EOS_ONLY.get(self.eos) or _EOS_ONLY.setdefault(
                self.eos, frozenset((self.eos,)))
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.finished = False
        self.in_waiting = False
        self.draining = False
        self.lifecycle: Lifecycle[EngineRequestState, EngineRequestEvent] = (
            ENGINE_REQUEST.lifecycle(trace=trace)
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"<Request {self.request_id!r} {self.lifecycle.state.name} "
                f"computed={self.num_computed_tokens}/{len(self.all_token_ids)}>")


# Token columns a decode batch holds before it writes them back to the requests' lists. Each
# write-back touches every request (the cost the batch exists to avoid), so it should be rare;
# the buffer is column-major, so a step writes one contiguous column.
_BATCH_COLUMNS = 128
# Finished requests leave the waiting heap lazily (skipped when they reach its top); once
# stale entries outnumber live ones by this much the heap is rebuilt, so aborting requests
# that never run (a paused engine, a burst of cancels) cannot grow it without bound.
_WAITING_SLACK = 1024


class DecodeBatch:
    """The running requests of a steady decode phase, column-wise (vLLM's persistent batch).

    Built from ``Scheduler.running`` when the steady-decode fast path starts; row ``i`` is
    ``reqs[i]``. While a request is a row, three of its fields live here instead: its
    ``num_tokens`` is ``ntok[i]``, its ``num_computed_tokens`` is ``ntok[i] - 1`` (every token
    but the last sampled one), and the tokens sampled since its row was last written back sit
    in ``buf[:ntok[i] - base[i], i]`` rather than in ``all_token_ids``. A step then updates a
    few arrays instead of touching every request's objects, which after a device wait means a
    cache miss per object (docs/benchmarks.md, fourth round). ``flush`` and ``flush_rows``
    write the fields back; the scheduler calls them before anything reads a request.
    """

    __slots__ = ("_aligned", "_grow", "_len_at", "_records", "base", "buf", "cached_rows",
                 "col", "cols", "eos", "has_eos", "ids", "last", "np", "ntok", "reqs", "rows",
                 "stop_len", "stop_rows", "stream_ids", "stream_mask")

    def __init__(self, reqs: list[Request]) -> None:
        import numpy as np  # here: an engine that never batches never loads numpy

        self.np = np
        n = len(reqs)
        self.reqs = reqs
        # One pass over the requests (each one is a few cache misses after a device wait).
        ids: list[str] = []
        nums: list[tuple[int, int, int, int]] = []
        stop_rows: list[int] = []
        cached_rows: list[int] = []
        for i, r in enumerate(reqs):
            ids.append(r.request_id)
            nums.append((r.num_tokens, r.stop_len, r.eos, r.all_token_ids[-1]))
            if r.stop_ids:
                stop_rows.append(i)
            if r.num_cached_tokens:
                cached_rows.append(i)
        table = np.array(nums, np.int64).reshape(n, 4)
        self.ids = ids
        self.ntok = table[:, 0].copy()
        self.base = self.ntok.copy()
        self.stop_len = table[:, 1].copy()
        self.eos = table[:, 2].copy()
        self.last = table[:, 3].copy()
        self.has_eos = bool((self.eos >= 0).any())
        self.buf = np.empty((_BATCH_COLUMNS, n), np.int64)
        self.rows = np.arange(n)
        self.col = 0  # columns used by the row written back longest ago (an upper bound)
        # Worker-owned columns (e.g. the null model's per-request constants), kept aligned.
        self.cols: dict[str, Any] = {}
        self._index_rows(stop_rows, cached_rows)
        # Steps recorded, and the rows grouped by when they need a block (rows_to_grow).
        self._records = 0
        self._grow: tuple[int, dict[int, list[int]]] | None = None
        # Every row has ``col`` tokens in the columns (until a partial write-back): a step
        # then writes one contiguous column.
        self._aligned = True
        self._next_length_finish()

    def _next_length_finish(self) -> None:
        """The first step count at which a row can reach its length limit: every row gains
        one token a step, so until then no step needs to compare the whole batch."""
        left = self.stop_len - self.ntok
        self._len_at = self._records + (int(left.min()) if len(left) else 0)

    def length_finish_possible(self) -> bool:
        return self._records >= self._len_at

    def _index_rows(self, stop_rows: list[int], cached_rows: list[int]) -> None:
        self.stop_rows = stop_rows
        self.cached_rows = cached_rows
        self.stream_mask: Any = None
        if cached_rows:
            mask = self.np.ones(len(self.reqs), bool)
            mask[cached_rows] = False
            self.stream_mask = mask
            self.stream_ids = [rid for rid, keep in zip(self.ids, mask.tolist(), strict=True)
                               if keep]
        else:
            self.stream_ids = self.ids

    def __len__(self) -> int:
        return len(self.reqs)

    def flush_rows(self, rows: list[int], *, history: bool = True) -> None:
        """Write rows ``rows`` back to their requests. ``history=False`` writes the counters
        only: for rows that finish now, whose token history nobody reads again (their full
        blocks were registered as they filled), a burst's end spares 64 x K ints."""
        if not rows:
            return
        ntoks = self.ntok[rows]
        reqs = self.reqs
        if not history:
            for i, ntok in zip(rows, ntoks.tolist(), strict=True):
                req = reqs[i]
                req.num_tokens = ntok
                req.num_computed_tokens = ntok - 1
            return
        self._aligned = len(rows) == len(reqs)
        if self._aligned:  # every row written back: the columns start empty
            self.col = 0
        pending = (ntoks - self.base[rows]).tolist()
        hist = self.buf[:max(pending), rows].T.tolist()
        for i, ntok, k, toks in zip(rows, ntoks.tolist(), pending, hist, strict=True):
            req = reqs[i]
            if k:
                req.all_token_ids.extend(toks[:k])
            req.num_tokens = ntok
            req.num_computed_tokens = ntok - 1
        self.base[rows] = ntoks

    def flush(self) -> None:
        """Write every row back; the batch stays usable (its columns start empty)."""
        self.flush_rows(self.rows.tolist())
        self.col = 0  # also with no rows, which flush_rows leaves as they are

    def record(self, toks: Any) -> None:
        """This step's sampled tokens, one per row, go into the columns."""
        if self.col == _BATCH_COLUMNS:
            self.flush()
        if self._aligned:
            self.buf[self.col] = toks
        else:
            self.buf[self.ntok - self.base, self.rows] = toks
        self.col += 1
        self.ntok += 1
        self._records += 1
        self.last = toks

    def rows_to_grow(self, block_size: int) -> list[int]:
        """The rows whose computed tokens fill their last block exactly (``(ntok - 1) %
        block_size == 0``): this step's token needs a new block.

        No NumPy here: this runs before the forward, while the output thread waits for the
        GIL to send the last batch, and a NumPy operation on more than a few hundred
        elements releases the GIL; that thread then takes it, and the step waits for its
        whole encode and send (K = 1024: ~0.1 ms a step, and the send no longer overlaps
        the forward). Every row gains one token a step, so ``(ntok - records) % block_size``
        is fixed per row: the rows are grouped by it once (again after ``keep``), and a step
        is a dict lookup."""
        grow = self._grow
        if grow is None or grow[0] != block_size:
            groups: dict[int, list[int]] = {}
            records = self._records
            for i, n in enumerate(self.ntok.tolist()):
                groups.setdefault((n - records) % block_size, []).append(i)
            grow = self._grow = (block_size, groups)
        return grow[1].get((1 - self._records) % block_size, [])

    def keep(self, mask: Any) -> None:
        """Drop the rows where ``mask`` is False (finished, already written back). Reads no
        request: the lists are rebuilt from the batch's own, the special rows remapped."""
        np = self.np
        idx = np.flatnonzero(mask)
        rows = idx.tolist()
        reqs, ids = self.reqs, self.ids
        self.reqs = [reqs[i] for i in rows]
        self.ids = [ids[i] for i in rows]
        for name in ("ntok", "base", "stop_len", "eos", "last"):
            setattr(self, name, getattr(self, name)[idx])
        buf = np.empty((_BATCH_COLUMNS, len(rows)), np.int64)
        buf[:self.col] = self.buf[:self.col, idx]
        self.buf = buf
        self.cols = {k: v[idx] for k, v in self.cols.items()}
        self.rows = np.arange(len(rows))
        self._grow = None  # the rows were renumbered
        self._next_length_finish()
        self.has_eos = bool((self.eos >= 0).any())
        stop_rows, cached_rows = self.stop_rows, self.cached_rows
        if stop_rows or cached_rows:
            kept = mask.tolist()
            new_index = (np.cumsum(mask) - 1).tolist()
            stop_rows = [new_index[i] for i in stop_rows if kept[i]]
            cached_rows = [new_index[i] for i in cached_rows if kept[i]]
        self._index_rows(stop_rows, cached_rows)


def _worst_first(req: Request) -> tuple[int, float, int]:
    # The rank negated: heapq is a min-heap and a victim is the worst (largest) rank. Every
    # part is a finite number (the engine refuses a NaN arrival_time), so negation is exact.
    p, a, s = req.sort_key
    return (-p, -a, -s)


class _Victims:
    """Candidates for preemption under KV pressure in one scheduling pass, worst rank first.

    One heap built at the pass's first preemption (``running[i:]``, the requests not yet
    scheduled) instead of a scan of ``running`` per victim: with every running request short
    of a block at once, that scan made a step quadratic (about a minute at the largest
    ``max_num_seqs``). Entries before the pass's current index were scheduled since: skipped.
    """

    __slots__ = ("heap",)

    def __init__(self, running: list[Request], start: int) -> None:
        self.heap = [(_worst_first(r), k, r) for k, r in enumerate(running[start:], start)]
        heapq.heapify(self.heap)

    def pop_worst(self, i: int) -> Request:
        """The worst-ranked request at index ``i`` or later (``running[i]`` is always there:
        it is the one asking, and it is not preempted yet)."""
        heap = self.heap
        while heap[0][1] < i:
            heapq.heappop(heap)
        return heapq.heappop(heap)[2]


class _Evictions:
    """Priority preemptions while admitting (``Scheduler._admit``), worst rank first.

    One heap over ``running`` built at the first eviction instead of a scan of ``running``
    (and of the step's batch) per victim, which made admitting S better-ranked requests over
    S running ones quadratic (minutes at the largest ``max_num_seqs``). Victims stay in the
    lists until ``apply`` removes them all at once.

    Requests admitted after the heap was built are not in it, and need not be: a waiting
    request comes out in rank order, so one admitted earlier never ranks worse than the one
    now asking, and a victim must rank strictly worse (for the same reason a victim admitted
    again in the same pass is never a victim twice).
    """

    __slots__ = ("batch_pos", "gone", "heap", "num_batch", "num_running")

    def __init__(self, running: list[Request], batch: list[Request]) -> None:
        self.heap = [(_worst_first(r), r) for r in running]
        heapq.heapify(self.heap)
        self.gone: set[int] = set()  # id() of each victim
        self.num_running = len(running)
        self.num_batch = len(batch)
        self.batch_pos = {id(r): k for k, r in enumerate(batch)}

    def worst(self) -> Request | None:
        return self.heap[0][1] if self.heap else None

    def take(self) -> None:
        self.gone.add(id(heapq.heappop(self.heap)[1]))

    def apply(self, running: list[Request], batch: list[Request], nums: list[int]) -> None:
        """Drop the victims' entries made before the heap was built (one admitted again
        since keeps its new entry)."""
        gone = self.gone
        n = self.num_running
        running[:n] = [r for r in running[:n] if id(r) not in gone]
        m = self.num_batch
        keep = [k for k in range(m) if id(batch[k]) not in gone]
        batch[:m] = [batch[k] for k in keep]
        nums[:m] = [nums[k] for k in keep]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "priority",
        decode_batch: bool = False,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.priority_preemption = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # live requests only
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple[int, float, int], Request]] = []  # heap by rank
        self.num_waiting = 0
        self.drain_only = False  # while draining for a pause: admit only requests marked draining
        # Live requests marked draining, and those of them waiting: read every step while a
        # pause(wait) drains, so counted as the marks change rather than by a pass over every
        # live request (a step of a drain cost O(live), the whole drain O(live^2)).
        self._num_draining = 0
        self._num_draining_waiting = 0
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of which made room for a better waiting request
        # Steady decode fast path. ``update`` sets this to ``running`` when it proved that
        # every request there was scheduled by the step that just ran, sampled a token (so the
        # next step computes exactly one token for it), and has KV blocks for that token; the
        # next ``schedule`` then takes the whole list without a per-request pass. Anything that
        # changes the running set or frees blocks resets it (and replaces ``running``, which
        # the identity check catches too).
        self._decode_ready: list[Request] | None = None
        self._all_scheduled = False
        # Whether ``update`` also saw every ready request's next token fit its blocks; only
        # the per-request fast path needs that (the decode batch grows blocks itself).
        self._decode_blocks_ok = False
        # Column-wise steady decode (DecodeBatch), when the worker can run from it and the
        # caller takes stream columns. ``step_batch`` is the batch when the last ``schedule``
        # chose one: then ``update_decode``, not ``update``, applies that step.
        self._use_batch = decode_batch
        if decode_batch:
            import numpy  # noqa: F401  (now, not in the first steady step: ~0.1 s)
        self._batch: DecodeBatch | None = None
        # While ``update_decode`` finishes rows: the requests whose blocks it frees together.
        self._batch_freed: list[Request] | None = None
        # The requests the last ``update_decode`` finished, kept alive past it: tearing down
        # a thousand requests' token lists takes milliseconds, and the engine process does
        # it after their outputs are sent (``take_ended``), not before.
        self.ended: list[Request] = []
        self.step_batch: DecodeBatch | None = None

    # -- bookkeeping ---------------------------------------------------------------------------

    def audit(self) -> SchedulerAudit:
        """Queue contents recounted from the queues themselves (see ``KVCacheManager.audit``)."""
        live = self.requests
        return SchedulerAudit(
            live=len(live),
            running=len(self.running),
            running_finished=sum(1 for r in self.running if r.finished),
            running_unknown=sum(1 for r in self.running if live.get(r.request_id) is not r),
            waiting=self.num_waiting,
            waiting_in_queue=sum(1 for _, r in self._waiting if r.in_waiting
                                 and not r.finished),
            draining=self._num_draining,
            draining_waiting=self._num_draining_waiting,
            request_block_refs=sum(len(r.block_ids) for r in live.values()),
        )

    def _push_waiting(self, req: Request) -> None:
        req.in_waiting = True
        self.num_waiting += 1
        if req.draining:  # preempted while draining
            self._num_draining_waiting += 1
        heapq.heappush(self._waiting, (req.sort_key, req))

    def _compact_waiting(self) -> None:
        # In place: ``_admit`` holds the list while it may finish requests.
        waiting = self._waiting
        waiting[:] = [e for e in waiting if e[1].in_waiting and not e[1].finished]
        heapq.heapify(waiting)

    def add(self, req: Request) -> None:
        req.lifecycle.fire(RE.ADD)
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_draining(self) -> int:
        return self._num_draining

    def start_drain(self) -> None:
        """Mark every live request draining and admit only those until ``end_drain``."""
        for r in self.requests.values():
            r.draining = True
        self._num_draining = len(self.requests)
        self._num_draining_waiting = self.num_waiting
        self.drain_only = True

    def end_drain(self) -> None:
        """Clear every mark; admission is open again."""
        for r in self.requests.values():
            r.draining = False
        self._num_draining = self._num_draining_waiting = 0
        self.drain_only = False

    def finish(self, req: Request, event: EngineRequestEvent, reason: FinishReason,
               stop_reason: int | str | None = None, error: str | None = None,
               new_token_ids: list[int] | None = None) -> EngineCoreOutput:
        """End ``req`` (firing ``event``), free its blocks, return its finishing output."""
        if self._batch is not None and self._batch_freed is None:
            self.release_batch()
        self._decode_ready = None
        req.lifecycle.fire(event)
        req.finished = True
        if req.draining:
            self._num_draining -= 1
        if req.in_waiting:  # its heap entry is skipped lazily
            req.in_waiting = False
            self.num_waiting -= 1
            if req.draining:
                self._num_draining_waiting -= 1
            if len(self._waiting) > 2 * self.num_waiting + _WAITING_SLACK:
                self._compact_waiting()
        if self._batch_freed is None:
            self.kv.free(req)
        else:  # freed with the rest of its batch (KVCacheManager.free_many)
            self._batch_freed.append(req)
        del self.requests[req.request_id]
        return EngineCoreOutput(req.request_id, new_token_ids or [], reason, stop_reason,
                                req.num_cached_tokens, error)

    def abort(self, request_ids: Iterable[str], unknown: list[str] | None = None
              ) -> list[EngineCoreOutput]:
        """ABORT outputs for the live ids; ``unknown`` collects the others (in order: a
        repeated id is unknown by its second turn)."""
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                outs.append(self.finish(req, RE.ABORT, FinishReason.ABORT))
            elif unknown is not None:
                unknown.append(rid)
        if outs:
            self.running = [r for r in self.running if not r.finished]
        return outs

    def abort_all(self) -> list[EngineCoreOutput]:
        return self.abort(list(self.requests))

    def release_batch(self) -> None:
        """Write the decode batch back to its requests and stop using it (before anything
        reads a running request's counters or tokens)."""
        batch, self._batch, self.step_batch = self._batch, None, None
        if batch is not None:
            batch.flush()

    def _preempt(self, req: Request) -> None:
        self.release_batch()
        self._decode_ready = None
        req.lifecycle.fire(RE.PREEMPT)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        self._push_waiting(req)

    def preempt_all_running(self) -> None:
        """Park every running request for recompute (their KV is about to be released)."""
        self.release_batch()
        for req in self.running:
            self._preempt(req)
        self.running = []

    # -- one step ------------------------------------------------------------------------------

    @property
    def steady_decode(self) -> bool:
        """Whether the next ``schedule`` takes the steady-decode fast path: the last
        ``update`` proved that every running request decodes exactly one token next (see
        ``__init__``; anything that changed the running set since reset the proof) and the
        token budget holds them all. Otherwise ``_schedule_full`` decides the step (so it
        does when a per-request steady step finds a request short of its next block)."""
        return (self._decode_ready is self.running
                and len(self.running) <= self.max_num_batched_tokens)

    @property
    def decode_batch_applies(self) -> bool:
        """Whether a steady-decode step runs column-wise (``DecodeBatch``): the worker reads
        a batch, and one exists already or no request waits (an admitted prefill sends the
        step per request, so a batch built for it would be released at once)."""
        return self._use_batch and (self._batch is not None or not self.num_waiting)

    def schedule(self) -> tuple[list[Request], list[int]]:
        """Pick this step's requests and how many new tokens each computes.

        The fast path (``steady_decode``) takes the running list as it is, and with
        ``decode_batch_applies`` sets ``step_batch``; the general path is ``_schedule_full``.
        """
        budget = self.max_num_batched_tokens
        running = self.running
        steady = self.steady_decode
        self._decode_ready = None
        self.step_batch = None
        if steady:
            # Steady decode (see __init__): one token each, blocks already there.
            reqs = running.copy()
            nums = [1] * len(reqs)
            batch = self._batch
            if self.decode_batch_applies:
                if batch is None:
                    batch = self._batch = DecodeBatch(reqs)
                if not self._grow_batch_blocks(batch):
                    self.release_batch()
                    return self._schedule_full()
            elif not self._decode_blocks_ok:
                return self._schedule_full()  # some request needs a block: allocate there
            self._admit(reqs, nums, budget - len(reqs))
            self._all_scheduled = len(reqs) == len(self.running)
            if batch is not None:
                if len(reqs) == len(batch) and self._batch is batch:
                    self.step_batch = batch
                else:  # admitted a prefill (or evicted a row): this step goes per request
                    self.release_batch()
            return reqs, nums
        return self._schedule_full()

    def _grow_batch_blocks(self, batch: DecodeBatch) -> bool:
        """Give every row whose computed tokens fill its last block exactly a new block for
        this step's token; False (the full pass will preempt) if the pool runs short."""
        need = batch.rows_to_grow(self.kv.block_size)
        if need:
            allocate, reqs, ntok = self.kv.allocate, batch.reqs, batch.ntok.tolist()
            for i in need:
                if not allocate(reqs[i], ntok[i]):
                    return False
        return True

    def _schedule_full(self) -> tuple[list[Request], list[int]]:
        """The per-request pass: chunked prefill, block growth, preemption, admission.

        The general path of ``schedule``: right for every step, and the only one unless
        ``steady_decode`` holds (then the fast path picks the same requests and tokens, and
        with ``decode_batch_applies`` runs them column-wise). tests/runtime/test_scheduler.py
        runs both on the same load and compares every step."""
        self.release_batch()
        kv, bs = self.kv, self.kv.block_size
        budget = self.max_num_batched_tokens
        running = self.running
        reqs: list[Request] = []
        nums: list[int] = []
        preempted = False
        victims: _Victims | None = None  # built at the first preemption of this step
        add_req, add_num = reqs.append, nums.append
        for i, req in enumerate(running):
            if req.in_waiting:  # preempted earlier in this pass; ``running`` is rebuilt below
                continue
            total = req.num_tokens  # the tokens computed once this step is done
            n = total - req.num_computed_tokens
            if n > budget:
                if budget <= 0:
                    break
                n = budget
                total = req.num_computed_tokens + n
            if total > len(req.block_ids) * bs and not kv.allocate(req, total):
                preempted = True
                if victims is None:
                    victims = _Victims(running, i)
                if not self._preempt_for(req, i, total, victims):
                    break  # it preempted itself: stop here, as vLLM does
            add_req(req)
            add_num(n)
            budget -= n
        if preempted:
            running[:] = [r for r in running if not r.in_waiting]
        else:
            self._admit(reqs, nums, budget)
        # reqs is a subset of running (admitted requests join both): equal sizes, equal sets.
        self._all_scheduled = len(reqs) == len(self.running)
        return reqs, nums

    def _preempt_for(self, req: Request, i: int, total: int, victims: _Victims) -> bool:
        """Preempt from ``running[i:]`` until ``req`` gets its blocks; False if ``req`` itself
        was the victim. Victims stay in ``running`` (marked ``in_waiting``) until the pass
        ends."""
        while True:
            # Lowest priority (latest arrival among equals) of those not yet scheduled.
            victim = victims.pop_worst(i)
            self._preempt(victim)
            if victim is req:
                return False
            if self.kv.allocate(req, total):
                return True

    def _evict_for(self, req: Request, ev: _Evictions, nums: list[int]) -> int | None:
        """Preempt the worst-ranked running request if its priority is strictly worse than
        ``req``'s; return the tokens it gives back to this step's budget, None if none ranks
        below ``req``. The victim leaves ``running`` and this step's batch when ``_admit``
        ends (``_Evictions.apply``)."""
        victim = ev.worst()
        if victim is None or victim.priority <= req.priority:
            return None
        ev.take()
        self._preempt(victim)
        self.num_priority_preemptions += 1
        k = ev.batch_pos.get(id(victim))
        return 0 if k is None else nums[k]

    def _admit(self, reqs: list[Request], nums: list[int], budget: int) -> None:
        kv, waiting, running = self.kv, self._waiting, self.running
        skipped: list[tuple[tuple[int, float, int], Request]] = []
        # Built at the first eviction (priority policy only); None while nothing was evicted.
        ev: _Evictions | None = None
        while waiting and budget > 0:
            req = waiting[0][1]
            if req.finished or not req.in_waiting:
                heapq.heappop(waiting)
                continue
            if self.drain_only and not req.draining:
                if not self._num_draining_waiting:
                    # Only arrivals since the pause are left: looking further would pop and
                    # push all of them again every step of the drain.
                    break
                skipped.append(heapq.heappop(waiting))
                continue
            if len(running) - (0 if ev is None else len(ev.gone)) >= self.max_num_seqs:
                if ev is None and self.priority_preemption:
                    ev = _Evictions(running, reqs)
                freed = None if ev is None else self._evict_for(req, ev, nums)
                if freed is None:
                    break
                budget += freed
                continue
            if req.num_computed_tokens == 0 and kv.enable_prefix_caching:
                cached = kv.claim_cached_prefix(req)
                req.num_computed_tokens = cached
                if len(req.all_token_ids) == req.num_prompt_tokens:
                    req.num_cached_tokens = cached
            n = len(req.all_token_ids) - req.num_computed_tokens
            if n > budget:
                n = budget
            if not kv.allocate(req, req.num_computed_tokens + n):
                if ev is None and self.priority_preemption:
                    ev = _Evictions(running, reqs)
                freed = None if ev is None else self._evict_for(req, ev, nums)
                if freed is not None:  # retry with the victim's blocks (and tokens) free
                    budget += freed
                    continue
                if req.num_computed_tokens:  # give back claimed prefix blocks while it waits
                    kv.free(req)
                    req.num_computed_tokens = 0
                break
            heapq.heappop(waiting)
            req.in_waiting = False
            self.num_waiting -= 1
            if req.draining:
                self._num_draining_waiting -= 1
            req.lifecycle.fire(RE.SCHEDULE)
            running.append(req)
            reqs.append(req)
            nums.append(n)
            budget -= n
        for item in skipped:
            heapq.heappush(waiting, item)
        if ev is not None and ev.gone:
            ev.apply(running, reqs, nums)

    def update(
        self,
        reqs: list[Request],
        nums: list[int],
        tokens: list[int],
        stream: tuple[list[str], list[int]] | None = None,
    ) -> tuple[list[EngineCoreOutput], list[str] | None]:
        """Apply one step's results; return the outputs and the ids finished (None if none).

        The general path: a step ``schedule`` ran as ``step_batch`` (``decode_batch_applies``)
        may instead be applied column-wise by ``update_decode``, which must give the same
        outputs, columns and request state (the differential tests in test_scheduler.py).

        With ``stream``, a decode that neither finishes nor carries a cached-token count is
        appended to its two lists (ids, tokens) instead of becoming an output struct: the
        columnar form ``EngineCoreOutputs.stream_ids``/``stream_tokens`` of the wire.
        """
        self.release_batch()  # the per-request pass reads what the batch holds
        outs: list[EngineCoreOutput] = []
        add = outs.append
        finished: list[str] | None = None
        register = self.kv.register_full_blocks if self.kv.enable_prefix_caching else None
        output = EngineCoreOutput
        bs = self.kv.block_size
        # Stays True while every request that goes on decodes next step; blocks_ok while
        # each of them also has the block for that step's token.
        ready = blocks_ok = self._all_scheduled
        add_id = add_tok = None
        if stream is not None:
            add_id, add_tok = stream[0].append, stream[1].append
        # The hot path is a decode that does not finish: one pass, one set lookup, and the
        # output appended to the stream columns, or built with as few arguments as its fields
        # allow (defaults cost nothing).
        for req, n, tok in zip(reqs, nums, tokens, strict=False):
            if tok < 0:  # a prefill chunk that does not reach the end: nothing sampled
                req.num_computed_tokens += n
                if register is not None:
                    register(req)
                ready = blocks_ok = False
                continue
            # A worker samples only for a chunk that reaches the request's last token, so
            # every token it had is computed now (a store, not a read-modify-write).
            ntok = req.num_tokens
            req.num_computed_tokens = ntok
            if register is not None:
                register(req)
            req.all_token_ids.append(tok)
            ntok += 1
            req.num_tokens = ntok
            if tok not in req.stops and ntok < req.stop_len:
                # Its blocks cover the ntok - 1 computed tokens; token ntok fits unless
                # ntok - 1 fills its last block exactly (then someone allocates).
                if blocks_ok and (ntok - 1) % bs == 0:
                    blocks_ok = False
                cached = req.num_cached_tokens
                if cached:
                    add(output(req.request_id, [tok], None, None, cached))
                elif add_id is not None:
                    add_id(req.request_id)
                    add_tok(tok)  # type: ignore[misc]
                else:
                    add(output(req.request_id, [tok]))
                continue
            add(self._finish_on(req, tok))
            if finished is None:
                finished = []
            finished.append(req.request_id)
        if finished is not None:
            self.running = [r for r in self.running if not r.finished]
        if ready:
            self._decode_ready = self.running
            self._decode_blocks_ok = blocks_ok
        return outs, finished

    def update_decode(
        self, batch: DecodeBatch, toks: Any
    ) -> tuple[list[EngineCoreOutput], list[str] | None, list[str], list[int]]:
        """``update`` for a step ``schedule`` ran as ``batch`` (one token per row, ``toks`` an
        int64 array). Returns the outputs, the ids finished, and the stream columns (ids,
        tokens). The ids list may be the batch's own: callers must not mutate it."""
        np = batch.np
        batch.record(toks)
        ntok, reqs = batch.ntok, batch.reqs
        # A step where no row can reach its length, with no EOS or stop ids to look for,
        # compares nothing (most steps: this runs cold, after the forward).
        fin: Any = ntok >= batch.stop_len if batch.length_finish_possible() else None
        if batch.has_eos:
            fin = toks == batch.eos if fin is None else fin | (toks == batch.eos)
        toks_list: list[int] | None = None
        if batch.stop_rows:
            toks_list = toks.tolist()
            for i in batch.stop_rows:
                if toks_list[i] in reqs[i].stop_ids:
                    if fin is None:
                        fin = np.zeros(len(reqs), bool)
                    fin[i] = True
        if self.kv.enable_prefix_caching:
            register = self.kv.register_full_blocks
            full = np.flatnonzero((ntok - 1) % self.kv.block_size == 0).tolist()
            batch.flush_rows(full)  # it hashes the block from the token list
            for i in full:
                register(reqs[i])
        fin_rows: list[int] = [] if fin is None else np.flatnonzero(fin).tolist()
        outs: list[EngineCoreOutput] = []
        finished: list[str] | None = None
        if fin_rows or batch.cached_rows:
            if toks_list is None:
                toks_list = toks.tolist()
            finset = set(fin_rows)
            special = sorted(finset.union(batch.cached_rows))
            batch.flush_rows(fin_rows, history=False)
            freed = self._batch_freed = []
            try:
                for i in special:
                    req, tok = reqs[i], toks_list[i]
                    if i in finset:
                        outs.append(self._finish_on(req, tok))
                        if finished is None:
                            finished = []
                        finished.append(req.request_id)
                    else:
                        outs.append(EngineCoreOutput(req.request_id, [tok], None, None,
                                                     req.num_cached_tokens))
            finally:
                self._batch_freed = None
                self.kv.free_many(freed)
                self.ended = freed
        if fin_rows:
            keep = ~fin
            smask = keep if batch.stream_mask is None else keep & batch.stream_mask
            ids = batch.ids
            stream_ids = [ids[i] for i in np.flatnonzero(smask).tolist()]
            stream_toks = toks[smask].tolist()
            batch.keep(keep)
            self.running = list(batch.reqs)
        else:
            stream_ids = batch.stream_ids
            if batch.stream_mask is None:
                stream_toks = toks_list if toks_list is not None else toks.tolist()
            else:
                stream_toks = toks[batch.stream_mask].tolist()
        self._batch = batch if len(batch) else None
        if self._batch is None:
            self.step_batch = None
        self._decode_ready = self.running
        self._decode_blocks_ok = False  # the batch grows blocks; nobody else checked them
        return outs, finished, stream_ids, stream_toks

    def _finish_on(self, req: Request, tok: int) -> EngineCoreOutput:
        """``tok`` ended ``req`` (a stop id, EOS or the length limit): finish it."""
        if tok in req.stop_ids:
            return self.finish(req, RE.STOP, FinishReason.STOP, tok, None, [tok])
        if tok == req.eos:
            return self.finish(req, RE.STOP, FinishReason.STOP, None, None, [tok])
        return self.finish(req, RE.LENGTH, FinishReason.LENGTH, None, None, [tok])
