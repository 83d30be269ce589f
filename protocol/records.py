"""Records kept in the KV buckets: sessions, training runs, checkpoints, workers.

Written by the gateway (sessions, runs) and by workers (checkpoints, worker heartbeats), read by
both, so declared once here. msgpack-encoded; times are Unix seconds.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from protocol.api import LoraConfig
from protocol.images import VisionGeometry


class SessionRecord(msgspec.Struct):
    """A client session (one `ServiceClient`)."""

    session_id: str
    tenant_id: str
    created_at: float
    last_heartbeat: float
    tags: list[str] = []
    user_metadata: dict[str, str] = {}
    finished: bool = False
    sdk_version: str = ""
    finished_at: float | None = None
    finish_reason: str = (
        ""  # "success", "errored", "interrupted", or "expired" (heartbeats stopped)
    )


class RunRecord(msgspec.Struct):
    """A training run (one `model_id`), owned by one tenant."""

    model_id: str
    tenant_id: str
    session_id: str
    base_model: str
    lora: LoraConfig
    created_at: float
    last_request_time: float
    user_metadata: dict[str, str] = {}
    corrupted: bool = False
    unloaded_at: float | None = None  # its adapter left the worker (session finished)
    # set on a run made by `copy_weights`: the tinker:// path it copies (it is never trained)
    copied_from: str = ""


class CheckpointRecord(msgspec.Struct):
    """A saved checkpoint; `path` is its `tinker://` name, `directory` where the files are."""

    run_id: str
    tenant_id: str
    checkpoint_id: str  # "weights/<name>" or "sampler_weights/<name>"
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    path: str
    directory: str
    created_at: float
    size_bytes: int
    base_model: str
    lora: LoraConfig
    with_optimizer: bool = False
    public: bool = False
    expires_at: float | None = None
    user_metadata: dict[str, str] = {}
    # a fresh id per save: an overwritten name gets new content, and readers bound to the old
    # one (sampling sessions) keep reading it from `paths.version_dir`
    content_id: str = ""
    # in an artifact store (`directory` then empty): the files' key prefix
    # (`paths.checkpoint_key`) and the sha256 of its manifest
    store_key: str = ""
    sha256: str = ""


class SamplerRecord(msgspec.Struct):
    """A sampling session: a base model, optionally with a sampler checkpoint (immutable)."""

    sampling_session_id: str
    tenant_id: str
    session_id: str
    base_model: str
    model_path: str | None
    created_at: float
    content_id: str = ""  # the checkpoint content this session samples ("": whatever is current)


class WorkerRecord(msgspec.Struct):
    """A worker's heartbeat: which base model it serves and what the model accepts."""

    worker_id: str
    pool: str
    base_model: str
    arch: str
    vocab_size: int
    max_context: int
    max_rank: int
    slots_total: int
    slots_used: int
    heartbeat_at: float
    role: str = "trainer"  # "trainer" or "sampler"
    sampler_backend: str = ""  # "torch", "vllm", or "" when this process does not sample
    metrics_url: str = ""  # where this process serves Prometheus `/metrics` ("" if nowhere)
    # a vision-language model's image geometry and limits (None: a text model), which the
    # gateway reads image headers and counts their tokens with
    vision: VisionGeometry | None = None
    # LoRA config flags this base model cannot train (`train_mlp` where its experts are not a
    # layout the bank adapts), each with why: the gateway refuses such a create_model at once
    refused: dict[str, str] = msgspec.field(default_factory=dict)
    # the memory plan (`workers.engine.memory.plan_tokens`): the longest datum this worker
    # trains and the longest prompt + max_tokens its sampler runs (None: not planned)
    max_train_tokens: int | None = None
    max_sample_tokens: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode(record: msgspec.Struct) -> bytes:
    return _ENCODER.encode(record)


T = TypeVar("T")


def decode(data: bytes, type_: type[T]) -> T:
    return msgspec.msgpack.decode(data, type=type_)


# -- tenancy ------------------------------------------------------------------------------------


