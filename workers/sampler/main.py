"""`python -m workers.sampler.main`: a sampler process (the `twinkle-async sampler` command).

Serves one pool's sample jobs with vLLM (`--backend vllm`, the production choice) or with the
torch sampler on its own copy of the model (`--backend torch`), and reports itself in
`tw_workers` so the gateway knows the pool can sample. Options are declared once in
`sampler_options` (each also read from its `TWINKLE_*` variable) and become a `WorkerSettings`
(`sampler` = the backend, `max_slots` = `--max-loras`, `max_rank` = `--max-lora-rank`). The
process's Prometheus series are served on `--metrics-host:--metrics-port`; the bound URL is in
its heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from protocol import records, subjects
from protocol.records import WorkerRecord
from workers import settings as worker_settings
from workers.settings import WorkerSettings

PROG = "twinkle-async sampler"
DEFAULT_SAMPLER_SLOTS = 4  # adapters a sampler keeps loaded (`--max-loras`)


def sampler_options(
    base_model: Annotated[
        str,
        typer.Option(envvar="TWINKLE_BASE_MODEL", help="model id (hub) or a local model directory"),
    ],
    backend: Annotated[
        Literal["vllm", "torch"], typer.Option(envvar="TWINKLE_SAMPLER_BACKEND")
    ] = "vllm",
    nats_url: worker_settings.NatsUrl = "nats://127.0.0.1:4222",
    data_dir: Annotated[
        Path,
        typer.Option(envvar="TWINKLE_DATA_DIR", help="checkpoints live in DATA_DIR/checkpoints"),
    ] = Path("data"),
    max_lora_rank: Annotated[int, typer.Option(envvar="TWINKLE_MAX_RANK", min=1)] = 32,
    max_loras: Annotated[
        int, typer.Option(envvar="TWINKLE_MAX_LORAS", min=1, help="adapters kept loaded")
    ] = DEFAULT_SAMPLER_SLOTS,
    metrics_host: Annotated[
        str, typer.Option(envvar="TWINKLE_METRICS_HOST", help="address /metrics binds")
    ] = "127.0.0.1",
    metrics_port: Annotated[
        int,
        typer.Option(envvar="TWINKLE_METRICS_PORT", min=0, help="/metrics port (0: a free one)"),
    ] = 0,
    max_attempts: Annotated[
        int,
        typer.Option(
            envvar="TWINKLE_MAX_ATTEMPTS", min=1, help="times a sample may stop its sampler"
        ),
    ] = 3,
    ack_wait_s: worker_settings.AckWaitS = 120.0,
    sample_timeout_s: worker_settings.SampleTimeoutS = 600.0,
    max_image_pixels: worker_settings.MaxImagePixels = worker_settings.DEFAULT_MAX_IMAGE_PIXELS,
    max_images_per_request: worker_settings.MaxImagesPerRequest = (
        worker_settings.DEFAULT_MAX_IMAGES
    ),
    artifact_store: worker_settings.ArtifactStoreUrl = None,
    artifact_cache_bytes: worker_settings.ArtifactCacheBytes = 16 * 1024**3,
    log_level: Annotated[str, typer.Option(envvar="TWINKLE_LOG_LEVEL")] = "INFO",
) -> WorkerSettings:
    """Run a sampler: one pool's sample requests, with vLLM or the torch sampler."""
    return WorkerSettings(
        base_model=base_model,
        nats_url=nats_url,
        data_dir=data_dir,
        max_slots=max_loras,
        max_rank=max_lora_rank,
        sampler=backend,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        log_level=log_level,
        artifact_store=artifact_store,
        artifact_cache_bytes=artifact_cache_bytes,
        max_attempts=max_attempts,
        sample_timeout_s=sample_timeout_s,
        max_image_pixels=max_image_pixels,
        max_images=max_images_per_request,
        ack_wait_s=ack_wait_s,
        worker_id=f"{socket.gethostname()}-sampler-{uuid.uuid4().hex[:8]}",
    )


def parse_args(argv: list[str]) -> WorkerSettings:
    """The settings a command line and the `TWINKLE_*` variables ask for (runs nothing)."""
    return worker_settings.parse(sampler_options, argv, PROG)


