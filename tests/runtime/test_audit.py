"""The ``audit_resources`` utility and the oracle's reading of it (issue 30, "resources at
quiescence"): a leak changes no output, so only a recount of the engine's books shows it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.protocol.records import ResourceAudit
from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.spec import EngineState
from enginewire.testing.oracle import Oracle, OracleViolation, audit_violations

TINY = EngineConfig(model="tiny", enable_prefix_caching=True)


def _drive(client: Any) -> None:
    """Adds (some sharing a prefix), an abort mid-flight, and everything run to its end."""
    live = set()
    for i in range(6):
        rid = f"r{i}"
        client.add_request(EngineCoreRequest(rid, [1, 2, 3, 4] * (i + 1),
                                             SamplingParams(max_tokens=6, ignore_eos=True)))
        live.add(rid)
    client.get_output(timeout=30)
    client.abort_requests(["r1", "r3", "unknown", "r1"])
    while live:
        for out in client.get_output(timeout=30).outputs:
            if out.finished:
                live.discard(out.request_id)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_quiet_engine_balances_its_books_on_every_client(multiprocess: bool) -> None:
    with make_client(TINY, multiprocess=multiprocess, asyncio=False) as client:
        busy = client.call_utility("audit_resources")
        assert audit_violations(busy, quiet=False) == []
        _drive(client)
        audit = client.call_utility("audit_resources")
        # A typed record on both clients: in process as returned, over the wire rebuilt.
        assert isinstance(audit, ResourceAudit) and audit.state is EngineState.IDLE
        assert audit_violations(audit, quiet=True, asleep_tags=frozenset()) == [], audit
        assert audit.kv.cached > 0  # the prefix cache holds blocks, all of them free
        client.sleep(1)
        asleep = client.call_utility("audit_resources")
        assert asleep.state is EngineState.SLEEPING
        assert audit_violations(asleep, quiet=True,
                                asleep_tags=frozenset({"weights", "kv_cache"})) == []
        # The model and the engine disagree about what is asleep: that is a finding too.
        assert audit_violations(asleep, quiet=True, asleep_tags=frozenset())


def test_the_async_client_and_the_data_parallel_one_audit_too() -> None:
    import asyncio

    async def run() -> None:
        async with make_client(EngineConfig(model="null"), multiprocess=True,
                               asyncio=True) as client:
            audit = await client.call_utility_async("audit_resources")
            assert audit_violations(audit, quiet=True) == []

    asyncio.run(run())
    dp = EngineConfig(model="null", data_parallel_size=2)
    with make_client(dp, multiprocess=True, asyncio=False) as client:
        audits = client.call_utility("audit_resources")  # one per engine, in index order
        assert isinstance(audits, list) and len(audits) == 2
        assert all(audit_violations(a, quiet=True) == [] for a in audits)


def test_each_broken_count_is_named() -> None:
    with make_client(EngineConfig(model="null"), multiprocess=False, asyncio=False) as client:
        clean = client.call_utility("audit_resources")
    assert audit_violations(clean, quiet=True) == []

    def broken(part: str, key: str, value: int, quiet: bool = True) -> list[str]:
        return audit_violations(_with(clean, part, **{key: value}), quiet=quiet)

    assert any("negative_refs = 1" in p for p in broken("kv", "negative_refs", 1, quiet=False))
    assert any("unaccounted = 2" in p for p in broken("kv", "unaccounted", 2, quiet=False))
    assert any("running_unknown" in p for p in broken("scheduler", "running_unknown", 1))
    assert any("deferred_replies = 1" in p for p in broken("", "deferred_replies", 1))
    leak = broken("kv", "num_free_blocks", clean.kv.num_blocks - 3)
    assert any("a leak" in p for p in leak) and any("free +" in p for p in leak)
    # Live work holds blocks and queues: not a finding until the engine is quiet.
    busy = _with(clean, "scheduler", live=1, running=1)
    assert audit_violations(busy, quiet=False) == []
    assert audit_violations(busy, quiet=True)
    oracle = Oracle(exact_tokens=False)
    with pytest.raises(OracleViolation, match="resource accounting is off"):
        oracle.check_audit(busy)
    # Anything but the record (an untyped map, say) is a finding, not a crash.
    assert audit_violations({"kv": {}}, quiet=True)  # type: ignore[arg-type]


def _with(audit: ResourceAudit, part: str, **changes: int) -> ResourceAudit:
    """``audit`` with ``changes`` to one of its parts ("": the audit's own counts)."""
    if not part:
        return msgspec.structs.replace(audit, **changes)
    return msgspec.structs.replace(
        audit, **{part: msgspec.structs.replace(getattr(audit, part), **changes)})


_LEAKY = """
import json
from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime import make_client
from enginewire.runtime.config import EngineConfig
from enginewire.testing import mutants
from enginewire.testing.oracle import audit_violations

mutants.apply("abort_leaks_kv_blocks")  # here, and in the engine process it starts
# Long enough that the abort lands before the request could end by itself.
config = EngineConfig(model="null", max_model_len=2048)
client = make_client(config, multiprocess={mp}, asyncio=False)
client.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=2000,
                                                                    ignore_eos=True)))
client.get_output(timeout=30)
client.abort_requests(["a"])
while not any(o.finished for o in client.get_output(timeout=30).outputs):
    pass
print(json.dumps(audit_violations(client.call_utility("audit_resources"), quiet=True)))
client.shutdown()
"""


@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_seeded_kv_leak_on_abort_shows_only_in_the_audit(multiprocess: bool) -> None:
    done = subprocess.run([sys.executable, "-c", _LEAKY.format(mp=multiprocess)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    problems = json.loads(done.stdout.strip().splitlines()[-1])
    assert any("a leak" in p for p in problems), problems
