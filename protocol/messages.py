"""Wire messages: frozen msgspec Structs, one closed set per direction.

This page is the whole contract: a front end written from it alone, in any language with
ZeroMQ and msgpack, can drive an engine (``tests/protocol/test_protocol_doc.py`` does so in
raw pyzmq, and reads the tables below from this page).

## Sockets and the ready handshake

The front end binds both sockets; the engine connects to them.

| front end binds | engine connects | direction | one message |
|---|---|---|---|
| ROUTER (input) | DEALER | front end → engine | ``[identity, type byte + payload, aux...]`` |
| PULL (output) | PUSH | engine → front end | ``[payload, aux...]``, or the sentinel frame |

1. The engine speaks first, because a ROUTER can only address a peer it has heard from. Its
   ``ReadyResponse`` arrives on the ROUTER as ``[identity, payload]``: no type byte, no aux.
   The front end sends nothing before it; a ROUTER silently drops a message to an identity
   it has no route to yet.
2. ``identity`` is ``engine_index.to_bytes(2, "little")`` (engine 0: ``b"\\x00\\x00"``). The
   front end puts it first on every message it sends; the ROUTER strips it, so the engine's
   DEALER sees ``[type byte + payload, aux...]``.
3. The front end checks ``protocol_version`` and refuses one it does not know (see
   Versioning). A plain (ipc, insecure tcp) engine queues its ready on the connection and
   waits for its front end however long that takes. A CURVE engine queues only on an
   authenticated connection (``ZMQ_IMMEDIATE``: a message queued towards an impostor would be
   lost), so one that no front end has taken the ready from within 30 s exits.

4. The engine sends its ready again every time its input connection is made anew: after a
   dropped link (the same front end sees a second ready, which it ignores) and when a new
   front end binds the addresses of one that went away.

## Attaching: one front end at a time

An engine started on its own (``enginewire engine``) outlives its front ends, so a front end
may find it busy with work a previous one left, and that work's outputs still on their way.
After the ready, a front end sends ``ATTACH`` with a random 16-byte ``session``; the engine
answers on the output socket with the *attach marker*: an ``EngineCoreOutputs`` whose
``session`` field is that session and nothing else but ``engine_index`` and ``timestamp``.
Everything the front end receives before the marker belongs to an earlier front end and is
dropped unread; everything after it is its own. If ``session`` differs from the engine's
current one (a fresh engine has none), the engine first ends whatever came before it: live
and parked requests are dropped without outputs (nobody who asked for them is listening),
deferred calls and replies not yet sent are dropped, the prefix cache is emptied, and an
engine asleep or paused wakes up (every tag) or resumes. The new front end finds it as after
start-up: awake, scheduling, no request. ``ATTACH`` is optional for the front end that takes
an engine's first ready (nothing can precede it); ``MPClient`` always sends it, and declares
the engine dead if the marker has not come within its ready deadline (``ready_timeout_s``)
of the ``ATTACH``, on a timer: a lost ``ATTACH`` would otherwise leave it dropping every
reply, or waiting for one, for good.

An ``ATTACH`` whose ``integrity`` differs from the engine's own setting is refused: the marker
then carries ``refusal`` (why), is never sealed, ends nothing, and the engine drops every
message but another ``ATTACH`` until one it accepts: a misconfigured front end cannot take
down an engine that serves others. Likewise a front end whose message fails the engine's
integrity check (below) loses its session, not the engine: the engine ends the session as a
new ``ATTACH`` would (its requests dropped without outputs, deferred calls and unsent replies
dropped, the engine awake and idle), sends the *session's end* (below) and drops every
message but an ``ATTACH``; the next front end attaches as usual.

Socket options worth copying: ``ROUTER_HANDOVER=1`` (after an oversized frame libzmq drops
the engine's connection and the engine connects again under the same identity; without
handover the stale pipe keeps it unreachable) and ``SNDHWM=0`` on the ROUTER (one at its
high-water mark drops messages silently).

## Front end → engine

A message's first frame is its request-type byte followed by its msgpack payload (kinds in
the table below), so a transport can route on the first byte without decoding.

* ``ADD``: the request then gets outputs until one carries a ``finish_reason``. A request the
  engine refuses (bad sampling values, prompt too long, ...) gets one ``ERROR`` output whose
  ``error`` says why; so does a malformed ADD whose ``request_id`` can still be read, unless
  that id names a live request: then the malformed ADD is logged and dropped, and the live
  request streams on untouched (an ``ERROR`` under its id would finish it for the front end
  while it kept streaming). A well-formed ADD that reuses a live id ends the live request
  with ``ERROR`` instead (one id names one request).
* ``ABORT``: each live request named ends with an ``ABORT`` output; unknown or finished ids
  are no-ops. Aborts are applied in order with ADDs (never before their ADD), at the next
  step boundary.
* ``ATTACH``: ``AttachRequest``; answered by the attach marker (above). An engine serving
  several front ends (one address pair each; docs/runtime.md, "Several front ends") refuses
  one whose ``client_index`` is not its pair's position, and takes ``goodbye=True`` as the
  front end leaving: its work ends, no marker answers. Its ready handshake then carries
  ``front_end_timeout_s``: a front end silent that long is gone, so a front end sends a
  heartbeat (an empty ``ABORT``, a no-op to any engine) well within it.
* ``UTILITY``: exactly one reply, an ``EngineCoreOutputs`` whose ``utility_output`` carries
  the same ``call_id`` (chosen by the front end). ``failure_message`` is set when the call
  failed: an unknown method (the message lists the allowed ones), bad arguments, a result
  that cannot be sent. ``echo(x)`` returns ``x``.

Field meanings:

* ``client_index`` (both requests): the sending front end's rank (vLLM's several front ends).
  The engine records it but answers on its one output socket: a single front end sends 0.
* ``EngineCoreRequest.arrival_time``: the front end's timestamp in seconds, on any clock it
  uses consistently; must be finite. Waiting requests are ranked by ``priority`` (lower
  first), then ``arrival_time`` (earlier first), then the order the engine received them, so
  all 0.0 is first come, first served.
* ``SamplingParams``: a ``temperature`` below 1e-5 (0.0 included) samples greedily, as in
  vLLM; ``top_k`` 0 means no top-k filter; ``top_p`` is in (0, 1], and the most likely token
  always survives it. Out-of-range values end the request with ``ERROR``; a non-finite
  ``temperature`` or ``top_p`` (``inf``, ``nan``) is refused when decoded (malformed ADD,
  ``ERROR``) and when built (``ValueError`` naming the field).
* ``EngineCoreOutput.stop_reason``: the token id from ``stop_token_ids`` that ended the
  request with ``STOP`` (also the last of ``new_token_ids``); null when EOS, the length
  limit, an abort or an error ended it. The ``str`` form is reserved for stop strings, which
  this engine never sends.
* ``EngineCoreOutputs.timestamp``: the engine's ``time.monotonic()`` when it built the batch
  (0.0 on a rejection).

## Engine → front end

Every message is one ``EngineCoreOutputs`` with its aux frames, or the sentinel. The engine
sends a message's parts together, so read whole messages. A batch is one of:

* **Request outputs.** A token reaches the front end in one of two places. ``outputs`` holds
  ``EngineCoreOutput`` structs; the *stream columns* hold the commonest case (one new token,
  not finished, no cached-token count) as two flat lists of equal length: request
  ``stream_ids[i]`` got token ``stream_tokens[i]``. In steady decoding most tokens arrive
  *only* in the columns, so a front end that ignores them loses tokens. Expand a batch as
  ``EngineCoreOutputs.expanded()`` does: first one ``EngineCoreOutput(stream_ids[i],
  [stream_tokens[i]])`` per column entry, in column order, then ``outputs`` in order. A
  finishing output is always in ``outputs``, and ``finished_requests`` lists the ids this
  batch finished (null when none). ``scheduler_stats`` rides along on step batches.
* **A utility reply**: ``utility_output`` set.
* **A heartbeat**: an ``EngineCoreOutputs`` with nothing but ``engine_index`` and
  ``timestamp``. With a heartbeat interval set, the engine sends one as soon as its output
  socket connects (about when the ready goes out; there is no order across the two sockets)
  and again whenever it has sent nothing for that long. The interval is
  ``run_engine_core(heartbeat_interval_s=...)``, default None (no heartbeats), or
  ``enginewire engine --heartbeat-interval``, default 1.0 s. A front end with a liveness
  deadline asks for beats well inside it (``MPClient`` uses a quarter).
* **The session's end** (frame integrity only): an ``EngineCoreOutputs`` after the marker
  with ``refusal`` set (why: which check failed) and ``session`` (the front end's, null for
  one that never attached), nothing else but ``engine_index`` and ``timestamp``, sealed as
  usual (the next ``seq``). The engine has ended this front end's session and ignores it
  until it attaches again: everything it awaits is lost (``MPClient`` declares the engine
  dead with a ``ProtocolError`` saying why). Before the marker the same shape is a refused
  ``ATTACH``; a ``refusal`` is never a heartbeat.
* **A power notice** (an engine serving several front ends): an ``EngineCoreOutputs`` with
  ``power`` set (``PowerNotice``: the method and its reply's result) and nothing else but
  ``engine_index`` and ``timestamp``: another front end's ``sleep``, ``wake_up``,
  ``pause_scheduler`` or ``resume_scheduler`` succeeded, and this front end follows it as it
  would that reply. Request ids and call ids are the front end's own: each front end's
  requests, outputs and replies are its alone.
* **The sentinel**: one frame, exactly ``ENGINE_DEAD_SENTINEL``. The engine hit a fatal
  error; nothing follows and the process exits 1.

## Shutdown

There is no shutdown message. SIGTERM or SIGINT to the engine process stops it: live
requests end with an ``ABORT`` output (and in ``finished_requests``), deferred utility calls
(``sleep``/``pause_scheduler`` waiting for requests) get *no* reply (to their caller the
engine went away, which the front end learns from the exit), the last outputs are flushed
(for up to 4 s) and the process exits 0, *without* a sentinel. After that nothing
arrives: the front end learns that the engine is gone from the process's exit, or from
missed heartbeats, not from the wire. A signal during start-up exits 0 before any ready.

## Arrays and aux frames

torch tensors and numpy arrays, and registered Structs, travel as msgpack ext values:

| ext code | carries | ext body (msgpack) |
|---|---|---|
| 1 | torch tensor | ``[dtype, shape, data]`` |
| 2 | numpy array | ``[dtype, shape, data]`` |
| 3 | registered Struct (a utility result) | ``[name, value]`` |

* ``dtype``: for torch the dtype's name without ``torch.`` (``float32``, ``bfloat16``,
  ``int64``, ``bool``, ``float8_e4m3fn``, ...); for numpy its canonical ``dtype.str``: byte
  order, kind, item size and an optional datetime unit (``<f4``, ``|u1``, ``<M8[ns]``).
  Object, void and zero-size dtypes are refused: nothing is ever pickled.
* ``shape``: at most 64 sizes, each >= 0.
* ``data``: the array's bytes in C order, either inline (msgpack bin) or an int index into
  the message's aux frames; aux 0 is the frame right after the payload frame (on the input
  socket, after the type byte + payload frame). Senders here inline arrays under 256 bytes
  and put larger ones in aux frames, zero-copy; a receiver takes either form at any size. The
  byte count must equal the product of ``shape`` times the item size; a bool array's bytes
  are each 0 or 1.

Arrays may appear in the ``Any`` fields: ``UtilityRequest.args``, ``UtilityOutput.result``,
``EngineCoreRequest.tensors``. Decoding is strict: the typed decoders refuse every ext code
but these three with one exception, msgpack's standard timestamp (ext -1), which msgspec
decodes natively: inside an ``Any`` field it becomes a UTC ``datetime`` (and ``echo`` sends
it back as ext -1); a typed field refuses it. Bounds, checked before allocating: frames of at
most 256 MiB (libzmq drops the connection on a larger one), 64 frames a message, 2^20
prompt tokens, 65536 ids in an ABORT or a batch.

## Which parts belong to a message

Aux frames follow only a payload that refers to them (or, with frame integrity, the trailer
follows), and each side reads a message's further parts only then. Without integrity the
engine decodes a message's first frame alone; only if that fails and libzmq says more parts
follow does it read the rest of the ZMQ message and decode it all together (aux frames no
payload refers to are then ignored). So a part that no payload refers to is read as a
message of its own: a valid one is executed as such (the same peer could have sent it
alone, so this grants nothing), and a malformed one is rejected alone (with any parts after
it in its ZMQ message); nothing in later messages is lost. A rejected ADD whose
``request_id`` can be read gets an ``ERROR`` output, a rejected UTILITY whose ``call_id`` can
be read a failure reply; anything else is logged and dropped, and the engine serves on. The
engine never sends a part nothing refers to: a front end treats a message it cannot decode
as a broken engine (``MPClient`` declares it dead).

## Frame integrity (optional)

Off unless both ends are told (engine: ``run_engine_core(integrity=True)`` or ``enginewire
engine --integrity``). Then every message except the ready, ``ATTACH`` and the sentinel ends
with one 24-byte trailer frame::

    b"EWS1" | seq (u64 LE) | ack (u64 LE) | crc32 (u32 LE)

``seq`` counts this direction's messages from 1; ``ack`` is the last ``seq`` received the
other way. A session starts both counts afresh: the engine expects ``seq`` 1 from the first
message after an ``ATTACH`` and seals the attach marker with ``seq`` 1. The CRC-32 (zlib's)
runs over every frame before the trailer in order, then over the trailer's first 20 bytes.
It never covers the identity frame: the front end seals
``[type byte + payload, aux...]``, what the engine's DEALER receives, and adds the identity
in front when sending. A missing trailer, a bad CRC or an unexpected ``seq`` on the engine's
input ends that front end's session (the session's end, above), not the engine: one broken
link must not take down an engine that serves front ends one after another. The same
failure on the front end's side is its own to handle (``MPClient``: engine dead).

## Bounds (``protocol.codec.Limits``)

Every bound is checked before the memory it guards is held:

* ``max_frame_bytes`` (256 MiB): one frame; libzmq refuses a larger one from its header
  (``ZMQ_MAXMSGSIZE``) and drops the connection.
* ``max_frames`` (64): parts of one message; past it the rest are read one at a time and
  released as read, and the message is refused (an ADD's id, when readable, gets ``ERROR``).
  libzmq delivers a multi-part message only once all its parts have arrived, so until then
  it holds them, bounded per part by ``max_frame_bytes`` only.
* ``max_call_bytes`` (1 MiB): a UTILITY's payload (its arguments decode untyped); an ADD
  over it is screened from its msgpack headers before it is decoded.
* ``max_prompt_tokens`` (2**20) and ``max_stop_tokens`` (4096): an ADD's
  ``prompt_token_ids`` and ``stop_token_ids``, read from their array headers in a screened
  ADD (a smaller one cannot hold more elements than it has bytes).
* ``max_batch`` (2**16): an ABORT's ids (msgspec refuses a longer array from its header),
  and a batch's ``outputs`` + ``stream_ids``, ``stream_tokens`` and ``finished_requests``
  (screened from the headers of a batch over 64 KiB, on the front end).
* Nesting: msgpack nested deeper than the decoder recurses is a malformed message
  (``ProtocolError``), never a ``RecursionError``; an ADD's id is still read from its head.

## Versioning

Evolution rule (msgspec's schema-evolution guide): Structs are ``array_like`` (positional),
so fields are only ever *appended*, each new field has a default, and no field is removed,
renamed or re-typed. An older peer's shorter array still decodes; ``tests/protocol`` pins
the positional layout of every message so a reorder fails a test. A peer also ignores
trailing fields it does not know, which is harmless for a hint and not for data: a front
end that predates ``stream_ids``/``stream_tokens`` would silently drop most tokens. Only the
engine reports its version, so only the front end can refuse a mismatch, and it must refuse
any ``protocol_version`` it does not know, a newer one included, rather than decode it with
its own (older) types.

| version | change |
|---|---|
| 1 | initial layout; ``stream_ids``/``stream_tokens`` appended later in version 1 |
| 2 | the type byte leads the payload in one frame (version 1 sent it as its own frame) |
| 3 | ``ATTACH``, the attach marker (``EngineCoreOutputs.session``), a ready per connection |
| 4 | the session's end: ``refusal`` after the marker (with frame integrity) |

The stream columns came without a version bump, so a version-1 engine may send them to a
version-1 front end that drops them: one more reason to refuse any other version. Version 4
adds no field, only a meaning: a version-3 front end would take the session's end for a
heartbeat and learn of its broken link only from the ``ack`` its messages never get, so the
version moved and such a front end is refused at the handshake instead (a version-3
engine sent the sentinel and exited on a broken link).
"""

