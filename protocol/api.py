"""The Tinker JSON bodies: every request the gateway reads and every response it writes.

Each body is declared once, as a msgspec `Struct` named after the SDK's type (tinker 0.38,
`tinker/types/*.py`). The two directions follow the SDK's two validation regimes:

- Requests are decoded leniently: unknown fields are ignored, fields that have a default in the
  SDK may be missing, and the `type` discriminator (a msgspec tag) is optional but must match
  when sent. `decode` turns any failure into a one-line `UserError` naming the field.
- Responses must pass the SDK's strict validation: fields the SDK requires have no default here
  so they are always written; optional fields default to `None` and are left out when unset
  (`omit_defaults`), and every other default equals the SDK's, so leaving it out changes
  nothing. Datetimes are written as ISO-8601 with a timezone.

The protobuf bodies (forward_backward in, ForwardBackwardOutput and SampleResponse out) live in
`protocol.tensors`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from protocol.custom_loss import LossGraph, LossInput
from protocol.errors import ErrorCategory, UserError

T = TypeVar("T")

QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
CheckpointType = Literal["training", "sampler", "external"]
SamplingClientKind = Literal["snapshot", "inflight"]


class RequestBody(msgspec.Struct, frozen=True):
    """Base of request bodies: lenient by default (unknown fields are ignored)."""


class ResponseBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """Base of response bodies: `None` optionals are not written."""


# -- shared pieces ------------------------------------------------------------------------------


class LoraConfig(RequestBody, frozen=True):
    """The adapter shape of `create_model`; at least one `train_*` flag is true (client-checked)."""

    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class AdamOptimizerConfig(msgspec.Struct, frozen=True, tag_field="type", tag="adamw"):
    """The optimizer family fixed at model creation: AdamW (the default)."""


class DimuonOptimizerConfig(msgspec.Struct, frozen=True, tag_field="type", tag="dimuon"):
    """The Dimuon optimizer family."""

    version: int = 1


OptimizerConfig = AdamOptimizerConfig | DimuonOptimizerConfig
ADAMW = AdamOptimizerConfig()


class AdamParams(RequestBody, frozen=True):
    """One `optim_step`'s AdamW hyper-parameters; the SDK always sends every field."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class DimuonParams(RequestBody, frozen=True, tag_field="type", tag="dimuon"):
    """One `optim_step`'s Dimuon hyper-parameters (sent as `optimizer_params`)."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9


# -- service and session ------------------------------------------------------------------------


class ClientConfigRequest(RequestBody, frozen=True):
    """Body of `client/config` and `client/dynamic_config`."""

    sdk_version: str = ""


class ClientConfigResponse(msgspec.Struct, frozen=True):
    """Feature flags for the SDK, read once per client holder. Every flag is written out."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    use_pyqwest_transport: bool = True
    proto_compress_fwdbwd: bool = False
    parallel_fwdbwd_chunks: bool = True
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    fwdbwd_dispatch_bytes_semaphore_size: int = 50_000_000
    sample_dispatch_bytes_semaphore_size: int = 10 * 1024 * 1024
    inflight_response_bytes_semaphore_size: int = 50 * 1024 * 1024
    billing_exception_max_pause_duration_sec: int = 3600
    sample_no_retries: bool = False
    sample_enable_stuck_detection: bool = True
    sample_max_concurrent_requests: int = 2000
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class ClientDynamicConfigResponse(msgspec.Struct, frozen=True):
    """Flags the SDK re-reads every `refresh_interval_sec` (at least 10 s)."""

    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class SupportedModel(ResponseBody, frozen=True):
    """One entry of `get_server_capabilities`."""

    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None
    # the workers' memory plan: the longest datum they train, the longest prompt + max_tokens
    # they sample (docs/long-context.md)
    max_train_tokens: int | None = None
    max_sample_tokens: int | None = None


class GetServerCapabilitiesResponse(ResponseBody, frozen=True):
    """The base models this deployment serves (informational: the SDK does not enforce it)."""

    supported_models: list[SupportedModel]


