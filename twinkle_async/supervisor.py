"""Child processes that come back: start, await the exit, restart with backoff, stop. For `up`.

Every child runs in its own process group (Ctrl-C in a terminal reaches `up` alone, which then
stops the children itself) with a parent-death signal: when `up` dies, even by SIGKILL, the
kernel SIGKILLs each child (`die_with_parent`, Linux `prctl(PR_SET_PDEATHSIG)`).

`Child.supervise` is one child's loop: await its exit, log it, wait out the backoff
(`protocol.backoff.restart_delay`: 0.5 s doubling to 30 s, back to 0.5 s once the child had
stayed up 60 s), start it again. It never gives up, so one crashing child never takes the
cluster down. `Child.stop` sends SIGTERM to the child's group, then SIGKILL after a timeout.
`supervise_nats` is the same loop for a nats-server node, restarted on its store and ports.

`reported_in` is the pure part of `up`'s start: which worker children have reported in (put a
fresh heartbeat in `tw_workers`), each matched by the worker id `up` gave it. `up` supervises a
child from the moment it reports in, so one that then dies is restarted even while another child
is still starting; only a child that never reported in fails the start.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from asyncio.subprocess import Process
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol.backoff import restart_delay
from protocol.records import WorkerRecord
from twinkle_async.nats_server import NatsServer

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEARTBEAT_CLOCK_SLACK_S = 1.0  # how far a worker's clock may lag the supervisor's


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn`: the child leads its own process group and gets SIGKILL when this
    process dies (Linux; elsewhere only the process group).

    Build it in the thread that starts the child: the kernel ties the signal to the thread that
    forked, which for `up` is the event loop's (main) thread.
    """
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)

    return preexec


def describe_exit(returncode: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL`."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to a child's process group (the child and whatever it started)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


class Child:
    """One supervised command line. `argv` may change between starts (the gateway's port)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.process: Process | None = None
        self.started_at = 0.0  # monotonic
        self.restarts = 0

    async def start(self) -> Process:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent()
        )
        self.started_at = time.monotonic()
        log.info("%s started (pid %d)", self.name, self.process.pid)
        return self.process

    async def supervise(self) -> None:
        """Restart the child each time it exits; runs until cancelled."""
        delay_s: float | None = None
        while True:
            uptime_s = 0.0
            process = self.process
            if process is not None:
                returncode = await process.wait()
                uptime_s = time.monotonic() - self.started_at
                signal_group(process.pid, signal.SIGKILL)  # what it started and left behind
                delay_s = restart_delay(delay_s, uptime_s)
                log.error(
                    "%s (pid %d) %s after %.1f s; restarting it in %.1f s",
                    self.name,
                    process.pid,
                    describe_exit(returncode),
                    uptime_s,
                    delay_s,
                )
            else:
                delay_s = restart_delay(delay_s, uptime_s)
            await asyncio.sleep(delay_s)
            self.restarts += 1
            try:
                await self.start()
            except OSError:
                log.exception("%s could not be started; trying again", self.name)
                self.process = None

    async def stop(self) -> None:
        """SIGTERM to the child's group, SIGKILL after `stop_timeout_s`; waits for the exit."""
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=self.stop_timeout_s)
            except TimeoutError:
                log.warning(
                    "%s did not stop within %.0f s; killing it", self.name, self.stop_timeout_s
                )
                signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        signal_group(process.pid, signal.SIGKILL)


async def supervise_nats(nats: NatsServer) -> None:
    """Restart a nats-server node on the same store and ports whenever it exits; runs until
    cancelled."""
    delay_s: float | None = None
    started_at = time.monotonic()
    while True:
        process = nats.process
        assert process is not None
        # a thread waits for the exit (the server is a plain Popen child); it returns once
        # the server exits, at the latest when `stop` ends it
        returncode = await asyncio.to_thread(process.wait)
        uptime_s = time.monotonic() - started_at
        delay_s = restart_delay(delay_s, uptime_s)
        log.error(
            "nats-server %s (pid %d) %s after %.1f s; restarting it on the same store and"
            " ports in %.1f s",
            nats.name,
            process.pid,
            describe_exit(returncode),
            uptime_s,
            delay_s,
        )
        await asyncio.sleep(delay_s)
        started_at = time.monotonic()
        try:
            await nats.start_async()
        except (OSError, RuntimeError, TimeoutError):
            log.exception("nats-server did not start; trying again")
            continue
        assert nats.process is not None
        log.info("nats-server %s back at %s (pid %d)", nats.name, nats.url, nats.process.pid)


@dataclass(frozen=True)
class Awaited:
    """The heartbeat that says a worker child has reported in: its base model and role as
    `tw_workers` records them, and the worker id `up` gave it (None: the one child of its role
    for that base model, which picks its own id, as a sampler does)."""

    base_model: str
    role: str
    worker_id: str | None = None


def reported_in(
    awaited: Iterable[Awaited], heartbeats: Iterable[WorkerRecord], since: float
) -> set[Awaited]:
    """The `awaited` children (all of one `up`) with a heartbeat written at or after `since`
    (wall clock, less `HEARTBEAT_CLOCK_SLACK_S`): an older one is an earlier run's, whose
    trainers had the same ids. A child that reported in and exited since still counts: its
    record stays in the bucket (30 s, the bucket's TTL), so a caller that reads the exits
    before the heartbeats never takes a served child for one that never reported in."""
    awaited = list(awaited)
    named = {child.worker_id for child in awaited if child.worker_id is not None}
    fresh = [r for r in heartbeats if r.heartbeat_at >= since - HEARTBEAT_CLOCK_SLACK_S]
    found = set()
    for child in awaited:
        for record in fresh:
            if (record.base_model, record.role) != (child.base_model, child.role):
                continue
            if record.worker_id == child.worker_id or (
                child.worker_id is None and record.worker_id not in named
            ):
                found.add(child)
                break
    return found
