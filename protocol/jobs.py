"""Bus messages: the jobs the gateway publishes and the outcomes workers write back.

Step 1 (gateway): an HTTP request becomes one `Job` (a tagged union), msgpack-encoded and
published to `tw.v1.ops.<pool>.<shard>.<model_token>` with `Nats-Msg-Id = <model_id>/<seq_id>`.
Step 2 (worker): the job runs in `seq_id` order per model.
Step 3 (worker): its `Outcome` is written to KV `tw_futures` under `res.<request_id>`; the
gateway, watching the bucket, answers `retrieve_future` from it.

A forward_backward job carries the client's protobuf body as is (token ids stay packed int32
bytes). Fields are appended with defaults only, so old and new processes can talk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import msgspec

from protocol.api import AdamParams, LoraConfig
from protocol.custom_loss import CustomLoss
from protocol.errors import ErrorCategory
from protocol.tensors import DEFAULT_MAX_REQUEST_ELEMENTS


class JobBase(msgspec.Struct, frozen=True, tag_field="op"):
    """Fields every op carries. `seq_id` orders a model's ops; creation is seq 0."""

    request_id: str
    model_id: str
    tenant_id: str
    seq_id: int
    published_at: float = 0.0


class CreateModelJob(JobBase, frozen=True, tag="create_model"):
    """Allocate an adapter slot with fresh LoRA weights."""

    base_model: str = ""
    lora: LoraConfig = LoraConfig()


class ForwardBackwardJob(JobBase, frozen=True, tag="forward_backward"):
    """One chunk of a `forward_backward` or `forward`: the SDK's protobuf body, decompressed."""

    body: bytes = b""
    forward_only: bool = False
    n_tokens: int = 0
    max_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS  # the budget the gateway checked it against
    # the tenant's rate limit lets it start then (Unix seconds; 0: at once), and why
    not_before: float = 0.0
    queue_reason: str = ""
    # stable_reinforce: the recorded runs behind the datums' sampled spans
    # (`protocol.stability.encode_slices`), resolved by the gateway
    provenance: bytes = b""
    # loss_fn "custom": the validated graph its loss_id names, so the worker looks nothing up
    custom_loss: CustomLoss | None = None


class StepAdam(AdamParams, frozen=True):
    """A step's Adam settings, with `coupled_weight_decay`: the decay added to the gradient (an
    L2 penalty, torch's `Adam`) instead of applied to the weights (`AdamW`, Tinker's)."""

    coupled_weight_decay: bool = False


class OptimStepJob(JobBase, frozen=True, tag="optim_step"):
    """Apply the accumulated gradients of this model with its own AdamW settings; `discard`:
    clear them without a step (a Twinkle client's `zero_grad` before its `step`);
    `coupled_weight_decay`: decay as torch's `Adam` does (a Twinkle client's `Adam`)."""

    adam: AdamParams = AdamParams()
    discard: bool = False
    coupled_weight_decay: bool = False

    def step_adam(self) -> AdamParams:
        """The settings the optimizer steps with."""
        if not self.coupled_weight_decay:
            return self.adam
        return StepAdam(**msgspec.structs.asdict(self.adam), coupled_weight_decay=True)


class SaveWeightsJob(JobBase, frozen=True, tag="save_weights"):
    """Write a checkpoint: `weights` (adapter + optimizer), `sampler_weights` or
    `external_weights` (both the PEFT adapter only; external is `save_weights_external`)."""

    name: str = ""
    kind: Literal["weights", "sampler_weights", "external_weights"] = "weights"
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = {}
    # set for save_weights_and_get_sampling_client: the result names this session, not a path
    sampling_session_id: str = ""
    overwrite: bool = False  # replace an existing checkpoint of this name (else a user error)


class LoadWeightsJob(JobBase, frozen=True, tag="load_weights"):
    """Load a checkpoint into this model; `create` makes the model (create-via-load, seq 0)."""

    path: str = ""
    with_optimizer: bool = False
    create: bool = False
    base_model: str = ""
    content_id: str = ""  # the checkpoint's content when the load was asked (artifact stores)


