"""Supervision and riding out NATS outages, below the SDK: the restart backoff, a supervised
child process, dying with the parent, which children have reported in while `up` starts (a
served one that dies is restarted, one that never reported in fails the start), both bus
wrappers across a nats-server restart, the 503 mapping, and the gateway command line `up`
builds."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.msg import Msg
from typer.testing import CliRunner

from protocol import backoff, records, subjects
from protocol.errors import Unavailable
from protocol.records import WorkerRecord
from twinkle_async import bus as gateway_bus
from twinkle_async import cli
from twinkle_async.bus import Bus
from twinkle_async.gateway.middleware import errors_middleware
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings, GatewaySettings
from twinkle_async.supervisor import Awaited, Child, describe_exit, reported_in
from twinkle_async.up import Cluster, UpOptions, gateway_command, gateway_env
from workers import bus as worker_bus
from workers.bus import WorkerBus

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _heartbeat(
    worker_id: str, at: float, base_model: str = "m", role: str = "trainer"
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        pool=subjects.pool_of(base_model),
        base_model=base_model,
        arch="qwen3",
        vocab_size=256,
        max_context=64,
        max_rank=8,
        slots_total=4,
        slots_used=0,
        heartbeat_at=at,
        role=role,
    )


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- pure ----------------------------------------------------------------------------------------


def test_restart_delay_doubles_to_30_s_and_starts_over_after_a_stable_run() -> None:
    delays: list[float] = []
    delay = None
    for _ in range(9):
        delay = backoff.restart_delay(delay, uptime_s=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.restart_delay(30.0, uptime_s=backoff.RESTART_STABLE_S) == 0.5


def test_bus_retry_backoff_is_capped_at_2_s() -> None:
    delay = None
    for _ in range(10):
        delay = backoff.BUS_RETRY.after(delay)
    assert delay == 2.0


def test_describe_exit() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "was killed by SIGKILL"


def test_reported_in_matches_each_child_by_the_id_up_gave_it() -> None:
    since = 1000.0
    trainer_0, trainer_1 = Awaited("m", "trainer", "h-m-0"), Awaited("m", "trainer", "h-m-1")
    sampler = Awaited("m", "sampler")  # picks its own id
    other = Awaited("n", "trainer", "h-n-0")
    awaited = [trainer_0, trainer_1, sampler, other]
    assert reported_in(awaited, [], since) == set()
    # trainer 0 reported in (and may have died since: its record stays); trainer 1's record is
    # an earlier run's; one base model's heartbeat never stands for another's
    beats = [
        _heartbeat("h-m-0", since + 5.0),
        _heartbeat("h-m-1", since - 30.0),
        _heartbeat("h-n-0", since + 5.0, base_model="other"),
    ]
    assert reported_in(awaited, beats, since) == {trainer_0}
    # a second of clock slack between processes
    assert reported_in(awaited, [_heartbeat("h-m-1", since - 0.5)], since) == {trainer_1}
    # the sampler: any fresh id of its role and base model, never a trainer's
    assert reported_in(awaited, [_heartbeat("h-m-0", since, role="sampler")], since) == set()
    beats = [_heartbeat("h-sampler-1f3a", since, role="sampler")]
    assert reported_in(awaited, beats, since) == {sampler}


def test_both_wrappers_retry_the_same_errors() -> None:
    assert set(gateway_bus.TRANSIENT_ERRORS) == set(worker_bus.TRANSIENT_ERRORS)
    assert nats.errors.TimeoutError in gateway_bus.TRANSIENT_ERRORS
    assert nats.errors.OutboundBufferLimitError in gateway_bus.TRANSIENT_ERRORS


# -- processes -----------------------------------------------------------------------------------


async def test_a_dead_child_is_restarted_and_stop_ends_it() -> None:
    child = Child("sleeper", SLEEPER, stop_timeout_s=5.0)
    first = await child.start()
    supervising = asyncio.create_task(child.supervise())
    try:
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while child.process is first or child.process is None:
            assert time.monotonic() < deadline, "not restarted"
            await asyncio.sleep(0.05)
        assert child.restarts == 1 and _alive(child.process.pid)
        assert os.getpgid(child.process.pid) == child.process.pid  # its own process group
    finally:
        supervising.cancel()
        await asyncio.gather(supervising, return_exceptions=True)
        await child.stop()
    assert child.process is not None and child.process.returncode == -signal.SIGTERM


async def test_while_up_starts_a_served_worker_that_dies_is_restarted(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Per child: trainer 0 reports in and is killed while trainer 1 is still starting; trainer
    0 comes back and `up` keeps waiting. Trainer 1, which never reported in, then dies: that
    fails the start."""
    options = UpOptions(base_models=["m"], data_dir=tmp_path, nats_url=nats_server.url)
    cluster = Cluster(options, "tml-key", "twa-key")
    cluster.nats_url = nats_server.url
    for index in range(2):
        awaited = Awaited("m", "trainer", f"h-m-{index}")
        child = Child(f"trainer {index} of m", SLEEPER, stop_timeout_s=5.0)
        cluster.workers.append((awaited, child))
        await child.start()
    (_, served), (_, starting) = cluster.workers
    waiting = asyncio.create_task(cluster.wait_for_workers(time.time()))
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    try:
        record = _heartbeat("h-m-0", time.time())
        key = subjects.worker_key(record.pool, record.worker_id)
        await bus.put(subjects.BUCKET_WORKERS, key, records.encode(record))
        first = served.process
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)  # at once: maybe before `up` read the heartbeat
        deadline = time.monotonic() + 10
        while served.process is first or served.process is None:
            assert not waiting.done(), waiting.exception()
            assert time.monotonic() < deadline, "the served worker was not restarted"
            await asyncio.sleep(0.05)
        assert served.restarts == 1 and _alive(served.process.pid)
        assert not waiting.done()

        assert starting.process is not None
        os.kill(starting.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="trainer 1 of m was killed by SIGKILL while"):
            await asyncio.wait_for(waiting, timeout=10)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await bus.close()
        await cluster.stop()
    assert served.process.returncode == -signal.SIGTERM  # stopped, not restarted again


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    """The parent-death signal: SIGKILL a parent, its child goes too."""
    script = (
        "import subprocess, sys, time\n"
        "from twinkle_async.supervisor import die_with_parent\n"
        f"p = subprocess.Popen({SLEEPER!r}, preexec_fn=die_with_parent())\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent
    )
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert _alive(grandchild)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(grandchild):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


