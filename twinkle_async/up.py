"""`twinkle-async up`: the one-command local cluster, and its supervisor.

Step 1: start nats-server (loopback, a port it picks, store under `<data-dir>/nats`), or with
`--nats-cluster N` a JetStream cluster of N nodes (`<data-dir>/nats/n1`...; streams and buckets
with `--nats-replicas` copies, N by default), unless `--nats-url` names one to use instead.
Step 2: start the gateway as a child (`python -m twinkle_async gateway ...`, the settings `up`
was given; the keys travel in its environment, not on its command line) and read the port it
bound from its `--ready-file`; every later start of the gateway asks for that same port, so the
base URL clients hold stays valid.
Step 3: start `--workers` trainer workers per base model (and a vLLM sampler if asked) and wait
until each has put a fresh heartbeat in `tw_workers`.
Step 4: print the base URL and the keys, and write them to `--ready-file`.
Step 5: supervise until SIGINT or SIGTERM: a child that exits is logged and restarted with
backoff (`supervisor.Child`), each nats-server node likewise on the same store and ports
(`supervisor.supervise_nats`).
Supervision is per child and begins the moment that child reports in (a node listens, the
gateway's ready file, a worker's heartbeat), during steps 1-3 too: a worker that served and
died while another is still starting is restarted, and the gateway stays up. Only a child that
dies before it ever reported in stops the cluster: that is a configuration to fix, not a crash
to ride out.
Step 6: stop every child (SIGTERM, then SIGKILL), then nats-server; remove the ready file.

Every child, nats-server included, leads its own process group and dies with `up` (a
parent-death signal), so even a SIGKILLed `up` leaves nothing running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from protocol import records, subjects
from protocol.records import WorkerRecord
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsCluster, NatsServer
from twinkle_async.settings import bus_from_env
from twinkle_async.supervisor import (
    Awaited,
    Child,
    describe_exit,
    die_with_parent,
    reported_in,
    supervise_nats,
)

log = logging.getLogger(__name__)


@dataclass
class UpOptions:
    """What `up` was asked for."""

    base_models: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    api_key: str | None = None
    admin_key: str | None = None  # generated when absent, printed with the API key
    session_timeout_s: float = 120.0
    sweep_interval_s: float = 10.0
    rate_burst_s: float = 60.0
    long_poll_s: float = 30.0
    key_file: Path | None = None  # more tml- keys for more tenants, passed to the gateway
    ready_file: Path | None = None
    worker_args: list[str] = field(default_factory=list)
    fwdbwd_max_chunk_len: int = 1024
    worker_ready_timeout_s: float = 300.0
    gateway_ready_timeout_s: float = 90.0
    # a sampler process per base model with this backend ("vllm"); None: the trainers sample
    sampler_backend: str | None = None
    sampler_args: list[str] = field(default_factory=list)
    checkpoint_sweep_s: float | None = 60.0  # None: expired checkpoints are never swept
    workers_per_model: int = 1  # trainer worker processes per base model
    nats_url: str | None = None  # an external NATS; None: start one under data_dir
    nats_cluster: int = 1  # nodes of the NATS `up` starts (1: one server)
    nats_replicas: int = 1  # copies of every stream and bucket
    # checkpoints and snapshots in this S3 store; each worker then gets a data directory of its
    # own (`<data-dir>/hosts/<role>-<index>`), as on separate machines
    artifact_store: str | None = None
    bus_retry_s: float = 10.0  # the gateway's `BusSettings.retry_s`
    stop_timeout_s: float = 15.0  # SIGTERM to SIGKILL when stopping a child
    log_level: str = "INFO"
    # an interpreter with twinkle-kit: it runs the Twinkle processor service (remote datasets
    # of Twinkle's client) on the datasets under `twinkle_data`; None: no processor
    twinkle_python: Path | None = None
    twinkle_data: Path | None = None  # default `<data-dir>/twinkle-data`


def _commands(
    base_model: str, nats_url: str, options: UpOptions
) -> list[tuple[Awaited, list[str]]]:
    """(its heartbeat, argv) of each process a base model needs: `--workers` trainers, and a
    sampler process if asked (vLLM)."""
    pool = subjects.pool_of(base_model)

    def common(role: str) -> list[str]:
        data_dir = options.data_dir
        store: list[str] = []
        if options.artifact_store:  # no shared disk: a data directory per process
            data_dir = options.data_dir / "hosts" / f"{pool}-{role}"
            store = ["--artifact-store", options.artifact_store]
        return [
            *("--base-model", base_model, "--nats-url", nats_url),
            *("--data-dir", str(data_dir), *store),
        ]

    # A stable id per trainer: restarted after a crash, it finds its own shard leases and the
    # journal of what it was running (workers/trainer/leases.py, workers/watchdog.py).
    host = socket.gethostname().split(".")[0] or "host"
    commands = [
        (
            Awaited(base_model, "trainer", f"{host}-{pool}-{index}"),
            [
                *(sys.executable, "-m", "workers", *common(f"trainer-{index}")),
                *("--nats-replicas", str(options.nats_replicas), *options.worker_args),
                *("--worker-id", f"{host}-{pool}-{index}"),
            ],
        )
        for index in range(options.workers_per_model)
    ]
    if options.sampler_backend:
        sampler = [sys.executable, "-m", "workers.sampler.main", *common("sampler")]
        backend = ["--backend", options.sampler_backend]
        commands.append(
            (Awaited(base_model, "sampler"), [*sampler, *backend, *options.sampler_args])
        )
    return commands


def gateway_command(options: UpOptions, nats_url: str, port: int, ready_file: Path) -> list[str]:
    """The gateway's command line: every setting `up` was given except the keys (environment)."""
    argv = [
        sys.executable,
        "-m",
        "twinkle_async",
        "gateway",
        "--nats-url",
        nats_url,
        "--nats-replicas",
        str(options.nats_replicas),
        "--host",
        options.host,
        "--port",
        str(port),
        "--ready-file",
        str(ready_file),
        "--data-dir",
        str(options.data_dir),
        "--session-timeout-s",
        str(options.session_timeout_s),
        "--sweep-interval-s",
        str(options.sweep_interval_s),
        "--rate-burst-s",
        str(options.rate_burst_s),
        "--long-poll-s",
        str(options.long_poll_s),
        "--fwdbwd-max-chunk-len",
        str(options.fwdbwd_max_chunk_len),
        "--checkpoint-sweep-s",
        str(options.checkpoint_sweep_s or 0),
        "--bus-retry-s",
        str(options.bus_retry_s),
        "--log-level",
        options.log_level,
    ]
    for base_model in options.base_models:
        argv += ["--base-model", base_model]
    if options.key_file is not None:
        argv += ["--key-file", str(options.key_file)]
    if options.artifact_store:
        argv += ["--artifact-store", options.artifact_store]
    return argv