class HealthResponse(msgspec.Struct, frozen=True):
    """Body of `GET /healthz`."""

    status: Literal["ok"] = "ok"


class CreateSessionRequest(RequestBody, frozen=True, tag_field="type", tag="create_session"):
    """Open a session; the SDK sends `tags` and `user_metadata` even when empty."""

    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class CreateSessionResponse(ResponseBody, frozen=True, tag_field="type", tag="create_session"):
    """The new session's id; the messages are logged client-side at info/warning/error level."""

    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(RequestBody, frozen=True, tag_field="type", tag="session_heartbeat"):
    """Sent every 10 s while a session lives."""

    session_id: str


class SessionHeartbeatResponse(
    ResponseBody, frozen=True, tag_field="type", tag="session_heartbeat"
):
    """Acknowledges a heartbeat (a 410 instead tells the client the session is over)."""


class SessionFinishReason(RequestBody, frozen=True):
    """Why a client closed its session: `success`, `errored` or `interrupted`."""

    type: str = "success"


class SessionFinishRequest(RequestBody, frozen=True):
    """Body of `POST /sessions/{session_id}/finish`."""

    reason: SessionFinishReason = SessionFinishReason()
    detail: str | None = None


class TelemetryRequest(RequestBody, frozen=True):
    """Client telemetry; accepted and not interpreted, so every field is optional."""

    events: list[Any] = []
    platform: str = ""
    sdk_version: str = ""
    session_id: str = ""
    process_uuid: str = ""


class TelemetryResponse(msgspec.Struct, frozen=True):
    """Body answering `/telemetry`."""

    status: Literal["accepted"] = "accepted"


# -- training -----------------------------------------------------------------------------------


class CreateModelRequest(RequestBody, frozen=True, tag_field="type", tag="create_model"):
    """Create a LoRA training model; its id is `{session_id}:train:{model_seq_id}`."""

    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = ADAMW


class GetInfoRequest(RequestBody, frozen=True, tag_field="type", tag="get_info"):
    """Ask for a training model's description (answered synchronously)."""

    model_id: str


class ModelData(ResponseBody, frozen=True):
    """What the model is; `model_name` must be set or the SDK's `get_tokenizer()` asserts."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(ResponseBody, frozen=True, tag_field="type", tag="get_info"):
    """A training model's description."""

    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig = ADAMW
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class OptimStepRequest(RequestBody, frozen=True, tag_field="type", tag="optim_step"):
    """Apply the accumulated gradients: `adam_params` for AdamW, `optimizer_params` otherwise."""

    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: DimuonParams | None = None


class SaveWeightsRequest(RequestBody, frozen=True, tag_field="type", tag="save_weights"):
    """`save_state`: adapter and optimizer state under `tinker://<run>/weights/<path>`."""

    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(
    RequestBody, frozen=True, tag_field="type", tag="save_weights_for_sampler"
):
    """Named (`path`) or ephemeral (`sampling_session_seq_id`, no path) weights for sampling."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: SamplingClientKind = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    overwrite: bool = False  # not sent by the SDK: a named sampler checkpoint is never replaced


class LoadWeightsRequest(RequestBody, frozen=True, tag_field="type", tag="load_weights"):
    """Load a checkpoint, addressed one of two ways.

    Create-via-load (`session_id` + `model_seq_id`): the load creates the model, implicitly
    seq 0, and the client then uses `{session_id}:train:{model_seq_id}` unasked. Legacy
    (`model_id` + `seq_id`): load into an existing model.
    """

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None

    def __post_init__(self) -> None:
        # msgspec reports a ValueError raised here as a validation error of the body.
        create = self.session_id is not None or self.model_seq_id is not None
        if create and self.model_id is not None:
            raise ValueError("load_weights: give session_id+model_seq_id or model_id, not both")
        if create and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("load_weights: session_id and model_seq_id must be given together")
        if not create and self.model_id is None:
            raise ValueError("load_weights: needs session_id+model_seq_id or model_id")

    @property
    def creates_model(self) -> bool:
        """True for create-via-load."""
        return self.session_id is not None


class WeightsInfoRequest(RequestBody, frozen=True):
    """Body of `POST /weights_info`."""

    tinker_path: str


# -- futures ------------------------------------------------------------------------------------


class UntypedAPIFuture(ResponseBody, frozen=True):
    """The immediate answer of every asynchronous submit."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class FutureRetrieveRequest(RequestBody, frozen=True):
    """One long-poll for a future's result."""

    request_id: str
    allow_metadata_only: bool = False


