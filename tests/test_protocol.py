"""protocol.api and protocol.account_api against the official tinker SDK's own code paths.

Requests are built with the SDK's types and serialized the way the SDK sends them; responses we
encode are parsed with the SDK's strict validation. The protobuf bodies: test_protocol_tensors.py.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from tinker import types
from tinker._compat import model_dump
from tinker._models import validate_type
from tinker.types._pydantic_types.tensor_data import TensorData as JsonTensorData
from tinker.types.request_error_category import RequestErrorCategory
from tinker.types.try_again_response import TryAgainResponse

from protocol import account_api, api, rest_api
from protocol.errors import ErrorCategory, UserError
from protocol.sampling import prompt_tokens

# -- JSON responses: our encoder -> SDK strict validation ----------------------------------------

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
CKPT = rest_api.Checkpoint(
    checkpoint_id="weights/step-1",
    checkpoint_type="training",
    time=datetime(2026, 11, 29, 12, 0, 0),  # naive: taken as UTC
    tinker_path="tinker://sess-1:train:0/weights/step-1",
    size_bytes=123,
    user_metadata={"k": "v"},
)
SAMPLER_CKPT = rest_api.Checkpoint(
    checkpoint_id="sampler_weights/s",
    checkpoint_type="sampler",
    time=NOW,
    tinker_path="tinker://sess-1:train:0/sampler_weights/s",
    expires_at=NOW.astimezone(timezone(timedelta(hours=2))) + timedelta(days=1),
)
RUN = rest_api.TrainingRun(
    training_run_id="sess-1:train:0",
    base_model="Qwen/Qwen3-8B",
    model_owner="tenant-a",
    is_lora=True,
    last_request_time=NOW,
    lora_rank=8,
    last_checkpoint=CKPT,
    last_sampler_checkpoint=SAMPLER_CKPT,
)
CURSOR = rest_api.Cursor(offset=0, limit=20, total_count=1)

TRAINED = account_api.BillingUsageEvent(
    bucket_start=NOW,
    bucket_end=NOW,
    event_info=account_api.TrainingBillingEvent(token_count=120),
    base_model="b",
    user_id="tenant-a",
    project_id="tenant-a",
)
STORED = account_api.BillingUsageEvent(
    bucket_start=NOW, bucket_end=NOW, event_info=account_api.StorageBillingEvent(gigabyte_hours=0.5)
)
STORAGE_ITEM = account_api.CurrentCheckpointStorageUsageItem(
    checkpoint_count=2, size_bytes=10, size_gigabytes=1e-8, project_id="tenant-a"
)
AUDIT_ENTRY = account_api.AuditLogEntry(
    timestamp=NOW,
    event="checkpoint_create",
    event_details={"tenant": "tenant-a", "size_bytes": 10, "public": False},
    model_id="sess-1:train:0",
    tinker_path="tinker://sess-1:train:0/weights/a",
)
SEARCH_CURSOR = account_api.SessionSearchCursor(last_created_at=NOW, last_session_id="sess-1")
SUMMARY = account_api.SessionSummary(
    session_id="sess-1",
    created_at=NOW,
    owner="tenant-a",
    project_id="tenant-a",
    checkpoints_count=1,
    status=account_api.ClientSessionFinished(reason={"type": "interrupted"}),
    user_metadata={"a": "b"},
    checkpoint_storage_bytes=10,
)
ACCOUNT_RESPONSES: list[tuple[Any, type[Any]]] = [
    (account_api.TrainingBillingEvent(token_count=3), types.TrainingBillingEvent),
    (account_api.SamplingSampleBillingEvent(token_count=3), types.SamplingSampleBillingEvent),
    (account_api.CheckpointBillingEvent(count=2), types.CheckpointBillingEvent),
    (account_api.StorageBillingEvent(gigabyte_hours=1.5), types.StorageBillingEvent),
    (TRAINED, types.BillingUsageEvent),
    (STORED, types.BillingUsageEvent),
    (account_api.BillingUsageSession(user_metadata={"a": "b"}), types.BillingUsageSession),
    (
        account_api.BillingUsageResponse(
            data=[
                TRAINED,
                account_api.BillingUsageEvent(
                    bucket_start=NOW,
                    bucket_end=NOW,
                    event_info=account_api.SamplingSampleBillingEvent(token_count=4),
                ),
                account_api.BillingUsageEvent(
                    bucket_start=NOW,
                    bucket_end=NOW,
                    event_info=account_api.CheckpointBillingEvent(count=1),
                ),
                STORED,
            ]
        ),
        types.BillingUsageResponse,
    ),
    (account_api.BillingUsageResponse(data=[]), types.BillingUsageResponse),
    (STORAGE_ITEM, types.CurrentCheckpointStorageUsageItem),
    (
        account_api.CurrentCheckpointStorageUsageResponse(data=[STORAGE_ITEM]),
        types.CurrentCheckpointStorageUsageResponse,
    ),
    (AUDIT_ENTRY, types.AuditLogEntry),
    (account_api.AuditLogResponse(entries=[AUDIT_ENTRY]), types.AuditLogResponse),
    (SEARCH_CURSOR, types.SessionSearchCursor),
    (account_api.SessionActive(), types.SessionActive),
    (account_api.ClientSessionFinished(reason={"type": "success"}), types.ClientSessionFinished),
    (SUMMARY, types.SessionSummary),
    (
        account_api.SessionSearchResponse(
            sessions=[
                SUMMARY,
                account_api.SessionSummary(
                    session_id="sess-2",
                    created_at=NOW,
                    owner="tenant-a",
                    project_id="tenant-a",
                    checkpoints_count=0,
                    status=account_api.SessionActive(),
                ),
            ],
            next_cursor=SEARCH_CURSOR,
        ),
        types.SessionSearchResponse,
    ),
    (account_api.SessionSearchResponse(sessions=[]), types.SessionSearchResponse),
]

RESPONSES: list[tuple[Any, type[Any]]] = [
    (
        api.ClientConfigResponse(proto_compress_fwdbwd=True, use_pyqwest_transport=False),
        types.ClientConfigResponse,
    ),
    (api.ClientDynamicConfigResponse(refresh_interval_sec=60), types.ClientDynamicConfigResponse),
    (
        api.GetServerCapabilitiesResponse(
            supported_models=[
                api.SupportedModel(model_name="Qwen/Qwen3-8B", max_context_length=4096),
                api.SupportedModel(),
            ]
        ),
        types.GetServerCapabilitiesResponse,
    ),
    (api.SupportedModel(model_name="m", trainable=True), types.SupportedModel),
    (api.ModelData(model_name="m"), types.ModelData),
    (api.HealthResponse(), types.HealthResponse),
    (api.TelemetryResponse(), types.TelemetryResponse),
    (
        api.CreateSessionResponse(session_id="sess-1", warning_message="w"),
        types.CreateSessionResponse,
    ),
    (api.SessionHeartbeatResponse(), types.SessionHeartbeatResponse),
    (
        api.GetInfoResponse(
            model_id="sess-1:train:0",
            model_data=api.ModelData(
                arch="qwen3", model_name="Qwen/Qwen3-8B", tokenizer_id="Qwen/Qwen3-8B"
            ),
            is_lora=True,
            lora_rank=8,
            model_name="Qwen/Qwen3-8B",
        ),
        types.GetInfoResponse,
    ),
    (
        api.GetInfoResponse(
            model_id="m",
            model_data=api.ModelData(model_name="x"),
            optimizer_config=api.DimuonOptimizerConfig(),
        ),
        types.GetInfoResponse,
    ),
    (api.UntypedAPIFuture(request_id="r1", model_id="m"), types.UntypedAPIFuture),
    (
        api.UntypedAPIFuture(request_id="r2", sample_sequence_ids=["r2-0", "r2-1"]),
        types.UntypedAPIFuture,
    ),
    (
        api.TryAgainResponse(
            request_id="r1", queue_state="paused_capacity", queue_state_reason="busy"
        ),
        TryAgainResponse,
    ),
    (
        api.RequestFailedResponse(error="bad shape", category=ErrorCategory.USER),
        types.RequestFailedResponse,
    ),
    (api.CreateModelResponse(model_id="sess-1:train:0"), types.CreateModelResponse),
    (api.OptimStepResponse(metrics={"grad_norm:mean": 0.5}), types.OptimStepResponse),
    (api.OptimStepResponse(), types.OptimStepResponse),
    (api.SaveWeightsResponse(path="tinker://r/weights/a"), types.SaveWeightsResponse),
    (
        api.SaveWeightsForSamplerResponse(path="tinker://r/sampler_weights/a"),
        types.SaveWeightsForSamplerResponseInternal,
    ),
    (
        api.SaveWeightsForSamplerResponse(sampling_session_id="sess-1:sample:0"),
        types.SaveWeightsForSamplerResponseInternal,
    ),
    (
        api.SaveWeightsForSamplerResponse(path="tinker://r/sampler_weights/a"),
        types.SaveWeightsForSamplerResponse,
    ),
    (api.LoadWeightsResponse(path="tinker://r/weights/a", model_id="m"), types.LoadWeightsResponse),
    (api.UnloadModelResponse(model_id="sess-1:train:0"), types.UnloadModelResponse),
    (CKPT, types.Checkpoint),
    (SAMPLER_CKPT, types.Checkpoint),
    (RUN, types.TrainingRun),
    (
        rest_api.TrainingRun(
            training_run_id="r",
            base_model="b",
            model_owner="o",
            is_lora=True,
            last_request_time=NOW,
        ),
        types.TrainingRun,
    ),
    (CURSOR, types.Cursor),
    (rest_api.TrainingRunsResponse(training_runs=[RUN], cursor=CURSOR), types.TrainingRunsResponse),
    (
        rest_api.CheckpointsListResponse(checkpoints=[CKPT, SAMPLER_CKPT]),
        types.CheckpointsListResponse,
    ),
    (
        rest_api.CheckpointsListResponse(checkpoints=[], cursor=CURSOR),
        types.CheckpointsListResponse,
    ),
    (
        rest_api.WeightsInfoResponse(base_model="b", is_lora=True, lora_rank=8, train_mlp=True),
        types.WeightsInfoResponse,
    ),
    (
        api.CreateSamplingSessionResponse(sampling_session_id="sess-1:sample:0"),
        types.CreateSamplingSessionResponse,
    ),
    (
        api.GetSamplerResponse(
            sampler_id="s", base_model="b", model_path="tinker://r/sampler_weights/a"
        ),
        types.GetSamplerResponse,
    ),
    (
        api.SaveWeightsExternalResponse(path="tinker://r/external_weights/a", size_bytes=9),
        types.SaveWeightsExternalResponseInternal,
    ),
    (
        api.SaveWeightsExternalResponse(path="tinker://r/external_weights/a"),
        types.SaveWeightsExternalResponse,
    ),
    (
        rest_api.ExternalWeightsUrlsResponse(
            urls={"adapter_config.json": "http://h/f?sig=1"}, expires=NOW
        ),
        types.ExternalWeightsUrlsResponse,
    ),
    (
        rest_api.CopyWeightsResponse(tinker_path="tinker://copy-1/weights/a"),
        types.CopyWeightsResponse,
    ),
    (rest_api.ListSessionsResponse(sessions=["sess-1", "sess-2"]), types.ListSessionsResponse),
    (
        rest_api.GetSessionResponse(
            training_run_ids=["sess-1:train:0"],
            sampler_ids=["sess-1:sample:0"],
            user_metadata={"a": "b"},
        ),
        types.GetSessionResponse,
    ),
    (rest_api.GetSessionResponse(training_run_ids=[], sampler_ids=[]), types.GetSessionResponse),
    (api.CreateCustomLossResponse(loss_id="sess-1:loss:0"), types.CreateCustomLossResponse),
    *ACCOUNT_RESPONSES,
]


def _plain(value: Any) -> Any:
    """Normalise an SDK model dump and our builtins form so that they compare."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("ours, sdk_type", RESPONSES, ids=lambda x: getattr(x, "__name__", ""))
