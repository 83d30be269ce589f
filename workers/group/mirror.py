"""Rank 0 of a worker group runs the worker; every engine call that changes state runs on
every rank, in the same order, with the same arguments.

Job: `GroupEngine` is rank 0's engine. Each state-changing call (create, release, a shared pass,
a fused step, save, load, capture, adopt, restoring a parked adapter, a torch sampler step) is first sent to the
other ranks (`workers.group.wire`, over gloo on the host), then run here while they run it
too: the collectives inside (expert parallelism, gathered checkpoints) meet. `follow` is the
loop of every other rank: receive a call, run it on its own engine, repeat. Reads (`has`,
`spec`, `validate`, sizes) stay on rank 0, whose bookkeeping is the same as every rank's.

What rank 0 alone reads (a checkpoint's files, a snapshot's state from the store) is sent with
the call, in one device's layout; each rank keeps its share. Seeds are fixed on rank 0 before
a create is sent, so a create without one draws the same adapter on every rank.

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
from typing import Any, Literal, TypeVar

import msgspec
import torch
import torch.distributed as dist

from protocol.api import AdamParams, LoraConfig
from protocol.errors import ServerError, TwinkleError
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from workers.engine.collective import ProcessGroupCollective
from workers.group import wire
from workers.sampler.backends import Stepped, Submit, run_step
from workers.sampler.torch_sampler import TorchSampler
from workers.trainer.engine import Engine
from workers.trainer.parking import SlotState

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


class GroupEngine(Engine):
    """Rank 0's engine: state-changing calls run on every rank of the group."""

    def __init__(
        self, *args: Any, channel: Channel, keepalive_s: float = 30.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.keepalive_s = keepalive_s  # 0: none (a group that times out when idle)
        assert isinstance(self.collective, ProcessGroupCollective)
        self.group_collective: ProcessGroupCollective = self.collective
        self.channel = channel
        self._lock = threading.Lock()  # the engine thread against the keepalive
        self._last_sent = time.monotonic()
        self._stopped = False
        self._inside = False  # a mirrored call is running (on the engine thread)
        threading.Thread(target=self._keepalive, name="group-keepalive", daemon=True).start()

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
                _agree(self.group_collective, failed=True)
                raise
            finally:
                self._inside = False
            _agree(self.group_collective, failed=False)
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

    def create(self, model_id: str, spec: LoraConfig) -> None:
        if spec.seed is None:  # drawn here, once, so every rank draws the same adapter
            spec = _with_seed(spec, secrets.randbits(31))
        self._mirror(wire.Create(model_id, spec), lambda: Engine.create(self, model_id, spec))

    def release(self, model_id: str) -> None:
        self._mirror(wire.Release(model_id), lambda: Engine.release(self, model_id))

    def forward_backward(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        call = wire.ForwardBackward(
            self.pass_tokens, [(model_id, wire.pack_request(req)) for model_id, req in batch]
        )
        return self._mirror(call, lambda: Engine.forward_backward(self, batch))

    def optim_step(
        self, steps: list[tuple[str, AdamParams]]
    ) -> list[dict[str, float] | TwinkleError]:
        return self._mirror(wire.OptimStep(steps), lambda: Engine.optim_step(self, steps))

    def save(
        self,
        model_id: str,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        return self._mirror(
            wire.Save(model_id, kind),
            lambda: Engine.save(self, model_id, directory, kind=kind, meta=meta),
        )

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> LoraConfig:
        stored = self.slots.files.read(directory, with_optimizer=with_optimizer)  # rank 0 reads
        return self._mirror(
            wire.Load(model_id, with_optimizer, wire.pack_stored(stored)),
            lambda: self.slots.load_stored(model_id, stored, with_optimizer=with_optimizer),
        )

    def load_snapshot(self, key: str, directory: Path) -> None:
        self._sampling()
        Engine.load_snapshot(self, key, directory)  # every rank reads the files (one host)

    def snapshot_slot(self, key: str) -> int:
        self._sampling()
        return Engine.snapshot_slot(self, key)

    def _sampling(self) -> None:
        """Snapshots move only inside a sampler step, which every rank runs."""
        if not self._inside:
            raise ServerError("a worker group moves sampler snapshots only in a sampler step")

    def sample_step(self, sampler: Any, submits: list[Submit], cancels: list[int]) -> Stepped:
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

    def slot(self, model_id: str) -> int:
        return self._mirror(wire.Slot(model_id), lambda: Engine.slot(self, model_id))

    def capture(self, model_id: str) -> SlotState:
        return self._mirror(wire.Capture(model_id), lambda: Engine.capture(self, model_id))

    def adopt(self, model_id: str, state: SlotState) -> None:
        self._mirror(
            wire.Adopt(model_id, wire.pack_state(state)),
            lambda: Engine.adopt(self, model_id, state),
        )


def _with_seed(spec: LoraConfig, seed: int) -> LoraConfig:
    return msgspec.structs.replace(spec, seed=seed)


def follow(engine: Engine, channel: Channel) -> None:
    """Run rank 0's calls on this rank's engine until it says stop (or is gone)."""
    collective = engine.collective
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
                    samplers.append(TorchSampler(engine))
                submits = [
                    (spec, key, None if path is None else Path(path))
                    for spec, key, path in call.submits
                ]
                run_step(samplers[0], submits, call.cancels)
            else:
                _apply(engine, call)
        except BaseException as error:
            if isinstance(error, GroupBroken | KeyboardInterrupt | SystemExit):
                raise
            log.debug("call %s raised here too: %s", type(call).__name__, error)
            _agree(collective, failed=True)
            continue
        _agree(collective, failed=False)


def _apply(engine: Engine, call: wire.AnyCall) -> None:
    if isinstance(call, wire.Create):
        engine.create(call.model_id, call.spec)
    elif isinstance(call, wire.Release):
        engine.release(call.model_id)
    elif isinstance(call, wire.ForwardBackward):
        engine.pass_tokens = call.pass_tokens
        engine.forward_backward([(m, wire.unpack_request(r)) for m, r in call.items])
    elif isinstance(call, wire.OptimStep):
        engine.optim_step(call.steps)
    elif isinstance(call, wire.Save):
        kind: Literal["weights", "sampler_weights"] = (
            "weights" if call.kind == "weights" else "sampler_weights"
        )
        engine.save(call.model_id, Path("."), kind=kind, meta={})  # rank 0 writes the files
    elif isinstance(call, wire.Load):
        stored = wire.unpack_stored(call.stored)
        engine.slots.load_stored(call.model_id, stored, with_optimizer=call.with_optimizer)
    elif isinstance(call, wire.Slot):
        engine.slot(call.model_id)
    elif isinstance(call, wire.Capture):
        engine.capture(call.model_id)
    elif isinstance(call, wire.Adopt):
        engine.adopt(call.model_id, wire.unpack_state(call.state))
    else:
        raise GroupBroken(f"unknown group call {type(call).__name__}")
