"""Submitting a call that spends a model's `seq_id`: every seq the SDK spends is settled.

The SDK numbers each call on a training model (`seq_id` 1, 2, 3, ...) before sending it, and
the worker runs a model's calls strictly in that order. So a call must never leave a hole:

1. The caller must own the model (checked by the route first): another tenant's model is a 404
   that touches nothing of it, so no tenant can settle or skip another's calls.
2. `seq_id` must be in range and not absurdly far ahead of the model's latest call; otherwise a
   400, and nothing is spent (no worker would ever wait for it). It is noted as the model's
   highest seq; when the gateway already knows the seq is near enough, beside step 3.
3. `(model_id, seq_id)` is claimed with the call's type and body digest (`claim_seq`). A
   genuine retry (same type and digest) gets the first request id; a different call reusing the
   seq is a 400.
4. The call is validated, built and encoded. If the gateway refuses it (a job too big for one
   bus message included), a *tombstone* carrying the error is published in its place (the
   worker treats it as applied), the future holds the error, and the client gets the 4xx at
   once; the model's next call runs without waiting.
5. Otherwise, at once, the future is recorded as pending and the job published with
   `Nats-Msg-Id = <model_id>/<seq_id>` (JetStream drops a re-publish).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from natskv.store import both
from protocol import api, rules, subjects
from protocol.errors import ErrorCategory, Gone, TwinkleError, UserError
from protocol.jobs import Job, Outcome, SeqClaim, TombstoneJob
from protocol.records import RunRecord
from twinkle_async.gateway.bodies import json_response
from twinkle_async.gateway.state import BUS, FUTURES, REGISTRY, TENANT
from twinkle_async.lifecycle import SESSION_END_CHECKPOINT
from twinkle_async.seq_claims import claim_seq

# build(request_id, first): the job of the call; `first` is False for a retry, which must not
# be charged again (rate-limit tokens).
BuildJob = Callable[[str, bool], Awaitable[Job]]


class SeqRef(msgspec.Struct):
    """The two fields a sequenced JSON body is routed on, read before (and whatever) the rest."""

    model_id: str | None = None
    seq_id: int | None = None


_SEQ_REF = msgspec.json.Decoder(SeqRef)


def seq_ref(body: bytes) -> SeqRef:
    """`model_id` and `seq_id` of a JSON body whose other fields may still be wrong.

    Only these two must be well-formed here; every other field is checked when the call is
    built, after ownership, so that a refusal can settle the seq.
    """
    try:
        return _SEQ_REF.decode(body or b"{}")
    except msgspec.ValidationError as exc:
        raise UserError(f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise UserError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise UserError(f"invalid body: {api.NESTED_TOO_DEEPLY}") from None


def body_digest(body: bytes) -> str:
    """What makes a retry a retry: the same bytes."""
    return hashlib.sha256(body).hexdigest()[:32]


async def live_run(request: web.Request, model_id: str) -> RunRecord:
    """A run the caller owns (else 404) whose adapter is still loaded (else 410)."""
    run = await request.app[REGISTRY].run(model_id, request[TENANT])
    if run.unloaded_at is not None:
        raise Gone(
            f"model_id {model_id!r} was unloaded when its session finished; its state is in"
            f" tinker://{model_id}/weights/{SESSION_END_CHECKPOINT}"
        )
    return run


async def owned_run(request: web.Request, body: bytes) -> tuple[RunRecord, int | None]:
    """The live run a sequenced JSON call names (see `live_run`), and its seq_id."""
    ref = seq_ref(body)
    if ref.model_id is None:
        raise UserError("model_id: missing")
    return await live_run(request, ref.model_id), ref.seq_id


async def submit_sequenced(
    request: web.Request,
    run: RunRecord,
    seq_id: int | None,
    request_type: str,
    body: bytes,
    build: BuildJob,
    *,
    field: str = "seq_id",
) -> web.Response:
    """Steps 2-5 of the module docstring for a call on `run`, which the caller owns; answers
    the future's request id."""
    request_id = await submit(request, run, seq_id, request_type, body, build, field=field)
    return json_response(api.UntypedAPIFuture(request_id=request_id, model_id=run.model_id))


async def submit(
    request: web.Request,
    run: RunRecord,
    seq_id: int | None,
    request_type: str,
    body: bytes,
    build: BuildJob,
    *,
    field: str = "seq_id",
) -> str:
    """`submit_sequenced`'s work: the request id of the submitted call."""
    futures = request.app[FUTURES]
    model_id = run.model_id
    noted: Awaitable[int] | None = None
    if seq_id != 0:  # 0 is the model's creation, claimed like any call but never "ahead"
        rules.check_seq_id(field, seq_id)
        assert seq_id is not None
        noted = futures.note_seq(model_id, seq_id, field)
        if not futures.seq_in_range(model_id, seq_id):
            await noted  # it may refuse the seq: before anything is claimed
            noted = None
    assert seq_id is not None
    claiming = claim_seq(
        futures,
        model_id,
        seq_id,
        request_type,
        body_digest(body),
        named=f"model {model_id!r}",
        field=field,
    )
    if noted is None:
        claim, first = await claiming
    else:
        # A note that cannot refuse goes beside the claim: one bus round trip less (a claimed
        # seq's retry gets its request id back, whichever failed).
        _, (claim, first) = await both(noted, claiming)
    bus = request.app[BUS]
    try:
        job = await build(claim.request_id, first)
        data = bus.encode_job(job)  # past the bus's largest message: a refusal, 413
    except TwinkleError as err:
        # A retryable refusal (rate limited) is retried by the SDK with this same seq: only a
        # final refusal settles it.
        if err.category is ErrorCategory.USER and not err.retryable:
            await settle_refused(request, run, seq_id, claim, err)
        raise
    pending = futures.record_pending(
        claim.request_id,
        request_type,
        model_id,
        request[TENANT],
        not_before=getattr(job, "not_before", 0.0),
        queue_reason=getattr(job, "queue_reason", ""),
    )
    published = bus.publish_job(subjects.pool_of(run.base_model), job, data)
    # Both at once: one bus round trip less per call. Either order is safe: the pending record
    # never replaces a result (`record_pending`), and the client learns the request id only
    # from this response, after both are stored.
    await both(pending, published)
    return claim.request_id


async def settle_refused(
    request: web.Request, run: RunRecord, seq_id: int, claim: SeqClaim, err: TwinkleError
) -> None:
    """Publish the tombstone of a refused call and store its error as the call's outcome."""
    tombstone = TombstoneJob(
        request_id=claim.request_id,
        model_id=run.model_id,
        tenant_id=run.tenant_id,
        seq_id=seq_id,
        published_at=time.time(),
        request_type=claim.request_type,
        error=err.message,
        category=err.category,
    )
    await request.app[FUTURES].resolve(
        Outcome(
            request_id=claim.request_id,
            state="error",
            request_type=claim.request_type,
            model_id=run.model_id,
            error=err.message,
            category=err.category,
            finished_at=time.time(),
            tenant_id=run.tenant_id,
        )
    )
    await request.app[BUS].publish_job(subjects.pool_of(run.base_model), tombstone)