def test_response_passes_sdk_strict_validation(ours: Any, sdk_type: type[Any]) -> None:
    body = api.encode(ours)
    raw = json.loads(body)
    assert "null" not in body.decode(), "None optionals are left out"
    parsed = validate_type(type_=sdk_type, value=raw)  # the strict path of direct responses
    assert sdk_type.model_validate(raw) == parsed  # the path of future results
    ours_plain = _plain(msgspec.to_builtins(ours))
    sdk_plain = _plain(parsed.model_dump(mode="json"))
    for key, value in ours_plain.items():
        if key in sdk_plain:
            assert _same(sdk_plain[key], value), key
    for key in ("time", "expires_at", "last_request_time"):
        if key in raw:
            assert raw[key].endswith("Z") or raw[key][-6] in "+-", raw[key]


def _same(sdk_value: Any, our_value: Any) -> bool:
    if isinstance(our_value, str) and isinstance(sdk_value, str) and our_value[:4].isdigit():
        return datetime.fromisoformat(sdk_value) == datetime.fromisoformat(our_value)
    if isinstance(our_value, dict) and isinstance(sdk_value, dict):
        return all(k in sdk_value and _same(sdk_value[k], v) for k, v in our_value.items())
    if isinstance(our_value, list) and isinstance(sdk_value, list):
        return len(our_value) == len(sdk_value) and all(map(_same, sdk_value, our_value))
    return bool(sdk_value == our_value)


