"""Records kept in the KV buckets: sessions, training runs, checkpoints, workers.

Written by the gateway (sessions, runs) and by workers (checkpoints, worker heartbeats), read by
both, so declared once here. msgpack-encoded; times are Unix seconds.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from protocol.api import LoraConfig


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


_ENCODER = msgspec.msgpack.Encoder()


def encode(record: msgspec.Struct) -> bytes:
    return _ENCODER.encode(record)


T = TypeVar("T")


def decode(data: bytes, type_: type[T]) -> T:
    return msgspec.msgpack.decode(data, type=type_)