class TenantRecord(msgspec.Struct):
    """A tenant: the owner of sessions, runs, checkpoints and API keys (`tw_tenants`)."""

    name: str
    created_at: float
    display_name: str = ""


class KeyRecord(msgspec.Struct):
    """An API key, stored under the sha256 of the key (`tw_keys`): never the key itself.

    `prefix` is the key's first characters, enough for a person to tell keys apart in a list.
    """

    key_id: str
    tenant_id: str
    key_hash: str
    prefix: str
    created_at: float
    label: str = ""
    revoked_at: float | None = None


class QuotaRecord(msgspec.Struct, omit_defaults=True):
    """A tenant's limits (`tw_quotas`); `None` takes the deployment's default for that limit."""

    tenant_id: str
    max_adapters: int | None = None
    max_rank: int | None = None
    max_tokens_per_request: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_samples: int | None = None
    max_checkpoint_bytes: int | None = None


class PriceList(msgspec.Struct):
    """The operator's prices (`tw_quotas`, key `subjects.PRICES_KEY`): what a million tokens of
    each kind costs, in `currency` (a code of 1 to 8 capital letters). `train`: tokens of
    `forward_backward` passes; `forward`: tokens of forward-only passes; `sample`: tokens
    generated by samplers. One list for every tenant; none set costs nothing."""

    currency: str = "USD"
    train: float = 0.0
    forward: float = 0.0
    sample: float = 0.0


class UsageRecord(msgspec.Struct):
    """What one worker ran for one tenant, cumulative since the worker started counting.

    Each worker writes its own key (`tw_usage`, `<tenant>.<worker>`), so no two writers share a
    counter; a tenant's usage is the sum over its keys.
    """

    tenant_id: str
    worker_id: str
    tokens_trained: int = 0
    tokens_forward: int = 0
    forward_backward_requests: int = 0
    optim_steps: int = 0
    samples: int = 0
    sampled_tokens: int = 0
    updated_at: float = 0.0


class UsageHistory(msgspec.Struct):
    """Hourly snapshots of one worker's counters for one tenant (`tw_usage`,
    `hist.<tenant>.<worker_token>`), kept by the gateways for the billing usage API.

    `snapshots` holds, per UTC hour, the last cumulative `UsageRecord` seen in that hour, oldest
    first and at most a bounded number; `baseline` is the last snapshot dropped off the front
    (None: the counters started from zero), so the first kept hour still has a difference.
    """

    tenant_id: str
    worker_id: str
    snapshots: list[UsageRecord] = []
    baseline: UsageRecord | None = None
    base_model: str = ""


class RateBucket(msgspec.Struct):
    """A tenant's training-token bucket (`tw_usage`, `rate.<tenant>`): level and when measured.

    The level may go negative: that debt is the queue of accepted work not yet allowed to run.
    """

    level: float
    updated_at: float


class InFlightSamples(msgspec.Struct):
    """A tenant's sample requests in flight on the whole cluster (`tw_usage`, `inflight.<tenant>`):
    request id -> when a gateway admitted it (Unix seconds), for `max_concurrent_samples`."""

    started: dict[str, float] = {}


# -- crash transparency ---------------------------------------------------------------------------


class LeaseRecord(msgspec.Struct):
    """Who owns one shard of a pool's ops (`tw_leases`, key `<pool>.<shard>`), until when.

    Renewed by its owner well before `expires_at`; anyone may take an expired lease over with
    a compare-and-set on the entry's revision.
    """

    pool: str
    shard: int
    worker_id: str
    expires_at: float
    claimed_at: float


class SnapshotRecord(msgspec.Struct):
    """A model's latest state snapshot (`tw_runs`, key `snap.<model_token>`).

    `applied_seq` is the last op the state includes and `stream_seq` its position in `TW_OPS`:
    a worker taking the model over restores the files and replays the model's logged ops after
    `stream_seq`. The files are written before this record, so the record is the commit point.
    """

    model_id: str
    applied_seq: int
    stream_seq: int
    directory: str
    step: int
    created_at: float
    worker_id: str = ""
    store_key: str = ""  # in an artifact store (`directory` then empty): `paths.snapshot_key`
