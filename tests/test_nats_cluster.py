"""NATS as a cluster, against real `nats-server` processes on loopback: `--nats-url` lists,
replicated streams and buckets (created, scaled up, refused with a reason), a client that
rides out a stream leader's crash and a frozen node, and the settings that ask for them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.errors import ServiceUnavailableError
from typer.testing import CliRunner

from protocol import subjects, topology
from protocol.errors import Unavailable
from protocol.jobs import OptimStepJob, Outcome, encode_outcome
from twinkle_async.bus import TRANSIENT_ERRORS, Bus, TopologyError, ensure_topology
from twinkle_async.cli import app
from twinkle_async.futures import FutureStore
from twinkle_async.nats_server import NatsCluster, NatsServer
from twinkle_async.settings import BusSettings
from workers.__main__ import parse_args
from workers.bus import WorkerBus

runner = CliRunner(env={"COLUMNS": "300"})  # one line per error message


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path_factory.mktemp("nats-cluster"), 3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _streams() -> list[str]:
    buckets = [f"KV_{spec.name}" for spec in topology.buckets(0.0)]
    return [subjects.STREAM_OPS, subjects.STREAM_SAMPLE, subjects.STREAM_METRICS, *buckets]


async def _replicas(url: str) -> dict[str, int]:
    nc = await nats.connect(servers=topology.nats_servers(url))
    try:
        js = nc.jetstream(timeout=10)
        return {name: (await js.stream_info(name)).config.num_replicas or 1 for name in _streams()}
    finally:
        await nc.close()


def _bus(url: str, replicas: int, **settings: float) -> Bus:
    return Bus(BusSettings(nats_url=url, nats_replicas=replicas, **settings))  # type: ignore[arg-type]


async def _lead(bus: Bus, stream: str, server_name: str) -> None:
    """Move `stream`'s leadership to node `server_name` (a step-down naming its successor)."""
    assert bus.nc is not None and bus.js is not None
    body = json.dumps({"placement": {"preferred": server_name}}).encode()
    for _ in range(50):
        info = await bus.js.stream_info(stream)
        if info.cluster is not None and info.cluster.leader == server_name:
            return
        await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=10)
        await asyncio.sleep(0.2)
    raise AssertionError(f"{stream} did not move to {server_name}")


async def _restarted(node: NatsServer) -> None:
    await asyncio.to_thread(node.start)


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        (
            "nats://10.0.0.1:4222, nats://10.0.0.2:4223,tls://n3.example:4222",
            ["nats://10.0.0.1:4222", "nats://10.0.0.2:4223", "tls://n3.example:4222"],
        ),
        ("127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        ("nats://user:pw@127.0.0.1:4222", ["nats://user:pw@127.0.0.1:4222"]),
    ],
)
def test_a_nats_url_may_list_a_clusters_nodes(url: str, servers: list[str]) -> None:
    assert topology.nats_servers(url) == servers


@pytest.mark.parametrize(
    "url",
    [
        "",
        ",",
        "nats://127.0.0.1:4222,",
        "http://127.0.0.1:4222",
        "nats://:4222",
        "nats://127.0.0.1:99999",
        "nats://127.0.0.1:-1",
        "nats://127.0.0.1:port",
        "nats://127.0.0.1:4222/path",
        "nats://127.0.0.1:",
        "nats://a:1 nats://b:2",
    ],
)
def test_a_malformed_nats_url_is_refused_naming_the_entry(url: str) -> None:
    with pytest.raises(ValueError, match="is not nats://HOST:PORT"):
        topology.nats_servers(url)


@pytest.mark.parametrize("replicas", [0, -1, 6, 10**9])
def test_replicas_outside_jetstreams_range_are_refused(replicas: int) -> None:
    with pytest.raises(ValueError, match="1 to 5"):
        topology.check_replicas(replicas)


def test_command_lines_check_the_url_and_the_replicas() -> None:
    bad_url = runner.invoke(app, ["gateway", "--nats-url", "nats://a:1,,nats://b:2"])
    assert bad_url.exit_code == 2 and "not nats://HOST:PORT" in bad_url.output
    too_many = runner.invoke(app, ["gateway", "--nats-replicas", "6"])
    assert too_many.exit_code == 2
    both = runner.invoke(
        app, ["up", "--base-model", "m", "--nats-url", "nats://a:1", "--nats-cluster", "3"]
    )
    assert both.exit_code != 0 and "not both" in both.output
    short = runner.invoke(
        app, ["up", "--base-model", "m", "--nats-cluster", "3", "--nats-replicas", "5"]
    )
    assert short.exit_code != 0 and "needs at least that many nodes" in short.output
    with pytest.raises(Exception, match="not nats://HOST:PORT"):
        parse_args(["--base-model", "m", "--nats-url", "nats://a:1,"])


