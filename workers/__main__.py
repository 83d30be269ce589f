"""`python -m workers worker ...`: run a trainer worker (the `twinkle-async worker` command).

Kept apart from `twinkle_async` so the gateway never imports torch; `twinkle-async worker`
execs this module.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from workers.settings import WorkerSettings, env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="twinkle-async worker", description="Run a trainer worker."
    )
    parser.add_argument(
        "--base-model",
        default=env("BASE_MODEL", "") or None,
        required=not env("BASE_MODEL", ""),
        help="model id (hub) or a local model directory",
    )
    parser.add_argument("--nats-url", default=env("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--data-dir", type=Path, default=Path(env("DATA_DIR", "data")))
    parser.add_argument("--max-slots", type=int, default=int(env("MAX_SLOTS", "8")))
    parser.add_argument("--max-rank", type=int, default=int(env("MAX_RANK", "32")))
    parser.add_argument("--device", default=env("DEVICE", "cpu"))
    parser.add_argument("--threads", type=int, default=int(env("TORCH_THREADS", "0")) or None)
    parser.add_argument("--shards", type=int, default=int(env("SHARDS", "16")))
    parser.add_argument("--gap-timeout-s", type=float, default=float(env("GAP_TIMEOUT_S", "120")))
    parser.add_argument(
        "--sampler",
        choices=["torch", "none"],
        default=env("SAMPLER", "torch"),
        help="serve sample requests in this process with the torch sampler",
    )
    parser.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


async def serve(settings: WorkerSettings) -> None:
    import torch

    from workers.bus import WorkerBus
    from workers.engine import Engine
    from workers.service import TrainerService

    if settings.threads:
        torch.set_num_threads(settings.threads)
    engine = Engine(
        settings.base_model,
        max_slots=settings.max_slots,
        max_rank=settings.max_rank,
        device=settings.device,
    )
    bus = WorkerBus(settings.nats_url, ack_wait_s=settings.ack_wait_s)
    await bus.connect()
    service = TrainerService(bus, engine, settings)
    runs = [service.run()]
    if settings.sampler == "torch":
        from workers.sampler_service import SamplerService, TorchBackend
        from workers.sampling_torch import TorchSampler

        backend = TorchBackend(TorchSampler(engine), engine, service.executor)
        runs.append(
            SamplerService(
                bus, backend, settings.pool, settings.checkpoint_root, usage=service.usage
            ).run()
        )
    task = asyncio.ensure_future(asyncio.gather(*runs))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    settings = WorkerSettings(
        base_model=args.base_model,
        nats_url=args.nats_url,
        data_dir=args.data_dir,
        n_shards=args.shards,
        max_slots=args.max_slots,
        max_rank=args.max_rank,
        device=args.device,
        threads=args.threads,
        gap_timeout_s=args.gap_timeout_s,
        sampler="" if args.sampler == "none" else args.sampler,
    )
    import uvloop

    uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
