"""The service's cycle shell on a bus that records every write: no NATS and no model.

After an engine call the worker's first write is each op's outcome (the gateway answers the
client's long-poll from it); bookkeeping that no client waits for (clearing the crash journal)
comes after, and only once every step of the ops is over, their snapshots included. A fault in
a step after the engine call fails the op or its model, never the service. With merging off
(`--no-merge`), each planned cycle holds one model's work.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from protocol import subjects
from protocol.jobs import ForwardBackwardJob, Job, OptimStepJob, decode_outcome
from twinkle_async.nats_server import NatsServer
from workers.settings import WorkerSettings
from workers.trainer import snapshots as trainer_snapshots
from workers.trainer.operations import EngineOps, Result, done_outcome
from workers.trainer.sequencer import Pending
from workers.trainer.service import TrainerService
from workers.watchdog import running_key, snapshot_step, strikes_key


class RecordingBus:
    """The part of `WorkerBus` that `TrainerService._run` uses: KV writes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str, bytes]] = []

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        self.writes.append((bucket, key, value))


def _service(
    bus: RecordingBus, tmp_path: Path, released: list[str] | None = None
) -> TrainerService:
    """A service whose ops are the real `EngineOps` on a stub model and residency: `_run` only
    calls the function it is given, planning reads the pass size, and the residency holds every
    model but those in `released` (where `release` records them) and captures a stub state."""
    settings = WorkerSettings(base_model="stub", data_dir=tmp_path, worker_id="w-1")
    gone = released if released is not None else []
    model: Any = SimpleNamespace(pass_tokens=16384, max_slots=8, geometry=None)
    residency: Any = SimpleNamespace(
        has=lambda model_id: model_id not in gone,
        release=gone.append,
        capture=lambda model_id: SimpleNamespace(step=1),
        slots_used=lambda: 0,
        parked={},
    )
    return TrainerService(bus, EngineOps(model, residency, settings), settings)  # type: ignore[arg-type]


def _ran(jobs: list[Job]) -> list[Result]:
    return [(done_outcome(job, b"{}"), None) for job in jobs]


async def test_outcomes_are_written_before_the_journal_is_cleared(tmp_path: Path) -> None:
    bus = RecordingBus()
    service = _service(bus, tmp_path)
    jobs: list[Job] = [
        ForwardBackwardJob(request_id="req-a", model_id="m-a", tenant_id="t", seq_id=1),
        OptimStepJob(request_id="req-b", model_id="m-b", tenant_id="t", seq_id=1),
    ]
    items: list[Pending[Any]] = [Pending(job=job, handle=None, received_at=0.0) for job in jobs]
    for item in items:
        service.sequencer.start(item.job.model_id, applied_seq=0)
        service.sequencer.offer(item)

    await service._run(items, _ran)
    await service.journal.settle()  # nothing else is ready

    keys = [key for _, key, _ in bus.writes]
    journal = running_key("w-1")
    outcomes = [subjects.future_key("req-a"), subjects.future_key("req-b")]
    assert keys == [journal, *outcomes, journal]  # running, the outcomes, then idle
    assert _journal(bus) == [["req-a", "req-b"], []]