# -- the bus across a nats-server restart ------------------------------------------------------


async def test_gateway_bus_call_waits_for_nats_to_come_back(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url, retry_s=20.0))
    await bus.connect()
    try:
        await bus.put(subjects.BUCKET_RUNS, "k", b"before")
        port = nats_server.port
        nats_server.kill()
        put = asyncio.create_task(bus.put(subjects.BUCKET_RUNS, "k", b"during"))
        await asyncio.sleep(1.5)
        assert not put.done()
        nats_server.start()
        assert nats_server.port == port  # the same address, the same store
        await asyncio.wait_for(put, timeout=15)
        assert await bus.get(subjects.BUCKET_RUNS, "k") == b"during"
    finally:
        await bus.close()


async def test_gateway_bus_gives_up_with_unavailable(nats_server: NatsServer) -> None:
    bus = Bus(BusSettings(nats_url=nats_server.url, retry_s=1.0))
    await bus.connect()
    try:
        nats_server.kill()
        started = time.monotonic()
        with pytest.raises(Unavailable) as caught:
            await bus.get(subjects.BUCKET_RUNS, "k")
        assert 0.9 <= time.monotonic() - started < 4.0
        assert caught.value.status == 503 and caught.value.retryable
    finally:
        nats_server.start()
        await bus.close()