class UnloadModelJob(JobBase, frozen=True, tag="unload_model"):
    """Release the model's slot (session finished or expired, or an older SDK's unload_model).

    With `save_as`, the adapter and optimizer state are first saved as the training checkpoint
    `tinker://<model_id>/weights/<save_as>` (replacing one of that name), so nothing is lost.
    """

    save_as: str = ""


class TombstoneJob(JobBase, frozen=True, tag="tombstone"):
    """Settles a `seq_id` the gateway refused: the worker treats it as applied, runs nothing.

    The SDK numbers a call before sending it, so without this a refused call would leave a hole
    that stalls the model's next call. `error` and `category` are the refusal, which the
    refused call's future also holds; `request_type` is the call that was refused.
    """

    request_type: str = ""
    error: str = ""
    category: ErrorCategory = ErrorCategory.USER


class ImportAdapterJob(JobBase, frozen=True, tag="import_adapter"):
    """Make an uploaded PEFT adapter the training checkpoint `tinker://<model_id>/weights/<name>`.

    The gateway staged the upload's two files in `<checkpoint root>/.imports/<staging_id>/`
    (with an artifact store: under `import_staging_key`, with a manifest); the worker checks them against its model (shapes, rank cap, finite values), writes the
    checkpoint with fresh optimizer state and answers its record. Seq 0 of a run that is never
    trained: the tenant loads the checkpoint into a new training client.
    """

    staging_id: str = ""
    name: str = ""
    base_model: str = ""
    max_bytes: int = 0  # the checkpoint's files may not take more (0: no limit)


AdapterLayout = Literal["peft", "per-expert", "tinker"]
"""How an adapter file lays out a fused MoE block's expert LoRA (`workers.trainer.expert_files`):
PEFT's `target_parameters` (what checkpoints hold), 2-D keys per expert, or Tinker's 3-D tensors.
Adapters without fused experts are the same in all three."""
ADAPTER_LAYOUTS: tuple[AdapterLayout, ...] = ("peft", "per-expert", "tinker")


class ExportMergedJob(JobBase, frozen=True, tag="export_merged"):
    """Merge a checkpoint's adapter into the base model and write the whole model
    (safetensors, config, tokenizer) to `<checkpoint root>/.exports/<export_id>/`; with a
    `layout`, write the adapter folder in that layout there instead. With an artifact store,
    the checkpoint is read from it and the files go to it, under `merged_export_key`.

    `model_id` is a one-off id of the export, not a run: the job is its only op.
    """

    path: str = ""  # the checkpoint, tinker://...
    export_id: str = ""
    layout: AdapterLayout | None = None  # None: the merged model
    content_id: str = ""  # the checkpoint's content, for one in the artifact store


Job = (
    CreateModelJob
    | ForwardBackwardJob
    | OptimStepJob
    | SaveWeightsJob
    | LoadWeightsJob
    | UnloadModelJob
    | TombstoneJob
    | ImportAdapterJob
    | ExportMergedJob
)