class HistoryBus(RecordingBus):
    """A bus whose metric history publish finishes only once the outcome's write has begun:
    a service that waited for the entry before writing the outcome would lose the entry."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []
        self.kept: list[str] = []
        self.outcome_sent = asyncio.Event()

    async def publish_once(self, subject: str, data: bytes, msg_id: str) -> None:
        self.sent.append(msg_id)
        await asyncio.wait_for(self.outcome_sent.wait(), 2.0)
        self.kept.append(msg_id)

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        if key.startswith(subjects.future_key("")):
            self.sent.append(key)
            self.outcome_sent.set()
        await super().put(bucket, key, value)


async def test_an_ops_history_entry_and_outcome_go_out_together_entry_first(
    tmp_path: Path,
) -> None:
    bus = HistoryBus()
    service = _service(bus, tmp_path)
    await service._run(_step(service), _ran)
    assert bus.sent == ["metrics-req-b", subjects.future_key("req-b")]
    assert bus.kept == ["metrics-req-b"]  # not given up waiting for the outcome's write


async def test_the_next_calls_list_replaces_a_cleared_one_unwritten(tmp_path: Path) -> None:
    """Ops that keep coming: each engine call writes its list once; the cleared list in between
    is never written (a KV write less per call), and is written once nothing is ready."""
    bus = RecordingBus()
    service = _service(bus, tmp_path)
    service.sequencer.start("m-a", applied_seq=0)
    for seq in (1, 2):
        job = ForwardBackwardJob(request_id=f"req-{seq}", model_id="m-a", tenant_id="t", seq_id=seq)
        item: Pending[Any] = Pending(job=job, handle=None, received_at=0.0)
        service.sequencer.offer(item)
        await service._run([item], _ran)
    assert _journal(bus) == [["req-1"], ["req-2"]]  # a stop now strikes req-2, which ran
    await service.journal.settle()
    await service.journal.settle()  # written once
    assert _journal(bus) == [["req-1"], ["req-2"], []]


async def test_merging_off_plans_one_model_per_cycle(tmp_path: Path) -> None:
    service = _service(RecordingBus(), tmp_path)
    for model_id in ("m-a", "m-b"):
        service.sequencer.start(model_id, applied_seq=0)
        jobs: list[Job] = [
            ForwardBackwardJob(
                request_id=f"{model_id}-1", model_id=model_id, tenant_id="t", seq_id=1
            ),
            OptimStepJob(request_id=f"{model_id}-2", model_id=model_id, tenant_id="t", seq_id=2),
        ]
        for job in jobs:
            service.sequencer.offer(Pending(job=job, handle=None, received_at=0.0))

    [merged] = service._plan()
    assert {item.job.model_id for item in merged.shared_pass} == {"m-a", "m-b"}
    assert {item.job.model_id for item in merged.optim_steps} == {"m-a", "m-b"}

    service.settings = dataclasses.replace(service.settings, merge=False)
    cycles = service._plan()
    assert [[item.job.request_id for item in cycle.shared_pass] for cycle in cycles] == [
        ["m-a-1"],
        ["m-b-1"],
    ]
    assert [[item.job.request_id for item in cycle.optim_steps] for cycle in cycles] == [
        ["m-a-2"],
        ["m-b-2"],
    ]


async def test_a_cycle_runs_lone_optim_steps_before_its_pass_and_following_ones_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _service(RecordingBus(), tmp_path)
    calls: list[tuple[str, list[str]]] = []

    def recorder(kind: str) -> Any:
        def run(jobs: list[Job]) -> list[Result]:
            calls.append((kind, [job.request_id for job in jobs]))
            return _ran(jobs)

        return run

    monkeypatch.setattr(service.ops, "shared_pass", recorder("pass"))
    monkeypatch.setattr(service.ops, "optim_steps", recorder("step"))
    jobs: list[Job] = [
        OptimStepJob(request_id="light-step", model_id="m-light", tenant_id="a", seq_id=1),
        ForwardBackwardJob(request_id="flood-fb", model_id="m-flood", tenant_id="b", seq_id=1),
        OptimStepJob(request_id="flood-step", model_id="m-flood", tenant_id="b", seq_id=2),
    ]
    for model_id in ("m-light", "m-flood"):
        service.sequencer.start(model_id, applied_seq=0)
    for job in jobs:
        service.sequencer.offer(Pending(job=job, handle=None, received_at=0.0))

    [cycle] = service._plan()
    await service._run_cycle(cycle)

    assert calls == [
        ("step", ["light-step"]),
        ("pass", ["flood-fb"]),
        ("step", ["flood-step"]),
    ]


def _snapshotting(service: TrainerService) -> None:
    """`snapshot_every` 1, with no time between snapshots."""
    service.settings = dataclasses.replace(service.settings, snapshot_every=1, snapshot_min_s=0.0)
    service.snapshots.settings = service.settings


def _step(service: TrainerService) -> list[Pending[Any]]:
    job = OptimStepJob(request_id="req-b", model_id="m-b", tenant_id="t", seq_id=1)
    service.sequencer.start(job.model_id, applied_seq=0)
    item: Pending[Any] = Pending(job=job, handle=None, received_at=0.0, stream_seq=7)
    service.sequencer.offer(item)
    return [item]


def _journal(bus: RecordingBus) -> list[list[str]]:
    """Every running list the service wrote, in order."""
    key = running_key("w-1")
    return [msgspec.msgpack.decode(value) for _, k, value in bus.writes if k == key]


async def test_a_snapshot_due_waits_for_snapshot_min_s_since_the_models_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of a few milliseconds: a model due a snapshot every step gets one when its last is
    `snapshot_min_s` old, not after each step; it stays due meanwhile."""
    service = _service(RecordingBus(), tmp_path)
    service.settings = dataclasses.replace(service.settings, snapshot_every=1, snapshot_min_s=0.3)
    service.snapshots.settings = service.settings
    written: list[int] = []

    def write(directory: Path, seq_id: int, state: Any, meta: dict[str, Any]) -> Path:
        written.append(seq_id)
        return directory / f"state-{seq_id}.json"

    monkeypatch.setattr(trainer_snapshots, "write_state", write)
    service.sequencer.start("m-b", applied_seq=0)
    for seq in range(1, 5):
        job = OptimStepJob(request_id=f"req-{seq}", model_id="m-b", tenant_id="t", seq_id=seq)
        item: Pending[Any] = Pending(job=job, handle=None, received_at=0.0, stream_seq=seq)
        service.sequencer.offer(item)
        await service._run([item], _ran)
        await service.snapshots.settle()
        if seq == 3:
            await asyncio.sleep(0.35)
    assert written == [1, 4]  # steps 2 and 3 came within 0.3 s of the first


