"""Rank 0 of a worker group runs the worker; every call on the engine thread runs on every
rank, in the same order, with the same arguments.

Job: `GroupOps` is rank 0's `workers.trainer.operations.TrainerOps`. It composes this rank's
`EngineOps` (no subclass): each call (a cycle's jobs, a release, a capture, an adopt, a torch
sampler step, a calibration) is first sent to the other ranks (`workers.group.wire`, over gloo
on the host), then run here while they run it too, so the collectives inside (expert
parallelism, gathered checkpoints) meet. A cycle's jobs travel as the bus carries them
(`protocol.jobs.encode_job`), and every rank decodes, validates and runs them with the same
code as a single-device worker (`EngineOps`); the other ranks' `EngineOps` write no files
(`writes=False`), and where a file's presence decides, rank 0's answer stands. `follow` is the loop
of every other rank: receive a call, run it, repeat. Reads (sizes, `has`, `spec`) stay on rank 0,
whose bookkeeping is the same as every rank's.

Seeds: a create without one draws its seed from its request id (`EngineOps`), and a sampler
request without one gets one here before it is sent, so every rank draws alike. What rank 0
alone reads (a snapshot's state, for an adopt) is sent with the call, in one device's layout.

One failure domain: after each call the ranks agree on whether it raised (a request's own error
raises alike everywhere). If they disagree, or a rank is gone (the agreement itself fails), the
call raises `GroupBroken`, which no request handler catches: rank 0 exits, the other ranks with
it, and the supervisor starts the group again; its models come back from their snapshots and
logs, and no client sees the fault. An idle rank 0 sends a keepalive every `keepalive_s` (an
eighth of the group's timeout), so ranks waiting for work never reach the process group's
timeout.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from protocol.errors import ServerError
from protocol.jobs import Job, decode_job, encode_job
from workers.engine.collective import ProcessGroupCollective
from workers.engine.model import MultiSlotModel
from workers.group import wire
from workers.metrics import TrainerMetrics
from workers.sampler.backends import Stepped, Submit, run_step
from workers.sampler.torch_sampler import TorchSampler
from workers.trainer.calibration import Calibration, cached, measure, store_calibration
from workers.trainer.operations import EngineOps, Result
from workers.trainer.parking import SlotState
from workers.trainer.residency import Residency

log = logging.getLogger(__name__)

T = TypeVar("T")


class GroupBroken(BaseException):  # noqa: N818 (a stop, not an error a handler may absorb)
    """A rank of the group is gone or went its own way: the group stops as one."""


class Channel:
    """Rank 0's messages to every other rank: a length, then the bytes (gloo broadcasts)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def send(self, payload: bytes) -> None:
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self.group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.group)

    def receive(self) -> bytes:
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, 0, group=self.group)
        data = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.group)
        return data.numpy().tobytes()


def _agree(collective: ProcessGroupCollective, failed: bool) -> None:
    """Every rank's verdict on the call it just ran: all raised, or none did."""
    try:
        any_failed, any_passed = collective.agree_max([int(failed), int(not failed)])
    except Exception as error:
        raise GroupBroken(f"a rank of the group is gone ({error})") from None
    if any_failed and any_passed:
        raise GroupBroken("the ranks of the group disagree on whether a call failed")


