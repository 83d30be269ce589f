"""REST endpoints of the RestClient: training runs, checkpoints, weights info, sessions.

Listings show the caller's own objects only; one checkpoint's lifecycle (delete, publish, TTL,
downloads) is in `checkpoint_routes`.
"""

from __future__ import annotations

import datetime as dt

from aiohttp import web

from protocol import api, metric_history, paths, rest_api, subjects
from protocol.errors import UserError
from protocol.records import CheckpointRecord, RunRecord
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.state import BUS, REGISTRY, TENANT

routes = web.RouteTableDef()


def iso(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


_CHECKPOINT_TYPES: dict[str, api.CheckpointType] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


def checkpoint_view(ckpt: CheckpointRecord) -> rest_api.Checkpoint:
    return rest_api.Checkpoint(
        checkpoint_id=ckpt.checkpoint_id,
        checkpoint_type=_CHECKPOINT_TYPES.get(ckpt.kind, "sampler"),
        time=iso(ckpt.created_at),
        tinker_path=ckpt.path,
        size_bytes=ckpt.size_bytes,
        public=ckpt.public,
        expires_at=iso(ckpt.expires_at) if ckpt.expires_at else None,
        user_metadata=ckpt.user_metadata or None,
        twinkle_path=paths.parse_path(ckpt.path).twinkle_path,
    )


def run_view(run: RunRecord, ckpts: list[CheckpointRecord]) -> rest_api.TrainingRun:
    training = [c for c in ckpts if c.kind == "weights"]
    sampler = [c for c in ckpts if c.kind == "sampler_weights"]
    last_time = max([run.last_request_time, *(c.created_at for c in ckpts)])
    return rest_api.TrainingRun(
        training_run_id=run.model_id,
        base_model=run.base_model,
        model_owner=run.tenant_id,
        is_lora=True,
        corrupted=run.corrupted,
        lora_rank=run.lora.rank,
        last_request_time=iso(last_time),
        last_checkpoint=checkpoint_view(training[-1]) if training else None,
        last_sampler_checkpoint=checkpoint_view(sampler[-1]) if sampler else None,
        user_metadata=run.user_metadata or None,
    )


_MAX_QUERY_INT = 10**9


def int_param(request: web.Request, name: str, default: int) -> int:
    """A non-negative decimal query parameter (ASCII digits only, at most 10**9)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10) or int(raw) > _MAX_QUERY_INT:
        raise UserError(
            f"query parameter {name}: {raw[:20]!r} is not an integer in 0..{_MAX_QUERY_INT}"
        )
    return int(raw)


@routes.get("/api/v1/training_runs")
async def list_training_runs(request: web.Request) -> web.Response:
    limit = int_param(request, "limit", 20)
    offset = int_param(request, "offset", 0)
    registry = request.app[REGISTRY]
    runs = await registry.runs(request[TENANT])
    page = runs[offset : offset + limit]
    views = [run_view(run, await registry.checkpoints(run.model_id)) for run in page]
    return json_response(
        rest_api.TrainingRunsResponse(
            training_runs=views,
            cursor=rest_api.Cursor(offset=offset, limit=limit, total_count=len(runs)),
        )
    )


@routes.get("/api/v1/training_runs/{run_id}")
async def get_training_run(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    run = await registry.run(request.match_info["run_id"], request[TENANT])
    return json_response(run_view(run, await registry.checkpoints(run.model_id)))


@routes.get("/api/v1/training_runs/{run_id}/metrics")
async def run_metrics(request: web.Request) -> web.Response:
    """The run's metric history (`protocol.metric_history`), oldest first."""
    run = await request.app[REGISTRY].run(request.match_info["run_id"], request[TENANT])
    return json_response({"steps": await metric_steps(request, run.model_id)})


async def metric_steps(request: web.Request, run_id: str) -> list[metric_history.MetricEntry]:
    found = await request.app[BUS].subject_messages(
        subjects.STREAM_METRICS, subjects.metrics_subject(run_id)
    )
    return [metric_history.decode(data) for data in found]


@routes.get("/api/v1/training_runs/{run_id}/checkpoints")
async def list_checkpoints(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    run = await registry.run(request.match_info["run_id"], request[TENANT])
    ckpts = await registry.checkpoints(run.model_id)
    return json_response(
        rest_api.CheckpointsListResponse(checkpoints=[checkpoint_view(c) for c in ckpts])
    )


@routes.get("/api/v1/checkpoints")
async def list_user_checkpoints(request: web.Request) -> web.Response:
    """Every checkpoint of the caller's runs, newest first, a page at a time."""
    limit = int_param(request, "limit", 100)
    offset = int_param(request, "offset", 0)
    ckpts = await request.app[REGISTRY].tenant_checkpoints(request[TENANT])
    return json_response(
        rest_api.CheckpointsListResponse(
            checkpoints=[checkpoint_view(c) for c in ckpts[offset : offset + limit]],
            cursor=rest_api.Cursor(offset=offset, limit=limit, total_count=len(ckpts)),
        )
    )


@routes.post("/api/v1/weights_info")
async def weights_info(request: web.Request) -> web.Response:
    body = await read_json(request, api.WeightsInfoRequest)
    path = paths.parse_path(body.tinker_path)
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    return json_response(
        rest_api.WeightsInfoResponse(
            base_model=ckpt.base_model,
            is_lora=True,
            lora_rank=ckpt.lora.rank,
            train_unembed=ckpt.lora.train_unembed,
            train_mlp=ckpt.lora.train_mlp,
            train_attn=ckpt.lora.train_attn,
        )
    )


# -- sessions -----------------------------------------------------------------------------------


@routes.get("/api/v1/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    """The caller's session ids, newest first (`access_scope` is accepted; every scope is the
    caller's own here)."""
    limit = int_param(request, "limit", 20)
    offset = int_param(request, "offset", 0)
    sessions = (await request.app[REGISTRY].sessions(request[TENANT]))[::-1]  # newest first
    page = sessions[offset : offset + limit]
    return json_response(rest_api.ListSessionsResponse(sessions=[s.session_id for s in page]))


@routes.get("/api/v1/sessions/{session_id}")
async def get_session(request: web.Request) -> web.Response:
    """A session's training runs (creation order) and sampling sessions."""
    registry = request.app[REGISTRY]
    tenant = request[TENANT]
    session = await registry.session(request.match_info["session_id"], tenant)
    runs = [run for run in await registry.runs(tenant) if run.session_id == session.session_id]
    samplers = await registry.session_samplers(session.session_id)
    return json_response(
        rest_api.GetSessionResponse(
            training_run_ids=[run.model_id for run in runs],
            sampler_ids=[sampler.sampling_session_id for sampler in samplers],
            user_metadata=session.user_metadata or None,
        )
    )


@routes.get("/api/v1/sessions/{session_id}/trace_export")
async def export_session_trace(request: web.Request) -> web.Response:
    """`tinker session export-trace`: refused clearly, since no per-request timeline is kept."""
    await request.app[REGISTRY].session(request.match_info["session_id"], request[TENANT])
    raise UserError(
        "session trace export is not supported by this server: it keeps no per-request"
        " timeline to build a Perfetto trace from",
        code="unsupported",
    )


@routes.put("/api/v1/sessions/{session_id}/project")
async def assign_session_project(request: web.Request) -> web.Response:
    """Projects do not exist here: a tenant's sessions are its one project."""
    await request.app[REGISTRY].session(request.match_info["session_id"], request[TENANT])
    raise UserError(
        "projects are not supported by this server: a tenant's sessions all belong to it",
        code="unsupported",
    )