# the directory holding the packages (`workers.processor` runs from it, in another interpreter)
_PACKAGES_ROOT = Path(__file__).resolve().parents[1]


def processor_command(options: UpOptions, port: int, ready_file: Path) -> list[str]:
    """The Twinkle processor service's command line (`workers.processor`)."""
    assert options.twinkle_python is not None
    data = options.twinkle_data or options.data_dir / "twinkle-data"
    argv = [
        str(options.twinkle_python),
        "-m",
        "workers.processor",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--ready-file", str(ready_file)),
        *("--secret-file", str(options.data_dir / "processor-secret")),
        *("--data-root", str(data)),
    ]
    for base_model in options.base_models:
        argv += ["--model", f"{base_model}={base_model}"]
    return argv


def gateway_env(api_key: str, admin_key: str, key_file: Path | None) -> dict[str, str]:
    """The gateway's environment: ours, plus its keys and a download secret that outlives a
    restart (signed URLs handed out stay valid)."""
    env = dict(os.environ)
    env["TWINKLE_API_KEY"] = api_key
    env["TWINKLE_ADMIN_KEY"] = admin_key
    env.setdefault("TWINKLE_DOWNLOAD_SECRET", secrets.token_urlsafe(32))
    if key_file is None:
        env.pop("TWINKLE_KEY_FILE", None)  # only the keys `up` was given
    return env


