"""The trainer service against a real nats-server and real ops on a real model, in-process: ops published
before the worker starts are merged into one shared pass across models, outcomes land in KV,
a model whose next seq never arrives fails loudly instead of hanging, an unload frees the
model's adapter and answers with the SDK's response, and a request that crashes a shared pass
fails alone while the others of its pass succeed; the service's metrics count what it ran. A
fault after the engine call (a snapshot that raises, or kills the process each time) fails its
model, not the worker, and never the other tenants of its pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from protocol import api, records, subjects
from protocol.api import LoraConfig
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    OptimStepJob,
    Outcome,
    SeqClaim,
    UnloadModelJob,
    decode_job,
    decode_outcome,
    request_type_of,
)
from protocol.records import SnapshotRecord
from protocol.tensors import (
    DatumArrays,
    FwdBwdRequest,
    decode_forward_backward_output,
    encode_forward_backward,
)
from twinkle_async.bus import Bus
from twinkle_async.futures import FutureStore
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings
from workers.bus import WorkerBus
from workers.engine.model import MultiSlotModel
from workers.engine.passes import Checked, PassResults
from workers.settings import WorkerSettings
from workers.tiny_model import build_tiny_model
from workers.trainer import snapshots as trainer_snapshots
from workers.trainer.operations import EngineOps
from workers.trainer.residency import Residency
from workers.trainer.service import TrainerService
from workers.trainer.snapshots import write_state


def fwd_job(model_id: str, seq_id: int, length: int) -> ForwardBackwardJob:
    tokens = np.arange(3, 3 + length + 1, dtype=np.int64)
    request = FwdBwdRequest(
        model_id=model_id,
        seq_id=seq_id,
        loss_fn="cross_entropy",
        forward_only=False,
        loss_fn_config={},
        datums=[
            DatumArrays(tokens=tokens[:-1].astype(np.int32), inputs={"target_tokens": tokens[1:]})
        ],
    )
    return ForwardBackwardJob(
        request_id=f"req-{model_id}-{seq_id}",
        model_id=model_id,
        tenant_id="t",
        seq_id=seq_id,
        body=encode_forward_backward(request),
        n_tokens=length,
    )


async def wait_outcome(bus: Bus, request_id: str, timeout_s: float = 60.0) -> Outcome:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = await bus.get(subjects.BUCKET_FUTURES, subjects.future_key(request_id))
        if data:
            return decode_outcome(data)
        await asyncio.sleep(0.05)
    raise TimeoutError(request_id)


def worker_settings(nats_server: NatsServer, tmp_path: Path, **overrides: Any) -> WorkerSettings:
    """A worker on a tiny model built offline, against the test's nats-server."""
    return WorkerSettings(
        base_model=str(build_tiny_model(tmp_path / "tiny")),
        nats_url=nats_server.url,
        data_dir=tmp_path / "data",
        max_rank=8,
        **overrides,
    )


def create_job(model_id: str, model_dir: Path, *, rank: int = 4, seed: int = 1) -> CreateModelJob:
    return CreateModelJob(
        request_id=f"req-{model_id}-0",
        model_id=model_id,
        tenant_id="t",
        seq_id=0,
        base_model=str(model_dir),
        lora=LoraConfig(rank=rank, seed=seed),
    )


def optim_job(model_id: str, seq_id: int) -> OptimStepJob:
    return OptimStepJob(
        request_id=f"req-{model_id}-{seq_id}", model_id=model_id, tenant_id="t", seq_id=seq_id
    )


def engine_ops(settings: WorkerSettings, max_slots: int = 2) -> EngineOps:
    """The worker's ops on a fresh model of `max_slots` slots, composed as `workers.__main__`
    composes them."""
    model = MultiSlotModel(settings.base_model, max_slots=max_slots, max_rank=8)
    return EngineOps(model, Residency(model), settings)


@contextlib.asynccontextmanager
async def running_worker(
    settings: WorkerSettings, ops: EngineOps | None = None
) -> AsyncIterator[EngineOps]:
    """A trainer service (on fresh ops unless given) serving until the block ends."""
    ops = ops or engine_ops(settings)
    worker_bus = WorkerBus(settings.nats_url)
    await worker_bus.connect()
    task = asyncio.create_task(TrainerService(worker_bus, ops, settings).run())
    try:
        yield ops
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()


