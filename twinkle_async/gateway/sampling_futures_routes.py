"""Sampling-session endpoints: `retrieve_futures`, `cancel_future`, `join_sampling_session`.

Step 6 of the request flow for samples, when the SDK's `sample_use_retrieve_futures` is on:
one long-poll per (sampling session, clone) answers every completion since the client's
cursor from `SessionCompletions` (fed by the futures subscription), awaiting the next one when
there is none; the client then fetches each result once with `retrieve_future`. After a gateway
restart (or a NATS outage, or a trimmed log) a poll whose cursor predates what the gateway
knows rebuilds the target's completions from KV first: the seq claims of its sampling session
name its request ids, their outcomes say which finished. The rebuild is bounded (the newest
`_MAX_SCAN` samples of the clone) and shares the poll's time budget; one that runs out answers
what it found with the client's own cursor, so the next poll tries again.

`cancel_future` fails a pending sample with a compare-and-set on its outcome (a result that
landed first wins) and tells the pool's samplers on `tw.v1.cancel.<pool>` to drop it.
`join_sampling_session` hands a clone of a sampling client the next clone id of its session
(a compare-and-set counter in `tw_sessions`), so clones number their samples in disjoint
blocks and the asample dedupe on `(sampling_session_id, seq_id)` never merges two of them.

Every endpoint checks that the sampling session, or the future, is the caller's: another
tenant's reads as unknown.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from aiohttp import web

from protocol import rules, subjects
from protocol.errors import Cancelled, NotFound, TwinkleError, Unavailable, UserError
from protocol.jobs import Outcome, decode_claim, decode_outcome
from protocol.sampling_futures import (
    MAX_CLONE_ID,
    CancelFutureRequest,
    FuturesRetrieveRequest,
    FuturesRetrieveResponse,
    JoinSamplingSessionRequest,
    JoinSamplingSessionResponse,
    check_retrieve,
    clone_of,
)
from twinkle_async.gateway.bodies import json_response, read_json
from twinkle_async.gateway.completions import SessionCompletions, Target
from twinkle_async.gateway.state import BUS, FUTURES, REGISTRY, SAMPLES, SETTINGS, TENANT

log = logging.getLogger(__name__)

routes = web.RouteTableDef()

COMPLETIONS = web.AppKey("completions", SessionCompletions)

_MAX_SCAN = 4096  # newest samples of a clone a rebuild reads
_SCAN_BATCH = 64  # KV reads in flight at once during a rebuild
_MIN_SCAN_S = 2.0  # a rebuild gets at least this long, even for an answer-at-once poll
_SKEW_US = 5_000_000  # finished this long before the cursor still counts (clocks differ)
_MAX_JOIN_TRIES = 32  # compare-and-set attempts of one join under contention
_MAX_CANCEL_TRIES = 8  # compare-and-set attempts of one cancel against a sampler's updates
_PUBLISH_TIMEOUT_S = 2.0


@routes.post("/api/v1/retrieve_futures")
async def retrieve_futures(request: web.Request) -> web.Response:
    started = time.monotonic()
    body = await read_json(request, FuturesRetrieveRequest)
    hold_s = check_retrieve(body, request.app[SETTINGS].long_poll_s)
    sampler = await request.app[REGISTRY].sampler(
        body.target.sampling_session_id, request[TENANT], "target.sampling_session_id"
    )
    target = Target(sampler.sampling_session_id, body.target.cloned_sampler_id)
    completions = request.app[COMPLETIONS]
    completions.acknowledge(target, body.retrieved_request_ids)
    complete = True
    if completions.needs_scan(target, body.prev_cursor, sampler.created_at):
        complete = await _rebuild(request.app, target, body.prev_cursor, max(hold_s, _MIN_SCAN_S))
    found, cursor = completions.since(target, body.prev_cursor)
    remaining_s = hold_s - (time.monotonic() - started)
    if not found and remaining_s > 0:
        await completions.wait(target, remaining_s)
        found, cursor = completions.since(target, body.prev_cursor)
    if not complete:
        cursor = body.prev_cursor  # not past what the unfinished rebuild may still find
    return json_response(FuturesRetrieveResponse(completions=found, cursor=cursor))


async def _rebuild(app: web.Application, target: Target, prev_cursor: int, budget_s: float) -> bool:
    """Log the target's completions that finished after `prev_cursor` (roughly: clocks
    differ), read from KV; whether it finished within `budget_s`."""
    bus, futures, completions = app[BUS], app[FUTURES], app[COMPLETIONS]
    try:
        async with asyncio.timeout(budget_s):
            keys = await bus.keys(
                subjects.BUCKET_FUTURES, subjects.seq_prefix(target.sampling_session_id)
            )
            seqs = sorted(
                (
                    seq
                    for seq in map(_seq_of, keys)
                    if seq is not None and clone_of(seq) == target.clone_id
                ),
                reverse=True,
            )[:_MAX_SCAN]
            for start in range(0, len(seqs), _SCAN_BATCH):
                claims = await asyncio.gather(
                    *(
                        bus.get(
                            subjects.BUCKET_FUTURES,
                            subjects.seq_key(target.sampling_session_id, seq),
                        )
                        for seq in seqs[start : start + _SCAN_BATCH]
                    )
                )
                outcomes = await asyncio.gather(
                    *(futures.read(decode_claim(claim).request_id) for claim in claims if claim)
                )
                for outcome in outcomes:
                    if _finished_after(outcome, prev_cursor):
                        assert outcome is not None
                        completions.record_for(target, outcome)
    except TimeoutError:
        log.warning(
            "rebuilding the completions of %s (clone %d) took over %.1f s; answering what was"
            " found",
            target.sampling_session_id,
            target.clone_id,
            budget_s,
        )
        return False
    completions.mark_complete(target)
    return True


def _seq_of(key: str) -> int | None:
    """The seq id of a `seq_key`, None for anything else."""
    tail = key.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _finished_after(outcome: Outcome | None, prev_cursor: int) -> bool:
    return (
        outcome is not None
        and outcome.state != "pending"
        and outcome.finished_at * 1e6 > prev_cursor - _SKEW_US
    )


@routes.post("/api/v1/cancel_future")
async def cancel_future(request: web.Request) -> web.Response:
    """Stop a pending sample; a finished one is left as it is. An unknown or expired id, or
    another tenant's, is a 404 (the same answer for both) and changes nothing."""
    body = await read_json(request, CancelFutureRequest)
    request_id = rules.check_request_id("request_id", body.request_id)
    tenant = request[TENANT]
    # A sampler counts each start on the pending outcome (`workers.sampler.guard`), so a
    # compare-and-set that lost to one reads the outcome again; one that finished is left.
    for _ in range(_MAX_CANCEL_TRIES):
        entry = await request.app[BUS].entry(
            subjects.BUCKET_FUTURES, subjects.future_key(request_id)
        )
        outcome = decode_outcome(entry[0]) if entry is not None else None
        if entry is None or outcome is None or outcome.tenant_id != tenant:
            raise NotFound(f"request_id {request_id!r} not found (unknown or expired)")
        if outcome.request_type != "sample":
            raise UserError(
                f"request_id: {request_id!r} is a {outcome.request_type or 'training'} request;"
                " only samples can be cancelled"
            )
        if outcome.state != "pending":
            return json_response({})
        if await request.app[FUTURES].cancel(outcome, entry[1], Cancelled().message):
            await request.app[SAMPLES].done(tenant, request_id)
            try:
                sampler = await request.app[REGISTRY].sampler(outcome.sampling_session_id, tenant)
            except TwinkleError:
                sampler = None  # the session is gone: nothing to route the cancel by
            if sampler is not None:
                await tell_samplers(request.app, request_id, sampler.base_model)
            log.info("sample %s cancelled by its client", request_id)
            return json_response({})
    raise Unavailable(f"could not cancel {request_id!r} while its sampler updated it; retry")


