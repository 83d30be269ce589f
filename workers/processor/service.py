"""The processor service's HTTP side: `POST /create` and `POST /call` with the bodies twinkle's
client sends to `/api/v1/processor/twinkle/create` and `/call`, from our gateway only.

`POST /template` runs a Twinkle sampler's template (`sampler_templates`) for the gateway.

Every request carries `X-Processor-Secret` (the secret file's content, else 401), `X-Tenant` and
`X-Session` (else 400): the (tenant, session) that owns what it creates and alone may call it.
Answers: `{"processor_id": "pid:..."}`, `{"result": ...}`, or `{"detail": "..."}` with 400 (a
wrong field, name or value), 404 (no such object in this session), 410 (iterator exhausted), 413
(over a budget) or 500 (an unexpected failure, logged with its traceback here).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from workers.processor import objects
from workers.processor.checks import Fields, Refused, json_object, listed, shown
from workers.processor.objects import CALLS, CREATE, Context, Work
from workers.processor.registry import Owner, Registry
from workers.processor.sampler_templates import Templates, template_work

log = logging.getLogger(__name__)

MAX_BODY = 2 << 20  # a client's call, as the gateway forwards it
MAX_TEMPLATE_BODY = 32 << 20  # a sampler's prompts and samples (the gateway bounds them)
MAX_HEADER = 256  # X-Tenant, X-Session
POOL_WORKERS = 2
_dumps = functools.partial(json.dumps, ensure_ascii=False)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as `{"detail": ...}`: a refusal with its status, anything else a 500."""
    try:
        return await handler(request)
    except Refused as exc:
        return web.json_response({"detail": exc.detail}, status=exc.status, dumps=_dumps)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"detail": exc.text or exc.reason}, status=exc.status)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response({"detail": "internal error of the processor service"}, status=500)


class Service:
    """The objects of every (tenant, session), the thread pool their twinkle work runs in."""

    def __init__(self, ctx: Context, secret: str, max_objects: int, ttl_s: float) -> None:
        self.ctx = ctx
        self.secret = secret.encode()
        self.registry = Registry(max_objects)
        self.ttl_s = ttl_s
        self.pool = ThreadPoolExecutor(POOL_WORKERS, thread_name_prefix="twinkle")
        self.templates = Templates(ctx)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors], client_max_size=MAX_TEMPLATE_BODY)
        app.router.add_post("/create", self.create)
        app.router.add_post("/call", self.call)
        app.router.add_post("/template", self.template)
        return app

    def owner(self, request: web.Request) -> Owner:
        given = request.headers.get("X-Processor-Secret", "").encode()
        if not hmac.compare_digest(given, self.secret):
            raise Refused("X-Processor-Secret: missing or wrong", 401)
        owner = []
        for header in ("X-Tenant", "X-Session"):
            value = request.headers.get(header, "")
            if not value or len(value) > MAX_HEADER:
                raise Refused(f"{header}: expected 1 to {MAX_HEADER} characters")
            owner.append(value)
        return owner[0], owner[1]

    async def run(self, work: Work) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    async def create(self, request: web.Request) -> web.Response:
        owner = self.owner(request)
        f = Fields("", json_object(await _body(request, MAX_BODY)))
        class_type = f.take("class_type")
        if not isinstance(class_type, str) or class_type not in CREATE:
            raise Refused(
                f"class_type: {shown(class_type)} is not served; allowed: {listed(CREATE)}"
            )
        processor_type = f.take("processor_type")
        if processor_type != CREATE[class_type]:
            raise Refused(
                f"processor_type: a {class_type} is of type {CREATE[class_type]!r}, "
                f"got {shown(processor_type)}"
            )
        parent = None
        if class_type == "Dataset":
            work = objects.create_dataset(f, self.ctx)
        else:
            parent = self.registry.get(owner, f.take("dataset"), "dataset")
            if parent.kind != "Dataset":
                raise Refused(f"dataset: {parent.pid} is a {parent.kind}, not a Dataset")
            work = objects.create_dataloader(parent, objects.dataloader_options(f))
        self.registry.reserve(owner)
        made = False
        try:
            if parent is None:
                obj = await self.run(work)
            else:
                async with parent.lock:
                    parent.touch()
                    obj = await self.run(work)
            made = True
        finally:
            if not made:
                self.registry.release(owner)
        entry = self.registry.add(owner, class_type, obj, parent)
        log.info("%s %s created for tenant %s", class_type, entry.pid, owner[0])
        return web.json_response({"processor_id": entry.pid})

    async def call(self, request: web.Request) -> web.Response:
        owner = self.owner(request)
        f = Fields("", json_object(await _body(request, MAX_BODY)))
        entry = self.registry.get(owner, f.take("processor_id"))
        function = f.take("function")
        table = CALLS[entry.kind]
        if not isinstance(function, str) or function not in table:
            raise Refused(
                f"function: {shown(function)} is not served on a {entry.kind}; "
                f"allowed: {listed(table)}"
            )
        work = table[function](entry, f, self.ctx)
        async with entry.lock:
            entry.touch()
            try:
                result = await self.run(work)
            finally:
                entry.touch()
        if isinstance(result, bytes):
            return web.Response(body=result, content_type="application/json")
        return web.json_response({"result": result}, dumps=_dumps)

    async def template(self, request: web.Request) -> web.Response:
        """A sampler's template at work (`sampler_templates`): the gateway's call, for its
        caller's trajectories and samples."""
        self.owner(request)
        work = template_work(
            self.templates,
            Fields("", json_object(await _body(request, MAX_TEMPLATE_BODY))),
            self.ctx,
        )
        result = await self.run(work)
        if len(result) > self.ctx.max_answer_bytes:
            raise Refused(
                f"the answer is {len(result)} bytes of JSON, over this server's "
                f"{self.ctx.max_answer_bytes}; sample fewer inputs a call",
                413,
            )
        return web.Response(body=result, content_type="application/json")

    async def sweep_forever(self) -> None:
        """Drop objects idle past the TTL, checking every quarter of it (1 s to 60 s)."""
        interval = min(60.0, max(1.0, self.ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            for entry in self.registry.sweep(self.ttl_s):
                log.info("%s %s of tenant %s expired", entry.kind, entry.pid, entry.owner[0])


async def _body(request: web.Request, limit: int) -> bytes:
    raw = await request.read()
    if len(raw) > limit:
        raise Refused(f"body: {len(raw)} bytes, over this call's {limit}", 413)
    return raw


def write_ready(path: Path, url: str) -> None:
    """`{"url": ...}`, written whole (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"url": url}))
    os.replace(temporary, path)


async def serve(service: Service, host: str, port: int, ready_file: Path) -> None:
    """Listen, report the URL in `ready_file`, serve until SIGTERM or SIGINT."""
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    shown_host = f"[{host}]" if ":" in host else host
    write_ready(ready_file, f"http://{shown_host}:{bound}")
    log.info("processor service at http://%s:%d", shown_host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sweeper = asyncio.create_task(service.sweep_forever())
    try:
        await stop.wait()
    finally:
        sweeper.cancel()
        await runner.cleanup()
        service.pool.shutdown(wait=False, cancel_futures=True)
    log.info("processor service stopped")
