"""The error model: every failure carries a code, a category, an HTTP status and retryability.

Categories are the wire values the tinker SDK reads (`RequestErrorCategory`): lower-case
`user`, `server`, `unknown`. A user error is input the client controls (never a 5xx); a server
error is ours. The gateway maps a `TwinkleError` to a response in one place; a worker turns it
into a failed future (`{"error", "category"}`).
"""

from __future__ import annotations

import enum


class ErrorCategory(enum.StrEnum):
    """Who is at fault; the values are exactly what the SDK parses."""

    USER = "user"
    SERVER = "server"
    UNKNOWN = "unknown"


class TwinkleError(Exception):
    """Base of every error we report to a client.

    `status` is the HTTP status when the error answers a request directly; a failed future is
    still a 200 carrying `{"error", "category"}`.
    """

    code: str = "internal"
    category: ErrorCategory = ErrorCategory.SERVER
    status: int = 500
    retryable: bool = False

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_json(self) -> dict[str, str]:
        """The body a client sees: `detail` for HTTP errors, `error`+`category` for futures."""
        return {"error": self.message, "category": self.category.value, "code": self.code}


class UserError(TwinkleError):
    """Bad input: a field the client controls is wrong. Answered with a 4xx, never retried."""

    code = "bad_request"
    category = ErrorCategory.USER
    status = 400


class Cancelled(UserError):
    """The client cancelled the request (`cancel_future`); its future fails with this.

    `generated_tokens`: what a sampler had generated for it when it stopped (0 if queued).
    """

    code = "cancelled"

    def __init__(self, message: str = "cancelled by the client", *, generated_tokens: int = 0):
        super().__init__(message)
        self.generated_tokens = generated_tokens


class NotFound(UserError):
    """An id the client named does not exist, or belongs to another tenant (we never say which)."""

    code = "not_found"
    status = 404


class Gone(UserError):
    """The id named something that has ended (a finished session): the SDK stops using it."""

    code = "gone"
    status = 410


class Forbidden(UserError):
    """The caller is known but may not do this (an admin call on a gateway without an admin key)."""

    code = "forbidden"
    status = 403


class QuotaExceeded(UserError):
    """A hard cap of the tenant's quota; the message names the limit and the current value."""

    code = "quota_exceeded"
    status = 403


class RateLimited(UserError):
    """Over a rate the queue cannot absorb: retry later (the SDK retries a 429 with backoff)."""

    code = "rate_limited"
    status = 429
    retryable = True


class Unauthorized(UserError):
    """Missing or wrong API key."""

    code = "unauthorized"
    status = 401


class PayloadTooLarge(UserError):
    """A request body over the configured limit."""

    code = "payload_too_large"
    status = 413


class ServerError(TwinkleError):
    """Our fault: a worker failed, the bus is down, an invariant broke."""

    code = "internal"
    category = ErrorCategory.SERVER
    status = 500


class Unavailable(ServerError):
    """A dependency is briefly unavailable (bus, worker); the client may retry."""

    code = "unavailable"
    status = 503
    retryable = True