class Cluster:
    """The processes `up` runs, started in order and supervised."""

    def __init__(self, options: UpOptions, api_key: str, admin_key: str) -> None:
        self.options = options
        self.api_key = api_key
        self.admin_key = admin_key
        self.nats: list[NatsServer] = []  # the nodes `up` runs (none with --nats-url)
        self.nats_url = options.nats_url or ""
        self.gateway: Child | None = None
        self.processor: Child | None = None  # the Twinkle processor service, if asked
        self.processor_url = ""
        self.processor_secret = ""
        self.workers: list[tuple[Awaited, Child]] = []  # (its heartbeat, child)
        # one task per child and node that has reported in; cancelled by `stop`
        self.supervising: list[asyncio.Task[None]] = []

    @property
    def children(self) -> list[Child]:
        front = [c for c in (self.gateway, self.processor) if c is not None]
        return front + [child for _, child in self.workers]

    async def start(self) -> dict[str, Any]:
        """Steps 1-3; returns what the ready file holds."""
        options = self.options
        if options.nats_url is None and options.nats_cluster > 1:
            cluster = NatsCluster(
                options.data_dir / "nats", options.nats_cluster, preexec_fn=die_with_parent()
            )
            self.nats_url = await cluster.start_async()
            self.nats = cluster.nodes
            for node in self.nats:
                log.info("nats-server %s at %s (pid %d)", node.name, node.url, _pid(node))
        elif options.nats_url is None:
            server = NatsServer(options.data_dir / "nats", preexec_fn=die_with_parent())
            self.nats_url = await server.start_async()
            self.nats = [server]
            log.info("nats-server at %s (pid %d)", self.nats_url, _pid(server))
        for node in self.nats:
            self._supervise(supervise_nats(node), node.name)
        if options.twinkle_python is not None:
            self.processor_url = await self._start_processor()
        base_url = await self._start_gateway()
        started_at = time.time()
        for base_model in options.base_models:
            roles: list[str] = []
            for awaited, argv in _commands(base_model, self.nats_url, options):
                name = f"{awaited.role} {roles.count(awaited.role)} of {base_model}"
                roles.append(awaited.role)
                child = Child(name, argv, stop_timeout_s=options.stop_timeout_s)
                self.workers.append((awaited, child))
                await child.start()
        await self.wait_for_workers(started_at)
        return {
            "base_url": base_url,
            "api_key": self.api_key,
            "admin_key": self.admin_key,
            "nats_url": self.nats_url,
            "nats_pids": {node.name: _pid(node) for node in self.nats},
            "base_models": options.base_models,
        }

    async def _start_processor(self) -> str:
        """The Twinkle processor service, listening; its URL. Restarted on its first port."""
        options = self.options
        (options.twinkle_data or options.data_dir / "twinkle-data").mkdir(
            parents=True, exist_ok=True
        )
        secret_file = options.data_dir / "processor-secret"
        if not secret_file.exists():
            secret_file.touch(mode=0o600)
            secret_file.write_text(secrets.token_urlsafe(32))
        self.processor_secret = secret_file.read_text().strip()
        ready_file = options.data_dir / "processor-ready.json"
        ready_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(_PACKAGES_ROOT), "HF_HUB_OFFLINE": "1"}
        self.processor = Child(
            "twinkle processor",
            processor_command(options, 0, ready_file),
            env=env,
            stop_timeout_s=options.stop_timeout_s,
        )
        await _listening(self.processor, ready_file, options.gateway_ready_timeout_s)
        url = str(json.loads(ready_file.read_text())["url"])
        port = urlsplit(url).port
        assert port is not None
        self.processor.argv = processor_command(options, port, ready_file)
        self._supervise(self.processor.supervise(), self.processor.name)
        return url

    async def _start_gateway(self) -> str:
        options = self.options
        ready_file = options.data_dir / "gateway-ready.json"
        ready_file.unlink(missing_ok=True)
        env = gateway_env(self.api_key, self.admin_key, options.key_file)
        if self.processor_url:
            env["TWINKLE_PROCESSOR_URL"] = self.processor_url
            env["TWINKLE_PROCESSOR_SECRET"] = self.processor_secret
        self.gateway = Child(
            "gateway",
            gateway_command(options, self.nats_url, options.port, ready_file),
            env=env,
            stop_timeout_s=options.stop_timeout_s,
        )
        await _listening(self.gateway, ready_file, options.gateway_ready_timeout_s)
        base_url = str(json.loads(ready_file.read_text())["base_url"])
        port = urlsplit(base_url).port
        assert port is not None
        # a restarted gateway listens where clients already point
        self.gateway.argv = gateway_command(options, self.nats_url, port, ready_file)
        self._supervise(self.gateway.supervise(), self.gateway.name)
        return base_url

    def _supervise(self, loop: Coroutine[Any, Any, None], name: str) -> None:
        """Supervise a child or node that has reported in, from now on."""
        self.supervising.append(asyncio.create_task(loop, name=name))

    async def wait_for_workers(self, started_at: float) -> None:
        """Until each trainer and sampler started has put a fresh heartbeat in `tw_workers`;
        each is supervised from its first heartbeat on. One that exits before it fails the
        start."""
        starting = dict(self.workers)
        timeout_s = self.options.worker_ready_timeout_s
        deadline = time.monotonic() + timeout_s
        bus = Bus(bus_from_env(self.nats_url, self.options.nats_replicas))
        await bus.connect()
        try:
            while True:
                # exits before heartbeats: a child that reported in and then died is seen
                # reported in (its record stays), not as a start that failed
                exited = [
                    (awaited, child.process.returncode)
                    for awaited, child in starting.items()
                    if child.process is not None and child.process.returncode is not None
                ]
                heartbeats = [
                    records.decode(value, WorkerRecord)
                    for value in await bus.values(subjects.BUCKET_WORKERS)
                ]
                every = [awaited for awaited, _ in self.workers]
                for awaited in reported_in(every, heartbeats, started_at) & starting.keys():
                    child = starting.pop(awaited)
                    log.info("%s reported in", child.name)
                    self._supervise(child.supervise(), child.name)
                if not starting:
                    return
                for awaited, returncode in exited:
                    if awaited in starting:
                        raise RuntimeError(
                            f"the {starting[awaited].name} {describe_exit(returncode)}"
                            " while starting"
                        )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not report in within {timeout_s} s")
                await asyncio.sleep(0.2)
        finally:
            await bus.close()

    async def supervise(self) -> None:
        """Step 5: runs until cancelled (every child and node reported in during the start)."""
        await asyncio.gather(*self.supervising)

    async def stop(self) -> None:
        """Step 6: no restarts from here on, then every child, then the nodes."""
        for task in self.supervising:
            task.cancel()
        await asyncio.gather(*self.supervising, return_exceptions=True)
        await asyncio.gather(*(child.stop() for child in self.children))
        await asyncio.gather(*(asyncio.to_thread(node.stop) for node in self.nats))


