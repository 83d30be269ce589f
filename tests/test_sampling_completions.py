"""The completion logs behind `retrieve_futures` (`SessionCompletions`, pure, a fake clock), the
validation of a poll's fields, and a gateway restart against a real nats-server: a fresh
gateway rebuilds from KV the completions the client never saw, and a held poll is woken by
the next completion the futures subscription delivers."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from aiohttp import web

from protocol import subjects
from protocol.errors import UserError
from protocol.jobs import Outcome, SeqClaim, encode_outcome
from protocol.sampling_futures import (
    CLONE_SEQ_SPAN,
    FutureFailed,
    FutureFinished,
    FuturesRetrieveRequest,
    SamplingSessionFuturesTarget,
    check_retrieve,
)
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.gateway.completions import SessionCompletions, Target
from twinkle_async.gateway.sampling_futures_routes import COMPLETIONS, _rebuild
from twinkle_async.gateway.state import BUS, FUTURES
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings

T = Target("sess-1:sample:0", 0)


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def done(request_id: str, target: Target = T, payload: bytes = b"abc") -> Outcome:
    return Outcome(
        request_id=request_id,
        state="done",
        request_type="sample",
        payload=payload,
        payload_type="proto",
        finished_at=time.time(),
        tenant_id="t",
        sampling_session_id=target.sampling_session_id,
        clone_id=target.clone_id,
    )


def failed(request_id: str, target: Target = T) -> Outcome:
    return msgspec.structs.replace(done(request_id, target), state="error", payload=b"")


def test_completions_after_the_cursor_trimmed_once_seen() -> None:
    log = SessionCompletions(clock=Clock())
    log.record(done("r1"))
    log.record(failed("r2"))
    log.record(done("r1"))  # a second write of one outcome is reported once
    found, cursor = log.since(T, 0)
    assert found == [
        FutureFinished(request_id="r1", response_payload_uncompressed_size=3),
        FutureFailed(request_id="r2"),
    ]
    log.record(done("r3"))
    later, next_cursor = log.since(T, cursor)  # r1, r2 are seen: trimmed
    assert [c.request_id for c in later] == ["r3"] and next_cursor > cursor
    assert log.since(T, next_cursor) == ([], next_cursor)


def test_targets_and_clones_are_separate_and_foreign_outcomes_ignored() -> None:
    log = SessionCompletions(clock=Clock())
    clone = Target(T.sampling_session_id, 7)
    log.record(done("a"))
    log.record(done("b", clone))
    log.record(msgspec.structs.replace(done("c"), state="pending"))
    log.record(msgspec.structs.replace(done("d"), sampling_session_id=""))  # not a sample
    assert [c.request_id for c in log.since(T, 0)[0]] == ["a"]
    assert [c.request_id for c in log.since(clone, 0)[0]] == ["b"]


def test_acknowledged_ids_go_and_an_unknown_newer_cursor_gets_everything() -> None:
    log = SessionCompletions(clock=Clock())
    for name in ("a", "b", "c"):
        log.record(done(name))
    log.acknowledge(T, ["b", "never-seen"])
    found, cursor = log.since(T, log.cursor + 10**9)  # from a gateway this one never was
    assert [c.request_id for c in found] == ["a", "c"] and cursor == log.cursor


def test_cursors_grow_even_when_the_clock_stands_still_or_goes_back() -> None:
    clock = Clock()
    log = SessionCompletions(clock=clock)
    first = log.next_cursor()
    clock.now -= 50
    assert log.next_cursor() == first + 1
    clock.now += 100
    assert log.next_cursor() >= int(clock.now * 1e6)


def test_a_scan_is_needed_only_for_what_the_gateway_may_have_missed() -> None:
    clock = Clock()
    log = SessionCompletions(clock=clock)
    started = clock.now
    # a session created after this gateway started: everything reached its subscription
    assert not log.needs_scan(T, 0, created_at=started + 1)
    # created before, polled from before: the completions may predate the gateway
    assert log.needs_scan(T, 0, created_at=started - 60)
    # a cursor this gateway handed out is covered
    assert not log.needs_scan(T, log.cursor, created_at=started - 60)
    log.mark_complete(T)
    assert not log.needs_scan(T, 0, created_at=started - 60)
    clock.now += 10
    log.mark_incomplete()  # NATS was away: what was recorded since is all that is known
    assert log.needs_scan(T, 0, created_at=started - 60)


def test_a_full_log_drops_its_oldest_and_asks_for_a_scan() -> None:
    log = SessionCompletions(clock=Clock(), max_entries=2)
    log.mark_complete(T)
    for name in ("a", "b", "c"):
        log.record(done(name))
    assert [c.request_id for c in log.since(T, 0)[0]] == ["b", "c"]
    assert log.needs_scan(T, 0, created_at=0.0)


def test_idle_targets_are_dropped_and_their_count_is_bounded() -> None:
    clock = Clock()
    log = SessionCompletions(clock=clock, retain_s=60, max_targets=2)
    log.record(done("a"))
    clock.now += 61
    log.record(done("b", Target("other:sample:0", 0)))
    assert log.since(T, 0)[0] == []  # T idled out
    for n in range(5):
        log.record(done(f"x{n}", Target(f"s{n}:sample:0", 0)))
    assert len(log._logs) == 2


@pytest.mark.parametrize("how", ["crowded out", "idle"])
def test_a_target_dropped_with_unseen_completions_asks_for_a_scan(how: str) -> None:
    """Another tenant's many targets (or an idle spell) drop T's log with a completion T's
    client has not seen: its next poll must rebuild from KV, not answer nothing for ever."""
    clock = Clock()
    log = SessionCompletions(clock=clock, retain_s=60, max_targets=3)
    created = clock.now + 1  # T's session is newer than the gateway: no scan so far
    clock.now += 2
    _, seen = log.since(T, 0)
    assert not log.needs_scan(T, seen, created_at=created)
    log.record(done("unseen"))
    if how == "idle":
        clock.now += 61
    for n in range(3):
        log.record(done(f"x{n}", Target(f"hostile:sample:{n}", n)))
    assert T not in log._logs
    assert log.needs_scan(T, seen, created_at=created)


def test_a_target_dropped_with_nothing_unseen_costs_no_scan() -> None:
    clock = Clock()
    log = SessionCompletions(clock=clock, retain_s=60, max_targets=3)
    created = clock.now + 1
    clock.now += 2
    log.record(done("seen"))
    _, seen = log.since(T, 0)
    log.since(T, seen)  # its client has everything: the log is empty
    clock.now += 61
    for n in range(3):
        log.record(done(f"x{n}", Target(f"other:sample:{n}", n)))
    assert T not in log._logs
    assert not log.needs_scan(T, seen, created_at=created)


async def test_a_held_poll_wakes_on_its_targets_completion_only() -> None:
    log = SessionCompletions()
    other = Target("other:sample:0", 0)
    waiting = asyncio.create_task(log.wait(T, 10.0))
    await asyncio.sleep(0.01)
    log.record(done("x", other))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    log.record(done("y"))
    await asyncio.wait_for(waiting, 1.0)
    started = time.monotonic()
    await log.wait(T, 0.05)  # nothing new: back after the timeout
    assert 0.04 <= time.monotonic() - started < 1.0


def _poll(**fields: object) -> FuturesRetrieveRequest:
    base: dict[str, object] = {
        "target": SamplingSessionFuturesTarget(sampling_session_id="s:sample:0")
    }
    return FuturesRetrieveRequest(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "hold_s"),
    [({}, 30.0), ({"timeout": 0.0}, 0.0), ({"timeout": 5.0}, 5.0), ({"timeout": 500.0}, 30.0)],
)
def test_a_poll_is_held_at_most_the_long_poll(fields: dict[str, object], hold_s: float) -> None:
    assert check_retrieve(_poll(**fields), 30.0) == hold_s


@pytest.mark.parametrize(
    "fields",
    [
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": -0.5},
        {"timeout": 601.0},
        {"prev_cursor": -1},
        {"prev_cursor": 2**53 + 1},
        {"retrieved_request_ids": ["a"] * 4097},
        {"retrieved_request_ids": ["a b"]},
        {"target": SamplingSessionFuturesTarget(sampling_session_id="s", cloned_sampler_id=-1)},
        {"target": SamplingSessionFuturesTarget(sampling_session_id="../s")},
    ],
)
def test_hostile_poll_fields_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(UserError):
        check_retrieve(_poll(**fields), 30.0)


async def test_a_restarted_gateway_rebuilds_what_the_client_never_saw(
    nats_server: NatsServer,
) -> None:
    """Samples of clone 1 finished while no gateway watched; the next gateway's poll, from a
    cursor of the previous one, finds them in KV (and not clone 0's), then a held poll is woken
    by a completion its subscription delivers."""
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    futures = FutureStore(bus)
    try:
        session = "sess-9:sample:0"
        clone1, clone0 = Target(session, 1), Target(session, 0)
        for seq, _target, outcome in [
            (CLONE_SEQ_SPAN + 0, clone1, done("req-a-sample", clone1)),
            (CLONE_SEQ_SPAN + 1, clone1, failed("req-b-sample", clone1)),
            (
                CLONE_SEQ_SPAN + 2,
                clone1,
                msgspec.structs.replace(done("req-c-sample", clone1), state="pending"),
            ),
            (5, clone0, done("req-d-sample", clone0)),
        ]:
            claim = SeqClaim(request_id=outcome.request_id, request_type="sample", digest="x")
            assert await futures.claim(session, seq, claim) == claim
            await bus.put(
                subjects.BUCKET_FUTURES,
                subjects.future_key(outcome.request_id),
                encode_outcome(outcome),
            )
        previous_cursor = int((time.time() - 30) * 1e6)  # handed out by the gateway that went

        completions = SessionCompletions()  # the new gateway
        futures.on_finished.append(completions.record)
        await futures.start()
        app = web.Application()
        app[BUS], app[FUTURES], app[COMPLETIONS] = bus, futures, completions
        assert completions.needs_scan(clone1, previous_cursor, created_at=time.time() - 60)
        assert await _rebuild(app, clone1, previous_cursor, budget_s=10.0)
        found, cursor = completions.since(clone1, previous_cursor)
        assert sorted(c.request_id for c in found) == ["req-a-sample", "req-b-sample"]
        assert not completions.needs_scan(clone1, previous_cursor, created_at=time.time() - 60)

        waiting = asyncio.create_task(completions.wait(clone1, 10.0))
        await asyncio.sleep(0.05)
        await bus.put(
            subjects.BUCKET_FUTURES,
            subjects.future_key("req-c-sample"),
            encode_outcome(done("req-c-sample", clone1)),
        )
        await asyncio.wait_for(waiting, 5.0)
        found, _ = completions.since(clone1, cursor)
        assert [c.request_id for c in found] == ["req-c-sample"]
    finally:
        await futures.stop()
        await bus.close()
