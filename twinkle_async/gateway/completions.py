"""Sampling completions per (sampling session, clone): what `retrieve_futures` answers from.

Job: a log per target of the samples that finished or failed, each under a cursor, and the
waiters of the polls held on it. `FutureStore` hands every finished outcome it sees on its KV
subscription to `record`; a poll takes what is newer than its `prev_cursor` (`since`), and
when there is nothing, awaits the next `record` for its target (`wait`).

Invariants:
- Cursors are microseconds since the epoch, strictly increasing within one gateway, so a
  cursor from an earlier gateway (before a restart) is older than anything recorded since.
- A target's log is complete for cursors above its `floor`: outcomes seen since this gateway
  subscribed (or since NATS came back, `mark_incomplete`), minus what was trimmed. A poll whose
  `prev_cursor` is below the floor of a target created before it may have missed completions:
  the caller rebuilds them from KV (`needs_scan`, then `record_for` and `mark_complete`).
- Bounded: at most `max_entries` per target (the oldest go, raising the floor), targets idle
  for `retain_s` are dropped, at most `max_targets` kept (by any tenant's polls). Dropping a
  target that held completions (or had trimmed some) raises the `floor` every log starts
  from, so what it held is found again by a scan and a poll can never hang on a completion
  this gateway forgot; dropping one its client had seen all of costs no scan.
- `wait` registers its waiter without awaiting first, right after the caller's `since`: no
  record can slip between the two (one event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from protocol.jobs import Outcome
from protocol.sampling_futures import FutureCompletion, FutureFailed, FutureFinished


class Target(NamedTuple):
    """One sampling client: its session and clone id."""

    sampling_session_id: str
    clone_id: int


@dataclass
class _Log:
    floor: int
    entries: OrderedDict[str, tuple[int, FutureCompletion]] = field(default_factory=OrderedDict)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    touched: float = 0.0


def completion_of(outcome: Outcome) -> FutureCompletion:
    """How `retrieve_futures` reports a finished outcome."""
    if outcome.state == "done":
        return FutureFinished(
            request_id=outcome.request_id,
            response_payload_uncompressed_size=len(outcome.payload) or None,
        )
    return FutureFailed(request_id=outcome.request_id)


class SessionCompletions:
    """Completion logs of every sampling target this gateway has seen (see module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        retain_s: float = 900.0,
        max_entries: int = 4096,
        max_targets: int = 100_000,
    ) -> None:
        self.clock = clock
        self.retain_s = retain_s
        self.max_entries = max_entries
        self.max_targets = max_targets
        self._last = 0
        self.floor = self.next_cursor()  # where a target with no log yet is complete from
        self._logs: OrderedDict[Target, _Log] = OrderedDict()

    def next_cursor(self) -> int:
        self._last = max(self._last + 1, int(self.clock() * 1e6))
        return self._last

    @property
    def cursor(self) -> int:
        """The newest cursor handed out: every completion recorded so far is at or below it."""
        return self._last

    def _log(self, target: Target) -> _Log:
        log = self._logs.get(target)
        now = self.clock()
        if log is None:
            log = self._logs[target] = _Log(floor=self.floor)
        self._logs.move_to_end(target)
        log.touched = now
        self._evict(now)
        return log

    def _evict(self, now: float) -> None:
        while self._logs:
            target, oldest = next(iter(self._logs.items()))
            stale = now - oldest.touched > self.retain_s and not oldest.waiters
            if not stale and len(self._logs) <= self.max_targets:
                return
            del self._logs[target]
            _release(oldest)
            if oldest.entries or oldest.floor > self.floor:
                # what it held (or had trimmed) is gone: a poll from before now must scan
                self.floor = self.next_cursor()

    def record(self, outcome: Outcome) -> None:
        """A finished sample outcome from the KV subscription (others are ignored)."""
        if outcome.state == "pending" or not outcome.sampling_session_id:
            return
        self.record_for(Target(outcome.sampling_session_id, outcome.clone_id), outcome)

    def record_for(self, target: Target, outcome: Outcome) -> None:
        """Log `outcome` for `target` (once per request id) and wake its polls."""
        log = self._log(target)
        if outcome.request_id in log.entries:
            return
        log.entries[outcome.request_id] = (self.next_cursor(), completion_of(outcome))
        while len(log.entries) > self.max_entries:
            _, (cursor, _) = log.entries.popitem(last=False)
            log.floor = max(log.floor, cursor)
        _release(log)

    def acknowledge(self, target: Target, request_ids: list[str]) -> None:
        """The client has retrieved these: forget them."""
        log = self._logs.get(target)
        if log is not None:
            for request_id in request_ids:
                log.entries.pop(request_id, None)

    def since(self, target: Target, prev_cursor: int) -> tuple[list[FutureCompletion], int]:
        """Completions after `prev_cursor` (the ones at or before it are trimmed: the client
        has seen them), and the cursor to answer. A cursor this gateway never handed out
        (newer than its newest) gets everything it still holds."""
        log = self._log(target)
        if prev_cursor > self._last:
            return [completion for _, completion in log.entries.values()], self._last
        for request_id in [r for r, (cursor, _) in log.entries.items() if cursor <= prev_cursor]:
            del log.entries[request_id]
        return [completion for _, completion in log.entries.values()], self._last

    def needs_scan(self, target: Target, prev_cursor: int, created_at: float) -> bool:
        """Whether completions of `target` (created at `created_at`, Unix seconds) the client
        has not seen may be missing from the log."""
        log = self._logs.get(target)
        floor = log.floor if log is not None else self.floor
        return prev_cursor < floor and created_at * 1e6 < floor

    def mark_complete(self, target: Target) -> None:
        """A scan put every missing completion in the log."""
        self._log(target).floor = 0

    def mark_incomplete(self) -> None:
        """Outcomes may have been missed (NATS was away): every log is complete from now on."""
        self.floor = self.next_cursor()
        for log in self._logs.values():
            log.floor = self.floor

    async def wait(self, target: Target, timeout_s: float) -> None:
        """Until the next completion of `target`, at most `timeout_s`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        log = self._log(target)
        log.waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            pass
        finally:
            waiter.cancel()
            if waiter in log.waiters:
                log.waiters.remove(waiter)

    def close(self) -> None:
        """Release every held poll (the gateway is stopping)."""
        for log in self._logs.values():
            _release(log)


def _release(log: _Log) -> None:
    """Answer every poll held on `log` (they read the log again)."""
    for waiter in log.waiters:
        if not waiter.done():
            waiter.set_result(None)
    log.waiters.clear()