def test_every_response_struct_is_checked_against_the_sdk() -> None:
    checked = {type(ours) for ours, _ in RESPONSES}
    declared = {
        obj
        for module in (api, rest_api, account_api)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, api.ResponseBody)
        and obj is not api.ResponseBody
    }
    assert declared - checked == set()


def test_naive_datetimes_are_written_as_utc() -> None:
    assert json.loads(api.encode(CKPT))["time"] == "2026-11-29T12:00:00Z"
    assert validate_type(type_=types.Checkpoint, value=json.loads(api.encode(CKPT))).time == NOW


def test_complete_metadata_and_error_shapes_match_the_sdk_dispatch() -> None:
    # api_future_impl reads these keys by hand, before any model validation.
    assert json.loads(api.encode(api.CompleteMetadataResponse(response_payload_size=226))) == {
        "response_payload_size": 226,
        "status": "complete_metadata",
    }
    assert (
        json.loads(api.encode(api.TryAgainResponse(request_id="r", queue_state="active")))["type"]
        == "try_again"
    )
    failed = json.loads(
        api.encode(api.RequestFailedResponse(error="e", category=ErrorCategory.SERVER))
    )
    assert RequestErrorCategory(failed["category"]) is RequestErrorCategory.Server


def test_error_categories_are_the_sdk_values() -> None:
    assert {RequestErrorCategory(c.value).name for c in ErrorCategory} == {
        "User",
        "Server",
        "Unknown",
    }
    for category in ErrorCategory:
        assert RequestErrorCategory(category.value).value == category.value


