"""The web console's login session: a signed cookie, and the token that guards it.

Logging in with a key (a tenant's `tml-…` or the admin key) sets one cookie, `HttpOnly`,
`SameSite=Strict`, on path `/`. It holds no key: only which kind of login it is, the hash of the
key it was opened with, and when it lapses, signed with a secret derived from the gateway's
download secret (gateways that share that secret accept each other's sessions). Every request
made with it is checked again: a revoked key, or a changed admin key, ends the session at its
next request.

Each session has a CSRF token, an HMAC of the cookie that the page gets from `/console/session`
(same origin only) and sends back in `X-Console-CSRF` with every call. A request carrying the
cookie without that header is not authenticated by it: a page on another site can neither read
the token nor set the header without a CORS preflight, which this server never grants, and the
strict cookie is not sent from another site in the first place.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Literal

import msgspec

COOKIE = "twinkle_console"
CSRF_HEADER = "X-Console-CSRF"
SESSION_S = 12 * 3600
MAX_COOKIE_CHARS = 512  # what a session cookie this module writes can be; longer is junk

Kind = Literal["tenant", "admin"]


class Session(msgspec.Struct, frozen=True):
    kind: Kind
    key_hash: str  # `auth.hash_key` of the key the session was opened with
    expires: int  # Unix seconds


def _signing_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"twinkle-console-session", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(secret: bytes, kind: Kind, key_hash: str, now: float | None = None) -> str:
    """A cookie value for a session opened now."""
    expires = int((time.time() if now is None else now) + SESSION_S)
    body = _b64(msgspec.json.encode(Session(kind=kind, key_hash=key_hash, expires=expires)))
    mac = hmac.new(_signing_key(secret), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def read(secret: bytes, cookie: str, now: float | None = None) -> Session | None:
    """The session a cookie value holds, or None: malformed, not signed by `secret`, lapsed."""
    if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
        return None
    body, _, mac = cookie.partition(".")
    want = hmac.new(_signing_key(secret), body.encode(), hashlib.sha256).digest()
    try:
        if not hmac.compare_digest(_unb64(mac), want):
            return None
        session = msgspec.json.decode(_unb64(body), type=Session)
    except (ValueError, msgspec.DecodeError):
        return None
    if session.expires <= (time.time() if now is None else now):
        return None
    return session


def csrf_token(secret: bytes, cookie: str) -> str:
    """The token a page sends back with its session's requests."""
    return _b64(hmac.new(_signing_key(secret), b"csrf:" + cookie.encode(), hashlib.sha256).digest())


def csrf_ok(secret: bytes, cookie: str, token: str) -> bool:
    return bool(token) and hmac.compare_digest(token.encode(), csrf_token(secret, cookie).encode())
