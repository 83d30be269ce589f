"""`python -m workers.sampler_main`: a sampler process (the `twinkle-async sampler` command).

Serves one pool's sample jobs with vLLM (`--backend vllm`, the production choice) or with the
torch sampler on its own copy of the model (`--backend torch`), and reports itself in
`tw_workers` so the gateway knows the pool can sample.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from protocol import records, subjects
from protocol.records import WorkerRecord
from workers.settings import env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="twinkle-async sampler", description="Run a sampler.")
    parser.add_argument(
        "--base-model", default=env("BASE_MODEL", "") or None, required=not env("BASE_MODEL", "")
    )
    parser.add_argument(
        "--backend", choices=["vllm", "torch"], default=env("SAMPLER_BACKEND", "vllm")
    )
    parser.add_argument("--nats-url", default=env("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--data-dir", type=Path, default=Path(env("DATA_DIR", "data")))
    parser.add_argument("--max-lora-rank", type=int, default=int(env("MAX_RANK", "32")))
    parser.add_argument("--max-loras", type=int, default=int(env("MAX_LORAS", "4")))
    parser.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


async def heartbeat(bus: object, record: WorkerRecord, every_s: float = 5.0) -> None:
    key = subjects.worker_key(record.pool, record.worker_id)
    while True:
        record.heartbeat_at = time.time()
        await bus.put(subjects.BUCKET_WORKERS, key, records.encode(record))  # type: ignore[attr-defined]
        await asyncio.sleep(every_s)


async def serve(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from workers.bus import WorkerBus
    from workers.sampler_service import SamplerBackend, SamplerService, TorchBackend, VllmBackend

    pool = subjects.pool_of(args.base_model)
    backend: SamplerBackend
    closer = None
    if args.backend == "vllm":
        from transformers import AutoConfig

        from workers.sampling_vllm import VllmSampler

        config = AutoConfig.from_pretrained(args.base_model)
        text = getattr(config, "text_config", config)
        sampler = VllmSampler(
            args.base_model, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras
        )
        await sampler.start()
        closer = sampler.close
        backend = VllmBackend(sampler, int(text.vocab_size), int(text.max_position_embeddings))
    else:
        from workers.engine import Engine
        from workers.sampling_torch import TorchSampler

        engine = Engine(args.base_model, max_slots=args.max_loras, max_rank=args.max_lora_rank)
        backend = TorchBackend(
            TorchSampler(engine), engine, ThreadPoolExecutor(1, thread_name_prefix="engine")
        )
    bus = WorkerBus(args.nats_url)
    await bus.connect()
    record = WorkerRecord(
        worker_id=f"{socket.gethostname()}-sampler-{uuid.uuid4().hex[:8]}",
        pool=pool,
        base_model=args.base_model,
        arch="",
        vocab_size=backend.vocab_size,
        max_context=backend.max_context,
        max_rank=args.max_lora_rank,
        slots_total=args.max_loras,
        slots_used=0,
        heartbeat_at=time.time(),
        role="sampler",
        sampler_backend=backend.name,
    )
    service = SamplerService(bus, backend, pool, args.data_dir / "checkpoints")
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
        if closer is not None:
            await closer()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
