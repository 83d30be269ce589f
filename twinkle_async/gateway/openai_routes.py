"""An OpenAI-compatible API on every checkpoint: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, with a tenant's key as `Authorization: Bearer tml-...`.

`model` is a base model this cluster serves, or a sampler checkpoint (`tinker://` or
`twinkle://`) the caller may read (its own, or a published one; another tenant's is a 404, as
in the Tinker routes). A request is one sample job of a text prompt (`jobs.TextPrompt`): the
sampler tokenizes it (a chat through the base model's own chat template), samples as for
`asample` (the same samplers, checks and `max_concurrent_samples` quota) and answers text
(`protocol.text_sampling`). `stream` answers server-sent events: each choice's text as the
sampler draws it, then its end, the usage chunk and `[DONE]` (with logprobs asked for, each
choice in one chunk when it is done). A client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from aiohttp import web
from nats.aio.msg import Msg

from protocol import api, paths, subjects
from protocol.errors import TwinkleError, UserError
from protocol.jobs import Outcome, TextPrompt
from protocol.records import SamplerRecord
from protocol.sampling import MAX_LOGPROBS_K
from protocol.text_sampling import (
    ReceivedText,
    TextAnswer,
    TextProgress,
    check_prompt,
    decode_answer,
)
from twinkle_async.futures import new_request_id
from twinkle_async.gateway.bodies import json_response, read_body
from twinkle_async.gateway.futures_routes import finished
from twinkle_async.gateway.sampling_futures_routes import cancel_pending
from twinkle_async.gateway.sampling_routes import publish_sample
from twinkle_async.gateway.state import BUS, REGISTRY, TENANT

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

OWNER = "twinkle-async"
_DISCONNECT_POLL_S = 0.5


class _Options(msgspec.Struct, frozen=True):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    stream: bool = False
    user: str | None = None


class CompletionBody(_Options, frozen=True):
    prompt: str = ""
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Options, frozen=True):
    messages: list[ChatMessage] = []
    logprobs: bool = False
    top_logprobs: int | None = None


async def _model(request: web.Request, name: str) -> tuple[str, str, str]:
    """`model` as (base model, sampler checkpoint path or "", its content id)."""
    registry = request.app[REGISTRY]
    if "://" in name:
        path = paths.parse_path(name, "model")
        ckpt = await registry.checkpoint(path.run_id, path.checkpoint_id, request[TENANT])
        if path.kind == "external_weights":
            raise UserError(
                f"model {name[:80]!r} is an exported adapter; name a sampler checkpoint"
            )
        return ckpt.base_model, str(path), ckpt.content_id
    registry.check_base_model(name)
    return name, "", ""


def _sample_body(options: _Options, logprobs_k: int) -> api.SampleRequest:
    if not 1 <= options.n <= 128:
        raise UserError(f"n: {options.n} is out of range 1..128")
    if not 0 <= logprobs_k <= MAX_LOGPROBS_K:
        raise UserError(f"logprobs: {logprobs_k} is out of range 0..{MAX_LOGPROBS_K}")
    stop = [options.stop] if isinstance(options.stop, str) else options.stop
    max_tokens = options.max_completion_tokens or options.max_tokens
    params = api.SamplingParams(
        max_tokens=16 if max_tokens is None else max_tokens,
        seed=options.seed,
        stop=list(stop) if stop else None,
        temperature=options.temperature,
        top_p=options.top_p,
    )
    return api.SampleRequest(
        prompt=api.ModelInput(chunks=[]),
        sampling_params=params,
        num_samples=options.n,
        topk_sample_logprobs=logprobs_k,
    )


async def _submit(
    request: web.Request,
    options: _Options,
    prompt: TextPrompt,
    logprobs_k: int,
    request_id: str,
) -> str:
    """Publish the sample of `prompt` on `options.model` as `request_id`; its base model."""
    check_prompt(prompt)
    body = _sample_body(options, logprobs_k)
    base_model, model_path, content_id = await _model(request, options.model)
    registry = request.app[REGISTRY]
    if not registry.sampler_backends(base_model):
        raise UserError(
            f"no sampler serves {base_model!r} on this cluster (start one with --sampler)"
        )
    tenant = request[TENANT]
    sampler = SamplerRecord(
        sampling_session_id=f"openai:{tenant}",
        tenant_id=tenant,
        session_id="",
        base_model=base_model,
        model_path=model_path or None,
        created_at=time.time(),
        content_id=content_id,
    )
    await publish_sample(request, sampler, api.encode(body), request_id, request_id, text=prompt)
    return base_model


async def _run(
    request: web.Request, options: _Options, prompt: TextPrompt, logprobs_k: int
) -> tuple[str, TextAnswer]:
    """Sample `prompt` on `options.model`: the request id and the answer."""
    request_id = new_request_id("sample")
    base_model = await _submit(request, options, prompt, logprobs_k, request_id)
    outcome = await _finished_or_cancelled(request, request_id, base_model)
    return request_id, decode_answer(outcome.payload)


async def _finished_or_cancelled(request: web.Request, request_id: str, base_model: str) -> Outcome:
    """The sample's outcome; a client that goes away meanwhile cancels its generation."""
    waiting = asyncio.ensure_future(finished(request, request_id))
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
            if done:
                return waiting.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                await cancel_pending(request.app, request_id, base_model)
                raise UserError("the client went away; its generation was cancelled", status=499)
    except asyncio.CancelledError:
        await asyncio.shield(cancel_pending(request.app, request_id, base_model))
        raise
    finally:
        waiting.cancel()