def test_the_lease_default_outlasts_a_cluster_election() -> None:
    one = parse_args(["--base-model", "m"])
    replicated = parse_args(["--base-model", "m", "--nats-replicas", "3"])
    explicit = parse_args(["--base-model", "m", "--nats-replicas", "3", "--lease-s", "5"])
    assert one.lease_s == 10.0 and replicated.lease_s == 30.0 and explicit.lease_s == 5.0
    assert replicated.lease_renew_s == replicated.lease_s / 4


def test_replicas_on_one_server_are_refused_at_once(nats_server: NatsServer) -> None:
    async def main() -> None:
        bus = _bus(nats_server.url, 3, connect_wait_s=30.0)
        started = time.monotonic()
        with pytest.raises(TopologyError, match="not clustered"):
            await bus.connect()
        assert time.monotonic() - started < 10.0  # no retry cures it
        await bus.close()

    asyncio.run(main())


def test_every_stream_and_bucket_is_replicated_and_scaled_up(nats_cluster: NatsCluster) -> None:
    async def main() -> None:
        first = _bus(nats_cluster.url, 1)
        await first.connect()
        await first.close()
        assert set((await _replicas(nats_cluster.url)).values()) == {1}

        scaled = _bus(nats_cluster.url, 3)
        await scaled.connect()
        await scaled.close()
        assert set((await _replicas(nats_cluster.url)).values()) == {3}

        # a process asking for fewer keeps what is there
        again = _bus(nats_cluster.url, 1)
        await again.connect()
        await again.close()
        assert set((await _replicas(nats_cluster.url)).values()) == {3}

        # a worker's durable consumer has as many copies as its stream
        worker = WorkerBus(nats_cluster.url)
        await worker.connect()

        async def ignore(msg: object) -> None:
            return None

        task = await worker.consume(
            subjects.STREAM_OPS, f"{subjects.OPS_PREFIX}.p.0", "ops-test-0", ignore
        )
        assert worker.js is not None
        info = await worker.js.consumer_info(subjects.STREAM_OPS, "ops-test-0")
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        task.cancel()
        await worker.close()

    asyncio.run(main())


async def test_jetstream_temporarily_unavailable_is_tried_again() -> None:
    """A node whose JetStream is not ready (just restarted, or without a meta leader) answers
    503 / 10008 to the setup: tried again like a timeout, not a refusal that ends the process
    (seen once in CI, as `TopologyError: ... temporarily unavailable`)."""

    class Starting:
        async def add_stream(self, config: object) -> None:
            raise ServiceUnavailableError(
                code=503, err_code=10008, description="JetStream system temporarily unavailable"
            )

    with pytest.raises(ServiceUnavailableError) as raised:
        await ensure_topology(Starting(), BusSettings(nats_replicas=3))  # type: ignore[arg-type]
    assert isinstance(raised.value, TRANSIENT_ERRORS)


def test_more_replicas_than_nodes_is_refused_with_the_reason(nats_cluster: NatsCluster) -> None:
    async def main() -> None:
        bus = _bus(nats_cluster.url, 5, connect_wait_s=3.0)
        with pytest.raises(TopologyError, match="fewer NATS cluster nodes up than the 5"):
            await bus.connect()
        await bus.close()

    asyncio.run(main())


def test_a_client_whose_first_server_is_down_connects_to_another(
    nats_cluster: NatsCluster,
) -> None:
    down = nats_cluster.nodes[0]
    url = nats_cluster.url  # the down node first

    async def main() -> None:
        first = _bus(url, 3, connect_wait_s=30.0)
        await first.connect()  # the topology, while three nodes can hold its replicas
        await first.close()
        down.kill()
        try:
            for _ in range(3):  # nats-py shuffles the list: the dead one comes first sometimes
                bus = _bus(url, 3, connect_wait_s=30.0)
                await bus.connect()
                assert bus.nc is not None and bus.nc.connected_url is not None
                assert bus.nc.connected_url.port != down.port
                await bus.close()
                worker = WorkerBus(url)
                await worker.connect(retry_s=30.0)
                await worker.close()
        finally:
            await _restarted(down)

    asyncio.run(main())