@pytest.mark.timeout(120)
async def test_service_merges_models_and_fails_gaps(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    settings = worker_settings(
        nats_server,
        tmp_path,
        gap_timeout_s=1.0,
    )
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    models = ["m-a", "m-b", "m-c"]
    jobs: list[Job] = []
    for i, model_id in enumerate(models):
        jobs.append(
            CreateModelJob(
                request_id=f"req-{model_id}-0",
                model_id=model_id,
                tenant_id="t",
                seq_id=0,
                base_model=str(model_dir),
                lora=LoraConfig(rank=4 + 2 * i, seed=i),
            )
        )
        jobs.append(fwd_job(model_id, 1, length=5 + i))
        jobs.append(
            OptimStepJob(request_id=f"req-{model_id}-2", model_id=model_id, tenant_id="t", seq_id=2)
        )
    # a model whose seq 1 never comes: its seq 2 must fail, not hang
    jobs.append(
        CreateModelJob(
            request_id="req-gap-0",
            model_id="m-gap",
            tenant_id="t",
            seq_id=0,
            base_model=str(model_dir),
            lora=LoraConfig(rank=4),
        )
    )
    jobs.append(fwd_job("m-gap", 2, length=4))
    for job in reversed(jobs):  # arrival order is the reverse of seq order
        await gateway_bus.publish_job(settings.pool, job)

    worker_bus = WorkerBus(nats_server.url)
    await worker_bus.connect()
    service = TrainerService(worker_bus, engine_ops(settings, max_slots=8), settings)
    task = asyncio.create_task(service.run())
    try:
        for model_id in models:
            out = await wait_outcome(gateway_bus, f"req-{model_id}-1")
            assert out.state == "done" and out.payload_type == "proto"
            decoded = decode_forward_backward_output(out.payload)
            assert decoded.metrics["loss:sum"] > 0
            assert (await wait_outcome(gateway_bus, f"req-{model_id}-2")).state == "done"
        gap = await wait_outcome(gateway_bus, "req-m-gap-2", timeout_s=30)
        assert gap.state == "error" and gap.category == "server" and "never arrived" in gap.error
        assert max(service.pass_models) == 3, list(service.pass_models)
        value = service.metrics.registry.get_sample_value
        assert value("twinkle_worker_tokens_total") == 5 + 6 + 7
        assert (value("twinkle_worker_pass_seconds_count") or 0) >= 1
        assert value("twinkle_worker_pass_tenants_bucket", {"le": "3.0"}) == value(
            "twinkle_worker_pass_tenants_count"
        )
        assert (value("twinkle_worker_optim_step_seconds_count") or 0) >= 1
        done = {"kind": "forward_backward", "outcome": "done"}
        assert value("twinkle_worker_ops_total", done) == 3
        gap_failed = {"kind": "forward_backward", "outcome": "server_error"}
        deadline = time.monotonic() + 5  # counted just after the outcome is written
        while value("twinkle_worker_ops_total", gap_failed) is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert value("twinkle_worker_ops_total", gap_failed) == 1
        assert value("twinkle_worker_slots_used") == 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()
        await gateway_bus.close()


@pytest.mark.timeout(120)
async def test_an_op_delivered_to_a_connection_that_died_is_delivered_again_in_seconds(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    # A delivery the server sent on a connection that died (a NATS node killed mid-fetch)
    # counts as delivered and would come back only after ack_wait (120 s), or the model's gap
    # timeout would fail it: the worker has the shard's un-acked ops delivered again.
    settings = worker_settings(nats_server, tmp_path, gap_timeout_s=90.0)
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    worker_bus = WorkerBus(nats_server.url)
    await worker_bus.connect()
    service = TrainerService(worker_bus, engine_ops(settings), settings)
    deliver = service._on_msg
    lost: list[int] = []

    async def losing_the_first_copy_of_seq_1(msg: Any) -> None:
        job = decode_job(msg.data)
        if job.model_id == "m-lost" and job.seq_id == 1 and not lost:
            lost.append(job.seq_id)  # delivered, never acked, never run
            return
        await deliver(msg)

    service._on_msg = losing_the_first_copy_of_seq_1  # type: ignore[method-assign]
    task = asyncio.create_task(service.run())
    try:
        await gateway_bus.publish_job(settings.pool, create_job("m-lost", model_dir))
        assert (await wait_outcome(gateway_bus, "req-m-lost-0")).state == "done"
        started = time.monotonic()
        await gateway_bus.publish_job(settings.pool, fwd_job("m-lost", 1, length=4))
        await gateway_bus.publish_job(settings.pool, optim_job("m-lost", 2))
        out = await wait_outcome(gateway_bus, "req-m-lost-2", timeout_s=40)
        assert out.state == "done", out.error
        assert lost == [1]
        assert (await wait_outcome(gateway_bus, "req-m-lost-1")).state == "done"
        assert time.monotonic() - started < 30  # ack_wait is 120 s
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()
        await gateway_bus.close()


@pytest.mark.timeout(120)
async def test_service_unloads_a_model(nats_server: NatsServer, tmp_path: Path) -> None:
    settings = worker_settings(nats_server, tmp_path)
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    jobs: list[Job] = [
        create_job("m-u", model_dir),
        UnloadModelJob(request_id="req-m-u-1", model_id="m-u", tenant_id="t", seq_id=1),
    ]
    for job in jobs:
        await gateway_bus.publish_job(settings.pool, job)
    try:
        async with running_worker(settings) as ops:
            out = await wait_outcome(gateway_bus, "req-m-u-1")
            assert (out.state, out.error) == ("done", "")
            assert api.decode(out.payload, api.UnloadModelResponse).model_id == "m-u"
            assert not ops.residency.has("m-u") and ops.residency.slots_used() == 0
    finally:
        await gateway_bus.close()


def faulty_ops(settings: WorkerSettings, monkeypatch: pytest.MonkeyPatch) -> EngineOps:
    """Ops on a model that raises inside every pass holding model "m-bad", after its backward."""
    ops = engine_ops(settings, max_slots=4)
    run = ops.model.passes.run

    def faulty(items: Sequence[Checked], slots: Sequence[int]) -> PassResults:
        results = run(items, slots)
        if any(item.request.model_id == "m-bad" for item in items):
            raise RuntimeError("injected device fault")
        return results

    monkeypatch.setattr(ops.model.passes, "run", faulty)
    return ops


@pytest.mark.timeout(120)
async def test_service_fails_only_the_request_that_crashes_a_pass(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = worker_settings(nats_server, tmp_path)
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    models = ["m-a", "m-bad", "m-c"]
    for i, model_id in enumerate(models):
        create = CreateModelJob(
            request_id=f"req-{model_id}-0",
            model_id=model_id,
            tenant_id="t",
            seq_id=0,
            base_model=str(model_dir),
            lora=LoraConfig(rank=4, seed=i),
        )
        await gateway_bus.publish_job(settings.pool, create)
        await gateway_bus.publish_job(settings.pool, fwd_job(model_id, 1, length=5 + i))

    worker_bus = WorkerBus(nats_server.url)
    await worker_bus.connect()
    service = TrainerService(worker_bus, faulty_ops(settings, monkeypatch), settings)
    task = asyncio.create_task(service.run())
    try:
        outcomes = {m: await wait_outcome(gateway_bus, f"req-{m}-1") for m in models}
        bad = outcomes.pop("m-bad")
        assert bad.state == "error" and bad.category == "server"
        assert "req-m-bad-1" in bad.error and "injected" not in bad.error
        for out in outcomes.values():
            assert out.state == "done", out.error
        assert max(service.pass_models) == 3  # they did share a pass before the bisection
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()
        await gateway_bus.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lost_seq_5", ["forward_backward", "forward"])
async def test_a_model_whose_log_was_trimmed_past_its_snapshot_is_lost_only_if_a_change_went(
    nats_server: NatsServer, tmp_path: Path, lost_seq_5: str
) -> None:
    """The ops log keeps what its limits allow, whatever tenant filled it. A restarted worker
    restores a model's snapshot (seq 4) and finds its log resuming at seq 6. If seq 5 was a
    training pass, replaying 6 and 7 on top of the snapshot would silently drop it, which its
    client saw succeed: the model is lost, loudly. If it was a forward-only pass, it changed
    nothing (its claim says so): the model goes on from its snapshot."""
    settings = worker_settings(
        nats_server,
        tmp_path,
        gap_timeout_s=2.0,
        snapshot_every=2,  # a snapshot after seq 4, none after seq 6
        snapshot_min_s=0.0,
        worker_id="w-trimmed",
    )
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    futures = FutureStore(gateway_bus)
    fifth = fwd_job("m-t", 5, length=5)
    jobs: list[Job] = [
        create_job("m-t", model_dir),
        *(job for seq in (1, 3) for job in (fwd_job("m-t", seq, 5), optim_job("m-t", seq + 1))),
        msgspec.structs.replace(fifth, forward_only=lost_seq_5 == "forward"),
        optim_job("m-t", 6),
    ]
    for job in jobs:  # as a gateway does: each seq claimed, then published
        claim = SeqClaim(request_id=job.request_id, request_type=request_type_of(job), digest="")
        await futures.claim("m-t", job.seq_id, claim)
        await gateway_bus.publish_job(settings.pool, job)

    async def run_worker(until: str) -> Outcome:
        async with running_worker(settings):
            return await wait_outcome(gateway_bus, until, timeout_s=60)

    try:
        assert (await run_worker("req-m-t-6")).state == "done"
        assert await gateway_bus.get(subjects.BUCKET_RUNS, subjects.snapshot_key("m-t"))
        # other tenants' traffic filled the log: its limits dropped everything before seq 6
        assert gateway_bus.js is not None
        info = await gateway_bus.js.stream_info(subjects.STREAM_OPS)
        assert info.state is not None
        await gateway_bus.js.purge_stream(subjects.STREAM_OPS, seq=info.state.last_seq)
        await gateway_bus.publish_job(settings.pool, fwd_job("m-t", 7, length=5))
        out = await run_worker("req-m-t-7")  # the restarted worker takes the model over
        if lost_seq_5 == "forward_backward":
            assert out.state == "error" and "could not be recovered" in out.error, out
        else:
            assert (out.state, out.error) == ("done", ""), out
    finally:
        await gateway_bus.close()


@pytest.mark.timeout(120)
async def test_a_model_idle_since_its_last_change_is_snapshotted_once(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A model that stops after a few steps, short of `snapshot_every`, is snapshotted once it
    has been idle for `snapshot_idle_s`: its recovery then needs no ops from long ago, which
    the log's limits may have dropped."""
    settings = worker_settings(
        nats_server,
        tmp_path,
        gap_timeout_s=1.0,  # the cycle loop looks around every second
        snapshot_every=100,
        snapshot_idle_s=1.0,
    )
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    jobs: list[Job] = [
        create_job("m-i", model_dir),
        fwd_job("m-i", 1, length=5),
        optim_job("m-i", 2),
        msgspec.structs.replace(fwd_job("m-i", 3, length=5), forward_only=True),
    ]
    for job in jobs:
        await gateway_bus.publish_job(settings.pool, job)
    key = subjects.snapshot_key("m-i")
    try:
        async with running_worker(settings):
            assert (await wait_outcome(gateway_bus, "req-m-i-3")).state == "done"
            deadline = time.monotonic() + 20
            while (data := await gateway_bus.get(subjects.BUCKET_RUNS, key)) is None:
                assert time.monotonic() < deadline, "no snapshot of the idle model"
                await asyncio.sleep(0.1)
            first = records.decode(data, SnapshotRecord)
            # at its last op, a forward-only pass: a takeover needs nothing before seq 4
            assert (first.applied_seq, first.step) == (3, 1)
            await asyncio.sleep(3.0)  # idle and unchanged since: not written again
            again = await gateway_bus.get(subjects.BUCKET_RUNS, key)
            assert again is not None and records.decode(again, SnapshotRecord) == first
    finally:
        await gateway_bus.close()


def two_tenants(model_dir: Path, through_seq: int) -> list[Job]:
    """`m-bad` and the bystander `m-ok`, each created and trained in steps up to `through_seq`."""
    jobs: list[Job] = []
    for i, model_id in enumerate(["m-bad", "m-ok"]):
        jobs.append(create_job(model_id, model_dir, seed=i + 1))
        for seq in range(1, through_seq + 1):
            jobs.append(fwd_job(model_id, seq, 5) if seq % 2 else optim_job(model_id, seq))
    return jobs


def snapshot_writer(fault: BaseException) -> Any:
    """The service's `write_state`, raising `fault` for model `m-bad` only."""

    def write(directory: Path, seq_id: int, state: Any, meta: dict[str, Any]) -> Path:
        if meta["model_id"] == "m-bad":
            raise fault
        return write_state(directory, seq_id, state, meta)

    return write


@pytest.mark.timeout(120)
async def test_a_fault_after_the_engine_call_fails_its_model_not_the_worker(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot that raises after an optim_step (an MLP-only adapter on a model whose MLP the
    bank does not wrap once did: `torch.cat()` of nothing) fails that model: its next requests
    answer a clear `server` error. Exiting instead would replay the step from the log and fail
    again on every restart, the pool's other tenants down with it; the bystander sharing its
    passes and fused steps trains on."""
    fault = ValueError("torch.cat(): expected a non-empty list of Tensors")
    monkeypatch.setattr(trainer_snapshots, "write_state", snapshot_writer(fault))
    settings = worker_settings(nats_server, tmp_path, snapshot_every=1, snapshot_min_s=0.0)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    for job in two_tenants(Path(settings.base_model), through_seq=4):
        await gateway_bus.publish_job(settings.pool, job)
    try:
        async with running_worker(settings) as ops:
            # the step ran and was answered before its snapshot failed
            assert (await wait_outcome(gateway_bus, "req-m-bad-2")).state == "done"
            for seq in (3, 4):
                out = await wait_outcome(gateway_bus, f"req-m-bad-{seq}", timeout_s=30)
                assert (out.state, out.category) == ("error", "server"), out
                assert "stopped training" in out.error and "req-m-bad-2" in out.error, out
                assert "load your last checkpoint" in out.error and "torch" not in out.error
            for seq in range(1, 5):
                out = await wait_outcome(gateway_bus, f"req-m-ok-{seq}", timeout_s=30)
                assert (out.state, out.error) == ("done", ""), out
            assert not ops.residency.has("m-bad") and ops.residency.has("m-ok")
            # still serving: a later request of the bystander runs
            await gateway_bus.publish_job(settings.pool, fwd_job("m-ok", 5, 5))
            assert (await wait_outcome(gateway_bus, "req-m-ok-5", timeout_s=30)).state == "done"
        ok = await gateway_bus.get(subjects.BUCKET_RUNS, subjects.snapshot_key("m-ok"))
        assert ok is not None and records.decode(ok, SnapshotRecord).applied_seq == 4
        assert await gateway_bus.get(subjects.BUCKET_RUNS, subjects.snapshot_key("m-bad")) is None
    finally:
        await gateway_bus.close()


class WorkerDied(BaseException):
    """Stands for the process dying (a segfault): no handler of the worker's catches it, and
    none of its clean-up runs, so the crash journal stays as it was."""


@pytest.mark.timeout(240)
async def test_a_crash_that_recurs_in_a_snapshot_is_struck_out_like_a_poison_pass(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies while writing `m-bad`'s snapshot after its optim_step, whose outcome
    is stored already. Each restart (same worker id) rebuilds the model by replaying that step,
    which writes the snapshot again: the journal covers the write, so after `max_attempts`
    deaths the step is not replayed; the model fails clearly and the bystander trains on."""
    monkeypatch.setattr(trainer_snapshots, "write_state", snapshot_writer(WorkerDied()))
    settings = worker_settings(
        nats_server,
        tmp_path,
        snapshot_every=1,
        snapshot_min_s=0.0,
        max_attempts=2,
        worker_id="w-dies",
    )
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    for job in two_tenants(Path(settings.base_model), through_seq=3):
        await gateway_bus.publish_job(settings.pool, job)
    try:
        for _ in range(settings.max_attempts):
            worker_bus = WorkerBus(settings.nats_url)
            await worker_bus.connect()
            service = TrainerService(worker_bus, engine_ops(settings), settings)
            task = asyncio.create_task(service.run())
            await asyncio.wait([task], timeout=60)
            assert task.done() and isinstance(task.exception(), WorkerDied)
            service.executor.shutdown(wait=False)
            await worker_bus.close()
        assert (await wait_outcome(gateway_bus, "req-m-bad-2")).state == "done"
        async with running_worker(settings):
            out = await wait_outcome(gateway_bus, "req-m-bad-3", timeout_s=30)
            assert (out.state, out.category) == ("error", "server"), out
            assert "stopped training" in out.error and "2 times" in out.error, out
            for seq in range(1, 4):
                out = await wait_outcome(gateway_bus, f"req-m-ok-{seq}", timeout_s=30)
                assert (out.state, out.error) == ("done", ""), out
    finally:
        await gateway_bus.close()


@pytest.mark.timeout(120)
async def test_a_shard_handed_over_during_a_cycle_leaves_its_unrun_ops_to_the_new_owner(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard released while a cycle runs (a worker joined and the spread evens out): the op
    running finishes, and the ops of its models planned after it in the same cycle are left
    un-acked for the new owner. They used to run on the adapter the handover had just
    released and answer their client "is not loaded" (make compose-test saw it on an
    optim_step). Here the new owner is this worker again, once the lease is free: it rebuilds
    the model from the log and runs them, and the adapter ends equal to a bystander's trained
    alike in the same passes with no handover."""
    settings = worker_settings(nats_server, tmp_path, lease_renew_s=0.5)
    moved = "m-moved"
    shard = subjects.shard_of(moved, settings.n_shards)
    kept = next(
        f"m-kept-{i}"
        for i in range(100)
        if subjects.shard_of(f"m-kept-{i}", settings.n_shards) != shard
    )
    model_dir = Path(settings.base_model)
    gateway_bus = Bus(BusSettings(nats_url=nats_server.url))
    await gateway_bus.connect()
    for model_id in (moved, kept):
        for job in (create_job(model_id, model_dir), fwd_job(model_id, 1, 5)):
            await gateway_bus.publish_job(settings.pool, job)
        await gateway_bus.publish_job(settings.pool, optim_job(model_id, 2))
    worker_bus = WorkerBus(settings.nats_url)
    await worker_bus.connect()
    service = TrainerService(worker_bus, engine_ops(settings), settings)
    loop = asyncio.get_running_loop()
    released: list[Any] = []
    shared_pass = service.ops.shared_pass

    def pass_during_a_handover(jobs: list[Job]) -> Any:
        if not released and any(job.model_id == moved for job in jobs):
            released.append(asyncio.run_coroutine_threadsafe(service.leases.release(shard), loop))
            deadline = time.monotonic() + 10
            while service.sequencer.known(moved):  # its line goes, then its adapter's release
                assert time.monotonic() < deadline, "the shard was not handed over"
                time.sleep(0.01)
            time.sleep(0.2)  # ... is queued behind this call on the engine thread
        return shared_pass(jobs)

    monkeypatch.setattr(service.ops, "shared_pass", pass_during_a_handover)
    task = asyncio.create_task(service.run())
    try:
        for model_id in (moved, kept):
            for seq in range(3):
                out = await wait_outcome(gateway_bus, f"req-{model_id}-{seq}", timeout_s=60)
                assert (out.state, out.error) == ("done", ""), out
        assert released and released[0].done(), "the shard was not released mid-cycle"
        states = [
            await loop.run_in_executor(service.executor, service.ops.capture, model_id)
            for model_id in (moved, kept)
        ]
        assert states[0].step == states[1].step == 1
        assert states[0].rows.keys() == states[1].rows.keys()
        for name, row in states[0].rows.items():
            torch.testing.assert_close(row.values, states[1].rows[name].values, atol=1e-5, rtol=0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker_bus.close()
        await gateway_bus.close()