async def test_the_journal_lists_a_snapshot_after_an_op_until_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot after an optim_step is a step of the op: a worker that dies writing it leaves
    the op and the model's snapshot step on its running list, and its successor strikes them."""
    bus = RecordingBus()
    service = _service(bus, tmp_path)
    _snapshotting(service)
    during: list[list[str]] = []

    def write(directory: Path, seq_id: int, state: Any, meta: dict[str, Any]) -> Path:
        during.append(_journal(bus)[-1])
        return directory / f"state-{seq_id}.json"

    monkeypatch.setattr(trainer_snapshots, "write_state", write)
    await service._run(_step(service), _ran)

    assert during == [["req-b", snapshot_step("m-b")]]
    # the op is over; its snapshot is recorded beside the model's next ops
    await service.journal.settle()
    assert _journal(bus)[-1] == [snapshot_step("m-b")]
    await service.snapshots.settle()
    assert _journal(bus)[-1] == []  # cleared once every step is over
    assert subjects.snapshot_key("m-b") in [key for _, key, _ in bus.writes]


async def test_a_snapshot_that_stopped_the_worker_max_attempts_times_fails_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = RecordingBus()
    released: list[str] = []
    service = _service(bus, tmp_path, released)
    _snapshotting(service)
    service.journal.strikes[snapshot_step("m-b")] = service.settings.max_attempts

    def write(*args: Any) -> Path:
        raise AssertionError("written again")

    monkeypatch.setattr(trainer_snapshots, "write_state", write)
    await service._run(_step(service), _ran)

    assert released == ["m-b"]
    failure = service.ops.failure("m-b")
    assert failure is not None and "snapshot stopped the worker" in failure.message


class FailingBus(RecordingBus):
    """Refuses the first write of each key in `refused` (a fault, not NATS being away)."""

    def __init__(self, refused: set[str]) -> None:
        super().__init__()
        self.refused = refused

    async def put(self, bucket: str, key: str, value: bytes) -> None:
        if key in self.refused:
            self.refused.discard(key)
            raise RuntimeError("refused")
        await super().put(bucket, key, value)


async def test_an_outcome_that_cannot_be_stored_fails_its_op_and_the_model_it_changed(
    tmp_path: Path,
) -> None:
    """The step changed the model, so reporting it failed while keeping the model would be
    a lie (a failed op changed nothing); the model fails, and its op says so."""
    bus = FailingBus({subjects.future_key("req-b")})
    released: list[str] = []
    service = _service(bus, tmp_path, released)
    _snapshotting(service)
    service.settings = dataclasses.replace(service.settings, snapshot_every=100)
    service.snapshots.settings = service.settings
    await service._run(_step(service), _ran)

    [(_, _, stored)] = [w for w in bus.writes if w[1] == subjects.future_key("req-b")]
    outcome = decode_outcome(stored)
    assert (outcome.state, outcome.category) == ("error", "server")
    assert "stopped training" in outcome.error and "req-b" in outcome.error
    assert released == ["m-b"] and service.sequencer.missing_seq("m-b") == 2


async def test_a_snapshot_step_inherited_from_a_dead_worker_is_struck(
    nats_server: NatsServer,
) -> None:
    # A worker killed while it wrote a model's snapshot leaves `snapshot.<model_id>` on its
    # running list; model ids hold ':', which no KV key may: the heir raised InvalidKeyError
    # while gaining the shard, and died, again and again.
    from twinkle_async.bus import Bus
    from twinkle_async.settings import BusSettings
    from workers.bus import WorkerBus
    from workers.watchdog import CrashJournal

    gateway = Bus(BusSettings(nats_url=nats_server.url))
    await gateway.connect()  # the topology
    bus = WorkerBus(nats_server.url)
    await bus.connect()
    try:
        dead = CrashJournal(bus, "w-dead")
        step = snapshot_step("sess-0123456789abcdef:train:0")
        await dead.running(["req-a"])
        await dead.enter(step)
        heir = CrashJournal(bus, "w-heir")
        assert sorted(await heir.inherit("w-dead")) == sorted(["req-a", step])
        assert heir.strikes == {"req-a": 1, step: 1}
        again = CrashJournal(bus, "w-third")
        dead = CrashJournal(bus, "w-dead")  # restarted under its id, and killed again
        await dead.running(["req-a"])
        await dead.enter(step)
        await again.inherit("w-dead")
        assert again.strikes[step] == 2  # counted in KV across workers
        await again.forgive(step)
        assert await bus.get("tw_futures", strikes_key(step)) == b"0"
    finally:
        await bus.close()
        await gateway.close()
