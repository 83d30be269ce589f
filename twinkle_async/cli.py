"""The `twinkle-async` command: `up`, `gateway`, `worker`, `make-tiny-model`.

`worker` and `make-tiny-model` exec `python -m workers...` so this process never imports torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import urllib.parse
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from protocol import paths, topology
from protocol.devices import check_devices
from twinkle_async.settings import (
    BusSettings,
    GatewaySettings,
    bus_from_env,
    load_api_keys,
    quota_defaults_from_env,
)

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Twinkle Async: a Tinker-API training backend."
)


# Gateway options `up` passes on as they are: declared once, used by both commands.
SessionTimeoutS = Annotated[
    float, typer.Option(help="finish a session whose heartbeats stop for this long")
]
SweepIntervalS = Annotated[float, typer.Option(help="how often expired sessions are looked for")]
RateBurstS = Annotated[
    float, typer.Option(help="seconds' worth of tokens_per_minute a tenant may burst")
]
LongPollS = Annotated[
    float, typer.Option(help="how long retrieve_future holds a poll (under the SDK's 45 s)")
]


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def _until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` until it returns or SIGINT/SIGTERM cancels it (its clean-up runs)."""
    task = asyncio.ensure_future(main)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def _nats_url(value: str | None) -> str | None:
    if value is not None:
        try:
            topology.nats_servers(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    return value


def _artifact_store(value: str | None) -> str | None:
    if value:
        try:
            paths.parse_store_url(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    return value or None


def _endpoint_url(value: str | None) -> str | None:
    if value:
        parts = urllib.parse.urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise typer.BadParameter(f"{value!r} is not an http(s)://HOST[:PORT] URL")
    return value or None


def _run(coro: object) -> None:
    import uvloop

    try:
        uvloop.run(coro)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        pass


@app.command()
def up(
    base_model: Annotated[
        list[str], typer.Option("--base-model", help="model id or local dir; repeat for several")
    ],
    host: Annotated[str, typer.Option(help="address the gateway binds")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gateway port (0 picks a free one)")] = 8000,
    data_dir: Annotated[Path, typer.Option(help="NATS store and checkpoints")] = Path("data"),
    api_key: Annotated[
        str | None, typer.Option(help="the tml-... key clients use (generated if absent)")
    ] = None,
    ready_file: Annotated[
        Path | None, typer.Option(help="write base_url and api_key here as JSON once ready")
    ] = None,
    key_file: Annotated[
        Path | None, typer.Option(help="more keys for more tenants: lines of 'tml-KEY TENANT'")
    ] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(envvar="TWINKLE_ADMIN_KEY", help="guards /admin/v1 (generated if absent)"),
    ] = None,
    session_timeout_s: SessionTimeoutS = 120.0,
    sweep_interval_s: SweepIntervalS = 10.0,
    rate_burst_s: RateBurstS = 60.0,
    long_poll_s: LongPollS = 30.0,
    max_slots: Annotated[
        int | None,
        typer.Option(
            min=1, help="adapter slots per worker (default: what the device's free memory holds)"
        ),
    ] = None,
    max_rank: Annotated[int, typer.Option(help="largest LoRA rank a worker accepts")] = 32,
    max_parked: Annotated[
        int | None,
        typer.Option(min=0, help="adapters a worker parks in host memory (default: no bound)"),
    ] = None,
    fwdbwd_max_chunk_len: Annotated[
        int, typer.Option(help="datums per forward_backward chunk (client/config)")
    ] = 1024,
    threads: Annotated[int, typer.Option(help="torch threads per worker (0 = torch default)")] = 0,
    token_budget: Annotated[
        int, typer.Option(min=0, help="token positions of one pass (0: measured per device)")
    ] = 0,
    memory_limit_mib: Annotated[
        int,
        typer.Option(
            min=0,
            help="plan each worker's longest datum and sample in at most this much free memory"
            " (0: all of it)",
        ),
    ] = 0,
    sampler: Annotated[
        Literal["torch", "vllm", "none"],
        typer.Option(help="torch (in the trainer), vllm (own process) or none"),
    ] = "torch",
    checkpoint_sweep_s: Annotated[
        float, typer.Option(min=0, help="seconds between sweeps of expired checkpoints (0: none)")
    ] = 60.0,
    workers: Annotated[
        int, typer.Option("--workers", min=1, help="trainer worker processes per base model")
    ] = 1,
    devices: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="devices (ranks) per trainer worker: a MoE model's experts split over them",
        ),
    ] = 1,
    nats_url: Annotated[
        str | None,
        typer.Option(
            callback=_nats_url,
            help="use this NATS (JetStream on; a cluster's node URLs separated by commas)"
            " instead of starting one under --data-dir",
        ),
    ] = None,
    nats_cluster: Annotated[
        int,
        typer.Option(
            min=1,
            max=5,
            help="start a JetStream cluster of this many nodes on loopback (1: one server)",
        ),
    ] = 1,
    nats_replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=5,
            help="copies of every stream and bucket (default: the --nats-cluster size, else 1)",
        ),
    ] = None,
    artifact_store: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_ARTIFACT_STORE",
            callback=_artifact_store,
            help="s3://BUCKET/PREFIX for checkpoints and snapshots (endpoint and keys from"
            " AWS_*); each worker then has a data directory of its own",
        ),
    ] = None,
    bus_retry_s: Annotated[
        float,
        typer.Option(min=0, help="how long the gateway retries a bus call while NATS is away"),
    ] = 10.0,
    twinkle_python: Annotated[
        Path | None,
        typer.Option(
            help="an interpreter with twinkle-kit: runs the processor service of Twinkle's"
            " client (remote datasets) on the datasets under --twinkle-data",
        ),
    ] = None,
    twinkle_data: Annotated[
        Path | None,
        typer.Option(
            help="the datasets Twinkle's clients may load (default <data-dir>/twinkle-data)"
        ),
    ] = None,
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Start NATS, the gateway and the workers, restart any that dies; stop all on Ctrl-C."""
    from twinkle_async.up import UpOptions, run_up

    _logging(log_level)
    if nats_url and nats_cluster > 1:
        raise typer.BadParameter("--nats-cluster starts a cluster; --nats-url uses one: not both")
    if nats_url is None and nats_replicas is not None and nats_replicas > nats_cluster:
        raise typer.BadParameter(
            f"--nats-replicas {nats_replicas} needs at least that many nodes"
            f" (--nats-cluster {nats_cluster})"
        )
    for model in base_model:  # a local model whose experts the devices cannot share
        config = Path(model) / "config.json"
        if devices > 1 and config.is_file():
            try:
                check_devices(json.loads(config.read_text()), devices)
            except ValueError as exc:
                raise typer.BadParameter(f"{model}: {exc}") from exc
    if api_key is not None and not api_key.startswith("tml-"):
        raise typer.BadParameter(
            "the API key must start with 'tml-' (the tinker SDK refuses others)"
        )
    worker_args = [
        *(["--max-slots", str(max_slots)] if max_slots is not None else []),
        "--max-rank",
        str(max_rank),
        "--log-level",
        log_level,
    ]
    sampler_backend: str | None = "vllm" if sampler == "vllm" else None
    if devices > 1:
        worker_args += ["--devices", str(devices)]
    if sampler != "torch":
        # Only the sampler asked for serves the pool: a trainer that also took sample jobs
        # would answer some of them with the other backend (another RNG: a seeded request's
        # tokens would depend on which process took it; adapters vLLM refuses would pass).
        worker_args += ["--sampler", "none"]
    if threads:
        worker_args += ["--threads", str(threads)]
    if token_budget:
        worker_args += ["--token-budget", str(token_budget)]
    if memory_limit_mib:
        worker_args += ["--memory-limit-mib", str(memory_limit_mib)]
    if max_parked is not None:
        worker_args += ["--max-parked", str(max_parked)]
    if key_file is not None:
        load_api_keys(key_file, None)  # a bad key file fails here, not in the gateway child
    options = UpOptions(
        base_models=base_model,
        host=host,
        port=port,
        data_dir=data_dir,
        api_key=api_key,
        admin_key=admin_key,
        session_timeout_s=session_timeout_s,
        sweep_interval_s=sweep_interval_s,
        rate_burst_s=rate_burst_s,
        long_poll_s=long_poll_s,
        key_file=key_file,
        ready_file=ready_file,
        worker_args=worker_args,
        fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
        sampler_backend=sampler_backend,
        sampler_args=["--max-lora-rank", str(max_rank), "--log-level", log_level],
        checkpoint_sweep_s=checkpoint_sweep_s or None,
        workers_per_model=workers,
        nats_url=nats_url,
        nats_cluster=nats_cluster,
        nats_replicas=nats_replicas or (1 if nats_url else nats_cluster),
        artifact_store=artifact_store,
        bus_retry_s=bus_retry_s,
        log_level=log_level,
        twinkle_python=twinkle_python,
        twinkle_data=twinkle_data,
    )
    _run(run_up(options))


@app.command()
def gateway(
    nats_url: Annotated[
        str | None,
        typer.Option(
            callback=_nats_url,
            help="NATS URL, or a cluster's node URLs separated by commas"
            " (default $TWINKLE_NATS_URL)",
        ),
    ] = None,
    nats_replicas: Annotated[
        int | None,
        typer.Option(
            envvar="TWINKLE_NATS_REPLICAS",
            min=1,
            max=5,
            help="copies of every stream and bucket (default 1; needs a cluster of as many nodes)",
        ),
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    api_key: Annotated[str | None, typer.Option(help="a tml-... key for tenant 'default'")] = None,
    key_file: Annotated[Path | None, typer.Option(help="lines of 'tml-KEY TENANT'")] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_ADMIN_KEY", help="guards /admin/v1 (none: the admin API is off)"
        ),
    ] = None,
    session_timeout_s: SessionTimeoutS = 120.0,
    sweep_interval_s: SweepIntervalS = 10.0,
    rate_burst_s: RateBurstS = 60.0,
    long_poll_s: LongPollS = 30.0,
    base_model: Annotated[
        list[str] | None, typer.Option("--base-model", help="advertise before a worker reports in")
    ] = None,
    fwdbwd_max_chunk_len: Annotated[int, typer.Option()] = 1024,
    max_request_elements: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="tensor elements one forward_backward may declare (default: the chunk size in bytes)",
        ),
    ] = None,
    ready_file: Annotated[
        Path | None, typer.Option(help="write the base URL here as JSON once listening")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="TWINKLE_DATA_DIR",
            help="the workers' data directory: checkpoints are under <data-dir>/checkpoints",
        ),
    ] = None,
    checkpoint_root: Annotated[
        Path | None,
        typer.Option(
            help="checkpoint files, to delete, copy and serve (default <data-dir>/checkpoints)"
        ),
    ] = None,
    checkpoint_sweep_s: Annotated[
        float, typer.Option(min=0, help="seconds between sweeps of expired checkpoints (0: none)")
    ] = 60.0,
    download_secret: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_DOWNLOAD_SECRET",
            help="HMAC key of signed download URLs; gateways behind one address share it"
            " (default: random per process)",
        ),
    ] = None,
    public_url: Annotated[
        str | None,
        typer.Option(help="base URL clients reach this gateway at (default: the request's host)"),
    ] = None,
    artifact_store: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_ARTIFACT_STORE",
            callback=_artifact_store,
            help="s3://BUCKET/PREFIX the workers save checkpoints in (endpoint and keys from"
            " AWS_*): downloads, copies and deletes go there",
        ),
    ] = None,
    artifact_public_url: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_ARTIFACT_PUBLIC_URL",
            callback=_endpoint_url,
            help="the S3 endpoint clients reach, when it differs from AWS_ENDPOINT_URL"
            " (presigned download URLs are signed for it)",
        ),
    ] = None,
    bus_retry_s: Annotated[
        float,
        typer.Option(
            min=0,
            envvar="TWINKLE_BUS_RETRY_S",
            help="how long a bus call is retried while NATS is away before answering 503",
        ),
    ] = 10.0,
    processor_url: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_PROCESSOR_URL",
            help="the Twinkle processor service the processor routes forward to",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Serve the Tinker HTTP API over a running NATS."""
    from twinkle_async.gateway.app import serve

    _logging(log_level)
    settings = GatewaySettings(
        host=host,
        port=port,
        api_keys=load_api_keys(key_file, api_key),
        base_models=tuple(base_model or ()),
        fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
        max_request_elements=max_request_elements,
        admin_key=admin_key or None,  # an empty TWINKLE_ADMIN_KEY leaves the admin API off
        quota_defaults=quota_defaults_from_env(),
        session_timeout_s=session_timeout_s,
        sweep_interval_s=sweep_interval_s,
        rate_burst_s=rate_burst_s,
        long_poll_s=long_poll_s,
        bus=dataclasses.replace(
            bus_from_env(nats_url, nats_replicas)
            if nats_url or os.environ.get("TWINKLE_NATS_URL")
            else BusSettings(nats_replicas=nats_replicas or 1),
            retry_s=bus_retry_s,
        ),
        checkpoint_root=checkpoint_root or (data_dir / "checkpoints" if data_dir else None),
        checkpoint_sweep_s=checkpoint_sweep_s or None,
        public_url=public_url,
        artifact_store=artifact_store,
        artifact_public_url=artifact_public_url,
        processor_url=processor_url,
        processor_secret=os.environ.get("TWINKLE_PROCESSOR_SECRET", ""),
    )
    if download_secret:
        settings = dataclasses.replace(settings, download_secret=download_secret.encode())

    def on_ready(base_url: str) -> None:
        print(f"gateway listening on {base_url}", flush=True)
        if ready_file is not None:  # atomically: `up` reads it as soon as it appears
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"base_url": base_url}))
            tmp.replace(ready_file)

    _run(_until_signal(serve(settings, on_ready=on_ready)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(ctx: typer.Context) -> None:
    """Run a trainer worker: `twinkle-async worker --base-model ID [--nats-url ...]`."""
    os.execv(sys.executable, [sys.executable, "-m", "workers", *ctx.args])


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sampler(ctx: typer.Context) -> None:
    """Run a sampler: `twinkle-async sampler --base-model ID --backend vllm [--nats-url ...]`."""
    os.execv(sys.executable, [sys.executable, "-m", "workers.sampler.main", *ctx.args])


# The architectures `workers.tiny_model` builds, repeated here because the gateway side never
# imports `workers`; a test checks that the two lists agree.
TinyArch = Literal[
    "qwen3",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_5_moe",
    "gpt_oss",
    "qwen3_5_vl",
    "qwen3_5_moe_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llama",
    "deepseek_v3",
    "glm_moe_dsa",
    "deepseek_v4",
    "nemotron_h",
    "kimi_k25",
    "inkling_mm_model",
]


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path,
    arch: Annotated[
        TinyArch,
        typer.Option(
            help="architecture; the MoE ones: qwen3_moe, qwen3_5_moe, gpt_oss, qwen3_5_moe_vl, "
            "qwen3_vl_moe, deepseek_v3, glm_moe_dsa, deepseek_v4, nemotron_h, kimi_k25, "
            "inkling_mm_model; vision-language: qwen3_5_vl, qwen3_5_moe_vl, qwen3_vl, "
            "qwen3_vl_moe, kimi_k25, inkling_mm_model"
        ),
    ] = "qwen3",
    num_experts: Annotated[
        int | None, typer.Option(min=1, help="MoE archs: routed experts (default 8)")
    ] = None,
    top_k: Annotated[
        int | None, typer.Option(min=1, help="MoE archs: experts per token (default 2)")
    ] = None,
    moe_intermediate_size: Annotated[
        int | None, typer.Option(min=1, help="MoE archs: width of each expert (default 48)")
    ] = None,
) -> None:
    """Write a small random model and tokenizer, built offline, to DIRECTORY."""
    argv = [sys.executable, "-m", "workers.tiny_model", str(directory), "--arch", arch]
    for flag, value in (
        ("--num-experts", num_experts),
        ("--top-k", top_k),
        ("--moe-intermediate-size", moe_intermediate_size),
    ):
        if value is not None:
            argv += [flag, str(value)]
    os.execv(sys.executable, argv)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
