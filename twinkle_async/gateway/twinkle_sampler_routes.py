"""The Twinkle Client protocol's sampler routes (`/api/v1/sampler/{base model}/twinkle/{call}`,
`vLLMSampler` of `twinkle_client`; `protocol.twinkle_sampling` says how its calls map onto ours).

A session's sampler of a base model is a record in the sessions bucket: the template that
`set_template` names and the adapter names it was given. `sample` checks every input first,
then submits each as a sample job of its own, exactly as `asample` does (the same samplers,
quota and checks), and answers when all are done. A trajectory is encoded, and a sampled
sequence decoded, by the template in the processor service (`processor_routes.run_template`),
which holds twinkle-kit. Without a template, inputs are `InputFeature`s and answers carry no
`decoded` text or `new_input_feature`.

An adapter name alone samples the base model (a new adapter's weights leave it unchanged, as in
twinkle); `adapter_uri` names a saved checkpoint (`twinkle://` or `tinker://`) the caller may
read, whose weights are sampled.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from aiohttp import web

from protocol import api, paths, subjects
from protocol.errors import NotFound, UserError
from protocol.records import SamplerRecord, SessionRecord
from protocol.twinkle_api import check_adapter_name, lora_config
from protocol.twinkle_sampling import (
    MAX_INPUTS,
    AddSamplerAdapterBody,
    Params,
    SampleBody,
    TwinkleSamplerRecord,
    feature,
    inputs_of,
    is_feature,
    params,
    response_model,
    sample_request,
    sampler_template,
    trajectory,
)
from twinkle_async.futures import new_request_id
from twinkle_async.gateway.bodies import json_response
from twinkle_async.gateway.futures_routes import finished
from twinkle_async.gateway.processor_routes import run_template
from twinkle_async.gateway.sampling_routes import check_sample, publish_sample
from twinkle_async.gateway.state import BUS, QUOTAS, REGISTRY, TENANT
from twinkle_async.gateway.twinkle_routes import (
    MAX_ADAPTERS,
    json_body,
    served_base_model,
    twinkle_session,
)

routes = web.RouteTableDef()

SAMPLER = "/api/v1/sampler/{base_model:.+}/twinkle"
_OK = {"status": "ok"}
_ENCODER = msgspec.json.Encoder()
_SWAP_TRIES = 8


def _key(session_id: str, base_model: str) -> str:
    return f"twinkle-sampler.{subjects.token(session_id)}.{subjects.token(base_model)}"


async def _sampler(request: web.Request) -> tuple[SessionRecord, str]:
    """The caller's session and the served base model the URL names, which a sampler serves."""
    session = await twinkle_session(request)
    base_model = served_base_model(request)
    if not request.app[REGISTRY].sampler_backends(base_model):
        raise UserError(
            f"no sampler serves {base_model!r} on this cluster (start one with --sampler)"
        )
    return session, base_model


async def _record(
    request: web.Request, session: SessionRecord, base_model: str
) -> TwinkleSamplerRecord:
    entry = await request.app[BUS].entry(
        subjects.BUCKET_SESSIONS, _key(session.session_id, base_model)
    )
    if entry is None:
        raise NotFound(f"no sampler of {base_model!r} in this session (vLLMSampler creates it)")
    return msgspec.json.decode(entry[0], type=TwinkleSamplerRecord)


async def _update(
    request: web.Request, session: SessionRecord, base_model: str, change: Any
) -> None:
    """Apply `change(record)` to the session's sampler record (created when missing)."""
    bus = request.app[BUS]
    key = _key(session.session_id, base_model)
    for _ in range(_SWAP_TRIES):
        entry = await bus.entry(subjects.BUCKET_SESSIONS, key)
        if entry is None:
            record = TwinkleSamplerRecord(
                session_id=session.session_id,
                tenant_id=session.tenant_id,
                base_model=base_model,
                created_at=time.time(),
            )
            revision = None
        else:
            record = msgspec.json.decode(entry[0], type=TwinkleSamplerRecord)
            revision = entry[1]
        if await bus.swap(subjects.BUCKET_SESSIONS, key, _ENCODER.encode(change(record)), revision):
            return
    raise UserError(
        "the sampler was changed by concurrent calls; retry", code="conflict", status=409
    )


@routes.post(SAMPLER + "/create")
async def create(request: web.Request) -> web.Response:
    session, base_model = await _sampler(request)
    await json_body(request)  # vLLMSampler's keyword arguments: none is the server's to take
    await _update(request, session, base_model, lambda record: record)
    return json_response(_OK)


@routes.post(SAMPLER + "/set_template")
async def set_template(request: web.Request) -> web.Response:
    session, base_model = await _sampler(request)
    _, fields = await json_body(request)
    template = sampler_template(fields, base_model)
    await _update(
        request, session, base_model, lambda r: msgspec.structs.replace(r, template=template)
    )
    return json_response(_OK)


@routes.post(SAMPLER + "/add_adapter_to_sampler")
async def add_adapter_to_sampler(request: web.Request) -> web.Response:
    session, base_model = await _sampler(request)
    raw, _ = await json_body(request)
    body = api.decode(raw, AddSamplerAdapterBody)
    name = check_adapter_name(body.adapter_name)
    lora_config(body.config)  # a config this server could train, as add_adapter_to_model takes

    def add(record: TwinkleSamplerRecord) -> TwinkleSamplerRecord:
        if name in record.adapters:
            return record
        if len(record.adapters) >= MAX_ADAPTERS:
            raise UserError(f"adapter_name: this sampler holds {MAX_ADAPTERS} adapters, the most")
        return msgspec.structs.replace(record, adapters=[*record.adapters, name])

    await _update(request, session, base_model, add)
    return json_response({"status": "ok", "adapter_name": f"{session.session_id}-{name}"})


