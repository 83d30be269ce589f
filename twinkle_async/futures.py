"""Futures: pending records, dedupe of `(model_id, seq_id)`, and long-poll waiters.

Step 1 (submit): `claim` maps `(model_id, seq_id)` to one request id (a retry gets the first
one) and `record_pending` writes the pending outcome to KV `tw_futures`.
Step 5 (worker): the worker overwrites `res.<request_id>` with the result.
Step 6 (retrieve): one live subscription on the bucket resolves in-memory waiters; `wait`
registers a waiter, reads KV (the result may already be there, e.g. after a gateway restart),
and otherwise awaits the waiter with a timeout. No polling loops. The subscription misses what
is written while NATS is away, so after a reconnect every waiting request is read once more.
Submitted futures, finished outcomes and waiting long-polls are counted on `self.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import msgspec
from nats.aio.subscription import Subscription

from protocol import rules, subjects
from protocol.errors import ErrorCategory, Unavailable
from protocol.jobs import (
    Outcome,
    SeqClaim,
    decode_claim,
    decode_outcome,
    encode_claim,
    encode_outcome,
    now,
)
from twinkle_async.bus import Bus
from twinkle_async.metrics import GatewayMetrics

log = logging.getLogger(__name__)

_RES_PREFIX = "res."
_MAX_KNOWN_SEQS = 100_000  # models whose highest seq a gateway keeps (see `note_seq`)
_RECHECK_S = 60.0  # how long a reconnect keeps re-reading its waiters' results
_RECHECK_PAUSE_S = 1.0


def new_request_id(kind: str) -> str:
    """Opaque, unique, and a valid KV key."""
    return f"req-{uuid.uuid4().hex}-{kind}"


class FutureStore:
    """The gateway's view of `tw_futures`."""

    def __init__(self, bus: Bus, metrics: GatewayMetrics | None = None) -> None:
        self.bus = bus
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self._waiters: dict[str, list[asyncio.Future[Outcome]]] = {}
        # model_id → (highest seq_id, its `tw_runs` revision), as this gateway last saw them
        self._highest_seq: dict[str, tuple[int, int]] = {}
        self._sub: Subscription | None = None
        # called with every finished outcome the subscription delivers (sampling completions)
        self.on_finished: list[Callable[[Outcome], None]] = []

    async def start(self) -> None:
        self._sub = await self.bus.subscribe_kv(
            subjects.BUCKET_FUTURES, f"{_RES_PREFIX}>", self._on_update
        )
        self.bus.on_reconnect(self._recheck_waiters)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.cancel()
        self._waiters.clear()

    async def _on_update(self, key: str, data: bytes) -> None:
        if not data:
            return
        request_id = key[len(_RES_PREFIX) :]
        outcome = decode_outcome(data)
        if outcome.state == "pending":
            return
        self.metrics.future_resolved(outcome.request_type, outcome.state)
        self._wake(request_id, outcome)
        for listener in self.on_finished:
            listener(outcome)

    def _wake(self, request_id: str, outcome: Outcome) -> None:
        for waiter in self._waiters.pop(request_id, []):
            if not waiter.done():
                waiter.set_result(outcome)

    async def _recheck_waiters(self) -> None:
        """After a reconnect: wake the waiters whose result was written while NATS was away.

        A read that fails is tried again (after a node's crash the bucket's leader election
        can outlast one call's retries) for up to `_RECHECK_S`; a waiter still unchecked then
        is answered by its long poll's end, when the SDK polls again.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _RECHECK_S
        unchecked = set(self._waiters)
        while True:
            for request_id in sorted(unchecked):
                if request_id not in self._waiters:  # answered or given up meanwhile
                    unchecked.discard(request_id)
                    continue
                try:
                    outcome = await self.read(request_id)
                except Unavailable:
                    continue
                unchecked.discard(request_id)
                if outcome is not None and outcome.state != "pending":
                    self._wake(request_id, outcome)
            if not unchecked:
                return
            if loop.time() > deadline:
                log.warning(
                    "after a reconnect, %d waiting requests were not re-read", len(unchecked)
                )
                return
            await asyncio.sleep(_RECHECK_PAUSE_S)

    async def claim(self, model_id: str, seq_id: int, claim: SeqClaim) -> SeqClaim:
        """The claim owning `(model_id, seq_id)`: `claim` if it is the first, else the earlier one."""
        key = subjects.seq_key(model_id, seq_id)
        if await self.bus.create(subjects.BUCKET_FUTURES, key, encode_claim(claim)):
            return claim
        existing = await self.bus.get(subjects.BUCKET_FUTURES, key)
        return decode_claim(existing) if existing else claim

    async def note_seq(self, model_id: str, seq_id: int, field: str = "seq_id") -> int:
        """Record `seq_id` as seen for the model; returns the highest seq known before it.

        A seq too far past the highest is refused before it is recorded (`rules.check_seq_ahead`).
        A compare-and-set loop on one key per model: concurrent chunks of one call race here.
        The highest seq this gateway last read or wrote, and its revision, are kept: the next
        call of the model tries its compare-and-set on them first, one bus round trip instead
        of two, and reads the key only when another writer moved it meanwhile.
        """
        # In `tw_runs`, which never expires: a model idle for a day keeps its count.
        key = subjects.highest_seq_key(model_id)
        known = self._highest_seq.get(model_id)
        if known is not None:
            highest, revision = known
            if seq_id <= highest:
                return highest  # the key only grows: it is at least this high
            if seq_id <= highest + rules.MAX_SEQ_AHEAD:
                written = await self.bus.swap_revision(
                    subjects.BUCKET_RUNS, key, str(seq_id).encode(), revision
                )
                if written is not None:
                    self._remember_seq(model_id, seq_id, written)
                    return highest
        while True:
            entry = await self.bus.entry(subjects.BUCKET_RUNS, key)
            highest = int(entry[0]) if entry is not None else 0
            rules.check_seq_ahead(field, seq_id, highest)
            current = entry[1] if entry is not None else None
            if seq_id <= highest:
                if current is not None:
                    self._remember_seq(model_id, highest, current)
                return highest
            written = await self.bus.swap_revision(
                subjects.BUCKET_RUNS, key, str(seq_id).encode(), current
            )
            if written is not None:
                self._remember_seq(model_id, seq_id, written)
                return highest

    def seq_in_range(self, model_id: str, seq_id: int) -> bool:
        """Whether `note_seq` cannot refuse `seq_id` as too far ahead: the model's highest seq
        this gateway knows is within `rules.MAX_SEQ_AHEAD` of it (the key only grows)."""
        known = self._highest_seq.get(model_id)
        return known is not None and seq_id <= known[0] + rules.MAX_SEQ_AHEAD

    def _remember_seq(self, model_id: str, seq_id: int, revision: int) -> None:
        if len(self._highest_seq) >= _MAX_KNOWN_SEQS and model_id not in self._highest_seq:
            self._highest_seq.clear()  # only a shortcut: a model missing here is read again
        self._highest_seq[model_id] = (seq_id, revision)

    async def next_seq(self, model_id: str) -> int:
        """Reserve the seq after the highest one seen, for a call the server makes itself
        (unloading a finished session's model runs after everything its client sent)."""
        key = subjects.highest_seq_key(model_id)
        while True:
            entry = await self.bus.entry(subjects.BUCKET_RUNS, key)
            seq = (int(entry[0]) if entry is not None else 0) + 1
            revision = entry[1] if entry is not None else None
            if await self.bus.swap(subjects.BUCKET_RUNS, key, str(seq).encode(), revision):
                return seq

    async def record_pending(
        self,
        request_id: str,
        request_type: str,
        model_id: str,
        tenant_id: str,
        *,
        not_before: float = 0.0,
        queue_reason: str = "",
        sampling_session_id: str = "",
        clone_id: int = 0,
    ) -> None:
        """Write the pending outcome, unless a result is already there (a retried submit).

        `not_before` and `queue_reason` say the request waits in its tenant's rate-limit queue;
        a sample names its sampling session and clone.
        """
        pending = Outcome(
            request_id=request_id,
            state="pending",
            request_type=request_type,
            model_id=model_id,
            created_at=now(),
            tenant_id=tenant_id,
            not_before=not_before,
            queue_reason=queue_reason,
            sampling_session_id=sampling_session_id,
            clone_id=clone_id,
        )
        if await self.bus.create(
            subjects.BUCKET_FUTURES, subjects.future_key(request_id), encode_outcome(pending)
        ):
            self.metrics.future_submitted(request_type)

    async def resolve(self, outcome: Outcome) -> None:
        """Write a finished outcome directly (for requests the gateway answers itself)."""
        await self.bus.put(
            subjects.BUCKET_FUTURES,
            subjects.future_key(outcome.request_id),
            encode_outcome(outcome),
        )

    async def cancel(self, pending: Outcome, revision: int, reason: str) -> bool:
        """Fail a pending future with `reason` unless its outcome moved past `revision` (it
        finished meanwhile); whether it was this call that failed it."""
        cancelled = msgspec.structs.replace(
            pending, state="error", error=reason, category=ErrorCategory.USER, finished_at=now()
        )
        return await self.bus.swap(
            subjects.BUCKET_FUTURES,
            subjects.future_key(pending.request_id),
            encode_outcome(cancelled),
            revision,
        )

    async def read(self, request_id: str) -> Outcome | None:
        data = await self.bus.get(subjects.BUCKET_FUTURES, subjects.future_key(request_id))
        return decode_outcome(data) if data else None

    async def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome once finished, the pending outcome after `timeout_s`, None if unknown."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Outcome] = loop.create_future()
        self._waiters.setdefault(request_id, []).append(waiter)
        try:
            current = await self.read(request_id)
            if current is None or current.state != "pending":
                return current
            try:
                with self.metrics.long_polls_waiting.track_inprogress():
                    return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
            except TimeoutError:
                return current
        finally:
            waiters = self._waiters.get(request_id)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[request_id]
            waiter.cancel()
