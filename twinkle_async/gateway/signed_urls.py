"""Signed download URLs: an HMAC of what is fetched and until when, so a download needs no key.

A checkpoint's files are served at `/files/v1/checkpoints/<run>/<kind>/<name>/<file>` and as one
tar at `/files/v1/archives/<run>/<kind>/<name>`, each with `?expires=<unix s>&sig=<hex>`. The
signature covers the resource (the decoded path after `/files/v1/`), the checkpoint's content id
and the expiry, so a URL stops working when it expires, when the checkpoint is deleted, and when
an overwrite replaces the content it was signed for.

Pure: the key and the clock are passed in. The key is `GatewaySettings.download_secret`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import quote, urlencode

from protocol.errors import UserError
from protocol.paths import TinkerPath

FILES_PREFIX = "/files/v1"
_MAX_EXPIRES_DIGITS = 12


def file_resource(path: TinkerPath, file_name: str) -> str:
    """What a one-file URL grants."""
    return f"file/{path.run_id}/{path.kind}/{path.name}/{file_name}"


def archive_resource(path: TinkerPath) -> str:
    """What an archive URL grants."""
    return f"archive/{path.run_id}/{path.kind}/{path.name}"


def signature(secret: bytes, resource: str, content_id: str, expires: int) -> str:
    message = f"{resource}\n{content_id}\n{expires}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _query(secret: bytes, resource: str, content_id: str, expires: int) -> str:
    return urlencode({"expires": expires, "sig": signature(secret, resource, content_id, expires)})


def _segments(path: TinkerPath) -> str:
    # run ids hold ':' (kept as the SDK sends it); names use a URL-safe alphabet already
    return f"{quote(path.run_id, safe=':')}/{path.kind}/{quote(path.name, safe='')}"


def file_url(
    base_url: str, secret: bytes, path: TinkerPath, file_name: str, content_id: str, expires: int
) -> str:
    """The absolute, signed URL of one file of a checkpoint."""
    query = _query(secret, file_resource(path, file_name), content_id, expires)
    name = quote(file_name, safe="")
    return f"{base_url}{FILES_PREFIX}/checkpoints/{_segments(path)}/{name}?{query}"


def archive_url(
    base_url: str, secret: bytes, path: TinkerPath, content_id: str, expires: int
) -> str:
    """The absolute, signed URL of a checkpoint's files as one tar."""
    query = _query(secret, archive_resource(path), content_id, expires)
    return f"{base_url}{FILES_PREFIX}/archives/{_segments(path)}?{query}"


def check(
    secret: bytes, resource: str, content_id: str | None, query: Mapping[str, str], now: float
) -> None:
    """Refuse (403) a URL whose signature does not match or whose time is up.

    `content_id` is the checkpoint's current content, None when it no longer exists: a deleted
    checkpoint answers like a bad signature, so an unsigned caller learns nothing about ids.
    """
    refusal = UserError(
        "download link is invalid or expired, or its checkpoint changed; ask for a new one",
        code="forbidden",
        status=403,
    )
    raw = query.get("expires", "")
    given = query.get("sig", "")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= _MAX_EXPIRES_DIGITS):
        raise refusal
    if content_id is None:
        raise refusal
    expected = signature(secret, resource, content_id, int(raw))
    # bytes, not str: compare_digest refuses non-ASCII strings, and `sig` comes from anyone
    if not hmac.compare_digest(expected.encode(), given.encode()) or now > int(raw):
        raise refusal
