"""Worker settings, built once in `main()` from flags and `TWINKLE_*` variables, then passed down.

Both worker entry points (`workers/__main__.py`, the trainer; `workers/sampler/main.py`, a
sampler process) declare their options once, as the parameters of a function that returns a
`WorkerSettings` (Typer options with `envvar="TWINKLE_..."`: a flag wins over its variable, the
variable over the default). `parse` turns a command line into settings and runs nothing (tests,
the compose check); `run` parses and hands the settings to the process's serve function. Only
this module and those option declarations read the environment.
"""

from __future__ import annotations

import functools
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from protocol import paths, subjects, topology

if TYPE_CHECKING:
    from workers.artifacts import ArtifactStore


def _nats_url(value: str) -> str:
    try:
        topology.nats_servers(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return value


# Where NATS is: one URL, or a comma-separated list of a cluster's nodes.
NatsUrl = Annotated[
    str,
    typer.Option(
        envvar="TWINKLE_NATS_URL",
        callback=_nats_url,
        help="NATS URL, or a cluster's node URLs separated by commas",
    ),
]


def _artifact_store(value: str | None) -> str | None:
    if value:
        try:
            paths.parse_store_url(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    return value or None


# Where checkpoints and snapshots live when not on a local (or shared) disk.
ArtifactStoreUrl = Annotated[
    str | None,
    typer.Option(
        envvar="TWINKLE_ARTIFACT_STORE",
        callback=_artifact_store,
        help="s3://BUCKET/PREFIX for checkpoints and snapshots (endpoint and keys from AWS_*);"
        " default: DATA_DIR/checkpoints",
    ),
]
ArtifactCacheBytes = Annotated[
    int,
    typer.Option(
        envvar="TWINKLE_ARTIFACT_CACHE_BYTES",
        min=0,
        help="local cache of files read from the artifact store, in bytes",
    ),
]
ArtifactStoreWaitS = Annotated[
    float,
    typer.Option(
        envvar="TWINKLE_ARTIFACT_STORE_WAIT_S",
        min=0.0,
        help="a save or load waits this long for an artifact store that is away, then fails"
        " (retryable)",
    ),
]

# A shard lease outlives a NATS node's crash on a cluster: the bucket's leader election
# (4-9 s), noticing a silent host (`topology.PING_INTERVAL_S` x `MAX_OUTSTANDING_PINGS`, 6 s)
# and a reconnect fit in 30 s with a renewal (every lease_s / 4) to spare; on one server the
# lease only has to outlast a renewal's hiccup.
LEASE_S_ONE_SERVER = 10.0
LEASE_S_CLUSTER = 30.0


def default_lease_s(nats_replicas: int) -> float:
    """The shard lease a worker takes when `--lease-s` is not given."""
    return LEASE_S_ONE_SERVER if nats_replicas <= 1 else LEASE_S_CLUSTER


# An option both entry points declare: how long a job taken by a worker that stopped answering
# it (a crash) stays with that worker; a live worker keeps its jobs (`in_progress`) meanwhile.
AckWaitS = Annotated[
    float,
    typer.Option(
        envvar="TWINKLE_ACK_WAIT_S",
        min=1.0,
        help="a job its worker stopped answering (a crash) is handed out again after this",
    ),
]

# Both entry points sample: a request sampling longer than this stops the process (the engine
# cannot be interrupted); it is restarted, the request runs alone, and after `max_attempts`
# such stops it fails (`workers.sampler.guard`).
SampleTimeoutS = Annotated[
    float,
    typer.Option(
        envvar="TWINKLE_SAMPLE_TIMEOUT_S",
        min=0.1,
        help="a sample request sampling longer than this stops its sampler (restarted)",
    ),
]


# A vision-language model's limits on images: an image declaring more pixels is refused from
# its header, before any decoding; so is a request with more images.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES = 16
MaxImagePixels = Annotated[
    int,
    typer.Option(
        envvar="TWINKLE_MAX_IMAGE_PIXELS",
        min=1,
        help="a vision-language model refuses images declaring more pixels (from the header)",
    ),
]
MaxImagesPerRequest = Annotated[
    int,
    typer.Option(
        envvar="TWINKLE_MAX_IMAGES_PER_REQUEST",
        min=1,
        help="a vision-language model refuses requests with more images",
    ),
]


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker serves, how it batches, and where it publishes its metrics.

    A sampler process reads the same fields: `sampler` is its backend, `max_slots` the adapters
    it keeps loaded, `max_rank` the largest LoRA rank it accepts.
    """

    base_model: str
    nats_url: str = "nats://127.0.0.1:4222"
    data_dir: Path = Path("data")
    n_shards: int = subjects.DEFAULT_SHARDS
    max_slots: int | None = None  # trainer: None plans them from free memory; sampler: 8
    max_rank: int = 32
    max_parked: int | None = None  # adapters parked in host memory beyond the slots (None: any)
    device: str = "cpu"
    devices: int = 1  # ranks of one base model (a worker group: `workers.group`)
    group_timeout_s: float = 600.0  # a group's collective waiting longer fails (the group stops)
    threads: int | None = None
    token_budget: int | None = (
        None  # tokens of one pass (None: measured, `workers.trainer.calibration`)
    )
    # at most this much of the device's memory plans the longest datum and sequence
    # (`workers.engine.memory.plan_tokens`; None: what the device has free)
    memory_limit_mib: int | None = None

    @property
    def memory_limit(self) -> int | None:
        """`memory_limit_mib` in bytes (None: unset)."""
        return None if self.memory_limit_mib is None else self.memory_limit_mib * 2**20

    merge: bool = True  # False: each pass and fused step holds one model's work (a baseline)
    gap_timeout_s: float = 120.0
    ack_wait_s: float = 120.0
    heartbeat_s: float = 5.0
    sampler: str = "torch"  # the in-process sampler: "torch", or "" for none
    # crash transparency: shard leases, state snapshots, the pass watchdog, poison ops
    lease_s: float = 10.0  # a dead worker's shards are taken over after this long
    lease_renew_s: float = 2.5
    snapshot_every: int = 5  # optim_steps between a model's state snapshots (and every save_state)
    # ... and at least this long between them: a crash replays at most this much more training
    snapshot_min_s: float = 1.0
    snapshot_idle_s: float = (
        60.0  # a model that changed since its snapshot, idle this long: snapshot
    )
    pass_timeout_s: float = 600.0  # an engine call running longer stops the worker (restarted)
    max_attempts: int = 3  # an op that stopped the worker this often fails instead of running
    sample_timeout_s: float = 600.0  # a sample request running longer stops its sampler
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # per image, from its header
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: a free port chosen by the OS (reported in the heartbeat)
    log_level: str = "INFO"
    # checkpoints and snapshots in an S3 store (`workers.artifacts`); None: `checkpoint_root`
    artifact_store: str | None = None
    artifact_cache_bytes: int = 16 * 1024**3
    # an outage of the store: how long a call keeps trying before it fails, retryable
    artifact_store_wait_s: float = 30.0
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")

    @property
    def pool(self) -> str:
        return subjects.pool_of(self.base_model)

    @property
    def checkpoint_root(self) -> Path:
        return self.data_dir / "checkpoints"

    def open_store(self) -> ArtifactStore | None:
        """The artifact store these settings name, None for the local directory."""
        if self.artifact_store is None:
            return None
        from workers.artifacts import ArtifactStore

        return ArtifactStore(
            self.artifact_store,
            self.data_dir / "artifact-cache",
            self.artifact_cache_bytes,
            wait_s=self.artifact_store_wait_s,
        )


Options = Callable[..., WorkerSettings]


def _app(command: Callable[..., Any]) -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    return app


def parse(options: Options, argv: Sequence[str], prog: str) -> WorkerSettings:
    """The settings a command line (and the `TWINKLE_*` variables) asks for; runs nothing.

    A bad command line raises Typer's usage error; `--help` prints the help and exits.
    """
    result = _app(options)(args=list(argv), prog_name=prog, standalone_mode=False)
    if not isinstance(result, WorkerSettings):
        raise SystemExit(result)
    return result


def run(
    options: Options, serve: Callable[[WorkerSettings], None], argv: Sequence[str], prog: str
) -> None:
    """Parse the command line like `parse`, then `serve(settings)`; usage errors exit 2."""

    @functools.wraps(options)  # Typer reads the options from the wrapped signature
    def command(*args: Any, **kwargs: Any) -> None:
        serve(options(*args, **kwargs))

    _app(command)(args=list(argv), prog_name=prog)
