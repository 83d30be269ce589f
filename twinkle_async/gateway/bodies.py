"""Reading request bodies and writing JSON responses with the protocol's Structs."""

from __future__ import annotations

from typing import Any, TypeVar

import zstandard
from aiohttp import web

from protocol import api
from protocol.errors import PayloadTooLarge, UserError
from twinkle_async.gateway.state import SETTINGS

T = TypeVar("T")


async def read_body(request: web.Request, *, protobuf: bool = False) -> bytes:
    """The raw body, zstd-decompressed when the SDK compressed it, within the size limit.

    JSON bodies have a tighter limit than protobuf ones: decoding JSON numbers into Python
    objects costs many times their bytes, and no JSON call carries tensors.
    """
    settings = request.app[SETTINGS]
    limit = settings.max_request_bytes if protobuf else settings.max_json_bytes
    body = await request.read()
    encoding = request.headers.get("Content-Encoding", "").lower()
    if encoding in ("", "identity"):
        if len(body) > limit:
            raise PayloadTooLarge(f"request body of {len(body)} bytes exceeds {limit} bytes")
        return body
    if encoding != "zstd":
        raise UserError(f"unsupported Content-Encoding {encoding!r} (zstd or none)")
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        data = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise UserError(f"request body is not valid zstd: {exc}") from exc
    if len(data) > limit:
        raise PayloadTooLarge(f"decompressed request body exceeds {limit} bytes")
    return data


async def read_json(request: web.Request, type_: type[T]) -> T:
    return api.decode(await read_body(request), type_)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=api.encode(obj), status=status, content_type="application/json")
