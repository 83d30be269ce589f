"""Exponential backoff as data: the delay before the next attempt. Pure: no clock, no I/O.

One schedule serves two callers. `twinkle-async up` waits `RESTART.after(previous)` before it
restarts a crashed child (0.5 s doubling to 30 s), and starts over from the first delay once
the child had stayed up `RESTART_STABLE_S`. The gateway's and the workers' NATS wrappers wait
`BUS_RETRY.after(previous)` between attempts of a call that failed because the bus is away
(0.1 s doubling to 2 s, so a call resumes within 2 s of the bus coming back), until their
deadline; the deadline itself is a setting of each process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays that start at `first_s` and grow by `factor` up to `max_s`."""

    first_s: float
    max_s: float
    factor: float = 2.0

    def after(self, previous_s: float | None) -> float:
        """The delay that follows `previous_s` (None: no attempt waited yet)."""
        if previous_s is None:
            return self.first_s
        return min(self.max_s, previous_s * self.factor)


RESTART = Backoff(first_s=0.5, max_s=30.0)
RESTART_STABLE_S = 60.0  # a child up this long is healthy again: its next restart waits 0.5 s
BUS_RETRY = Backoff(first_s=0.1, max_s=2.0)


def restart_delay(previous_s: float | None, uptime_s: float) -> float:
    """How long to wait before restarting a child that ran for `uptime_s` and exited."""
    if uptime_s >= RESTART_STABLE_S:
        previous_s = None
    return RESTART.after(previous_s)
