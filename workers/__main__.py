"""`python -m workers ...`: run a trainer worker (the `twinkle-async worker` command).

Kept apart from `twinkle_async` so the gateway never imports torch; `twinkle-async worker`
execs this module. Options are declared once in `worker_options` (each also read from its
`TWINKLE_*` variable); `main` parses them into a `WorkerSettings` and serves until SIGINT or
SIGTERM. The process's Prometheus series are served on `--metrics-host:--metrics-port` and
the bound URL is reported in the worker's `tw_workers` heartbeat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from protocol.devices import check_devices
from workers import settings as worker_settings
from workers.settings import WorkerSettings

if TYPE_CHECKING:
    from workers.bus import WorkerBus
    from workers.engine.model import MultiSlotModel
    from workers.sampler.torch_sampler import TorchSampler

log = logging.getLogger(__name__)

PROG = "twinkle-async worker"


def worker_options(
    base_model: Annotated[
        str,
        typer.Option(envvar="TWINKLE_BASE_MODEL", help="model id (hub) or a local model directory"),
    ],
    nats_url: worker_settings.NatsUrl = "nats://127.0.0.1:4222",
    nats_replicas: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_NATS_REPLICAS",
            min=1,
            max=5,
            help="the cluster's replica count (the gateway sets it); the lease default follows",
        ),
    ] = 1,
    data_dir: Annotated[
        Path,
        typer.Option(envvar="TWINKLE_DATA_DIR", help="checkpoints live in DATA_DIR/checkpoints"),
    ] = Path("data"),
    max_slots: Annotated[
        int | None,
        typer.Option(
            envvar="TWINKLE_MAX_SLOTS",
            min=1,
            help="adapter slots on the device (default: what its free memory holds, up to 64)",
        ),
    ] = None,
    max_rank: Annotated[
        int, typer.Option(envvar="TWINKLE_MAX_RANK", min=1, help="largest LoRA rank accepted")
    ] = 32,
    max_parked: Annotated[
        int | None,
        typer.Option(
            envvar="TWINKLE_MAX_PARKED",
            min=0,
            help="adapters parked in host memory when slots run out (default: no bound)",
        ),
    ] = None,
    device: Annotated[str, typer.Option(envvar="TWINKLE_DEVICE")] = "cpu",
    devices: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_DEVICES",
            min=1,
            max=64,
            help="devices (ranks) of one base model: a MoE model's experts are split over them",
        ),
    ] = 1,
    group_timeout_s: Annotated[
        float,
        typer.Option(
            envvar="TWINKLE_GROUP_TIMEOUT_S",
            min=1.0,
            help="with --devices: a rank waiting this long for the others stops the group",
        ),
    ] = 600.0,
    threads: Annotated[
        int, typer.Option(envvar="TWINKLE_TORCH_THREADS", min=0, help="torch threads (0: default)")
    ] = 0,
    shards: Annotated[int, typer.Option(envvar="TWINKLE_SHARDS", min=1)] = 16,
    token_budget: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_TOKEN_BUDGET",
            min=0,
            help="token positions of one pass (0: measured on this device once, then cached)",
        ),
    ] = 0,
    memory_limit_mib: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_MEMORY_LIMIT_MIB",
            min=0,
            help="plan the longest datum and sample in at most this much free memory (0: all)",
        ),
    ] = 0,
    gap_timeout_s: Annotated[float, typer.Option(envvar="TWINKLE_GAP_TIMEOUT_S")] = 120.0,
    ack_wait_s: worker_settings.AckWaitS = 120.0,
    sample_timeout_s: worker_settings.SampleTimeoutS = 600.0,
    max_image_pixels: worker_settings.MaxImagePixels = worker_settings.DEFAULT_MAX_IMAGE_PIXELS,
    max_images_per_request: worker_settings.MaxImagesPerRequest = (
        worker_settings.DEFAULT_MAX_IMAGES
    ),
    worker_id: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_WORKER_ID",
            help="stable id (a restarted worker with the same id keeps its shard leases)",
        ),
    ] = None,
    lease_s: Annotated[
        float | None,
        typer.Option(
            envvar="TWINKLE_LEASE_S",
            min=1.0,
            help="a dead worker's shards move after (default: 10 s, 30 s with NATS replicas)",
        ),
    ] = None,
    snapshot_every: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_SNAPSHOT_EVERY", min=1, help="optim_steps between state snapshots"
        ),
    ] = 5,
    snapshot_min_s: Annotated[
        float,
        typer.Option(
            envvar="TWINKLE_SNAPSHOT_MIN_S",
            min=0.0,
            help="seconds at least between a model's snapshots after optim_steps",
        ),
    ] = 1.0,
    snapshot_idle_s: Annotated[
        float,
        typer.Option(
            envvar="TWINKLE_SNAPSHOT_IDLE_S",
            min=1.0,
            help="a model changed since its last snapshot and idle this long is snapshotted",
        ),
    ] = 60.0,
    pass_timeout_s: Annotated[
        float,
        typer.Option(
            envvar="TWINKLE_PASS_TIMEOUT_S", help="an engine call longer than this stops the worker"
        ),
    ] = 600.0,
    max_attempts: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_MAX_ATTEMPTS",
            min=1,
            help="times an op (or a sample) may stop the worker",
        ),
    ] = 3,
    merge: Annotated[
        bool,
        typer.Option(
            envvar="TWINKLE_MERGE",
            help="share passes and optimizer steps across models (--no-merge: one model each)",
        ),
    ] = True,
    sampler: Annotated[
        Literal["torch", "none"],
        typer.Option(
            envvar="TWINKLE_SAMPLER",
            help="serve sample requests in this process with the torch sampler",
        ),
    ] = "torch",
    metrics_host: Annotated[
        str, typer.Option(envvar="TWINKLE_METRICS_HOST", help="address /metrics binds")
    ] = "127.0.0.1",
    metrics_port: Annotated[
        int,
        typer.Option(envvar="TWINKLE_METRICS_PORT", min=0, help="/metrics port (0: a free one)"),
    ] = 0,
    artifact_store: worker_settings.ArtifactStoreUrl = None,
    artifact_cache_bytes: worker_settings.ArtifactCacheBytes = 16 * 1024**3,
    artifact_store_wait_s: worker_settings.ArtifactStoreWaitS = 30.0,
    log_level: Annotated[str, typer.Option(envvar="TWINKLE_LOG_LEVEL")] = "INFO",
) -> WorkerSettings:
    """Run a trainer worker: a base model, its adapter slots, shared passes and fused steps."""
    config = Path(base_model) / "config.json"
    if devices > 1 and config.is_file():  # a hub model is checked when the engine loads it
        try:
            check_devices(json.loads(config.read_text()), devices)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    lease = lease_s if lease_s is not None else worker_settings.default_lease_s(nats_replicas)
    settings = WorkerSettings(
        base_model=base_model,
        nats_url=nats_url,
        data_dir=data_dir,
        n_shards=shards,
        max_slots=max_slots,
        max_rank=max_rank,
        max_parked=max_parked,
        device=device,
        devices=devices,
        group_timeout_s=group_timeout_s,
        threads=threads or None,
        token_budget=token_budget or None,
        memory_limit_mib=memory_limit_mib or None,
        gap_timeout_s=gap_timeout_s,
        ack_wait_s=ack_wait_s,
        lease_s=lease,
        lease_renew_s=lease / 4,
        snapshot_every=snapshot_every,
        snapshot_min_s=snapshot_min_s,
        snapshot_idle_s=snapshot_idle_s,
        pass_timeout_s=pass_timeout_s,
        max_attempts=max_attempts,
        sample_timeout_s=sample_timeout_s,
        max_image_pixels=max_image_pixels,
        max_images=max_images_per_request,
        merge=merge,
        sampler="" if sampler == "none" else sampler,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        log_level=log_level,
        artifact_store=artifact_store,
        artifact_cache_bytes=artifact_cache_bytes,
        artifact_store_wait_s=artifact_store_wait_s,
    )
    return dataclasses.replace(settings, worker_id=worker_id) if worker_id else settings


def parse_args(argv: list[str]) -> WorkerSettings:
    """The settings a command line and the `TWINKLE_*` variables ask for (runs nothing)."""
    return worker_settings.parse(worker_options, argv, PROG)


def build_model(settings: WorkerSettings, max_slots: int | None) -> MultiSlotModel:
    """This process's multi-slot model on `settings.device`, its images limited as configured."""
    from workers.engine.model import MultiSlotModel

    model = MultiSlotModel(
        settings.base_model,
        max_slots=max_slots,
        max_rank=settings.max_rank,
        device=settings.device,
        memory_limit=settings.memory_limit,
    )
    if model.vision is not None:
        model.vision.limit(settings.max_image_pixels, settings.max_images)
    return model