@routes.post(SAMPLER + "/apply_patch")
async def apply_patch(request: web.Request) -> web.Response:
    await _sampler(request)
    raise UserError("apply_patch: patches run a client's code in the server; not served here")


async def _adapter(request: web.Request, uri: str | None, base_model: str) -> tuple[str, str]:
    """`adapter_uri` as the sampler checkpoint path and content it names ("" for the base)."""
    if uri is None:
        return "", ""
    path = paths.parse_path(uri, "adapter_uri")
    ckpt = await request.app[REGISTRY].checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
    if path.kind == "external_weights":
        raise UserError(f"adapter_uri {uri[:80]!r} is an exported adapter; name a saved checkpoint")
    if ckpt.base_model != base_model:
        raise UserError(
            f"adapter_uri: {uri[:80]!r} was trained on {ckpt.base_model!r}, not {base_model!r}"
        )
    return str(path), ckpt.content_id


async def _prompts(
    request: web.Request,
    session: SessionRecord,
    record: TwinkleSamplerRecord,
    items: list[dict[str, Any]],
) -> list[tuple[dict[str, Any], list[int]]]:
    """Each input's feature and prompt ids (trajectories encoded by the sampler's template)."""
    if is_feature(items[0]):
        return [(f, f["input_ids"]) for f in (feature(item, i) for i, item in enumerate(items))]
    trajectories = [trajectory(item, i) for i, item in enumerate(items)]
    if record.template is None:
        raise UserError("inputs: trajectories need the sampler's template (set_template first)")
    encoded = await run_template(request, session, _template_call(record, encode=trajectories))
    return [(row["feature"], row["prompt"]) for row in encoded]


def _template_call(record: TwinkleSamplerRecord, **call: Any) -> dict[str, Any]:
    assert record.template is not None
    template = {"template_cls": record.template.template_cls, **record.template.settings}
    return {"template": template, **call}


@routes.post(SAMPLER + "/sample")
async def sample(request: web.Request) -> web.Response:
    session, base_model = await _sampler(request)
    record = await _record(request, session, base_model)
    raw, _ = await json_body(request)
    body = api.decode(raw, SampleBody)
    items = inputs_of(body.inputs)
    given = params(body.sampling_params, body.num_samples)
    if body.adapter_name:
        check_adapter_name(body.adapter_name)
    model_path, content_id = await _adapter(request, body.adapter_uri, base_model)
    prompts = await _prompts(request, session, record, items)
    registry = request.app[REGISTRY]
    requests = [sample_request(prompt, given) for _, prompt in prompts]
    for index, one in enumerate(requests):  # every input checked before any is submitted
        try:
            check_sample(registry, base_model, one)
        except UserError as exc:
            raise UserError(f"inputs[{index}]: {exc}", status=exc.status) from None
    sampler = SamplerRecord(
        sampling_session_id=f"{session.session_id}:sample:twinkle",
        tenant_id=session.tenant_id,
        session_id=session.session_id,
        base_model=base_model,
        model_path=model_path or None,
        created_at=time.time(),
        content_id=content_id,
    )
    limit = (await request.app[QUOTAS].limits(session.tenant_id)).max_concurrent_samples
    gate = asyncio.Semaphore(max(1, min(MAX_INPUTS, limit or MAX_INPUTS)))

    async def one_sample(index: int) -> dict[str, Any]:
        async with gate:
            request_id = new_request_id("sample")
            await publish_sample(
                request, sampler, api.encode(requests[index]), request_id, request_id
            )
            outcome = await finished(request, request_id)
        return response_model(outcome.payload, given, len(prompts[index][1]))

    answers = await asyncio.gather(*(one_sample(i) for i in range(len(prompts))))
    await _finish(request, session, record, given, prompts, answers)
    return json_response({"samples": answers})


async def _finish(
    request: web.Request,
    session: SessionRecord,
    record: TwinkleSamplerRecord,
    given: Params,
    prompts: list[tuple[dict[str, Any], list[int]]],
    answers: list[dict[str, Any]],
) -> None:
    """Each sequence's `decoded` text and `new_input_feature`, as twinkle's sampler gives them:
    the prompt's feature with the sequence appended (the feature alone for logprobs only)."""
    if given.logprobs_only:
        for (prompt_feature, _), answer in zip(prompts, answers, strict=True):
            for seq in answer["sequences"]:
                seq["new_input_feature"] = prompt_feature
        return
    if record.template is None:
        return
    rows = [
        {"feature": index, "tokens": seq["tokens"]}
        for index, answer in enumerate(answers)
        for seq in answer["sequences"]
    ]
    features = [prompt_feature for prompt_feature, _ in prompts]
    done = await run_template(
        request, session, _template_call(record, features=features, finish=rows)
    )
    sequences = [seq for answer in answers for seq in answer["sequences"]]
    for seq, row in zip(sequences, done, strict=True):
        seq["decoded"] = row["decoded"]
        seq["new_input_feature"] = row["new_input_feature"]