class TextPrompt(msgspec.Struct, frozen=True):
    """A prompt as text (an OpenAI-compatible request): the sampler tokenizes `text`, or the
    chat `messages` with the base model's chat template, and answers text
    (`protocol.text_sampling`)."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    # the sampler publishes each sequence's text as it grows (`subjects.sample_stream_subject`)
    stream: bool = False


class SampleJob(msgspec.Struct, frozen=True):
    """One `asample`, on `tw.v1.sample.<pool>`: taken by any sampler of the pool.

    `adapter_path` is the sampler checkpoint (`tinker://...`) of the session, empty for the base
    model; `body` is the client's JSON `SampleRequest`.
    """

    request_id: str
    tenant_id: str
    sampling_session_id: str
    base_model: str
    adapter_path: str = ""
    body: bytes = b""
    published_at: float = 0.0
    adapter_content_id: str = ""  # the content the session is bound to ("": current)
    clone_id: int = 0  # the sampling client's clone (`seq_id // CLONE_SEQ_SPAN`)
    text: TextPrompt | None = None  # the prompt as text: `body`'s prompt is empty


RequestType = Literal[
    "create_model",
    "forward_backward",
    "forward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "unload_model",
    "save_weights_external",
    "import_adapter",
    "export_merged",
]


class Outcome(msgspec.Struct, frozen=True):
    """A future's state in KV: `pending`, `done` (payload) or `error` (message + category).

    `payload_type` is `proto` for ForwardBackwardOutput/SampleResponse bytes, `json` otherwise.
    """

    request_id: str
    state: Literal["pending", "done", "error"]
    request_type: str = ""
    model_id: str = ""
    payload: bytes = b""
    payload_type: Literal["json", "proto"] = "json"
    error: str = ""
    category: ErrorCategory | None = None  # set when `state` is "error"
    created_at: float = 0.0
    finished_at: float = 0.0
    tenant_id: str = ""  # the owner: another tenant's request_id reads as unknown
    # pending in its tenant's rate-limit queue until then (Unix seconds), and why
    not_before: float = 0.0
    queue_reason: str = ""
    # a sample's sampling session and clone: `retrieve_futures` reports the outcome to them
    sampling_session_id: str = ""
    clone_id: int = 0
    # a pending sample: times a sampler began it; one that stopped before answering leaves its
    # count (`workers.sampler.guard`)
    attempts: int = 0


class SeqClaim(msgspec.Struct, frozen=True):
    """Who spent `(model_id, seq_id)`: the first request's id, its type and its body's digest.

    A retry (same type, same digest) gets the same request id; anything else reusing the seq
    is refused.
    """

    request_id: str
    request_type: str
    digest: str


IMPORTS_DIR = ".imports"  # under the checkpoint root; never a run id (ids start alphanumeric)
EXPORTS_DIR = ".exports"


def import_staging_dir(root: Path, staging_id: str) -> Path:
    """Where the gateway stages an uploaded adapter for `ImportAdapterJob`."""
    return root / IMPORTS_DIR / staging_id


def merged_export_dir(root: Path, export_id: str) -> Path:
    """Where a worker writes the merged model of `ExportMergedJob`."""
    return root / EXPORTS_DIR / export_id


def import_staging_key(staging_id: str) -> str:
    """`import_staging_dir`'s prefix in an artifact store."""
    return f"{IMPORTS_DIR}/{staging_id}"


def merged_export_key(export_id: str) -> str:
    """`merged_export_dir`'s prefix in an artifact store."""
    return f"{EXPORTS_DIR}/{export_id}"


_JOB_ENCODER = msgspec.msgpack.Encoder()
_JOB_DECODER: msgspec.msgpack.Decoder[Job] = msgspec.msgpack.Decoder(Job)
_OUTCOME_DECODER = msgspec.msgpack.Decoder(Outcome)
_CLAIM_DECODER = msgspec.msgpack.Decoder(SeqClaim)
_SAMPLE_DECODER = msgspec.msgpack.Decoder(SampleJob)


def encode_job(job: Job) -> bytes:
    return _JOB_ENCODER.encode(job)


def decode_job(data: bytes) -> Job:
    return _JOB_DECODER.decode(data)


def encode_sample_job(job: SampleJob) -> bytes:
    return _JOB_ENCODER.encode(job)


def decode_sample_job(data: bytes) -> SampleJob:
    return _SAMPLE_DECODER.decode(data)


def encode_outcome(outcome: Outcome) -> bytes:
    return _JOB_ENCODER.encode(outcome)


def decode_outcome(data: bytes) -> Outcome:
    return _OUTCOME_DECODER.decode(data)


def encode_claim(claim: SeqClaim) -> bytes:
    return _JOB_ENCODER.encode(claim)


def decode_claim(data: bytes) -> SeqClaim:
    return _CLAIM_DECODER.decode(data)


_SAVE_REQUEST_TYPES = {
    "weights": "save_weights",
    "sampler_weights": "save_weights_for_sampler",
    "external_weights": "save_weights_external",
}


def request_type_of(job: Job) -> str:
    """The name of the request a job answers (the `forward` variant of fwd/bwd included)."""
    if isinstance(job, ForwardBackwardJob):
        return "forward" if job.forward_only else "forward_backward"
    if isinstance(job, SaveWeightsJob):
        return _SAVE_REQUEST_TYPES[job.kind]
    if isinstance(job, TombstoneJob):
        return job.request_type or "tombstone"
    return type(job).__struct_config__.tag  # type: ignore[return-value]


def now() -> float:
    return time.time()