async def _listening(child: Child, ready_file: Path, timeout_s: float) -> None:
    """Start `child` and wait for its ready file (written atomically once it listens)."""
    process = await child.start()
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(os.path.exists, ready_file):
        if process.returncode is not None:
            raise RuntimeError(
                f"the {child.name} {describe_exit(process.returncode)} while starting"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {child.name} did not listen within {timeout_s} s")
        await asyncio.sleep(0.05)


def _pid(node: NatsServer) -> int:
    assert node.process is not None
    return node.process.pid


def _announce(info: dict[str, Any], ready_file: Path | None) -> None:
    base_url = info["base_url"]
    print(
        f"Twinkle Async is up.\n  base URL:  {base_url}\n  API key:   {info['api_key']}\n"
        f"  admin key: {info['admin_key']}  (twinkle-admin --gateway {base_url} --admin-key ...)\n"
        f"  console:   {base_url}/console  (log in with either key)",
        flush=True,
    )
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)


async def run_up(options: UpOptions) -> None:
    options.data_dir.mkdir(parents=True, exist_ok=True)
    api_key = options.api_key or f"tml-{secrets.token_urlsafe(24)}"
    admin_key = options.admin_key or f"twa-{secrets.token_urlsafe(24)}"
    cluster = Cluster(options, api_key, admin_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait(), name="stop-signal")
    starting = asyncio.create_task(cluster.start(), name="start")
    supervising: asyncio.Task[None] | None = None
    try:
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            return  # stopped while starting
        try:
            info = starting.result()
        except (OSError, RuntimeError, TimeoutError) as exc:
            log.error("the cluster did not start: %s", exc)
            raise SystemExit(1) from exc
        _announce(info, options.ready_file)
        supervising = asyncio.create_task(cluster.supervise(), name="supervise")
        await asyncio.wait({supervising, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if supervising.done():
            supervising.result()  # only a bug ends supervision
    finally:
        for task in (starting, stopper, supervising):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (starting, stopper, supervising) if t is not None), return_exceptions=True
        )
        log.info("stopping")
        await cluster.stop()
        if options.ready_file is not None:
            options.ready_file.unlink(missing_ok=True)
        log.info("stopped")
