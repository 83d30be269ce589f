"""Checkpoint files in the artifact store (S3), as the gateway touches them: list, sign, stream,
copy and delete. The gateway never needs a copy of the files on its own disk.

The workers upload a checkpoint's content under `paths.checkpoint_key` (`<run>/<kind>/<name>/
<content_id>/`), with `STORE_MANIFEST` last (each file's size and sha256); the record's
`store_key` names that prefix. Here:
- `files` reads the manifest: the downloadable files and their sizes, without listing the bucket;
- `sign` makes a presigned GET URL of one file, for the endpoint clients reach
  (`--artifact-public-url` where it differs from the one the gateway uses);
- `chunks` streams one file (signed gateway downloads and `/archive` tars are served from it);
- `copy` is a server-side copy of every file of a content into another prefix (`copy_weights`);
- `delete_tree` removes every object under a prefix (a checkpoint name with all its contents);
- `put` streams an uploaded file in (an admin import is staged in the store for the worker),
  `put_manifest` commits such an upload, and `delete_older` sweeps what nobody fetched.

Keys come from a parsed `TinkerPath` or a record the workers wrote, never from a client's
string, and file names from a manifest are checked before use. Calls are obstore's async API.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import obstore
from obstore.store import S3Store

from protocol.errors import ServerError
from protocol.paths import CONTENT_ID_FILE, STORE_MANIFEST, parse_store_url

_CHUNK_BYTES = 1 << 20
_PART_BYTES = 8 << 20  # multipart part size of an upload
_MAX_MANIFEST_BYTES = 1 << 20  # a checkpoint holds a handful of files
_MAX_SIGN_S = 7 * 24 * 3600  # S3's limit on a presigned URL's lifetime


@dataclass(frozen=True)
class StoredFile:
    name: str
    size: int


def _s3(bucket: str, prefix: str, endpoint: str | None) -> S3Store:
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    return S3Store(
        bucket,
        prefix=prefix or None,
        endpoint=endpoint or None,
        client_options={"allow_http": endpoint.startswith("http://")},
    )


class StoreFiles:
    """The checkpoint objects of one `s3://BUCKET/PREFIX` store."""

    def __init__(self, url: str, public_url: str | None = None) -> None:
        bucket, prefix = parse_store_url(url)
        self.url = url
        self.store = _s3(bucket, prefix, None)
        # the signature covers the host: sign for the address clients use
        self.signer = _s3(bucket, prefix, public_url) if public_url else self.store

    async def _manifest(self, store_key: str) -> dict[str, dict[str, object]]:
        try:
            result = await obstore.get_async(self.store, f"{store_key}/{STORE_MANIFEST}")
        except FileNotFoundError:
            return {}
        if result.meta["size"] > _MAX_MANIFEST_BYTES:
            raise ServerError(f"artifact {store_key!r}: manifest too large")
        try:
            files = json.loads(bytes(await result.bytes_async()))["files"]
        except (ValueError, KeyError, TypeError) as err:
            raise ServerError(f"artifact {store_key!r}: unreadable manifest") from err
        if not isinstance(files, dict):
            raise ServerError(f"artifact {store_key!r}: unreadable manifest")
        return files

    async def files(self, store_key: str) -> list[StoredFile]:
        """The downloadable files of a content (bookkeeping excluded), by name; [] when the
        content is not in the store."""
        listed = []
        for name, entry in sorted((await self._manifest(store_key)).items()):
            if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                raise ServerError(f"artifact {store_key!r}: bad file name {name!r}")
            if name == CONTENT_ID_FILE:
                continue
            size = entry.get("size") if isinstance(entry, dict) else None
            if not isinstance(size, int) or size < 0:
                raise ServerError(f"artifact {store_key!r}: bad size of {name!r}")
            listed.append(StoredFile(name, size))
        return listed

    async def read_small(self, store_key: str, name: str, max_bytes: int) -> bytes | None:
        """One small file's bytes; None when it is missing or larger than `max_bytes`."""
        try:
            result = await obstore.get_async(self.store, f"{store_key}/{name}")
        except FileNotFoundError:
            return None
        if result.meta["size"] > max_bytes:
            return None
        return bytes(await result.bytes_async())

    async def sign(self, store_key: str, name: str, expires_in_s: float) -> str:
        """A presigned GET URL of one file, valid for `expires_in_s` (at most 7 days)."""
        seconds = max(1, min(int(expires_in_s), _MAX_SIGN_S))
        return await obstore.sign_async(
            self.signer, "GET", f"{store_key}/{name}", dt.timedelta(seconds=seconds)
        )

    async def chunks(self, store_key: str, name: str) -> AsyncIterator[bytes]:
        """The bytes of one file, a chunk at a time."""
        try:
            result = await obstore.get_async(self.store, f"{store_key}/{name}")
        except FileNotFoundError as err:
            raise ServerError(f"artifact {store_key}/{name} is missing from the store") from err
        async for chunk in result.stream(min_chunk_size=_CHUNK_BYTES):
            yield bytes(chunk)

    async def copy(self, source_key: str, target_key: str) -> None:
        """Every file of the content at `source_key` to `target_key`, the manifest last (the
        copy's record, written after, is its commit point). `FileNotFoundError` when the
        source holds nothing."""
        names = list(await self._manifest(source_key))
        if not names:
            raise FileNotFoundError(source_key)
        for name in [*names, STORE_MANIFEST]:
            await obstore.copy_async(self.store, f"{source_key}/{name}", f"{target_key}/{name}")

    async def delete_tree(self, prefix: str) -> None:
        """Remove every object under `prefix/`; nothing there is fine."""
        keys = [
            meta["path"] async for batch in obstore.list(self.store, f"{prefix}/") for meta in batch
        ]
        if keys:
            await obstore.delete_async(self.store, keys)

    async def put(self, prefix: str, name: str, data: bytes | AsyncIterable[bytes]) -> None:
        """One file under `prefix/` (an async iterable goes up in parts as it comes)."""
        await obstore.put_async(self.store, f"{prefix}/{name}", data, chunk_size=_PART_BYTES)

    async def put_manifest(self, prefix: str, files: dict[str, tuple[int, str]]) -> None:
        """The manifest of the files `put` under `prefix/` (name: size, sha256), last: a
        reader (`workers.artifacts`) checks every file against it."""
        entries = {name: {"size": size, "sha256": sha} for name, (size, sha) in files.items()}
        manifest = json.dumps({"files": entries}, sort_keys=True).encode()
        await obstore.put_async(self.store, f"{prefix}/{STORE_MANIFEST}", manifest)

    async def delete_older(self, prefix: str, cutoff: dt.datetime) -> int:
        """Remove every object under `prefix/` last written before `cutoff`; how many."""
        keys = [
            meta["path"]
            async for batch in obstore.list(self.store, f"{prefix}/")
            for meta in batch
            if meta["last_modified"] < cutoff
        ]
        if keys:
            await obstore.delete_async(self.store, keys)
        return len(keys)