class TryAgainResponse(ResponseBody, frozen=True, tag_field="type", tag="try_again"):
    """Not ready yet: the SDK polls again at once, so send this only after a long-poll."""

    request_id: str
    queue_state: QueueState
    queue_state_reason: str | None = None


class CompleteMetadataResponse(msgspec.Struct, frozen=True):
    """Ready, size first: only when the poll allowed metadata only; the next poll gets the bytes."""

    response_payload_size: int
    status: Literal["complete_metadata"] = "complete_metadata"


class RequestFailedResponse(ResponseBody, frozen=True):
    """A failed future (HTTP 200); the SDK raises `RequestFailedError` and does not retry."""

    error: str
    category: ErrorCategory


class CreateModelResponse(ResponseBody, frozen=True, tag_field="type", tag="create_model"):
    """Result of a `create_model` future."""

    model_id: str


class OptimStepResponse(ResponseBody, frozen=True):
    """Result of an `optim_step` future; metric keys are free-form (not reduced by the SDK)."""

    metrics: dict[str, float] | None = None


class SaveWeightsResponse(ResponseBody, frozen=True, tag_field="type", tag="save_weights"):
    """Result of a `save_weights` future: `tinker://<run>/weights/<name>`."""

    path: str


class SaveWeightsForSamplerResponse(
    ResponseBody, frozen=True, tag_field="type", tag="save_weights_for_sampler"
):
    """`path` for a named save, `sampling_session_id` for an ephemeral one (the SDK asserts)."""

    path: str | None = None
    sampling_session_id: str | None = None


class LoadWeightsResponse(ResponseBody, frozen=True, tag_field="type", tag="load_weights"):
    """Result of a `load_weights` future."""

    path: str | None = None
    model_id: str | None = None


class UnloadModelResponse(ResponseBody, frozen=True, tag_field="type", tag="unload_model"):
    """Result of an `unload_model` future: the adapter is gone from its worker."""

    model_id: str


# -- sampling -----------------------------------------------------------------------------------


class EncodedTextChunk(RequestBody, frozen=True, tag_field="type", tag="encoded_text"):
    """Token ids."""

    tokens: list[int]


class ImageChunk(RequestBody, frozen=True, tag_field="type", tag="image"):
    """An inline image (base64 on the wire)."""

    data: bytes
    format: str
    expected_tokens: int | None = None


class ImageAssetPointerChunk(RequestBody, frozen=True, tag_field="type", tag="image_asset_pointer"):
    """An image by reference."""

    location: str
    format: str
    expected_tokens: int | None = None


class DmelChunk(RequestBody, frozen=True, tag_field="type", tag="dmel"):
    """Audio tokens as serialized tensor bytes (base64 on the wire)."""

    dmel: bytes


ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk


class ModelInput(RequestBody, frozen=True):
    """A prompt: chunks of one tagged union, each with its `type`."""

    chunks: list[ModelInputChunk] = []


class TensorData(RequestBody, frozen=True):
    """JSON TensorData: flat row-major `data`, optionally sparse CSR over a 2-D `shape`."""

    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SamplingParams(RequestBody, frozen=True):
    """Generation settings; `stop` absent means stop at EOS, `[]` means never stop early."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class CreateSamplingSessionRequest(
    RequestBody, frozen=True, tag_field="type", tag="create_sampling_session"
):
    """Open a sampling session over a base model or a `tinker://` sampler checkpoint."""

    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class CreateSamplingSessionResponse(
    ResponseBody, frozen=True, tag_field="type", tag="create_sampling_session"
):
    """The new sampling session's id."""

    sampling_session_id: str