def test_writes_ride_out_the_crash_of_a_stream_leader(nats_cluster: NatsCluster) -> None:
    """A publish and KV writes during the election that follows the SIGKILL of the node leading
    the ops stream and the futures bucket: retried, not failed (they raised
    `NoStreamResponseError`, which no retry caught)."""

    async def main() -> None:
        bus = _bus(nats_cluster.url, 3, retry_s=30.0)
        await bus.connect()
        worker = WorkerBus(nats_cluster.url)
        await worker.connect(retry_s=30.0)
        assert bus.js is not None
        info = await bus.js.stream_info(subjects.STREAM_OPS)
        assert info.cluster is not None and info.cluster.leader
        leader = nats_cluster.node(info.cluster.leader)
        await _lead(bus, f"KV_{subjects.BUCKET_FUTURES}", leader.name)  # one crash hits both
        before = info.state.messages
        leader.kill()
        killed = time.monotonic()
        try:
            # writes all through the election (4-9 s): each must land
            seq = 0
            while time.monotonic() - killed < 12.0:
                seq += 1
                job = OptimStepJob(
                    request_id=f"r-{seq}", model_id="m-election", tenant_id="t", seq_id=seq
                )
                await bus.publish_job("p", job)
                await bus.put(subjects.BUCKET_FUTURES, f"g-{seq}", b"pending")
                await worker.put(subjects.BUCKET_FUTURES, f"w-{seq}", b"done")
                await asyncio.sleep(0.05)
            assert await bus.get(subjects.BUCKET_FUTURES, f"w-{seq}") == b"done"
            after = await bus.js.stream_info(subjects.STREAM_OPS)
            assert after.state.messages == before + seq
            assert after.cluster is not None and after.cluster.leader != leader.name
        finally:
            await bus.close()
            await worker.close()
            await _restarted(leader)

    asyncio.run(main())


def test_a_frozen_node_is_left_within_seconds(nats_cluster: NatsCluster) -> None:
    """A host that stops answering without closing its sockets (SIGSTOP): the client's pings go
    unanswered, it drops the connection and moves to another node in seconds, where nats-py's
    defaults (2 minutes x 2 pings) took minutes."""

    async def main() -> None:
        bus = _bus(nats_cluster.url, 3, retry_s=30.0)
        await bus.connect()
        assert bus.nc is not None and bus.nc.connected_url is not None
        port = bus.nc.connected_url.port
        frozen = next(node for node in nats_cluster.nodes if node.port == port)
        assert frozen.process is not None
        os.kill(frozen.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        try:

            def on_frozen() -> bool:
                url = bus.nc.connected_url if bus.nc is not None else None
                connected = bus.nc is not None and bus.nc.is_connected
                return connected and url is not None and url.port == port

            while on_frozen():  # until the client drops it (or has moved already)
                assert time.monotonic() - started < 20.0, "still on the frozen node"
                await asyncio.sleep(0.1)
            noticed_s = time.monotonic() - started
            # a reconnect may try the frozen node first: its connect timeout (5 s) runs out
            while not bus.nc.is_connected or bus.nc.connected_url.port == port:
                assert time.monotonic() - started < 30.0, "never moved to another node"
                await asyncio.sleep(0.1)
            # and it works from there (the frozen node's streams elect other leaders)
            await bus.put(subjects.BUCKET_SESSIONS, "frozen-test", b"x")
            assert await bus.get(subjects.BUCKET_SESSIONS, "frozen-test") == b"x"
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
            await bus.close()
        wait_s = topology.PING_INTERVAL_S * (topology.MAX_OUTSTANDING_PINGS + 2)
        assert noticed_s < wait_s, noticed_s

    asyncio.run(main())


def test_a_workers_write_in_flight_when_its_node_dies_is_retried_at_once(
    nats_cluster: NatsCluster,
) -> None:
    """The node a worker is connected to dies with a KV write in flight (frozen first, so the
    write is surely waiting, then SIGKILLed): the write is sent again through another node as
    soon as the client reconnects, not after the request's 10 s timeout."""

    async def main() -> None:
        bus = _bus(nats_cluster.url, 3, retry_s=30.0)
        await bus.connect()  # the topology
        worker = WorkerBus(nats_cluster.url)
        await worker.connect(retry_s=30.0)
        untested: list[str] = []
        try:
            for attempt in range(3):
                await _settled(bus, f"KV_{subjects.BUCKET_FUTURES}")
                if (
                    why := await _write_through_a_dying_node(bus, worker, nats_cluster, attempt)
                ) is None:
                    return
                untested.append(why)
            raise AssertionError(f"no try had a write in flight at the kill: {untested}")
        finally:
            await bus.close()
            await worker.close()

    asyncio.run(main())


async def _settled(bus: Bus, stream: str) -> None:
    """Wait until `stream` has a leader and every replica is current and online (a node the
    test before froze or killed rejoins its routes and catches up for a while)."""
    assert bus.js is not None
    for _ in range(100):
        info = await bus.js.stream_info(stream)
        replicas = info.cluster.replicas if info.cluster is not None else None
        if info.cluster is not None and info.cluster.leader and replicas is not None:
            if len(replicas) == 2 and all(r.current and not r.offline for r in replicas):
                return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{stream} did not settle: {info.cluster}")


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


async def _write_through_a_dying_node(
    bus: Bus, worker: WorkerBus, cluster: NatsCluster, attempt: int
) -> str | None:
    """One try: None when the property was tested, else why this try could not test it (the
    worker moved to another node before the freeze and wrote there at once, which a node still
    settling may cause)."""
    assert worker.nc is not None
    for _ in range(5):  # a reconnect meanwhile (a node still settling) moves the worker
        assert worker.nc.connected_url is not None
        port = worker.nc.connected_url.port
        node = next(n for n in cluster.nodes if n.port == port)
        other = next(n for n in cluster.nodes if n.port != port)
        # only the connection is lost, not the bucket's leader (no election to wait out)
        await _lead(bus, f"KV_{subjects.BUCKET_FUTURES}", other.name)
        if worker.nc.is_connected and worker.nc.connected_url.port == port:
            break
    assert node.process is not None
    os.kill(node.process.pid, signal.SIGSTOP)
    try:
        for _ in range(100):
            if _stopped(node.process.pid):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"node {node.name} did not stop on SIGSTOP")
        value = f"v{attempt}".encode()
        write = asyncio.create_task(worker.put(subjects.BUCKET_FUTURES, "in-flight", value))
        await asyncio.sleep(0.5)
        if write.done():
            where = worker.nc.connected_url.port if worker.nc.connected_url else None
            failure = write.exception()
            assert failure is None, f"the write failed at once: {failure!r}"
            assert where != port, f"a write through frozen node {node.name} (:{port}) finished"
            return f"try {attempt}: the worker had moved from :{port} to :{where}"
        node.kill()
        killed = time.monotonic()
        await asyncio.wait_for(write, timeout=30)
        took_s = time.monotonic() - killed
        assert await bus.get(subjects.BUCKET_FUTURES, "in-flight") == value
        assert took_s < 5.0, took_s  # the request's timeout is 10 s
        return None
    finally:
        node.kill()  # a frozen node holds its ports and store until it is gone
        await _restarted(node)