from __future__ import annotations

import enum
import math
import time
from typing import Annotated, Any

import msgspec

__all__ = [
    "ENGINE_DEAD_SENTINEL",
    "PROTOCOL_VERSION",
    "SESSION_BYTES",
    "AttachRequest",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "PowerNotice",
    "ReadyResponse",
    "RequestType",
    "SamplingParams",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityRequest",
]

# Bumped on any incompatible change; checked in the ready handshake.
PROTOCOL_VERSION = 4

# One frame, exactly these bytes. A msgpack-encoded message starts with an array header
# (0x90-0x9f, 0xdc, 0xdd), never with 'E' (0x45), so the two cannot be confused.
ENGINE_DEAD_SENTINEL = b"ENGINEWIRE_ENGINE_DEAD"


class RequestType(bytes, enum.Enum):
    """First byte of a client message's first frame; the payload follows it in that frame."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    ATTACH = b"\x04"


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # inf passes every range check (temperature >= 0) yet turns off top-k/top-p, and
        # nan fails them with a confusing message: a non-finite float is refused by name,
        # when built and when decoded (msgspec turns this ValueError into a decode error).
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name}={value!r}: must be a finite number")


class EngineCoreRequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = SamplingParams()
    arrival_time: float = 0.0
    priority: int = 0
    # Optional tensors (e.g. prompt embeddings) travel as out-of-band frames via the codec.
    tensors: dict[str, Any] | None = None
    client_index: int = 0
    # Which engine of a data-parallel client serves it (None: the least loaded); engines
    # ignore it.
    data_parallel_rank: int | None = None


class UtilityRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class PowerNotice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Another front end's power utility (sleep, wake_up, pause_scheduler, resume_scheduler)
    succeeded on an engine serving several front ends: ``method`` and the ``result`` its
    reply carried. The front end follows it as it would that reply (spec/client.py,
    ``PowerReply``), so its view of the engine's power state converges to the engine's."""

    method: str
    result: Any = None


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preempted: int = 0
    step_counter: int = 0


