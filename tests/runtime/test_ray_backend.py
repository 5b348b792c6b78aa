"""The Ray backend (runtime/ray_backend.py): engines as Ray actors, on a local cluster and on a
two-node cluster on this host; an actor's death is an engine death; Ray missing says how to
install it. All traffic stays on 127.0.0.1: Ray nodes and engines bind there only, and the
tests check every address and listening socket of the Ray they run on."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from enginewire.protocol.messages import EngineCoreRequest, SamplingParams
from enginewire.runtime import ray_backend
from enginewire.runtime.config import EngineConfig
from enginewire.runtime.ray_backend import INSTALL_HINT, RayEngines, _check_reach, is_loopback
from enginewire.runtime.sync_mp_client import SyncMPClient
from enginewire.spec import EngineDeadError, EngineStartupError

os.environ.setdefault("ENGINEWIRE_ENGINE_THREADS", "1")  # spawned engines inherit it

NULL = EngineConfig(model="null")
BOUND_S = 30.0
DEATH_BOUND_S = 5.0  # an actor's death reaches its client's waits within this


def serve_one(client: SyncMPClient, rid: str, tokens: int = 4) -> list[int]:
    client.add_request(EngineCoreRequest(
        rid, [1, 2, 3], SamplingParams(max_tokens=tokens, ignore_eos=True)))
    got: list[int] = []
    deadline = time.monotonic() + BOUND_S
    while True:
        out = client.get_output(timeout=max(0.0, deadline - time.monotonic()))
        for o in out.outputs:
            assert o.request_id == rid
            got += o.new_token_ids
            if o.finished:
                assert len(got) == tokens
                return got


def snapshot() -> tuple[int, set[str]]:
    return len(os.listdir("/proc/self/fd")), {t.name for t in threading.enumerate()}


def gone(pid: int, bound: float = BOUND_S) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``bound``."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def assert_on_loopback(ray: Any, engines: RayEngines) -> None:
    """Every address of the Ray this test runs on is loopback: each node (as the GCS knows
    it), the GCS, the driver, each engine actor (as it sees itself), and every inet socket
    that this process and its descendants (Ray's GCS, raylets, agents, workers; the engines)
    listen on or talk over."""
    addresses = {f"node {n['NodeManagerAddress']}" for n in ray.nodes() if n["Alive"]}
    addresses.add(f"gcs {ray.get_runtime_context().gcs_address}")
    addresses.add(f"driver {ray.util.get_node_ip_address()}")
    for i in range(engines.n):
        _, ip, _ = ray.get(engines.actor(i).where.remote(), timeout=BOUND_S)
        addresses.add(f"actor {i} {ip}")
    off = sorted(a for a in addresses if not is_loopback(a.rsplit(" ", 1)[1]))
    assert not off, f"Ray addresses off loopback: {off}"
    me = psutil.Process()
    sockets = []
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            name = proc.name()
            sockets += [(name, c) for c in proc.net_connections(kind="inet")]
    assert any(c.status == psutil.CONN_LISTEN for _, c in sockets), "no Ray socket found"
    off = sorted({f"{name}: {c.status} {c.laddr} -> {c.raddr or '-'}" for name, c in sockets
                  if not is_loopback(c.laddr.ip) or (c.raddr and not is_loopback(c.raddr.ip))})
    assert not off, f"sockets off loopback: {off}"


def client_on(engines: RayEngines, index: int) -> SyncMPClient:
    return SyncMPClient(NULL, transport="tcp", engine_launcher=engines.launcher(index),
                        engine_index=index, ready_timeout_s=BOUND_S)


def test_missing_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(EngineStartupError, match=re.escape(INSTALL_HINT)) as err:
        RayEngines(1)
    assert isinstance(err.value.__cause__, ImportError)


def test_an_engine_on_another_host_gets_no_loopback_no_ipc_no_plaintext() -> None:
    curve = object()  # any key config: only its presence is checked
    here, there = "10.0.0.1", "10.0.0.2"
    ok = {"input_address": "tcp://10.0.0.1:5000", "output_address": "tcp://10.0.0.1:5001",
          "curve": curve}
    _check_reach(ok, there, here, "e")
    _check_reach({**ok, "input_address": "ipc:///tmp/x", "curve": None}, here, here, "e")
    for bad, why in (({"input_address": "ipc:///tmp/x"}, "ipc does not cross hosts"),
                     ({"output_address": "tcp://127.0.0.1:5001"}, "loopback"),
                     ({"curve": None}, "plain tcp is refused")):
        with pytest.raises(EngineStartupError, match=why):
            _check_reach({**ok, **bad}, there, here, "e")


def test_a_local_ray_off_loopback_is_refused_and_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Should Ray ever put its node on the host's address despite us (the single-host mode
    that keeps it on 127.0.0.1 is not a public option), the client refuses to use it."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("needs Ray not initialized here (RayEngines starts its own)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_backend, "_loopback_node", lambda ray: contextlib.nullcontext())
    sigterm = signal.getsignal(signal.SIGTERM)
    with pytest.raises(EngineStartupError, match=r"came up off loopback \(.*node "):
        RayEngines(1, ready_timeout_s=BOUND_S)
    assert not ray.is_initialized()
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_local_cluster_serves_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no cluster to join, the client starts a local Ray (one start for these checks,
    not one each): it serves, a start-up failure's reason crosses it, it is reachable from
    this host only (on loopback: ray.init alone turned its 127.0.0.1 into this host's network
    address, where every Ray service listened on all interfaces), and it leaves nothing."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("needs Ray not initialized here (RayEngines starts its own)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before_ray = snapshot()
    sigterm = signal.getsignal(signal.SIGTERM)
    engines = RayEngines(1, ready_timeout_s=BOUND_S)
    try:
        assert ray.is_initialized()
        assert engines.node_of(0) == ray.get_runtime_context().get_node_id()
        actor_pid = engines._where[0][2]
        before = snapshot()
        client = client_on(engines, 0)
        engine_pid = client.engine_pid
        assert engine_pid is not None and engine_pid != actor_pid
        assert client.resources.proc.local is False
        assert len(serve_one(client, "r0")) == 4
        client.shutdown()
        assert gone(engine_pid), "the engine outlived its client's shutdown"
        fds, threads = snapshot()
        assert threads <= before[1], f"threads left: {threads - before[1]}"
        assert fds <= before[0], f"{fds - before[0]} file descriptors left"

        # A start-up failure's reason crosses Ray: the client names it, as for a local spawn.
        with pytest.raises(EngineStartupError, match="unknown model"):
            SyncMPClient(EngineConfig(model="no-such-model"), transport="tcp",
                         engine_launcher=engines.launcher(0), ready_timeout_s=BOUND_S)
        # ... and the actor launches again once its engine is gone.
        again = client_on(engines, 0)
        serve_one(again, "r1")
        assert_on_loopback(ray, engines)  # an engine and its tcp channel up too
        again.shutdown()
        assert snapshot()[0] <= before[0], "the failed launch left file descriptors"
    finally:
        engines.close()
    engines.close()  # idempotent
    assert not ray.is_initialized()
    assert signal.getsignal(signal.SIGTERM) is sigterm  # ray.init's handler is not left
    assert gone(actor_pid), "the actor outlived close()"
    # Threads only: Ray's driver keeps a dozen fds of its own after ray.shutdown() (event
    # loops, its session's log files), with or without RayEngines.
    threads = snapshot()[1]
    assert threads <= before_ray[1], f"threads left: {threads - before_ray[1]}"


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """Two Ray nodes on this host, both on 127.0.0.1, each with a sliver of CPU."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("needs Ray not initialized here")
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces it, shutdown leaves it
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        with pytest.MonkeyPatch.context() as mp:
            # Ray turns a loopback bootstrap address into this host's own IP before it
            # connects (services.resolve_ip_for_localhost), where nothing listens: its
            # single-host mode keeps the driver on 127.0.0.1 too.
            mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
            ray.init(address=cluster.address, _node_ip_address="127.0.0.1",
                     logging_level=logging.WARNING, log_to_driver=False)
        try:
            cluster.wait_for_nodes(BOUND_S)
            yield ray
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def test_strict_spread_places_engines_apart_and_one_death_spares_the_other(
        two_nodes: Any) -> None:
    ray = two_nodes
    engines = RayEngines(2, strategy="STRICT_SPREAD", ready_timeout_s=BOUND_S)
    clients: list[SyncMPClient] = []
    try:
        assert engines.node_of(0) != engines.node_of(1)
        clients = [client_on(engines, i) for i in range(2)]
        for i, client in enumerate(clients):
            serve_one(client, f"warm{i}")
        assert_on_loopback(ray, engines)
        dead_pid = clients[0].engine_pid
        assert dead_pid is not None

        t0 = time.monotonic()
        ray.kill(engines.actor(0))
        with pytest.raises(EngineDeadError) as err:
            clients[0].get_output(timeout=BOUND_S)
        assert "SIGKILL" in str(err.value.__cause__)  # ACTOR_DIED_EXITCODE
        assert "ray.kill" in str(clients[0].resources.proc.exit_reason)
        took = time.monotonic() - t0
        assert took < DEATH_BOUND_S, f"the actor's death took {took:.2f} s to be seen"
        assert clients[0].resources.proc.exitcode is not None
        assert gone(dead_pid), "the engine outlived its actor"

        assert len(serve_one(clients[1], "after")) == 4  # the other engine serves on
    finally:
        for client in clients:
            client.shutdown()
        engines.close()
    assert ray.is_initialized()  # the caller's Ray: not RayEngines' to shut down


def test_an_unplaceable_group_is_a_startup_error_and_is_removed(two_nodes: Any) -> None:
    ray = two_nodes
    with pytest.raises(EngineStartupError, match="could not place 3 engine bundle"):
        RayEngines(3, strategy="STRICT_SPREAD", ready_timeout_s=1.0)  # two nodes only
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_data_parallel_client_on_two_nodes(two_nodes: Any, kind: str) -> None:
    """data_parallel_backend="ray": one engine per node (STRICT_SPREAD), requests spread over
    both; an actor's death ends only its engine's request (ERROR), the other serves on, and
    with restart_dead_engines a new actor rejoins under the same index."""
    import asyncio

    from enginewire.protocol.messages import FinishReason
    from enginewire.runtime import make_client
    from enginewire.spec import MembershipState

    ray = two_nodes
    config = EngineConfig(model="null", data_parallel_size=2, data_parallel_backend="ray",
                          null_step_delay_s=0.005)
    loop = asyncio.new_event_loop() if kind == "async" else None

    def call(name: str, *args: Any, **kw: Any) -> Any:
        if loop is None:
            return getattr(client, name)(*args, **kw)
        return loop.run_until_complete(getattr(client, f"{name}_async")(*args, **kw))

    def finish(rids: set[str]) -> dict[str, tuple[Any, int]]:
        done: dict[str, tuple[Any, int]] = {}
        deadline = time.monotonic() + BOUND_S
        while set(done) < rids:
            assert time.monotonic() < deadline, rids - set(done)
            batch = call("get_output", timeout=0.5)
            for o in batch.outputs:
                if o.finished:
                    done[o.request_id] = (o.finish_reason, batch.engine_index)
        return done

    client = make_client(config, multiprocess=True, asyncio=loop is not None,
                         restart_dead_engines=True, ray_placement_strategy="STRICT_SPREAD",
                         ready_timeout_s=BOUND_S)
    try:
        placement = client._placement
        assert placement.node_of(0) != placement.node_of(1)
        for i in range(4):
            call("add_request", EngineCoreRequest(f"s{i}", [1, 2], SamplingParams(max_tokens=3)))
        assert sorted(e for _, e in finish({f"s{i}" for i in range(4)}).values()) == [0, 0, 1, 1]
        call("add_request", EngineCoreRequest("doomed", [1], SamplingParams(max_tokens=10_000),
                                              data_parallel_rank=1))
        call("add_request", EngineCoreRequest("kept", [1], SamplingParams(max_tokens=20),
                                              data_parallel_rank=0))
        old = client.engine_client(1).engine_pid
        ray.kill(placement.actor(1))
        assert finish({"doomed", "kept"}) == {"doomed": (FinishReason.ERROR, 1),
                                              "kept": (FinishReason.LENGTH, 0)}
        deadline = time.monotonic() + BOUND_S
        while client.engines[1] is not MembershipState.SERVING:
            assert time.monotonic() < deadline, client.engines
            call("get_output", timeout=0.1)
        assert client.engine_client(1).engine_pid != old
        assert call("call_utility_all", "echo", 5) == [5, 5]
    finally:
        if loop is None:
            client.shutdown()
        else:
            loop.run_until_complete(client.shutdown_async())
            loop.close()
    assert ray.is_initialized()  # the caller's Ray stays up


def test_a_ray_client_scales_up_and_down_and_an_index_rejoins(two_nodes: Any) -> None:
    """Issue 46 on Ray: every engine has a placement group of its own; a joiner's is made
    for it and a leaver's removed with it (its resources back to the cluster), an index of
    the first set included, which rejoins with a new actor and group, on a channel of its
    own."""
    from enginewire.protocol.messages import FinishReason
    from enginewire.runtime import make_client
    from enginewire.spec import MembershipState

    ray = two_nodes
    config = EngineConfig(model="null", data_parallel_size=2, data_parallel_backend="ray")

    def serve(rid: str, rank: int) -> None:
        client.add_request(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=3),
                                             data_parallel_rank=rank))
        deadline = time.monotonic() + BOUND_S
        while True:
            assert time.monotonic() < deadline, rid
            batch = client.get_output(timeout=0.5)
            done = [o for o in batch.outputs if o.request_id == rid and o.finished]
            if done:
                assert done[0].finish_reason is FinishReason.LENGTH
                assert batch.engine_index == rank
                return

    def groups() -> dict[str, str]:
        return {k: v["state"] for k, v in ray.util.placement_group_table().items()}

    client = make_client(config, multiprocess=True, asyncio=False, ready_timeout_s=BOUND_S)
    try:
        placement = client._placement
        before = groups()
        client.scale(3)
        assert client.engines == dict.fromkeys(range(3), MembershipState.SERVING)
        serve("on2", 2)
        added = {k for k, v in groups().items() if v == "CREATED"} - {
            k for k, v in before.items() if v == "CREATED"}
        assert len(added) == 1  # the joiner's own group
        pid2 = client.engine_pids[2]
        client.scale(2)
        assert client.engines == dict.fromkeys(range(2), MembershipState.SERVING)
        assert gone(pid2), "the leaver's engine outlived its removal"
        assert all(groups()[k] == "REMOVED" for k in added)
        old_actor, old_pid = placement.actor(1), client.engine_pids[1]
        first = {k for k, v in groups().items() if v == "CREATED"}
        assert len(first) == 2  # one group per engine of the first set
        cpus = ray.available_resources().get("CPU", 0.0)
        client.scale(1)
        assert gone(old_pid)
        assert len([k for k in first if groups()[k] == "REMOVED"]) == 1
        deadline = time.monotonic() + BOUND_S  # its bundle's CPU is the cluster's again
        while ray.available_resources().get("CPU", 0.0) <= cpus:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.05)
        client.scale(2)  # index 1 again: a new actor in a new group of its own
        assert placement.actor(1) is not old_actor and client.engine_pids[1] != old_pid
        serve("on1", 1)
    finally:
        client.shutdown()
    assert all(state == "REMOVED" for state in groups().values())