# -- JSON requests: SDK serializer -> our decoder ------------------------------------------------


def _sdk_json(request: Any) -> bytes:
    return json.dumps(
        model_dump(request, exclude_unset=False, exclude_none=True, mode="json")
    ).encode()


def test_sdk_requests_decode() -> None:
    lora = types.LoraConfig(rank=8, seed=3, train_unembed=False)
    create = api.decode(
        _sdk_json(
            types.CreateModelRequest(
                session_id="s", model_seq_id=0, base_model="Qwen/Qwen3-8B", lora_config=lora
            )
        ),
        api.CreateModelRequest,
    )
    assert create.lora_config == api.LoraConfig(rank=8, seed=3, train_unembed=False)
    assert create.optimizer_config == api.AdamOptimizerConfig()
    dimuon = types.CreateModelRequest(
        session_id="s",
        model_seq_id=1,
        base_model="b",
        optimizer_config=types.DimuonOptimizerConfig(),
    )
    assert api.decode(
        _sdk_json(dimuon), api.CreateModelRequest
    ).optimizer_config == api.DimuonOptimizerConfig(version=1)

    session = api.decode(
        _sdk_json(
            types.CreateSessionRequest(tags=["a"], user_metadata={"x": 1}, sdk_version="0.38.0")
        ),
        api.CreateSessionRequest,
    )
    assert (session.tags, session.user_metadata, session.sdk_version) == (["a"], {"x": 1}, "0.38.0")

    adam = types.AdamParams(learning_rate=2e-4, eps=1e-8)
    optim = api.decode(
        _sdk_json(types.OptimStepRequest(optim_params=adam, model_id="m", seq_id=2)),
        api.OptimStepRequest,
    )
    assert optim.adam_params == api.AdamParams(learning_rate=2e-4, eps=1e-8) and optim.seq_id == 2
    dim = types.OptimStepRequest(
        optim_params=types.DimuonParams(learning_rate=0.01), model_id="m", seq_id=3
    )
    optim = api.decode(_sdk_json(dim), api.OptimStepRequest)
    assert optim.adam_params is None and optim.optimizer_params == api.DimuonParams(
        learning_rate=0.01
    )

    save = types.SaveWeightsRequest(
        model_id="m", path="step-1", seq_id=4, ttl_seconds=3600, user_metadata={"a": "b"}
    )
    assert api.decode(_sdk_json(save), api.SaveWeightsRequest) == api.SaveWeightsRequest(
        model_id="m", path="step-1", seq_id=4, ttl_seconds=3600, user_metadata={"a": "b"}
    )
    named = types.SaveWeightsForSamplerRequest(model_id="m", path="s1", seq_id=5)
    assert api.decode(_sdk_json(named), api.SaveWeightsForSamplerRequest).path == "s1"
    ephemeral = types.SaveWeightsForSamplerRequest(
        model_id="m", sampling_session_seq_id=0, kind="inflight", seq_id=6
    )
    decoded = api.decode(_sdk_json(ephemeral), api.SaveWeightsForSamplerRequest)
    assert (decoded.path, decoded.sampling_session_seq_id, decoded.kind) == (None, 0, "inflight")

    via_load = types.LoadWeightsRequest(
        session_id="s", model_seq_id=2, path="tinker://r/weights/a", optimizer=True
    )
    load = api.decode(_sdk_json(via_load), api.LoadWeightsRequest)
    assert load.creates_model and (load.session_id, load.model_seq_id, load.optimizer) == (
        "s",
        2,
        True,
    )
    legacy = types.LoadWeightsRequest(
        model_id="m", seq_id=1, path="tinker://r/weights/a", optimizer=False
    )
    load = api.decode(_sdk_json(legacy), api.LoadWeightsRequest)
    assert not load.creates_model and (load.model_id, load.seq_id) == ("m", 1)

    assert (
        api.decode(_sdk_json(types.GetInfoRequest(model_id="m")), api.GetInfoRequest).model_id
        == "m"
    )
    assert (
        api.decode(
            _sdk_json(types.SessionHeartbeatRequest(session_id="s")), api.SessionHeartbeatRequest
        ).session_id
        == "s"
    )
    poll = api.decode(
        _sdk_json(types.FutureRetrieveRequest(request_id="r", allow_metadata_only=True)),
        api.FutureRetrieveRequest,
    )
    assert poll == api.FutureRetrieveRequest(request_id="r", allow_metadata_only=True)
    config = api.decode(
        _sdk_json(types.ClientConfigRequest(sdk_version="0.38.0")), api.ClientConfigRequest
    )
    assert config.sdk_version == "0.38.0"
    sampling = types.CreateSamplingSessionRequest(
        session_id="s", sampling_session_seq_id=1, model_path="tinker://r/sampler_weights/a"
    )
    assert (
        api.decode(_sdk_json(sampling), api.CreateSamplingSessionRequest).model_path
        == "tinker://r/sampler_weights/a"
    )