class GroupOps:
    """Rank 0's engine-thread calls, run on every rank of the group; see the module docstring."""

    def __init__(self, ops: EngineOps, channel: Channel, keepalive_s: float = 30.0) -> None:
        self.ops = ops
        self.model: MultiSlotModel = ops.model
        self.residency: Residency = ops.residency
        self.metrics: TrainerMetrics = ops.metrics
        self.store = ops.store
        self.failed = ops.failed  # the same dict: the service's entries are sent with each call
        self.keepalive_s = keepalive_s  # 0: none (a group that times out when idle)
        collective = ops.model.collective
        assert isinstance(collective, ProcessGroupCollective)
        self.collective: ProcessGroupCollective = collective
        self.channel = channel
        self._lock = threading.Lock()  # the engine thread against the keepalive
        self._last_sent = time.monotonic()
        self._stopped = False
        self._inside = False  # a mirrored call is running (on the engine thread)
        threading.Thread(target=self._keepalive, name="group-keepalive", daemon=True).start()

    def failure(self, model_id: str) -> ServerError | None:
        return self.ops.failure(model_id)

    def _mirror(self, call: wire.Call, run: Callable[[], T]) -> T:
        if self._inside:  # made by a call every rank runs: every rank makes it too
            return run()
        with self._lock:
            if self._stopped:
                raise GroupBroken("the group has stopped")
            try:
                self.channel.send(wire.encode(call))
            except Exception as error:
                raise GroupBroken(f"a rank of the group is gone ({error})") from None
            self._last_sent = time.monotonic()
            self._inside = True
            try:
                result = run()
            except BaseException:
                _agree(self.collective, failed=True)
                raise
            finally:
                self._inside = False
            _agree(self.collective, failed=False)
            return result

    def _keepalive(self) -> None:
        if self.keepalive_s <= 0:
            return
        while not self._stopped:
            time.sleep(self.keepalive_s / 4)
            if time.monotonic() - self._last_sent < self.keepalive_s:
                continue
            with self._lock:
                if self._stopped or time.monotonic() - self._last_sent < self.keepalive_s:
                    continue
                try:
                    self.channel.send(wire.encode(wire.Keepalive()))
                except Exception:
                    log.exception("the group's keepalive failed; a rank is gone")
                    return
                self._last_sent = time.monotonic()

    def stop_group(self) -> None:
        """Tell the other ranks to leave (a clean stop)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                self.channel.send(wire.encode(wire.Stop()))
            except Exception:
                log.warning("the other ranks were gone before the stop", exc_info=True)

    # -- the calls ---------------------------------------------------------------------------

    def _jobs(self, kind: str, jobs: list[Job], run: Callable[[list[Job]], T]) -> T:
        call = wire.Jobs(
            kind, [encode_job(job) for job in jobs], self.model.pass_tokens, dict(self.failed)
        )
        return self._mirror(call, lambda: run(jobs))

    def shared_pass(self, jobs: list[Job]) -> list[Result]:
        return self._jobs("shared_pass", jobs, self.ops.shared_pass)

    def optim_steps(self, jobs: list[Job]) -> list[Result]:
        return self._jobs("optim_steps", jobs, self.ops.optim_steps)

    def other(self, jobs: list[Job]) -> list[Result]:
        return self._jobs("other", jobs, self.ops.other)

    def release(self, model_id: str) -> None:
        self._mirror(wire.Release(model_id), lambda: self.ops.release(model_id))

    def capture(self, model_id: str) -> SlotState:
        return self._mirror(wire.Capture(model_id), lambda: self.ops.capture(model_id))

    def adopt(self, model_id: str, state: SlotState) -> None:
        self._mirror(
            wire.Adopt(model_id, wire.pack_state(state)), lambda: self.ops.adopt(model_id, state)
        )

    def calibrate(self, model: MultiSlotModel, directory: Path, threads: int) -> Calibration:
        """The pass size: from rank 0's cache, else measured by every rank in step."""
        found = cached(model, directory, threads)
        if found is None:
            found = self._mirror(wire.Calibrate(), lambda: measure(model))
            store_calibration(model, directory, threads, found)
        return found

    def sample_step(
        self, sampler: TorchSampler, submits: list[Submit], cancels: list[int]
    ) -> Stepped:
        """One torch sampler step on every rank: the same requests, seeds fixed here first (a
        request without one would draw other tokens on each rank), the same snapshots loaded
        from the same files, the same tokens drawn from the same summed logits."""
        fixed = [
            (spec if spec.seed is not None else replace(spec, seed=secrets.randbits(63)), key, path)
            for spec, key, path in submits
        ]
        call = wire.SampleStep(
            list(cancels),
            [(spec, key, None if path is None else str(path)) for spec, key, path in fixed],
        )
        return self._mirror(call, lambda: run_step(sampler, fixed, cancels))


def follow(ops: EngineOps, channel: Channel) -> None:
    """Run rank 0's calls on this rank's operations until it says stop (or is gone)."""
    collective = ops.model.collective
    assert isinstance(collective, ProcessGroupCollective)
    samplers: list[TorchSampler] = []  # this rank's, made at the first sampler step
    while True:
        try:
            call = wire.decode(channel.receive())
        except Exception as error:
            raise GroupBroken(f"rank 0 is gone ({error})") from None
        if isinstance(call, wire.Stop):
            return
        if isinstance(call, wire.Keepalive):
            continue
        try:
            if isinstance(call, wire.SampleStep):
                if not samplers:
                    samplers.append(TorchSampler(ops.model, ops.residency))
                submits = [
                    (spec, key, None if path is None else Path(path))
                    for spec, key, path in call.submits
                ]
                run_step(samplers[0], submits, call.cancels)
            else:
                _apply(ops, call)
        except BaseException as error:
            if isinstance(error, GroupBroken | KeyboardInterrupt | SystemExit):
                raise
            log.debug("call %s raised here too: %s", type(call).__name__, error)
            _agree(collective, failed=True)
            continue
        _agree(collective, failed=False)


def _apply(ops: EngineOps, call: wire.AnyCall) -> None:
    """Run one of rank 0's calls here; its result is rank 0's to report."""
    if isinstance(call, wire.Jobs):
        ops.model.pass_tokens = call.pass_tokens
        ops.failed.clear()
        ops.failed.update(call.failed)
        run = {"shared_pass": ops.shared_pass, "optim_steps": ops.optim_steps, "other": ops.other}
        run[call.kind]([decode_job(data) for data in call.jobs])
    elif isinstance(call, wire.Release):
        ops.release(call.model_id)
    elif isinstance(call, wire.Capture):
        ops.capture(call.model_id)
    elif isinstance(call, wire.Adopt):
        ops.adopt(call.model_id, wire.unpack_state(call.state))
    elif isinstance(call, wire.Calibrate):
        measure(ops.model)
    else:
        raise GroupBroken(f"unknown group call {type(call).__name__}")