def test_a_node_restarts_on_its_ports_and_store(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, 3)
    url = cluster.start()
    try:
        node = cluster.nodes[1]
        routes = node.cluster
        node.kill()
        node.start()
        assert cluster.url == url and node.cluster == routes
        assert len({n.cluster.route_port for n in cluster.nodes if n.cluster}) == 3
    finally:
        cluster.stop()


class _ElectingBus(Bus):
    """A real bus whose first `failures` reads fail as they do while a bucket elects a leader
    for longer than one call's retries."""

    def __init__(self, settings: BusSettings, failures: int) -> None:
        super().__init__(settings)
        self.failures = failures

    async def get(self, bucket: str, key: str) -> bytes | None:
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable(f"the job bus did not answer (read {bucket}/{key})")
        return await super().get(bucket, key)


async def test_a_reconnect_rereads_waiters_until_the_bucket_answers(
    nats_server: NatsServer,
) -> None:
    """A result written while the gateway was away reaches its long poll after the reconnect,
    even when the first re-reads fail (the reconnect hook gave up at the first failure)."""
    bus = _ElectingBus(BusSettings(nats_url=nats_server.url), failures=0)
    await bus.connect()
    futures = FutureStore(bus)  # not started: no live subscription, as during a disconnect
    try:
        request_id = "req-away-forward_backward"
        key = subjects.future_key(request_id)
        pending = Outcome(request_id=request_id, state="pending", request_type="forward_backward")
        await bus.put(subjects.BUCKET_FUTURES, key, encode_outcome(pending))
        waiting = asyncio.create_task(futures.wait(request_id, timeout_s=60.0))
        await asyncio.sleep(0.3)  # its first read saw "pending"; it waits
        assert request_id in futures._waiters and not waiting.done()
        done = msgspec.structs.replace(pending, state="done", payload=b"{}")
        await bus.put(subjects.BUCKET_FUTURES, key, encode_outcome(done))
        bus.failures = 2
        await asyncio.wait_for(futures._recheck_waiters(), timeout=30.0)
        outcome = await asyncio.wait_for(waiting, timeout=5.0)
        assert outcome is not None and outcome.state == "done"
    finally:
        await bus.close()