async def cancel_pending(app: web.Application, request_id: str, base_model: str) -> None:
    """Cancel a sample still pending (one the gateway's own caller gave up on); a finished
    one is left as it is."""
    for _ in range(_MAX_CANCEL_TRIES):
        entry = await app[BUS].entry(subjects.BUCKET_FUTURES, subjects.future_key(request_id))
        outcome = decode_outcome(entry[0]) if entry is not None else None
        if entry is None or outcome is None or outcome.state != "pending":
            return
        if await app[FUTURES].cancel(outcome, entry[1], Cancelled().message):
            await app[SAMPLES].done(outcome.tenant_id, request_id)
            await tell_samplers(app, request_id, base_model)
            return


async def tell_samplers(app: web.Application, request_id: str, base_model: str) -> None:
    """Ask the pool's samplers to drop the request (best effort: a sampler that misses it
    still skips the job at pickup, where the failed outcome is no longer pending)."""
    nc = app[BUS].nc
    if nc is None:
        return
    subject = subjects.sample_cancel_subject(subjects.pool_of(base_model))
    try:
        await asyncio.wait_for(nc.publish(subject, request_id.encode()), _PUBLISH_TIMEOUT_S)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not tell the samplers to drop %s: %r", request_id, exc)


@routes.post("/api/v1/join_sampling_session")
async def join_sampling_session(request: web.Request) -> web.Response:
    """The next clone id of the session (1, 2, ...; the original client is 0)."""
    body = await read_json(request, JoinSamplingSessionRequest)
    sampler = await request.app[REGISTRY].sampler(body.sampling_session_id, request[TENANT])
    bus = request.app[BUS]
    key = subjects.clone_counter_key(sampler.sampling_session_id)
    for _ in range(_MAX_JOIN_TRIES):
        entry = await bus.entry(subjects.BUCKET_SESSIONS, key)
        last = int(entry[0]) if entry is not None else 0
        if last >= MAX_CLONE_ID:
            raise UserError(
                f"sampling_session_id: {sampler.sampling_session_id!r} already has"
                f" {MAX_CLONE_ID} clones; create a new sampling session"
            )
        revision = entry[1] if entry is not None else None
        if await bus.swap(subjects.BUCKET_SESSIONS, key, str(last + 1).encode(), revision):
            return json_response(JoinSamplingSessionResponse(client_counter=last + 1))
    raise Unavailable("too many clones joined this sampling session at once; retry")
