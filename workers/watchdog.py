"""What was running when a worker stopped: the journal that turns a crash into a suspect.

Before each engine call the worker writes the request ids it is about to run to KV
(`tw_futures`, `running.<worker_id>`), and clears them only once every step of those requests
is over: the engine call, their outcomes, and what follows (a state snapshot's capture). The
cleared list is not written at once: the next engine call's list replaces it, or, when the worker
has nothing ready, `settle` writes it (one KV write less per engine call while ops keep coming;
a stop in between strikes requests that had finished, which only makes them run alone). A state
snapshot is on the list by its model (`snapshot_step`) from its capture until its files are
recorded, which goes on beside the model's next engine calls (`workers.trainer.snapshots`). A worker
that stops in between (killed by the pass watchdog for running past `pass_timeout_s`, crashed,
out of memory) leaves them there. Whoever carries on — the same worker restarted under its id,
or the worker that takes its shards over — inherits that list: each entry on it gets one more
strike (`strikes.<entry>`). A request with strikes runs alone, so it cannot take other tenants
down with it again; one with `max_attempts` strikes is not run at all: it fails with a `server`
error that says why, and its model carries on with its next requests in order (or, when its
client already has its result and only its replay stops the worker, its model fails). A model
whose snapshot stopped the worker `max_attempts` times in a row fails too.
"""

from __future__ import annotations

import logging
import os
from typing import NoReturn

import msgspec

from protocol import subjects
from workers.bus import WorkerBus

log = logging.getLogger(__name__)

_BUCKET = "tw_futures"
_IDS = msgspec.msgpack.Encoder()
_IDS_DECODER = msgspec.msgpack.Decoder(list[str])


def stop_process(reason: str, request_ids: list[str]) -> NoReturn:
    """Stop this process at once: an engine call that ran past its limit cannot be interrupted.
    Its supervisor (`up`, or compose's restart policy) starts it again; what was running then
    becomes a suspect (the journal here, or `workers.sampler.guard` for samples)."""
    log.critical("%s (%s); stopping this process", reason, ", ".join(request_ids))
    logging.shutdown()
    os._exit(70)


def running_key(worker_id: str) -> str:
    return f"running.{worker_id}"


def strikes_key(entry: str) -> str:
    """The KV key of an entry's strikes. Encoded: a snapshot step names its model, whose id
    holds ':' (`sess-...:train:0`), which no KV key may."""
    return f"strikes.{subjects.token(entry)}"


def snapshot_step(model_id: str) -> str:
    """The journal's entry for writing a model's state snapshot: the model's, not a request's
    (the snapshot an idle model gets stands at whichever op came last)."""
    return f"snapshot.{model_id}"


class CrashJournal:
    """This worker's running list, and the strikes of the entries it inherited."""

    def __init__(self, bus: WorkerBus, worker_id: str) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.strikes: dict[str, int] = {}
        self._running: list[str] = []  # the engine call's requests
        self._steps: list[str] = []  # steps entered beside them (snapshots being written)
        self._unwritten = False  # `idle` cleared the list; KV still holds the last call's

    async def running(self, request_ids: list[str]) -> None:
        """What the engine runs from now on (replaces the last call's; entered steps stay)."""
        self._running = list(request_ids)
        await self._write()

    def idle(self) -> None:
        """The engine call's requests are over: cleared here, written by the next `running`
        (which replaces it) or by `settle`."""
        if self._running:
            self._running = []
            self._unwritten = True

    async def settle(self) -> None:
        """Write the list `idle` cleared (the worker has nothing ready to run)."""
        if self._unwritten:
            await self._write()

    async def enter(self, entry: str) -> None:
        """One more step runs beside the engine calls until it `leave`s (a snapshot being
        captured and written while the model's next ops run)."""
        self._steps.append(entry)
        await self._write()

    async def leave(self, entry: str) -> None:
        """A step that `enter` listed is over."""
        if entry in self._steps:
            self._steps.remove(entry)
        await self._write()

    async def forgive(self, entry: str) -> None:
        """A step with strikes ran through: its count starts over (for a model's snapshots,
        whose entry lives as long as the model, strikes must be in a row)."""
        if self.strikes.pop(entry, 0):
            await self.bus.put(_BUCKET, strikes_key(entry), b"0")

    async def _write(self) -> None:
        listed = self._running + self._steps
        self._unwritten = False
        await self.bus.put(_BUCKET, running_key(self.worker_id), _IDS.encode(listed))

    async def inherit(self, worker_id: str) -> list[str]:
        """Take over what `worker_id` was running when it stopped: one strike each."""
        data = await self.bus.get(_BUCKET, running_key(worker_id))
        request_ids = _IDS_DECODER.decode(data) if data else []
        for request_id in request_ids:
            self.strikes[request_id] = await self._strike(request_id)
        if request_ids:
            log.warning(
                "worker %s stopped while running %s; they run alone from now on",
                worker_id,
                ", ".join(request_ids),
            )
            await self.bus.put(_BUCKET, running_key(worker_id), _IDS.encode([]))
        return request_ids

    async def _strike(self, request_id: str) -> int:
        key = strikes_key(request_id)
        while True:
            entry = await self.bus.entry(_BUCKET, key)
            count = int(entry[0]) + 1 if entry is not None and entry[0] else 1
            if await self.bus.swap(_BUCKET, key, str(count).encode(), entry[1] if entry else None):
                return count
