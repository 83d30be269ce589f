"""The trainer worker service: shard consumers → sequencer → scheduler → engine → outcomes.

Step 3 (docs/architecture.md): every op of the owned shards is offered to the per-model sequencer.
Step 4: each cycle plans one shared forward/backward pass across models, one fused optimizer
step, then saves/loads (`workers/trainer/scheduler.py`; with `--no-merge`, one model's per cycle), and
runs them on the engine's single thread.
Step 5: each op's outcome is written to KV `tw_futures`, then the op is acked; a crash between
the two only re-runs the op and rewrites the same key.

A fault in any step of an op (the engine call, its outcome, its snapshot) fails that op, or its
model once the op has changed it (`_finish`, `_fail_model`); it never ends the process, which
would replay the same op from the log and fail again, with every tenant of the pool down
meanwhile. Only a bus that stays away (`Unavailable`) does. A crash that is no exception (a
segfault, the pass watchdog) is what the journal is for: every step is on it.

The engine-thread work itself is `workers.trainer.operations`. This module is the transport and the
order around it: which shards this worker consumes (`workers.trainer.leases`), taking over a model it
has no state for (a snapshot, then the model's logged ops: `workers.trainer.recovery`), snapshots after
optimizer steps and saves (`workers.trainer.snapshots`), the pass watchdog and the journal that turns a
crash into strikes (`workers.watchdog`). Passes, fused steps, cycles, slots and every written
outcome are observed on `self.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from nats.aio.msg import Msg

from natskv.store import both
from protocol import metric_history, records, subjects
from protocol.errors import Gone, ServerError, Unavailable
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    LoadWeightsJob,
    OptimStepJob,
    Outcome,
    TombstoneJob,
    UnloadModelJob,
    decode_job,
    encode_outcome,
)
from protocol.records import CheckpointRecord
from workers.bus import WorkerBus
from workers.settings import WorkerSettings
from workers.trainer.gaps import Gaps
from workers.trainer.heartbeat import Heartbeat
from workers.trainer.leases import LeaseKeeper
from workers.trainer.operations import (
    Result,
    TrainerOps,
    failed_outcome,
    settled_outcome,
)
from workers.trainer.parking import SlotState
from workers.trainer.recovery import ModelLog, changes_state
from workers.trainer.scheduler import Cycle, FairShare, plan
from workers.trainer.sequencer import Pending, Sequencer
from workers.trainer.snapshots import Snapshots
from workers.trainer.takeover import take_over
from workers.usage import UsageBook
from workers.watchdog import CrashJournal, stop_process

log = logging.getLogger(__name__)

Item = Pending[Msg | None]


_STARTUP_GATHER_S = 0.2


def _creates(job: Job) -> bool:
    """Whether the op creates its model (seq 0): no state exists to take over before it."""
    return isinstance(job, CreateModelJob) or (isinstance(job, LoadWeightsJob) and job.create)


class TrainerService:
    """One trainer worker: owns every shard of its pool (leases come with more workers)."""

    def __init__(
        self,
        bus: WorkerBus,
        ops: TrainerOps,
        settings: WorkerSettings,
        executor: ThreadPoolExecutor | None = None,
        *,
        metrics_url: str = "",
    ) -> None:
        self.bus = bus
        # every call on the model and its slots, on the engine thread (`workers.trainer.operations`)
        self.ops = ops
        self.model = ops.model  # read here: sizes, the pass size, the image geometry
        self.residency = ops.residency  # read here: slots used and parked
        self.settings = settings
        self.metrics = ops.metrics
        self.sequencer: Sequencer[Msg | None] = Sequencer()
        self._wake = asyncio.Event()
        # the engine is not thread-safe: every engine call (training or torch sampling) runs here
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._in_flight: list[Msg] = []
        # models per shared pass, most recent last: the measure of cross-tenant merging
        self.pass_models: deque[int] = deque(maxlen=1000)
        # what ran for each tenant, flushed to KV with every heartbeat
        self.usage = UsageBook(settings.worker_id)
        self.heartbeat = Heartbeat(bus, settings, ops, self.usage, metrics_url)
        self.log_reader = ModelLog(bus, settings.pool, settings.n_shards)
        self.leases = LeaseKeeper(
            bus,
            settings.pool,
            settings.worker_id,
            settings.n_shards,
            lease_s=settings.lease_s,
            renew_s=settings.lease_renew_s,
            live_workers=self.heartbeat.live_workers,
            on_gain=self._gain_shard,
            on_lose=self._lose_shard,
        )
        self._shard_tasks: dict[int, asyncio.Task[None]] = {}
        self.gaps = Gaps(bus, settings, self.sequencer, self._shard_tasks)
        self.journal = CrashJournal(bus, settings.worker_id)
        self.fair_share = FairShare()  # tokens served per tenant and model: who goes first
        self.snapshots = Snapshots(
            bus,
            settings,
            self.ops.store,
            self.journal,
            self.sequencer,
            capture=self._capture,
            has=lambda model_id: self.residency.has(model_id),
            fail_model=self._fail_model,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled: the shards this worker holds leases on (`workers.trainer.leases`)."""
        await self.journal.inherit(self.settings.worker_id)  # restarted after a crash?
        tasks = [
            asyncio.create_task(self._cycle_loop(), name="cycles"),
            asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
            asyncio.create_task(self._keepalive_loop(), name="keepalive"),
            asyncio.create_task(self.leases.run(), name="leases"),
        ]
        log.info(
            "worker %s serving %s (pool %s)",
            self.settings.worker_id,
            self.settings.base_model,
            self.settings.pool,
        )
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def hand_over(self) -> None:
        """On a clean stop, before the bus closes: release every shard at once (a crashed
        worker's leases expire instead), then stop the engine thread."""
        await self.leases.release_all()
        await self.snapshots.close()
        await self.journal.settle()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- shards ------------------------------------------------------------------------------

    async def _gain_shard(self, shard: int, previous_owner: str | None) -> None:
        """Consume a shard just leased: from its oldest unfinished op, in stream order. What
        its previous owner was running when it stopped becomes suspect (`workers.watchdog`)."""
        if previous_owner is not None and previous_owner != self.settings.worker_id:
            await self.journal.inherit(previous_owner)
        durable = subjects.consumer_name(self.settings.pool, shard)
        await self.bus.reset_consumer(subjects.STREAM_OPS, durable)
        self._shard_tasks[shard] = await self.bus.consume(
            subjects.STREAM_OPS,
            subjects.shard_filter(self.settings.pool, shard),
            durable,
            self._on_msg,
        )

    async def _lose_shard(self, shard: int) -> None:
        """Stop consuming a shard and forget its models; their new owner takes them over.

        Ops still waiting here are not acked: the new owner's consumer delivers them again.
        """
        task = self._shard_tasks.pop(shard, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        gone = [
            model_id
            for model_id in list(self.sequencer.lines)
            if subjects.shard_of(model_id, self.settings.n_shards) == shard
        ]
        for model_id in gone:
            self.sequencer.forget(model_id)
            self.snapshots.forget(model_id)  # its new owner snapshots it
            self.ops.failed.pop(model_id, None)  # its new owner finds out for itself
        loop = asyncio.get_running_loop()
        for model_id in gone:
            await loop.run_in_executor(self.executor, self.ops.release, model_id)
        if gone:
            log.info("shard %d: handed %d models over", shard, len(gone))

    async def _on_msg(self, msg: Msg) -> None:
        try:
            job = decode_job(msg.data)
        except msgspec.DecodeError:
            log.error("dropping undecodable op on %s", msg.subject)
            await msg.term()
            return
        if not self.sequencer.known(job.model_id) and not _creates(job):
            try:
                await self._take_over(job.model_id)
            except Unavailable:
                raise
            except Exception:
                # Raised again by every worker that would take the model over, each one exiting
                # (`WorkerBus.consume`): the model fails instead, from this op on.
                log.exception("model %s: taking it over failed", job.model_id)
                self.ops.failed[job.model_id] = (
                    "could not be taken over by a new worker (see the worker log)"
                )
                self.sequencer.start(job.model_id, applied_seq=job.seq_id - 1)
        stream_seq = msg.metadata.sequence.stream if msg.metadata.sequence else 0
        pending: Item = Pending(
            job=job, handle=msg, received_at=time.monotonic(), stream_seq=stream_seq
        )
        if not self.sequencer.offer(pending):
            if self.sequencer.attach(job, msg):
                return  # its replayed copy acks it when it has run
            await self.gaps.answer_late(job, self._store)
            await msg.ack()
            return
        self._wake.set()

    async def _take_over(self, model_id: str) -> None:
        """A model this worker has no line for: restore its snapshot, queue its logged ops
        (`workers.trainer.takeover`)."""
        loop = asyncio.get_running_loop()

        async def adopt(model_id: str, state: SlotState) -> None:
            await loop.run_in_executor(self.executor, self.ops.adopt, model_id, state)

        async def release(model_id: str) -> None:
            await loop.run_in_executor(self.executor, self.ops.release, model_id)

        await take_over(
            model_id,
            log_reader=self.log_reader,
            sequencer=self.sequencer,
            snapshots=self.snapshots,
            adopt=adopt,
            release=release,
            failed=self.ops.failed,
        )
        self._wake.set()

    async def _keepalive_loop(self) -> None:
        """Ops waiting in the sequencer or running stay un-acked; tell JetStream they live."""
        while True:
            await asyncio.sleep(self.settings.ack_wait_s / 3)
            for msg in [*self.sequencer.held(), *self._in_flight]:
                try:
                    await msg.in_progress()
                except Exception:
                    log.debug("in_progress failed", exc_info=True)

    # -- cycles ------------------------------------------------------------------------------

    async def _cycle_loop(self) -> None:
        wake_at: float | None = None  # when a rate-limited model may go on
        # The first cycle waits for the first lease round and then, briefly, for every claimed
        # shard's first fetch: a backlog waiting at start-up shares passes instead of running
        # shard by shard as the fetches come back.
        await self.leases.settled.wait()
        await asyncio.sleep(_STARTUP_GATHER_S)
        while True:
            timeout = min(5.0, self.settings.gap_timeout_s)
            if wake_at is not None:
                timeout = max(0.0, min(timeout, wake_at - time.time()))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.gaps.fail_stalled(self._finish_unsequenced)
            await self.gaps.redeliver()
            while True:
                cycles = self._plan()
                wakes = [cycle.wake_at for cycle in cycles if cycle.wake_at is not None]
                wake_at = min(wakes, default=None)
                if not any(cycles):
                    break
                for cycle in cycles:
                    if cycle:
                        await self._run_cycle(cycle)
            # Only once no op is ready: the op that woke this loop does not wait behind another
            # model's idle snapshot (one write per look; an op arriving during it waits for it).
            await self.journal.settle()
            await self.snapshots.idle()

    def _plan(self) -> list[Cycle[Msg | None]]:
        """The next cycles: one across every model, or one per model with merging off.

        The one place the scheduler is called. With `settings.merge` off each model's ready
        run is planned on its own, so a pass or a fused step never holds two models' work (the
        baseline that `bench/cluster_throughput.py` compares merging against).
        """
        ready = self.sequencer.ready()
        groups = [ready] if self.settings.merge else [{key: run} for key, run in ready.items()]
        now = time.time()
        return [
            plan(group, self.model.pass_tokens, now, self.fair_share.finish) for group in groups
        ]

    async def _run_cycle(self, cycle: Cycle[Msg | None]) -> None:
        started = time.perf_counter()
        if cycle.early_steps:
            await self._run(cycle.early_steps, self.ops.optim_steps)
        if cycle.shared_pass:
            self.pass_models.append(len({item.job.model_id for item in cycle.shared_pass}))
            self.fair_share.record(
                [
                    (item.job.tenant_id, item.job.model_id, item.job.n_tokens)
                    for item in cycle.shared_pass
                    if isinstance(item.job, ForwardBackwardJob)
                ]
            )
            await self._run(cycle.shared_pass, self.ops.shared_pass)
        if cycle.optim_steps:
            await self._run(cycle.optim_steps, self.ops.optim_steps)
        for item in cycle.settled:
            assert isinstance(item.job, TombstoneJob)
            await self._finish(item, settled_outcome(item.job))
        for item in cycle.others:
            await self._run([item], self.ops.other)
        elapsed_s = time.perf_counter() - started
        self.metrics.observe_cycle(elapsed_s)
        self.heartbeat.update_gauges()
        log.debug(
            "cycle: %d fwd, %d optim, %d other in %.1f ms",
            len(cycle.shared_pass),
            len(cycle.early_steps) + len(cycle.optim_steps),
            len(cycle.others),
            elapsed_s * 1e3,
        )

    async def _run(self, items: list[Item], fn: Callable[[list[Job]], list[Result]]) -> None:
        """Run `fn(items)` on the engine thread, then store each outcome and ack its op.

        A request that was running when a worker stopped runs alone; one that did so
        `max_attempts` times fails without running (`workers.watchdog`). An engine call that
        runs past `pass_timeout_s` stops this process: the thread cannot be interrupted, and
        the supervisor or another worker carries on, with these requests as suspects.
        """
        items = self._still_here(items)
        if not items:
            return
        suspects = [item for item in items if self._strikes(item)]
        if suspects and len(items) > 1:
            for item in suspects:
                await self._run([item], fn)
            rest = [item for item in items if not self._strikes(item)]
            if rest:
                await self._run(rest, fn)
            return
        if suspects and self._strikes(suspects[0]) >= self.settings.max_attempts:
            [item] = suspects
            strikes, request_id = self._strikes(item), item.job.request_id
            if item.replay == "quiet":  # its client has its result, and its model needs it
                await self._fail_model(
                    item.job.model_id,
                    f"stopped training: its worker stopped each of the {strikes} times it"
                    f" replayed request {request_id} to rebuild the model's state",
                )
            err = self.ops.failure(item.job.model_id) or ServerError(
                f"request {request_id} was running each of the {strikes} times a worker stopped"
                f" (past the {self.settings.pass_timeout_s:.0f} s limit of one pass, or a crash);"
                " it was not applied, and the model's later requests run without it"
            )
            await self._finish(item, failed_outcome(item.job, err))
            return
        loop = asyncio.get_running_loop()
        await self.journal.running([item.job.request_id for item in items])
        # Checked again right before the call: the engine thread runs in order, so a model
        # handed over from here on is released after this call (`_lose_shard`), never during it.
        items = self._still_here(items)
        if not items:
            self.journal.idle()
            return
        self._in_flight = [item.handle for item in items if item.handle is not None]
        try:
            results: list[Result] = await asyncio.wait_for(
                loop.run_in_executor(self.executor, fn, [item.job for item in items]),
                self.settings.pass_timeout_s,
            )
        except TimeoutError:
            stop_process(
                f"an engine call ran past {self.settings.pass_timeout_s:.0f} s",
                [item.job.request_id for item in items],
            )
        except Exception:
            # A pass or a fused step isolates engine faults per request inside `fn`
            # (`_transactions`); what gets here is a lone op of `_other` that crashed, or a
            # fault of the cycle's own code that no request can be blamed for.
            log.exception(
                "cycle of %d ops failed: %s",
                len(items),
                ", ".join(item.job.request_id for item in items),
            )
            err = ServerError("the worker failed while running this request; see the worker log")
            results = [(failed_outcome(item.job, err), None) for item in items]
        finally:
            self._in_flight = []
        for item, (outcome, ckpt) in zip(items, results, strict=True):
            await self._finish(item, outcome, ckpt)
        # Cleared only now, off the clients' path and after every op's snapshot: a stop before
        # here strikes these requests, finished or not (`_strikes`). Written with the next
        # call's list, or once nothing is ready (`_cycle_loop`).
        self.journal.idle()

    def _still_here(self, items: list[Item]) -> list[Item]:
        """The planned ops whose model is still this worker's. A shard handed over while a
        cycle runs (`_lose_shard`) takes its models' lines with it: their ops not yet run are
        left un-acked for the new owner, which rebuilds each model from its snapshot and log.
        Running one here would find its adapter released and answer its client an error."""
        kept = [item for item in items if self.sequencer.holds(item)]
        if len(kept) < len(items):
            log.info(
                "%d planned ops left to their models' new owner: %s",
                len(items) - len(kept),
                ", ".join(item.job.request_id for item in items if item not in kept),
            )
        return kept

    def _strikes(self, item: Item) -> int:
        """Times this request was running when a worker stopped. A finished one replayed to
        rebuild its model (`quiet`) counts too: the list stayed set while its snapshot was
        written, which its replay writes again. A settled one (`skip`) never runs."""
        if item.replay == "skip":
            return 0
        return self.journal.strikes.get(item.job.request_id, 0)

    async def _store(self, outcome: Outcome) -> None:
        await self.bus.put(
            subjects.BUCKET_FUTURES,
            subjects.future_key(outcome.request_id),
            encode_outcome(outcome),
        )
        self.metrics.op_finished(outcome.request_type, outcome.state, outcome.category)

    async def _finish(
        self, item: Item, outcome: Outcome, checkpoint: CheckpointRecord | None = None
    ) -> None:
        """Store the outcome (not for a replayed op whose client has it) and the checkpoint
        record of a save, ack, move the line, then what follows the op (a snapshot).

        A fault in any of these is the op's, not the process's: an op whose outcome could not
        be stored fails instead, and its model with it if the op changed it (a failed op must
        have changed nothing); a fault after the outcome is stored fails the model, and so does
        a replay that fails to rebuild a state its client was told of. Only the bus staying
        away (`Unavailable`) goes on up.
        """
        job = item.job
        publish = item.replay in ("", "publish")
        try:
            if checkpoint is not None and publish:
                key = subjects.checkpoint_key(checkpoint.run_id, checkpoint.checkpoint_id)
                await self.bus.put(subjects.BUCKET_CHECKPOINTS, key, records.encode(checkpoint))
            if publish:
                # Sent together, the entry first on the one connection: a worker that dies
                # before both went out leaves the op to a replay that publishes both, the entry
                # stored once (its message id); one bus round trip per op, not two.
                await both(self._keep_metrics(job, outcome), self._store(outcome))
        except Unavailable:
            raise
        except Exception:
            log.exception("op %s of %s: storing its outcome failed", job.request_id, job.model_id)
            outcome = await self._unanswered(item, outcome)
        if (
            item.replay == "quiet"
            and outcome.state != "done"
            and job.model_id not in self.ops.failed
            and self.sequencer.holds(item)
        ):
            log.error(
                "op %s of %s failed in its replay: %s", job.request_id, job.model_id, outcome.error
            )
            await self._fail_model(
                job.model_id,
                f"stopped training: its request {job.request_id} failed when replayed to rebuild"
                " its state on a new worker (see the worker log)",
            )
        await self._ack(item)
        if outcome.state == "done" and publish:
            self._count(job)
        if not self.sequencer.holds(item):
            # Handed over while it ran: its new owner rebuilds the model from the snapshot and
            # the log (this op included) and snapshots it; a snapshot or a failure noted here
            # would outlive the handover, and a line this worker opened since is not this op's.
            return
        self.sequencer.applied(job)
        self.snapshots.applied(item)  # the idle snapshot stands at the last op
        if outcome.state == "done":
            try:
                await self.snapshots.after(item)
            except Unavailable:
                raise
            except Exception:
                log.exception("op %s of %s: what follows it failed", job.request_id, job.model_id)
                await self._fail_model(
                    job.model_id,
                    f"stopped training: its worker failed after request {job.request_id} had"
                    " run, writing its state (see the worker log)",
                )
        if isinstance(job, UnloadModelJob):
            for stale in self.sequencer.close(job.model_id):
                err = Gone(f"model_id {stale.job.model_id!r} was unloaded before this request ran")
                await self._finish_unsequenced(stale, failed_outcome(stale.job, err))

    async def _unanswered(self, item: Item, outcome: Outcome) -> Outcome:
        """Fail an op whose outcome (or checkpoint record) could not be stored; the outcome
        that stands for it now. If it changed its model, the model fails too."""
        if outcome.state == "done" and changes_state(item.job) and self.sequencer.holds(item):
            await self._fail_model(
                item.job.model_id,
                f"stopped training: its worker failed to store the result of request"
                f" {item.job.request_id} (see the worker log)",
            )
        err = self.ops.failure(item.job.model_id) or ServerError(
            "the worker failed while storing this request's result; see the worker log"
        )
        failed = failed_outcome(item.job, err)
        try:
            await self._store(failed)
        except Unavailable:
            raise
        except Exception:
            log.exception("op %s: its failure could not be stored either", item.job.request_id)
        return failed

    async def _ack(self, item: Item) -> None:
        if item.handle is None:
            return
        try:
            await item.handle.ack()
        except Exception:
            # delivered again later, and answered as the duplicate it is (`Gaps.answer_late`)
            log.warning("op %s: its ack failed", item.job.request_id, exc_info=True)

    async def _fail_model(self, model_id: str, why: str) -> None:
        """Every later request of `model_id` here fails, saying `why`; its adapter goes. After
        a handover its new owner rebuilds it from its snapshot and log (`_lose_shard` forgets
        the failure), and meets the fault again if it is the model's own."""
        log.error("model %s %s; its later requests here fail", model_id, why)
        self.ops.failed[model_id] = why
        self.snapshots.forget(model_id)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.executor, self.ops.release, model_id)
        except Exception:
            log.exception("model %s: releasing its adapter failed", model_id)

    async def _capture(self, model_id: str) -> SlotState:
        """A host copy of the model's state (on the engine thread), for its snapshot."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.ops.capture, model_id)

    def _count(self, job: Job) -> None:
        """Usage of a completed op, by its tenant."""
        if isinstance(job, ForwardBackwardJob):
            tokens = "tokens_forward" if job.forward_only else "tokens_trained"
            self.usage.add(job.tenant_id, forward_backward_requests=1, **{tokens: job.n_tokens})
        elif isinstance(job, OptimStepJob):
            self.usage.add(job.tenant_id, optim_steps=1)

    async def _keep_metrics(self, job: Job, outcome: Outcome) -> None:
        """Add a finished op's metrics to its run's history (`protocol.metric_history`); a
        failure here loses that entry only, never the op."""
        try:
            entry = metric_history.entry_of(job, outcome)
            if entry is None:
                return
            await self.bus.publish_once(
                subjects.metrics_subject(job.model_id),
                metric_history.encode(entry),
                f"metrics-{job.request_id}",
            )
        except Unavailable:
            raise
        except Exception:
            log.exception(
                "op %s of %s: its metric history entry was lost", job.request_id, job.model_id
            )

    async def _finish_unsequenced(self, item: Item, outcome: Outcome) -> None:
        """Store an outcome and ack, for an op whose model's line is gone."""
        if item.replay in ("", "publish"):
            await self._store(outcome)
        await self._ack(item)