@pytest.mark.parametrize(
    "type_", [api.CreateSessionRequest, api.CreateModelRequest, api.SampleRequest]
)
def test_deeply_nested_json_is_a_user_error(type_: type[Any]) -> None:
    """msgspec recurses per nesting level, even through a field it skips: a client's million
    `[` must be a 400 naming the body, not a RecursionError (a 500 with a traceback)."""
    depth = 1_000_000
    body = b'{"user_metadata":{"a":' + b"[" * depth + b"]" * depth + b"}}"
    with pytest.raises(UserError, match=f"invalid {type_.__name__} body: JSON nested too deeply"):
        api.decode(body, type_)


def test_sdk_sample_request_decodes() -> None:
    target = JsonTensorData(data=[1, -1, 3, 4], dtype="int64", shape=[2, 2])
    request = types.SampleRequest(
        num_samples=2,
        prompt=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]
        ),
        sampling_params=types.SamplingParams(max_tokens=3, stop=["\n"], temperature=0.7),
        sampling_session_id="s:sample:0",
        seq_id=0,
        prompt_logprobs=True,
        target_prompt_logprobs=target,
    )
    sample = api.decode(_sdk_json(request), api.SampleRequest)
    assert prompt_tokens(sample.prompt, None) == ([1, 2, 3], [])
    assert sample.sampling_params == api.SamplingParams(max_tokens=3, stop=["\n"], temperature=0.7)
    assert sample.target_prompt_logprobs == api.TensorData(
        data=[1, -1, 3, 4], dtype="int64", shape=[2, 2]
    )
    assert (sample.num_samples, sample.seq_id, sample.prompt_logprobs) == (2, 0, True)
    stop_tokens = types.SamplingParams(stop=[2, 0])
    assert api.decode(_sdk_json(stop_tokens), api.SamplingParams).stop == [2, 0]

    image = types.SampleRequest(
        prompt=types.ModelInput(
            chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
        ),
        sampling_params=types.SamplingParams(),
    )
    decoded = api.decode(_sdk_json(image), api.SampleRequest)
    assert decoded.prompt.chunks == [
        api.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    ]
    with pytest.raises(UserError, match="prompt chunk 0 is an image, and this model takes text"):
        prompt_tokens(decoded.prompt, None)