def standalone_torch_sampler(settings: WorkerSettings, max_slots: int) -> TorchSampler:
    """A sampler process's torch sampler (`workers.sampler.main --backend torch`): its own
    model, whose slots hold snapshots only (the trainer's residency, with no tenant)."""
    from workers.sampler.torch_sampler import TorchSampler
    from workers.trainer.residency import Residency

    model = build_model(settings, max_slots)
    return TorchSampler(model, Residency(model))


async def serve(settings: WorkerSettings) -> None:
    import torch
    from prometheus_client import CollectorRegistry

    from workers.bus import WorkerBus
    from workers.metrics import SamplerMetrics, TrainerMetrics, serve_metrics
    from workers.trainer.operations import EngineOps, TrainerOps
    from workers.trainer.residency import Residency
    from workers.trainer.service import TrainerService

    if settings.threads:
        torch.set_num_threads(settings.threads)
    from workers.engine.passes import tune_malloc

    tune_malloc()
    group = None
    registry = CollectorRegistry()
    metrics_server = serve_metrics(registry, settings.metrics_host, settings.metrics_port)
    try:
        ops: TrainerOps
        if settings.devices > 1:
            from workers.group.launch import start_group

            group = await asyncio.to_thread(start_group, settings, TrainerMetrics(registry))
            assert group.ops is not None
            ops = group.ops
        else:
            model = build_model(settings, settings.max_slots)
            residency = Residency(model, max_parked=settings.max_parked)
            ops = EngineOps(model, residency, settings, TrainerMetrics(registry))
        model = ops.model
        if settings.token_budget:
            model.pass_tokens = settings.token_budget
        else:
            from workers.trainer.calibration import cached_or_measured

            measure = group.ops.calibrate if group is not None and group.ops else cached_or_measured
            found = await asyncio.to_thread(
                measure, model, settings.data_dir / "calibration", torch.get_num_threads()
            )
            model.pass_tokens = found.pass_tokens
        from workers.engine.kernels import linear_attention_path, lora_path

        log.info(
            "engine %s on %s (%s): passes of %d tokens, linear attention %s, LoRA %s",
            settings.base_model,
            model.device,
            model.dtype,
            model.pass_tokens,
            linear_attention_path(model.model),
            lora_path(model.device),
        )
        bus = WorkerBus(settings.nats_url, ack_wait_s=settings.ack_wait_s)
        await bus.connect()
        service = TrainerService(bus, ops, settings, metrics_url=metrics_server.url)
        runs = [service.run()]
        if settings.sampler == "torch":
            from workers.sampler.backends import TorchBackend
            from workers.sampler.service import SamplerService
            from workers.sampler.torch_sampler import TorchSampler

            # a group's sampler steps run on every rank (the model is split between them)
            steps = group.ops.sample_step if group is not None and group.ops else None
            sampler = TorchSampler(model, ops.residency)  # the residency keeps its snapshots
            backend = TorchBackend(sampler, service.executor, steps)
            sampling = SamplerService(
                bus,
                backend,
                settings.pool,
                settings.checkpoint_root,
                usage=service.usage,
                metrics=SamplerMetrics(registry),
                max_attempts=settings.max_attempts,
                sample_timeout_s=settings.sample_timeout_s,
                store=ops.store,
            )
            runs.append(sampling.run())
        # What is built by now (the model, the libraries, the services) lives as long as the
        # process: frozen out of the collector's sight, a full collection no longer walks it all
        # (50 to 150 ms on a tiny model, a pause in whichever tenant's step it fell into).
        gc.collect()
        gc.freeze()
        task = asyncio.ensure_future(asyncio.gather(*runs))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            # a loop of the service died (e.g. NATS stayed away past the bus's retry deadline):
            # exit non-zero so the supervisor starts a fresh worker
            log.critical("worker %s failed; exiting (traceback below)", settings.worker_id)
            raise
        finally:
            await service.hand_over()
            await _close_bus(bus)
    finally:
        if group is not None:
            await asyncio.to_thread(group.stop)
        await asyncio.to_thread(metrics_server.close)


async def _close_bus(bus: WorkerBus, timeout_s: float = 10.0) -> None:
    """Close the connection without hanging on a NATS that is away."""
    try:
        await asyncio.wait_for(bus.close(), timeout=timeout_s)
    except TimeoutError:
        log.warning("closing the NATS connection timed out after %.0f s", timeout_s)


def _serve_forever(settings: WorkerSettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import uvloop

    uvloop.run(serve(settings))


def main(argv: list[str] | None = None) -> None:
    worker_settings.run(
        worker_options, _serve_forever, sys.argv[1:] if argv is None else argv, PROG
    )


if __name__ == "__main__":
    main()
