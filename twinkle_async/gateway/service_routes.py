"""Service endpoints: client config, capabilities, health, sessions, telemetry."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from protocol import api, rules
from protocol.records import SessionRecord
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.state import LIFECYCLE, REGISTRY, SETTINGS, TENANT

routes = web.RouteTableDef()


@routes.post("/api/v1/client/config")
async def client_config(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return json_response(
        api.ClientConfigResponse(
            pjwt_auth_enabled=False,
            # httpx's own transport, not pyqwest's: a pyqwest runtime thread that calls into
            # Python while the interpreter shuts down is ended by pthread_exit, which aborts a
            # client process on exit (SIGABRT; seen in about 1 `tinker` CLI run in 50 on a
            # loaded machine, Python 3.11).
            use_pyqwest_transport=False,
            proto_compress_fwdbwd=False,
            parallel_fwdbwd_chunks=True,
            fwdbwd_max_chunk_len=settings.fwdbwd_max_chunk_len,
            fwdbwd_max_chunk_bytes_count=settings.fwdbwd_max_chunk_bytes,
            sample_use_retrieve_futures=True,
            sample_join_sampling_session=True,
            custom_loss_server_side=True,
        )
    )


@routes.post("/api/v1/client/dynamic_config")
async def client_dynamic_config(request: web.Request) -> web.Response:
    return json_response(
        api.ClientDynamicConfigResponse(refresh_interval_sec=300, sample_cancel_enabled=True)
    )


@routes.get("/api/v1/get_server_capabilities")
async def get_server_capabilities(request: web.Request) -> web.Response:
    models = []
    registry = request.app[REGISTRY]
    for name, worker in sorted(registry.served_models().items()):
        models.append(
            api.SupportedModel(
                model_name=name,
                max_context_length=worker.max_context if worker else None,
                trainable=True,
                sampleable=bool(registry.sampler_backends(name)),
                max_train_tokens=worker.max_train_tokens if worker else None,
                max_sample_tokens=worker.max_sample_tokens if worker else None,
            )
        )
    return json_response(api.GetServerCapabilitiesResponse(supported_models=models))


@routes.get("/api/v1/healthz")
@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return json_response(api.HealthResponse(status="ok"))


@routes.post("/api/v1/create_session")
async def create_session(request: web.Request) -> web.Response:
    body = await read_json(request, api.CreateSessionRequest)
    session = await new_session(request, body.tags, body.user_metadata, body.sdk_version or "")
    return json_response(api.CreateSessionResponse(session_id=session.session_id))


async def new_session(
    request: web.Request,
    tags: list[str],
    user_metadata: dict[str, Any] | None,
    sdk_version: str,
) -> SessionRecord:
    """A new session of the caller, its labels checked, stored."""
    tags, user_metadata = rules.check_session_labels(tags, user_metadata)
    now = time.time()
    session = SessionRecord(
        session_id=f"sess-{uuid.uuid4().hex[:16]}",
        tenant_id=request[TENANT],
        created_at=now,
        last_heartbeat=now,
        tags=tags,
        user_metadata=user_metadata,
        sdk_version=sdk_version[:64],
    )
    await request.app[REGISTRY].put_session(session)
    return session


@routes.post("/api/v1/session_heartbeat")
async def session_heartbeat(request: web.Request) -> web.Response:
    body = await read_json(request, api.SessionHeartbeatRequest)
    await request.app[REGISTRY].touch_session(body.session_id, request[TENANT])
    return json_response(api.SessionHeartbeatResponse())


@routes.post("/api/v1/sessions/{session_id}/finish")
async def finish_session(request: web.Request) -> web.Response:
    """The client is done: its models are unloaded, their state saved (see `lifecycle.py`)."""
    session = await request.app[REGISTRY].session(request.match_info["session_id"], request[TENANT])
    body = await read_json(request, api.SessionFinishRequest)
    await request.app[LIFECYCLE].finish(session.session_id, body.reason.type[:32])
    return json_response({})


@routes.post("/api/v1/telemetry")
async def telemetry(request: web.Request) -> web.Response:
    await request.read()
    return json_response({"status": "accepted"})