def planned_model_len(base_model: str, config: Any) -> int | None:
    """vLLM's `max_model_len` from the memory plan (`workers.engine.memory.cached_tokens`): the
    longest sequence its KV cache holds, where the cache's size is known before the engine
    starts: `VLLM_CPU_KVCACHE_SPACE` GiB on a CPU; on a GPU, vLLM's 90% of the free memory less
    the weights of a local checkpoint. None (vLLM's own choice, at most the model's context)
    otherwise."""
    import torch

    from workers.engine.memory import cached_tokens, free_memory

    text = config.get_text_config()
    context = int(text.max_position_embeddings)
    if torch.cuda.is_available():
        weights = sum(f.stat().st_size for f in Path(base_model).glob("*.safetensors"))
        if not weights:
            return None
        cache = int(free_memory(torch.device("cuda")) * 0.9) - weights
        dtype_bytes = 2
    elif os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        cache = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
        dtype_bytes = 4
    else:
        return None
    return cached_tokens(config, dtype_bytes=dtype_bytes, cache_bytes=cache, max_context=context)


async def heartbeat(bus: object, record: WorkerRecord, every_s: float = 5.0) -> None:
    key = subjects.worker_key(record.pool, record.worker_id)
    while True:
        record.heartbeat_at = time.time()
        await bus.put(subjects.BUCKET_WORKERS, key, records.encode(record))  # type: ignore[attr-defined]
        await asyncio.sleep(every_s)


async def serve(settings: WorkerSettings) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client import CollectorRegistry

    from workers.bus import WorkerBus
    from workers.metrics import SamplerMetrics, serve_metrics
    from workers.sampler.backends import SamplerBackend, TorchBackend, VllmBackend
    from workers.sampler.service import SamplerService

    registry = CollectorRegistry()
    metrics_server = serve_metrics(registry, settings.metrics_host, settings.metrics_port)
    backend: SamplerBackend
    closer = None
    try:
        if settings.sampler == "vllm":
            from transformers import AutoConfig

            from workers.sampler.vllm_sampler import VllmSampler

            config = AutoConfig.from_pretrained(settings.base_model)
            text = getattr(config, "text_config", config)
            sampler = VllmSampler(
                settings.base_model,
                max_lora_rank=settings.max_rank,
                max_loras=(settings.max_slots or DEFAULT_SAMPLER_SLOTS),
                max_model_len=planned_model_len(settings.base_model, config),
            )
            await sampler.start()
            closer = sampler.close
            backend = VllmBackend(sampler, int(text.vocab_size), int(text.max_position_embeddings))
            longest = sampler.max_context  # the engine's max_model_len
        else:
            # the model and the slots its snapshots take are built where both rooms meet
            from workers.__main__ import standalone_torch_sampler

            torch_sampler = await asyncio.to_thread(
                standalone_torch_sampler, settings, settings.max_slots or DEFAULT_SAMPLER_SLOTS
            )
            backend = TorchBackend(
                torch_sampler, ThreadPoolExecutor(1, thread_name_prefix="engine")
            )
            longest = torch_sampler.model.token_plan.sample_tokens
        bus = WorkerBus(settings.nats_url, ack_wait_s=settings.ack_wait_s)
        await bus.connect()
        record = WorkerRecord(
            worker_id=settings.worker_id,
            pool=settings.pool,
            base_model=settings.base_model,
            arch="",
            vocab_size=backend.vocab_size,
            max_context=backend.max_context,
            max_rank=settings.max_rank,
            slots_total=(settings.max_slots or DEFAULT_SAMPLER_SLOTS),
            slots_used=0,
            heartbeat_at=time.time(),
            role="sampler",
            sampler_backend=backend.name,
            metrics_url=metrics_server.url,
            max_sample_tokens=longest,
        )
        service = SamplerService(
            bus,
            backend,
            settings.pool,
            settings.checkpoint_root,
            metrics=SamplerMetrics(registry),
            max_attempts=settings.max_attempts,
            sample_timeout_s=settings.sample_timeout_s,
            store=settings.open_store(),
        )
        task = asyncio.ensure_future(asyncio.gather(service.run(), heartbeat(bus, record)))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            await bus.close()
    finally:
        if closer is not None:
            await closer()
        await asyncio.to_thread(metrics_server.close)


def _serve_forever(settings: WorkerSettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import uvloop

    uvloop.run(serve(settings))


def main(argv: list[str] | None = None) -> None:
    worker_settings.run(
        sampler_options, _serve_forever, sys.argv[1:] if argv is None else argv, PROG
    )


if __name__ == "__main__":
    main()