class EngineCoreOutputs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    finished_requests: list[str] | None = None
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    # Columnar form of the commonest output (one new token, not finished, no cached-token
    # count): request ``stream_ids[i]`` got token ``stream_tokens[i]``. Two flat lists cost a
    # fraction of one struct per request to build, encode and decode; a client hands callers
    # ``expanded()`` batches, so ``outputs`` is all they read, unless it was built with
    # ``columnar_outputs=True`` (docs/runtime.md), whose callers read the columns first. Every
    # engine core makes the columns, whatever its client: the option is presentation only.
    stream_ids: list[str] = []
    stream_tokens: list[int] = []
    # Set only on the attach marker: the session of the front end whose ATTACH it answers,
    # and why the engine refused that front end (then it ignores it until another ATTACH);
    # and on the session's end, which follows the marker: why the engine ended the session.
    session: bytes | None = None
    refusal: str | None = None
    # Set only on a power notice (an engine serving several front ends): nothing else but
    # ``engine_index`` and ``timestamp`` beside it.
    power: PowerNotice | None = None

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def expanded(self) -> EngineCoreOutputs:
        """This batch with the stream columns turned into ``outputs`` (itself if none)."""
        ids = self.stream_ids
        if not ids:
            return self
        toks = self.stream_tokens
        if len(toks) != len(ids):  # the decoder's post-check refuses this on the wire
            raise ValueError(f"{len(ids)} stream ids but {len(toks)} stream tokens")
        # Iterated in C (no Python frame per token): ``list`` of each 1-tuple is the
        # one-token list, the struct built by a direct call. 10 % under a comprehension.
        outputs = list(map(EngineCoreOutput, ids, map(list, zip(toks))))
        if self.outputs:
            outputs += self.outputs
        return msgspec.structs.replace(self, outputs=outputs, stream_ids=[], stream_tokens=[])


# A front end's session id: random, long enough that two front ends never pick the same one.
SESSION_BYTES = 16


class AttachRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A front end taking over the engine; the engine answers with the attach marker."""

    session: Annotated[bytes, msgspec.Meta(min_length=SESSION_BYTES, max_length=SESSION_BYTES)]
    # Whether this front end seals its messages (frame integrity): the engine refuses a
    # front end that does not match its own setting instead of failing on its first message.
    integrity: bool = False
    # The front end's rank: an engine serving several front ends refuses an ATTACH whose
    # index is not its channel's position (spec/session.py).
    client_index: int = 0
    # A front end leaving (its shutdown): the engine ends this session's work at once
    # (FRONT_END_GONE) instead of at its heartbeat deadline. No marker answers it.
    goodbye: bool = False


class ReadyResponse(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The engine's first message on the input socket: who it is and what it can hold."""

    protocol_version: int
    engine_index: int
    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    model: str
    device: str
    # Set when the engine ends a silent front end's session (``front_end_timeout_s``): the
    # front end then sends a heartbeat (an empty ABORT) well inside it (MPClient: a quarter).
    front_end_timeout_s: float | None = None