class GetSamplerResponse(ResponseBody, frozen=True):
    """`GET /samplers/{sampler_id}`."""

    sampler_id: str
    base_model: str
    model_path: str | None = None


class SampleRequest(RequestBody, frozen=True, tag_field="type", tag="sample"):
    """`asample`: the answer must carry one `sample_sequence_ids` entry per sample."""

    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: int = 1
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


# -- REST: one checkpoint's lifecycle, exports, copies, sessions ------------------------------


class CreateCustomLossRequest(RequestBody, frozen=True, tag_field="type", tag="create_custom_loss"):
    """Upload a traced loss (`ServiceClient.create_custom_loss`); see `protocol.custom_loss`."""

    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[LossInput]
    graph: LossGraph


class CreateCustomLossResponse(
    ResponseBody, frozen=True, tag_field="type", tag="create_custom_loss"
):
    """The future result of `create_custom_loss`: the id `forward_backward` names it by."""

    loss_id: str


class SaveWeightsExternalRequest(
    RequestBody, frozen=True, tag_field="type", tag="save_weights_external"
):
    """Export the adapter as PEFT files under `tinker://<run>/external_weights/<path>`."""

    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class SaveWeightsExternalResponse(
    ResponseBody, frozen=True, tag_field="type", tag="save_weights_external"
):
    """Result of a `save_weights_external` future."""

    path: str
    size_bytes: int | None = None


class UnloadModelRequest(RequestBody, frozen=True, tag_field="type", tag="unload_model"):
    """Release a training model's adapter (older SDKs); the SDK sends no `seq_id`."""

    model_id: str
    seq_id: int | None = None


# -- codec --------------------------------------------------------------------------------------

_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    # Decoders are built once per type and reused (building one walks the whole schema).
    decoder = _DECODERS.get(type_)
    if decoder is None:
        decoder = _DECODERS[type_] = msgspec.json.Decoder(type_)
    return decoder


# msgspec recurses once per nesting level, even through a field it skips, so a body of a million
# `[` (2 MB) raises RecursionError: a client's error, not the server's.
NESTED_TOO_DEEPLY = "JSON nested too deeply"


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON request body; malformed JSON or a wrong field is a one-line `UserError`.

    An empty body reads as `{}`, so a body-less POST still names the first missing field.
    """
    try:
        try:
            result: T = _decoder(type_).decode(body or b"{}")
        except msgspec.ValidationError as exc:
            # SDKs that write JSON prompts (tinker 0.16) leave out a chunk's `type` where it is
            # the default: the same body with each chunk's type made explicit
            if "missing required field `type`" not in str(exc) or ".chunks[" not in str(exc):
                raise
            typed = _chunk_types(msgspec.json.decode(body))
            result = _decoder(type_).decode(msgspec.json.encode(typed))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UserError(f"invalid {type_.__name__} body: {exc}") from None
    except RecursionError:
        raise UserError(f"invalid {type_.__name__} body: {NESTED_TOO_DEEPLY}") from None
    return result


def _chunk_types(value: Any) -> Any:
    """`value` with a `type` on every chunk of a `chunks` list that has none: `encoded_text`
    with `tokens`, `image_asset_pointer` with a `location`, else `image`."""
    if isinstance(value, list):
        return [_chunk_types(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _chunk_types(item) for key, item in value.items()}
    chunks = out.get("chunks")
    if isinstance(chunks, list):
        for chunk in chunks:
            if isinstance(chunk, dict) and "type" not in chunk:
                chunk["type"] = (
                    "encoded_text"
                    if "tokens" in chunk
                    else "image_asset_pointer"
                    if "location" in chunk
                    else "image"
                )
    return out


def encode(obj: Any) -> bytes:
    """Encode a response body (any Struct above, or plain JSON data)."""
    return _ENCODER.encode(obj)
