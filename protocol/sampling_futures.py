"""Wire shapes and limits of the sampling-session endpoints: `retrieve_futures`,
`cancel_future` and `join_sampling_session` (tinker 0.38: `types/futures_retrieve_*.py`,
`types/future_completion.py`, `types/join_sampling_session_*.py`; `lib/session_futures_poller.py`).

How the SDK uses them (flags `sample_use_retrieve_futures`, `sample_join_sampling_session` in
`client/config`, `sample_cancel_enabled` in `client/dynamic_config`):
- A sampling client numbers its samples `CLONE_SEQ_SPAN * clone_id + n`; the original client is
  clone 0, an unpickled copy asks `join_sampling_session` for its clone id (`client_counter`).
- One background poller per (sampling session, clone) long-polls `retrieve_futures` with the
  cursor of its last answer; each completion it reports is then fetched once with
  `retrieve_future`, and acknowledged on a later poll in `retrieved_request_ids`.
- A sample future the caller abandons (cancelled, timed out) is sent to `cancel_future`.

`check_retrieve` validates every client-controlled field of a poll; the gateway holds the poll
at most `min(timeout, long_poll_s)`.
"""

from __future__ import annotations

import math

import msgspec

from protocol import rules
from protocol.api import RequestBody, ResponseBody
from protocol.errors import UserError

CLONE_SEQ_SPAN = 1_000_000_000  # seq ids of one clone: [clone * span, (clone + 1) * span)
MAX_CLONE_ID = 1_000_000_000  # an unjoined clone draws `uuid % 1e9 + 1` (SDK)
MAX_SAMPLE_SEQ_ID = (MAX_CLONE_ID + 1) * CLONE_SEQ_SPAN - 1
MAX_CURSOR = 2**53  # cursors are microseconds since the epoch: exact in any JSON reader
MAX_RETRIEVED_IDS = 4096  # acknowledgements in one poll (the SDK sends what it consumed since)
MAX_POLL_TIMEOUT_S = 600.0  # a longer `timeout` is refused; the hold is capped at long_poll_s


class SamplingSessionFuturesTarget(
    RequestBody, frozen=True, tag_field="type", tag="sampling_session"
):
    """What one poll watches: a sampling session's clone (0 for the original client)."""

    sampling_session_id: str
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(RequestBody, frozen=True):
    """`POST /retrieve_futures`: completions after `prev_cursor`, held up to `timeout` seconds
    (None: the server's long poll; 0: answer at once)."""

    target: SamplingSessionFuturesTarget
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class FutureFinished(ResponseBody, frozen=True, tag_field="state", tag="finished"):
    """A request with a result; the SDK reserves `response_payload_uncompressed_size` bytes."""

    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(ResponseBody, frozen=True, tag_field="state", tag="failed"):
    """A request that failed; `retrieve_future` answers its error."""

    request_id: str


FutureCompletion = FutureFinished | FutureFailed


class FuturesRetrieveResponse(msgspec.Struct, frozen=True):
    """The completions and the cursor to send back as `prev_cursor` (both always written)."""

    completions: list[FutureCompletion]
    cursor: int


class CancelFutureRequest(RequestBody, frozen=True):
    """`POST /cancel_future`: the SDK ignores the answer's body."""

    request_id: str


class JoinSamplingSessionRequest(
    RequestBody, frozen=True, tag_field="type", tag="join_sampling_session"
):
    """`POST /join_sampling_session`: a new clone of a sampling client asks for its id."""

    sampling_session_id: str


class JoinSamplingSessionResponse(
    ResponseBody, frozen=True, tag_field="type", tag="join_sampling_session"
):
    """The clone's id, unique among the session's clients (the original is 0)."""

    client_counter: int


def clone_of(seq_id: int) -> int:
    """The clone that numbered a sample `seq_id`."""
    return seq_id // CLONE_SEQ_SPAN


def check_sample_seq_id(field: str, seq_id: int) -> int:
    """A sample's seq id: a clone's block `[clone * span, (clone + 1) * span)`."""
    if not 0 <= seq_id <= MAX_SAMPLE_SEQ_ID:
        raise UserError(f"{field}: {seq_id} is out of range 0..{MAX_SAMPLE_SEQ_ID}")
    return seq_id


def check_retrieve(body: FuturesRetrieveRequest, long_poll_s: float) -> float:
    """Validate a poll's fields; the seconds it may be held."""
    target = body.target
    rules.check_id("target.sampling_session_id", target.sampling_session_id)
    if not 0 <= target.cloned_sampler_id <= MAX_CLONE_ID:
        raise UserError(
            f"target.cloned_sampler_id: {target.cloned_sampler_id} is out of range"
            f" 0..{MAX_CLONE_ID}"
        )
    if not 0 <= body.prev_cursor <= MAX_CURSOR:
        raise UserError(f"prev_cursor: {body.prev_cursor} is out of range 0..{MAX_CURSOR}")
    if len(body.retrieved_request_ids) > MAX_RETRIEVED_IDS:
        raise UserError(
            f"retrieved_request_ids: {len(body.retrieved_request_ids)} ids, at most"
            f" {MAX_RETRIEVED_IDS} per poll"
        )
    for request_id in body.retrieved_request_ids:
        rules.check_request_id("retrieved_request_ids", request_id)
    if body.timeout is None:
        return long_poll_s
    if not math.isfinite(body.timeout) or not 0 <= body.timeout <= MAX_POLL_TIMEOUT_S:
        raise UserError(
            f"timeout: {body.timeout} is not a number of seconds in 0..{MAX_POLL_TIMEOUT_S}"
        )
    return min(body.timeout, long_poll_s)