async def test_worker_fetch_loop_and_writes_resume_after_a_nats_restart(
    nats_server: NatsServer,
) -> None:
    gateway = Bus(BusSettings(nats_url=nats_server.url))
    await gateway.connect()  # creates the topology
    worker = WorkerBus(nats_server.url, timeout_s=2.0)
    await worker.connect(retry_s=30.0)
    received: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await msg.ack()
        await received.put(msg)

    try:
        await worker.consume(subjects.STREAM_SAMPLE, subjects.sample_subject("p"), "test-p", on_msg)
        nats_server.kill()
        put = asyncio.create_task(worker.put(subjects.BUCKET_FUTURES, "res.x", b"outcome"))
        await asyncio.sleep(6.0)  # past a fetch's long-poll window, with NATS away
        assert not put.done()
        nats_server.start()
        await asyncio.wait_for(put, timeout=15)
        assert await worker.get(subjects.BUCKET_FUTURES, "res.x") == b"outcome"
        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().publish(subjects.sample_subject("p"), b"after")
        finally:
            await nc.close()
        msg = await asyncio.wait_for(received.get(), timeout=15)
        assert msg.data == b"after"
    finally:
        await worker.close()
        await gateway.close()


# -- the 503 mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [Unavailable("the job bus did not answer"), nats.errors.TimeoutError()]
)
async def test_a_transient_bus_error_answers_503_with_retry(error: Exception) -> None:
    async def submit(request: web.Request) -> web.Response:
        raise error

    app = web.Application(middlewares=[errors_middleware])
    app.router.add_post("/api/v1/forward_backward", submit)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/api/v1/forward_backward", json={})
        assert response.status == 503
        assert response.headers["x-should-retry"] == "true"
        assert (await response.json())["category"] == "server"


# -- the gateway command line `up` builds ------------------------------------------------------


def test_every_setting_up_gives_the_gateway_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[GatewaySettings] = []

    async def fake_serve(settings: GatewaySettings, on_ready: object = None) -> None:
        seen.append(settings)

    monkeypatch.setattr("twinkle_async.gateway.app.serve", fake_serve)
    key_file = tmp_path / "keys.txt"
    key_file.write_text("tml-other-key other\n")
    options = UpOptions(
        base_models=["m1", "m2"],
        port=8123,
        data_dir=tmp_path / "data",
        session_timeout_s=33.0,
        sweep_interval_s=4.0,
        rate_burst_s=7.0,
        long_poll_s=12.0,
        key_file=key_file,
        fwdbwd_max_chunk_len=3,
        checkpoint_sweep_s=None,
        bus_retry_s=6.0,
    )
    argv = gateway_command(options, "nats://127.0.0.1:4999", 8123, tmp_path / "ready.json")
    assert argv[1:4] == ["-m", "twinkle_async", "gateway"]
    env = gateway_env("tml-main-key", "twa-admin", key_file)
    for name, value in env.items():
        if name.startswith("TWINKLE_"):
            monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli.app, argv[3:])
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert (settings.port, settings.base_models) == (8123, ("m1", "m2"))
    assert settings.api_keys == {"tml-main-key": "default", "tml-other-key": "other"}
    assert settings.admin_key == "twa-admin"
    assert (settings.session_timeout_s, settings.sweep_interval_s) == (33.0, 4.0)
    assert (settings.rate_burst_s, settings.long_poll_s) == (7.0, 12.0)
    assert settings.fwdbwd_max_chunk_len == 3 and settings.checkpoint_sweep_s is None
    assert settings.checkpoint_root == tmp_path / "data" / "checkpoints"
    assert settings.bus.nats_url == "nats://127.0.0.1:4999" and settings.bus.retry_s == 6.0
    assert settings.download_secret == env["TWINKLE_DOWNLOAD_SECRET"].encode()