def test_untyped_bodies_the_sdk_sends_decode() -> None:
    finish = api.decode(
        json.dumps({"reason": {"type": "errored"}, "detail": None}).encode(),
        api.SessionFinishRequest,
    )
    assert (finish.reason.type, finish.detail) == ("errored", None)
    assert api.decode(
        b'{"tinker_path": "tinker://r/weights/a"}', api.WeightsInfoRequest
    ).tinker_path.endswith("/a")
    event = types.SessionStartEvent(
        event="SESSION_START", event_id="e", event_session_index=0, severity="INFO", timestamp=NOW
    )
    telemetry = types.TelemetrySendRequest(
        events=[event], platform="Linux", sdk_version="0.38.0", session_id="s", process_uuid="p"
    )
    decoded = api.decode(_sdk_json(telemetry), api.TelemetryRequest)
    assert decoded.session_id == "s" and decoded.events[0]["event"] == "SESSION_START"


@pytest.mark.parametrize(
    "body, type_, fragment",
    [
        (b"{", api.GetInfoRequest, "truncated"),
        (b"{]", api.GetInfoRequest, "malformed"),
        (b'{"model_id": 3}', api.GetInfoRequest, "$.model_id"),
        (b'{"model_id": "m", "type": "optim_step"}', api.GetInfoRequest, "$.type"),
        (b"", api.GetInfoRequest, "model_id"),
        (b'{"model_id": "m", "seq_id": "x", "adam_params": {}}', api.OptimStepRequest, "$.seq_id"),
        (b'{"path": "tinker://r/weights/a"}', api.LoadWeightsRequest, "model_id"),
        (b'{"path": "p", "session_id": "s"}', api.LoadWeightsRequest, "model_seq_id"),
        (
            b'{"path": "p", "session_id": "s", "model_seq_id": 0, "model_id": "m"}',
            api.LoadWeightsRequest,
            "not both",
        ),
        (
            b'{"session_id": "s", "model_seq_id": 0, "base_model": "b", "optimizer_config": {"type": "sgd"}}',
            api.CreateModelRequest,
            "optimizer_config",
        ),
    ],
)
def test_bad_json_request_is_a_one_line_user_error(
    body: bytes, type_: type[Any], fragment: str
) -> None:
    with pytest.raises(UserError) as caught:
        api.decode(body, type_)
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.status == 400


def test_requests_ignore_unknown_fields_and_missing_type() -> None:
    body = b'{"model_id": "m", "future_field": {"a": 1}}'
    assert api.decode(body, api.GetInfoRequest) == api.GetInfoRequest(model_id="m")
