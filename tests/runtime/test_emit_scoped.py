"""``EngineCoreProc._emit_scoped`` (several front ends): its per-id cache against the plain
split it replaced (find the scope's end, look the prefix up among the served sessions), over
random steps with sessions attaching, going and coming back between them."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from enginewire.protocol.messages import EngineCoreOutput, EngineCoreOutputs
from enginewire.runtime._engine_input import SCOPE_END, channel_prefix
from enginewire.runtime.engine_proc import EngineCoreProc


class Sink:
    def __init__(self) -> None:
        self.got: list[EngineCoreOutputs] = []

    def put(self, batch: EngineCoreOutputs, direct: bool) -> None:
        self.got.append(batch)


def reference(proc: Any, outputs: EngineCoreOutputs) -> dict[int, tuple[Any, ...]]:
    served = {channel_prefix(ch, proc._generations[ch]): ch
              for ch, session in enumerate(proc._sessions) if session is not None}
    parts: dict[int, tuple[list[Any], ...]] = {}

    def part(rid: str) -> tuple[Any, str] | tuple[None, None]:
        cut = rid.find(SCOPE_END) + 1
        ch = served.get(rid[:cut])
        if ch is None:
            return None, None
        return parts.setdefault(ch, ([], [], [], [])), rid[cut:]

    for rid, tok in zip(outputs.stream_ids, outputs.stream_tokens, strict=True):
        p, own = part(rid)
        if p is not None:
            p[0].append(own)
            p[1].append(tok)
    for out in outputs.outputs:
        p, own = part(out.request_id)
        if p is not None:
            p[2].append(msgspec.structs.replace(out, request_id=own))
    for rid in outputs.finished_requests or ():
        p, own = part(rid)
        if p is not None:
            p[3].append(own)
    return {ch: (ids, toks, outs, fin or None) for ch, (ids, toks, outs, fin) in parts.items()}


@pytest.mark.parametrize("seed", range(5))
def test_the_cached_split_equals_the_plain_one(seed: int) -> None:
    rng = random.Random(seed)
    k = 3
    proc: Any = EngineCoreProc.__new__(EngineCoreProc)  # only the split's state
    proc.engine_index, proc._overlap = 0, False
    proc._generations, proc._sessions = [1] * k, [b"s"] * k
    proc._split, proc._split_key = {}, None
    proc.outputs = [Sink() for _ in range(k)]
    # ids as the engine holds them: scoped by the generation that sent them
    live: list[str] = []
    for _step in range(60):
        if rng.random() < 0.15:  # a session goes, or a new one attaches
            ch = rng.randrange(k)
            if proc._sessions[ch] is None or rng.random() < 0.5:
                proc._generations[ch] += 1
                proc._sessions[ch] = b"s"
            else:
                proc._sessions[ch] = None
        for _ in range(rng.randrange(4)):
            ch = rng.randrange(k)
            live.append(channel_prefix(ch, proc._generations[ch]) + f"r{rng.randrange(9)}")
        ended = [r for r in live if rng.random() < 0.2]
        ids = [r for r in live if rng.random() < 0.8]
        outs = [EngineCoreOutput(r, [7]) for r in live if rng.random() < 0.2]
        batch = EngineCoreOutputs(engine_index=0, outputs=outs, stream_ids=ids,
                                  stream_tokens=list(range(len(ids))), timestamp=1.0,
                                  finished_requests=ended or None)
        want = reference(proc, batch)
        for sink in proc.outputs:
            sink.got.clear()
        proc._emit_scoped(batch)
        got = {ch: (b.stream_ids, b.stream_tokens, b.outputs, b.finished_requests)
               for ch, sink in enumerate(proc.outputs) for b in sink.got}
        assert all(len(sink.got) <= 1 for sink in proc.outputs)
        assert got == want
        live = [r for r in live if r not in ended]