def _usage(answer: TextAnswer) -> dict[str, int]:
    completion = sum(len(seq.tokens) for seq in answer.sequences)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": answer.prompt_tokens + completion,
    }


async def _stream(
    request: web.Request, chunks: list[dict[str, Any]], usage: dict[str, Any]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in [*chunks, usage]:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


Chunk = Callable[[int, str, str | None], dict[str, Any]]  # (index, text, finish reason)


async def _token_stream(
    request: web.Request,
    options: _Options,
    prompt: TextPrompt,
    head: Callable[[str], dict[str, Any]],
    chunk: Chunk,
    first: Callable[[int], dict[str, Any]] | None = None,
) -> web.StreamResponse:
    """`stream` as OpenAI's API streams: each sequence's text as the sampler draws it
    (`protocol.text_sampling`), then each one's end, the usage chunk and `[DONE]`. `head`
    gives a chunk's common fields for a request id; `first`, a sequence's opening chunk."""
    nc = request.app[BUS].nc
    assert nc is not None
    request_id = new_request_id("sample")
    heard: asyncio.Queue[TextProgress] = asyncio.Queue()

    async def on_progress(msg: Msg) -> None:
        try:
            heard.put_nowait(msgspec.json.decode(msg.data, type=TextProgress))
        except msgspec.DecodeError:
            log.warning("an undecodable stream update for %s", request_id)

    subscription = await nc.subscribe(subjects.sample_stream_subject(request_id), cb=on_progress)
    try:
        streamed = msgspec.structs.replace(prompt, stream=True)
        base_model = await _submit(request, options, streamed, 0, request_id)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(data: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps({**head(request_id), **data})}\n\n".encode())

        try:
            if first is not None:
                for index in range(options.n):
                    await send(first(index))
            received = ReceivedText()
            waiting = asyncio.ensure_future(finished(request, request_id))
            try:
                while not waiting.done():
                    update = asyncio.ensure_future(heard.get())
                    done, _ = await asyncio.wait(
                        {waiting, update},
                        timeout=_DISCONNECT_POLL_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if update in done:
                        for index, text in received.add(update.result()):
                            await send(chunk(index, text, None))
                    else:
                        update.cancel()
                    if request.transport is None or request.transport.is_closing():
                        raise ConnectionResetError("the client went away")
                try:
                    answer = decode_answer(waiting.result().payload)
                except TwinkleError as err:  # the stream is open: the error is its last event
                    await send({"error": {"message": err.message, "code": err.code}})
                    await response.write(b"data: [DONE]\n\n")
                    await response.write_eof()
                    return response
            finally:
                waiting.cancel()
            for index, seq in enumerate(answer.sequences):
                await send(chunk(index, received.rest(index, seq.text), seq.finish_reason))
            await send({"choices": [], "usage": _usage(answer)})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client went away: nobody to answer
            await cancel_pending(request.app, request_id, base_model)
        except asyncio.CancelledError:
            await asyncio.shield(cancel_pending(request.app, request_id, base_model))
            raise
        return response
    finally:
        await subscription.unsubscribe()


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    now = int(time.time())
    data = [
        {"id": name, "object": "model", "created": now, "owned_by": OWNER}
        for name in sorted(registry.served_models())
    ]
    for ckpt in await registry.tenant_checkpoints(request[TENANT]):
        if ckpt.kind == "sampler_weights":
            data.append(
                {
                    "id": ckpt.path,
                    "object": "model",
                    "created": int(ckpt.created_at),
                    "owned_by": ckpt.tenant_id,
                }
            )
    return json_response({"object": "list", "data": data})


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = api.decode(await read_body(request), CompletionBody)
    if body.echo:
        raise UserError("echo: not supported (the prompt is not sent back)")
    k = body.logprobs or 0
    if body.stream and body.logprobs is None:
        return await _token_stream(
            request,
            body,
            TextPrompt(text=body.prompt),
            lambda request_id: {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
            },
            lambda index, text, finish: {
                "choices": [
                    {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
                ]
            },
        )
    request_id, answer = await _run(request, body, TextPrompt(text=body.prompt), k)
    created = int(time.time())
    choices = []
    for index, seq in enumerate(answer.sequences):
        logprobs = None
        if body.logprobs is not None:
            logprobs = {
                "tokens": seq.token_texts,
                "token_logprobs": seq.logprobs,
                "top_logprobs": [dict(row) for row in seq.top] if seq.top is not None else None,
                "text_offset": None,
            }
        choices.append(
            {
                "index": index,
                "text": seq.text,
                "finish_reason": seq.finish_reason,
                "logprobs": logprobs,
            }
        )
    head = {"id": f"cmpl-{request_id}", "created": created, "model": body.model}
    if body.stream:
        chunks = [{**head, "object": "text_completion", "choices": [c]} for c in choices]
        usage = {**head, "object": "text_completion", "choices": [], "usage": _usage(answer)}
        return await _stream(request, chunks, usage)
    return json_response(
        {**head, "object": "text_completion", "choices": choices, "usage": _usage(answer)}
    )


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = api.decode(await read_body(request), ChatBody)
    k = (body.top_logprobs or 1) if body.logprobs else 0
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    if body.stream and not body.logprobs:

        def delta(index: int, text: str, finish: str | None) -> dict[str, Any]:
            content = {"content": text} if text or finish is None else {}
            choice = {"index": index, "delta": content, "finish_reason": finish, "logprobs": None}
            return {"choices": [choice]}

        return await _token_stream(
            request,
            body,
            TextPrompt(messages=messages),
            lambda request_id: {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": body.model,
            },
            delta,
            lambda index: {
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ]
            },
        )
    request_id, answer = await _run(request, body, TextPrompt(messages=messages), k if k > 1 else 0)
    created = int(time.time())
    choices = []
    for index, seq in enumerate(answer.sequences):
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": [
                    {
                        "token": text,
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [
                            {"token": text, "logprob": value, "bytes": None}
                            for text, value in (seq.top[i] if seq.top is not None else [])
                        ],
                    }
                    for i, (text, lp) in enumerate(zip(seq.token_texts, seq.logprobs, strict=True))
                ]
            }
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": seq.text},
                "finish_reason": seq.finish_reason,
                "logprobs": logprobs,
            }
        )
    head = {"id": f"chatcmpl-{request_id}", "created": created, "model": body.model}
    if body.stream:
        chunks = [
            {
                **head,
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": c["index"],
                        "delta": c["message"],
                        "finish_reason": c["finish_reason"],
                        "logprobs": None,
                    }
                ],
            }
            for c in choices
        ]
        usage = {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(answer)}
        return await _stream(request, chunks, usage)
    return json_response(
        {**head, "object": "chat.completion", "choices": choices, "usage": _usage(answer)}
    )
