"""The Tinker REST bodies: training runs, checkpoints and their lifecycle, sessions.

What `GET /training_runs`, `/checkpoints`, a checkpoint's TTL, its signed download URLs,
`copy_weights` and the session listings read and write, declared as in `protocol.api` (whose
bases, conventions and codec they share: lenient requests, strict responses, ISO-8601 times with
a timezone). The bodies of the asynchronous calls (futures) are in `protocol.api`.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from protocol.api import ADAMW, CheckpointType, OptimizerConfig, RequestBody, ResponseBody


def utc_aware(value: datetime) -> datetime:
    """A naive datetime is taken as UTC so that it is always written with a timezone."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class Checkpoint(ResponseBody, frozen=True):
    """A stored checkpoint; `checkpoint_id` is `<segment>/<name>` and contains a slash."""

    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None
    twinkle_path: str = ""  # the same path as Twinkle's clients name it (`twinkle://…`)

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "time", utc_aware(self.time))
        if self.expires_at is not None:
            msgspec.structs.force_setattr(self, "expires_at", utc_aware(self.expires_at))


class TrainingRun(ResponseBody, frozen=True):
    """A training model as the REST API lists it; `training_run_id` equals its `model_id`."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "last_request_time", utc_aware(self.last_request_time))


class Cursor(ResponseBody, frozen=True):
    """Pagination of a listing."""

    offset: int
    limit: int
    total_count: int


class TrainingRunsResponse(ResponseBody, frozen=True):
    """`GET /training_runs`; the cursor is required."""

    training_runs: list[TrainingRun]
    cursor: Cursor


class CheckpointsListResponse(ResponseBody, frozen=True):
    """`GET /training_runs/{id}/checkpoints` (and `/checkpoints`)."""

    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class WeightsInfoResponse(ResponseBody, frozen=True):
    """What a checkpoint needs to be loaded."""

    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfig = ADAMW
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


# -- one checkpoint's lifecycle, copies, sessions -----------------------------------------


class CheckpointTtlRequest(RequestBody, frozen=True):
    """Body of `PUT /training_runs/{run}/checkpoints/{checkpoint_id}/ttl`; null clears the TTL."""

    ttl_seconds: int | None


class ExternalWeightsUrlsResponse(ResponseBody, frozen=True):
    """A signed download URL per file of a checkpoint, keyed by file name, valid until `expires`."""

    urls: dict[str, str]
    expires: datetime

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "expires", utc_aware(self.expires))


class CopyWeightsRequest(RequestBody, frozen=True):
    """Copy a checkpoint into a new, untrainable run: in a session (`session_id` +
    `model_seq_id`) or, without one, for a `destination_project_id`."""

    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class CopyWeightsResponse(ResponseBody, frozen=True):
    """The answer of `copy_weights` (synchronous): where the copy is."""

    tinker_path: str


class ListSessionsResponse(ResponseBody, frozen=True):
    """`GET /sessions`: the caller's session ids, newest first."""

    sessions: list[str]


class GetSessionResponse(ResponseBody, frozen=True):
    """`GET /sessions/{session_id}`: what the session created."""

    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
