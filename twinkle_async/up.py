"""`twinkle-async up`: the one-command local cluster.

Starts nats-server (loopback, a port it picks), the gateway in this process, and one trainer
worker per base model as child processes; waits until every worker has reported in; prints the
base URL and the API key (and writes them to `--ready-file`); stops everything on Ctrl-C or
SIGTERM, or when a child dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import sys
import time
from asyncio.subprocess import Process
from dataclasses import dataclass, field
from pathlib import Path

from protocol import records, subjects
from protocol.records import WorkerRecord
from twinkle_async.bus import Bus
from twinkle_async.gateway.app import serve
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import GatewaySettings, bus_from_env, quota_defaults_from_env

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
    extra_keys: dict[str, str] = field(default_factory=dict)  # more tml- keys -> tenant ids
    ready_file: Path | None = None
    worker_args: list[str] = field(default_factory=list)
    fwdbwd_max_chunk_len: int = 1024
    worker_ready_timeout_s: float = 300.0
    vllm_sampler: bool = False
    sampler_args: list[str] = field(default_factory=list)
    checkpoint_sweep_s: float | None = 60.0  # None: expired checkpoints are never swept


async def _wait_for_workers(
    bus: Bus, expected: set[tuple[str, str]], procs: list[Process], timeout_s: float
) -> None:
    """Until every (base model, role) expected has a heartbeat in `tw_workers`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [records.decode(v, WorkerRecord) for v in await bus.values(subjects.BUCKET_WORKERS)]
        if expected <= {(record.base_model, record.role) for record in found}:
            return
        for proc in procs:
            if proc.returncode is not None:
                raise RuntimeError(f"a worker exited with code {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not report in within {timeout_s} s")
        await asyncio.sleep(0.2)


def _commands(base_model: str, nats_url: str, options: UpOptions) -> list[tuple[str, list[str]]]:
    """(role, argv) of each process a base model needs: a trainer, and a vLLM sampler if asked."""
    common = [
        "--base-model",
        base_model,
        "--nats-url",
        nats_url,
        "--data-dir",
        str(options.data_dir),
    ]
    commands = [("trainer", [sys.executable, "-m", "workers", *common, *options.worker_args])]
    if options.vllm_sampler:
        sampler = [sys.executable, "-m", "workers.sampler_main", *common, "--backend", "vllm"]
        commands.append(("sampler", [*sampler, *options.sampler_args]))
    return commands


async def run_up(options: UpOptions) -> None:
    options.data_dir.mkdir(parents=True, exist_ok=True)
    api_key = options.api_key or f"tml-{secrets.token_urlsafe(24)}"
    admin_key = options.admin_key or f"twa-{secrets.token_urlsafe(24)}"
    nats = NatsServer(options.data_dir / "nats")
    nats_url = nats.start()
    log.info("nats-server at %s", nats_url)
    settings = GatewaySettings(
        host=options.host,
        port=options.port,
        api_keys={**options.extra_keys, api_key: "default"},
        admin_key=admin_key,
        quota_defaults=quota_defaults_from_env(),
        session_timeout_s=options.session_timeout_s,
        sweep_interval_s=options.sweep_interval_s,
        rate_burst_s=options.rate_burst_s,
        long_poll_s=options.long_poll_s,
        base_models=tuple(options.base_models),
        fwdbwd_max_chunk_len=options.fwdbwd_max_chunk_len,
        bus=bus_from_env(nats_url),
        checkpoint_root=options.data_dir / "checkpoints",  # where the workers write them
        checkpoint_sweep_s=options.checkpoint_sweep_s,
    )
    procs: list[Process] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    base_url_box: list[str] = []
    gateway = asyncio.create_task(serve(settings, on_ready=base_url_box.append), name="gateway")
    bus = Bus(settings.bus)
    try:
        while not base_url_box:
            if gateway.done():
                gateway.result()
            await asyncio.sleep(0.01)
        await bus.connect()
        expected: set[tuple[str, str]] = set()
        for base_model in options.base_models:
            for role, argv in _commands(base_model, nats_url, options):
                procs.append(await asyncio.create_subprocess_exec(*argv))
                expected.add((base_model, role))
        ready = asyncio.create_task(
            _wait_for_workers(bus, expected, procs, options.worker_ready_timeout_s)
        )
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({ready, stopper, gateway}, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            return
        ready.result()
        base_url = base_url_box[0]
        info = {
            "base_url": base_url,
            "api_key": api_key,
            "admin_key": admin_key,
            "nats_url": nats_url,
            "base_models": options.base_models,
        }
        print(
            f"Twinkle Async is up.\n  base URL:  {base_url}\n  API key:   {api_key}\n"
            f"  admin key: {admin_key}  (twinkle-admin --gateway {base_url} --admin-key ...)",
            flush=True,
        )
        if options.ready_file is not None:
            tmp = options.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(options.ready_file)
        while not stop.is_set():
            for proc in procs:
                if proc.returncode is not None:
                    log.error("worker %d exited with code %s; stopping", proc.pid, proc.returncode)
                    stop.set()
            if gateway.done():
                stop.set()
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), timeout=10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        gateway.cancel()
        await asyncio.gather(gateway, return_exceptions=True)
        await bus.close()
        nats.stop()
        if options.ready_file is not None and options.ready_file.exists():
            options.ready_file.unlink()
        log.info("stopped")
