"""Signed downloads of checkpoint files: no API key, the URL's signature is the permission.

`GET /files/v1/checkpoints/{run}/{kind}/{name}/{file}` serves one file (what SDK 0.38's
`tinker checkpoint download` fetches from `external_weights_urls`);
`GET /files/v1/archives/{run}/{kind}/{name}` serves all of them as one uncompressed tar with
flat member names (what older SDKs fetch after the `archive` redirect): extracted into a folder,
it is the PEFT folder `peft.PeftModel.from_pretrained(base, folder)` loads.

These paths are outside `/api/`, so the auth middleware lets them through; `signed_urls.check`
refuses a URL that is unsigned, expired, or signed for content that is gone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from protocol import paths
from protocol.errors import NotFound, ServerError
from protocol.paths import TinkerPath
from protocol.records import CheckpointRecord
from twinkle_async.gateway import signed_urls
from twinkle_async.gateway.checkpoint_files import (
    TAR_END,
    TarEntry,
    close_members,
    downloadable_files,
    open_members,
    tar_size,
)
from twinkle_async.gateway.checkpoint_routes import artifact_store, checkpoint_root
from twinkle_async.gateway.state import REGISTRY, SETTINGS

routes = web.RouteTableDef()

_CHUNK_BYTES = 1 << 20
_SEGMENTS = "{run_id}/{kind}/{name}"


async def _checked(request: web.Request, resource_of: str) -> tuple[TinkerPath, CheckpointRecord]:
    """The checkpoint a signed URL names, once its signature holds for the current content."""
    info = request.match_info
    path = paths.parse_path(
        f"{paths.SCHEME}{info['run_id']}/{info['kind']}/{info['name']}", "checkpoint"
    )
    resource = (
        signed_urls.archive_resource(path)
        if resource_of == "archive"
        else signed_urls.file_resource(path, info["file"])
    )
    ckpt = await request.app[REGISTRY].find_checkpoint(path.run_id, path.checkpoint_id)
    signed_urls.check(
        request.app[SETTINGS].download_secret,
        resource,
        ckpt.content_id if ckpt is not None else None,
        request.query,
        time.time(),
    )
    assert ckpt is not None  # `check` refuses a missing checkpoint
    return path, ckpt


@routes.get(f"{signed_urls.FILES_PREFIX}/checkpoints/{_SEGMENTS}/{{file}}")
async def download_file(request: web.Request) -> web.StreamResponse:
    path, ckpt = await _checked(request, "file")
    if ckpt.store_key:
        return await _stream_stored_file(request, path, ckpt)
    directory = paths.checkpoint_dir(checkpoint_root(request), path)
    files = await asyncio.to_thread(downloadable_files, directory)
    wanted = [f for f in files if f.name == request.match_info["file"]]
    if not wanted:
        raise NotFound(f"file {request.match_info['file'][:80]!r} is not part of {path}")
    return web.FileResponse(wanted[0], headers={"Content-Type": "application/octet-stream"})


async def _tar_response(
    request: web.Request, path: TinkerPath, members: Sequence[TarEntry]
) -> web.StreamResponse:
    """A prepared tar download of exactly `tar_size(members)` bytes."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "application/x-tar",
            "Content-Disposition": f'attachment; filename="{path.name}.tar"',
        }
    )
    response.content_length = tar_size(members)
    await response.prepare(request)
    return response


@routes.get(f"{signed_urls.FILES_PREFIX}/archives/{_SEGMENTS}")
async def download_archive(request: web.Request) -> web.StreamResponse:
    """Streamed: headers, data and padding are written as the files are read, never held whole;
    `Content-Length` is exact, computed from the opened files."""
    path, ckpt = await _checked(request, "archive")
    if ckpt.store_key:
        return await _stream_stored_archive(request, path, ckpt)
    directory = paths.checkpoint_dir(checkpoint_root(request), path)
    members = await asyncio.to_thread(open_members, directory)
    try:
        if not members:
            raise NotFound(f"checkpoint {path} has no files in the store")
        response = await _tar_response(request, path, members)
        for member in members:
            await response.write(member.header())
            left = member.size
            while left:
                chunk = await asyncio.to_thread(member.handle.read, min(left, _CHUNK_BYTES))
                if not chunk:
                    # the length is promised: a shrunken file must break the download, not pad it
                    raise ServerError(f"{member.name} of {path} shrank while it was sent")
                await response.write(chunk)
                left -= len(chunk)
            await response.write(member.padding())
        await response.write(TAR_END)
        await response.write_eof()
        return response
    finally:
        close_members(members)


# -- from the artifact store ---------------------------------------------------------------------


async def _stream_stored_file(
    request: web.Request, path: TinkerPath, ckpt: CheckpointRecord
) -> web.StreamResponse:
    store = artifact_store(request, ckpt)
    name = request.match_info["file"]
    wanted = [f for f in await store.files(ckpt.store_key) if f.name == name]
    if not wanted:
        raise NotFound(f"file {name[:80]!r} is not part of {path}")
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = wanted[0].size
    await response.prepare(request)
    await _send(response, store.chunks(ckpt.store_key, name), wanted[0].size, path, name)
    await response.write_eof()
    return response


async def _stream_stored_archive(
    request: web.Request, path: TinkerPath, ckpt: CheckpointRecord
) -> web.StreamResponse:
    """The tar of a stored content, streamed from the store file by file (content-addressed:
    nothing can change it while it is sent)."""
    store = artifact_store(request, ckpt)
    stored = await store.files(ckpt.store_key)
    if not stored:
        raise NotFound(f"checkpoint {path} has no files in the store")
    mtime = int(ckpt.created_at)
    members = [TarEntry(f.name, f.size, mtime) for f in stored]
    response = await _tar_response(request, path, members)
    for member in members:
        await response.write(member.header())
        await _send(
            response, store.chunks(ckpt.store_key, member.name), member.size, path, member.name
        )
        await response.write(member.padding())
    await response.write(TAR_END)
    await response.write_eof()
    return response


async def _send(
    response: web.StreamResponse,
    chunks: AsyncIterator[bytes],
    size: int,
    path: TinkerPath,
    name: str,
) -> None:
    """Exactly `size` bytes of `chunks`: the length was promised, a different one breaks the
    download instead of corrupting it."""
    sent = 0
    async for chunk in chunks:
        sent += len(chunk)
        if sent > size:
            break
        await response.write(chunk)
    if sent != size:
        raise ServerError(f"{name} of {path} is not the size its manifest says")
