"""State snapshots: a model's whole adapter state on disk, so another worker can carry on.

A snapshot holds what a slot holds (weights, both Adam moments, pending gradients, step count,
scales, LoRA config; see `parking.SlotState`) and where in the model's op log it stands: the
last applied `seq_id` and that op's stream sequence in `TW_OPS`. It is taken after an
`optim_step` every `snapshot_every` steps, but no sooner than `snapshot_min_s` after the model's
previous one (steps of a few milliseconds would otherwise pay a capture every few steps: a crash
replays at most that much more training), after every `save_state`, and once a model that
changed since its snapshot has been idle for `snapshot_idle_s` (the ops log, which keeps what
its limits allow, then need not reach back far for it).

Layout: `<checkpoint root>/<run_id>/.state/state-<seq>.safetensors` (one tensor per stored
buffer row) and `state-<seq>.json` (everything else). Files are written under temporary names
and renamed; then the `SnapshotRecord` in KV moves to them (the commit point); then older files
go. A reader trusts only the record, so a crash at any point leaves the previous snapshot whole.
The directory starts with '.', which no checkpoint kind or name does. With an artifact store
(`workers.artifacts`) the same files go up under a key of their own
(`protocol.paths.snapshot_key`), and the record names the key.

`Snapshots` decides when a model is snapshotted (after ops, and when idle) and writes, reads and
prunes its snapshots; the trainer service (`workers.trainer.service`) calls it after each op
and between cycles. A write is on the crash journal by its model (`workers.watchdog`): one that
stopped the worker `max_attempts` times in a row fails the model instead of stopping it again.

The next op waits for the capture (a copy of the slot on the engine thread) and the files'
write (a fault there fails the model: it would fail again on every try). The upload to an
artifact store and the record follow in a task of their own, one per model at a time, beside
the model's next ops (a snapshot due while the model's previous one is still going up waits for
the next optim_step). A fault there fails no op and no model: the model stays unsnapped and its
snapshot due. A store that is away (killed, frozen, unreachable:
`workers.artifacts`) holds no op up either, and while it is known to be away no snapshot is
tried. Looks at the store run on a thread of their own, one every `_LOOK_EVERY_S` at most; once
it answers, the next snapshot due is written (the model's next optim_step or save_state, or its
idle snapshot). Recovery meanwhile: the snapshot record still names the model's last snapshot
written, so a takeover restores that older one and replays the log from it, which works as long
as the log still reaches back to it (the longer the outage, the more it replays; ops its limits
trimmed are lost: `workers.trainer.takeover`). A takeover that cannot read the snapshot either
(the store still away) fails after the store's wait (`artifact_store_wait_s`) and rebuilds the
model from its log alone, which works only while the log still holds the model's creation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import safetensors.torch

from protocol import paths, records, subjects
from protocol.api import LoraConfig
from protocol.errors import ServerError, Unavailable
from protocol.jobs import OptimStepJob, SaveWeightsJob, UnloadModelJob
from protocol.records import SnapshotRecord
from workers.artifacts import ArtifactStore, ArtifactStoreUnavailable, staging_dir
from workers.bus import WorkerBus
from workers.engine.lora import LAYER_GROUPS, LayerGroup
from workers.settings import WorkerSettings
from workers.trainer.parking import HostRow, SlotState
from workers.trainer.recovery import changes_state
from workers.trainer.sequencer import Pending, Sequencer
from workers.watchdog import CrashJournal, snapshot_step

log = logging.getLogger(__name__)

Item = Pending[Any]

STATE_DIR = ".state"
_LOOK_EVERY_S = 2.0  # looks at an artifact store that is away, at most this often


def state_dir(root: Path, run_id: str) -> Path:
    return root / run_id / STATE_DIR


def write_state(directory: Path, seq_id: int, state: SlotState, meta: dict[str, Any]) -> Path:
    """Write one snapshot's files; returns the JSON file's path (the snapshot's name)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"state-{seq_id}"
    tensors = {name: row.values.contiguous() for name, row in state.rows.items()}
    body = {
        **meta,
        "spec": msgspec.structs.asdict(state.spec),
        "lora_alpha": state.lora_alpha,
        "step": state.step,
        "scales": state.scales,
        "whole_rows": {name: row.whole_row for name, row in state.rows.items()},
    }
    weights = directory / f"{stem}.safetensors"
    temporary = weights.with_name(weights.name + ".tmp")
    safetensors.torch.save_file(tensors, str(temporary))
    os.replace(temporary, weights)
    described = directory / f"{stem}.json"
    temporary = described.with_name(described.name + ".tmp")
    temporary.write_text(json.dumps(body))
    os.replace(temporary, described)
    return described


def read_state(described: Path) -> SlotState:
    """A snapshot as a slot state, ready to be adopted; a missing or broken file is our fault."""
    try:
        body = json.loads(described.read_text())
        tensors = safetensors.torch.load_file(str(described.with_suffix(".safetensors")))
        spec = msgspec.convert(body["spec"], LoraConfig)
        scales: dict[LayerGroup, float] = {
            group: float(body["scales"][group]) for group in LAYER_GROUPS
        }
        rows = {
            name: HostRow(values=tensors[name], whole_row=bool(whole))
            for name, whole in body["whole_rows"].items()
        }
        return SlotState(
            spec=spec,
            lora_alpha=float(body["lora_alpha"]),
            step=int(body["step"]),
            scales=scales,
            rows=rows,
        )
    except (OSError, KeyError, ValueError, msgspec.ValidationError) as err:
        raise ServerError(f"state snapshot {described} is unreadable: {err}") from err


def prune(directory: Path, keep: Path) -> None:
    """Remove the directory's snapshot files older than `keep` (a lower seq). Newer ones, and
    files being written, may be another worker's: the model's next owner after a handover."""
    kept = _seq_of(keep.name)
    for path in directory.glob("state-*"):
        seq = _seq_of(path.name)
        if seq is not None and kept is not None and seq < kept:
            path.unlink(missing_ok=True)


def _seq_of(name: str) -> int | None:
    """The seq in a snapshot file's name (`state-<seq>.json`, `.safetensors`, `.tmp`)."""
    digits = name.removeprefix("state-").split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


class Snapshots:
    """When each model of this worker is snapshotted, and its snapshots' files and record.

    `capture` copies a model's state on the engine thread; `has` says whether the model has an
    adapter here; `fail_model` fails a model whose snapshot keeps stopping the worker.
    """

    def __init__(
        self,
        bus: WorkerBus,
        settings: WorkerSettings,
        store: ArtifactStore | None,
        journal: CrashJournal,
        sequencer: Sequencer[Any],
        *,
        capture: Callable[[str], Awaitable[SlotState]],
        has: Callable[[str], bool],
        fail_model: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.store = store
        self.journal = journal
        self.sequencer = sequencer
        self.capture = capture
        self.has = has
        self.fail_model = fail_model
        self._steps_since: dict[str, int] = {}
        self._taken_at: dict[str, float] = {}  # by model: when its last snapshot was captured
        # models changed since their snapshot: their last applied op, and when it was applied
        self._unsnapped: dict[str, tuple[Item, float]] = {}
        self._writes: dict[str, asyncio.Task[None]] = {}  # by model: at most one at a time
        # every write task until it ends (`_writes` forgets a model's on a handover)
        self._tasks: set[asyncio.Task[None]] = set()
        self._look: asyncio.Future[bool] | None = None  # at an artifact store that is away
        self._looked_at = 0.0

    def forget(self, model_id: str) -> None:
        """The model is no longer this worker's to snapshot (handed over, failed, unloaded)."""
        self._steps_since.pop(model_id, None)
        self._taken_at.pop(model_id, None)
        self._unsnapped.pop(model_id, None)
        self._writes.pop(model_id, None)  # one still being written records nothing

    def applied(self, item: Item) -> None:
        """An op of the model ran: an idle snapshot now stands at it."""
        if item.job.model_id in self._unsnapped:
            self._unsnapped[item.job.model_id] = (item, time.monotonic())

    async def after(self, item: Item) -> None:
        """Snapshot a model after every `snapshot_every`-th optim_step (once `snapshot_min_s`
        has passed since its last snapshot; until then it stays due) and every save_state."""
        job = item.job
        if changes_state(job) and not isinstance(job, UnloadModelJob):
            self._unsnapped[job.model_id] = (item, time.monotonic())
        if isinstance(job, OptimStepJob):
            count = self._steps_since.get(job.model_id, 0) + 1
            self._steps_since[job.model_id] = count
            since_s = time.monotonic() - self._taken_at.get(job.model_id, -math.inf)
            if count >= self.settings.snapshot_every and since_s >= self.settings.snapshot_min_s:
                await self.take(item)
        elif isinstance(job, SaveWeightsJob) and job.kind == "weights":
            await self.take(item)
        elif isinstance(job, UnloadModelJob):
            self.forget(job.model_id)
            await self.bus.delete(subjects.BUCKET_RUNS, subjects.snapshot_key(job.model_id))

    async def take(self, item: Item, current: Callable[[], bool] = lambda: True) -> None:
        """Capture the model's state as of this op; its files and record follow in a task.

        `current`: whether the op is still the model's latest here (asked again before the
        record moves; an idle snapshot runs between cycles, and the shard may move meanwhile).
        The capture is all the next op waits for: the files are written (and uploaded) and the
        record moved beside the model's next ops (`_persist`), one write per model at a time.
        """
        model_id = item.job.model_id
        if not item.stream_seq or not self.has(model_id):
            return
        if model_id in self._writes or (self.store is not None and self.store.away):
            # not now: the model's previous snapshot is still being written, or the store is
            # away (until a look finds it back); the model stays unsnapped, its snapshot due
            self._steps_since[model_id] = self.settings.snapshot_every
            if self.store is not None and self.store.away:
                self._look_again()
            return
        step = snapshot_step(model_id)
        strikes = self.journal.strikes.get(step, 0)
        if strikes >= self.settings.max_attempts:
            await self.fail_model(
                model_id,
                f"stopped training: writing its state snapshot stopped the worker each of the"
                f" last {strikes} times",
            )
            return
        # On the journal from the capture until the record moved: a stop in between strikes it.
        await self.journal.enter(step)
        try:
            written = await self._write(item)
        except BaseException:
            await self.journal.leave(step)
            raise
        self._steps_since[model_id] = 0  # due again at once if it is not recorded (`_record`)
        self._taken_at[model_id] = time.monotonic()
        record = asyncio.create_task(self._record(item, written, current, step))
        self._writes[model_id] = record
        self._tasks.add(record)
        record.add_done_callback(self._tasks.discard)

    async def _write(self, item: Item) -> tuple[int, Path]:
        """Capture the model's state and write its files (to a staging directory when they go
        to an artifact store); returns the state's step and the JSON file's path."""
        model_id = item.job.model_id
        seq_id = item.job.seq_id
        state = await self.capture(model_id)
        meta = {"model_id": model_id, "seq_id": seq_id, "stream_seq": item.stream_seq}
        if self.store is None:
            directory = state_dir(self.settings.checkpoint_root, model_id)
        else:
            directory = await asyncio.to_thread(staging_dir, self.settings.data_dir, "state")
        try:
            written = await asyncio.to_thread(write_state, directory, seq_id, state, meta)
        except BaseException:
            if self.store is not None:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        return state.step, written

    async def settle(self) -> None:
        """Wait until every snapshot under way is recorded (or has failed)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the uploads still going (a clean stop): their snapshots stay due, and the
        model's next owner snapshots it."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _look_again(self) -> None:
        """Start a look at the artifact store that is away, on a thread of its own so that no
        cycle waits for it (a frozen store takes 2 s to give up). Its answer ends the outage
        (`ArtifactStore.away`); the next snapshot due then writes."""
        assert self.store is not None
        now = time.monotonic()
        if (self._look is not None and not self._look.done()) or (
            now - self._looked_at < _LOOK_EVERY_S
        ):
            return
        self._looked_at = now
        self._look = asyncio.get_running_loop().run_in_executor(None, self.store.reachable)
        self._look.add_done_callback(_look_failed)

    def read(self, snapshot: SnapshotRecord) -> SlotState:
        """A snapshot's state, from the artifact store (through the cache) or the local disk."""
        if not snapshot.store_key:
            return read_state(Path(snapshot.directory))
        if self.store is None:
            raise ServerError(
                f"snapshot {snapshot.store_key!r} is in an artifact store; this worker has none"
                " (--artifact-store)"
            )
        directory = self.store.download(snapshot.store_key)
        return read_state(directory / f"state-{snapshot.applied_seq}.json")

    def _prune(self, model_id: str, written: str, key: str) -> None:
        """Remove a model's snapshots older than the one just recorded."""
        if self.store is None:
            prune(state_dir(self.settings.checkpoint_root, model_id), Path(written))
            return
        kept = paths.snapshot_seq(key)
        try:
            for older in self.store.children(paths.snapshot_prefix(model_id), wait_s=0):
                seq = paths.snapshot_seq(older)
                if seq is not None and kept is not None and seq < kept:
                    self.store.delete(older, wait_s=0)
        except ArtifactStoreUnavailable as err:
            log.warning("model %s: older snapshots stay until the next prune: %s", model_id, err)

    async def _record(
        self, item: Item, written: tuple[int, Path], current: Callable[[], bool], step: str
    ) -> None:
        """Put a snapshot's written files up to the store (if any), then point the model's
        record at them, unless the model left this worker meanwhile (`forget`) or an op
        changed it since (`current`; its files go with the next prune). Any fault, a store
        away first of all, leaves the model unsnapped and its snapshot due: no op and no model
        fails for it."""
        model_id = item.job.model_id
        task = asyncio.current_task()
        state_step, files = written

        def still_ours() -> bool:
            return self._writes.get(model_id) is task and self.sequencer.known(model_id)

        try:
            if self.store is None:
                if still_ours() and current():
                    await self._commit(item, state_step, str(files), "")
            else:
                key = paths.snapshot_key(model_id, item.job.seq_id, uuid.uuid4().hex[:12])
                await asyncio.to_thread(_upload_files, self.store, key, files.parent)
                if still_ours() and current():
                    await self._commit(item, state_step, "", key)
            await self.journal.forgive(step)
        except (ArtifactStoreUnavailable, Unavailable) as err:
            log.warning("model %s: state snapshot not written, due again: %s", model_id, err)
            if self._writes.get(model_id) is task:
                self._steps_since[model_id] = self.settings.snapshot_every
        except Exception:
            log.exception("model %s: state snapshot not written, due again", model_id)
            if self._writes.get(model_id) is task:
                self._steps_since[model_id] = self.settings.snapshot_every
        finally:
            # a crash never gets here: its step stays on the journal, and strikes
            if self._writes.get(model_id) is task:
                del self._writes[model_id]
            await self.journal.leave(step)

    async def _commit(self, item: Item, step: int, written: str, key: str) -> None:
        """Point the model's snapshot record at the files written for `item`, then prune the
        older ones. The model stays unsnapped if an op changed it since."""
        model_id = item.job.model_id
        record = SnapshotRecord(
            model_id=model_id,
            applied_seq=item.job.seq_id,
            stream_seq=item.stream_seq,
            directory=written,
            step=step,
            created_at=time.time(),
            worker_id=self.settings.worker_id,
            store_key=key,
        )
        await self.bus.put(
            subjects.BUCKET_RUNS, subjects.snapshot_key(model_id), records.encode(record)
        )
        await asyncio.to_thread(self._prune, model_id, written, key)
        found = self._unsnapped.get(model_id)
        if found is not None and found[0] is item:
            del self._unsnapped[model_id]

    async def idle(self) -> None:
        """Snapshot each model idle for `snapshot_idle_s` since an op changed it. Its ops after
        its snapshot must stay in the log until the next one, and the log keeps only what its
        limits allow, whatever tenant filled it: an idle model would otherwise need ops from
        long ago (and be lost on a takeover if they were trimmed: `workers.trainer.takeover`)."""
        now = time.monotonic()
        for model_id, (item, applied_at) in list(self._unsnapped.items()):
            if now - applied_at < self.settings.snapshot_idle_s:
                continue
            if self.sequencer.pending(model_id):
                continue  # not idle: its next op snapshots when it is

            def current(model_id: str = model_id, item: Item = item) -> bool:
                found = self._unsnapped.get(model_id)
                return found is not None and found[0] is item and self.sequencer.known(model_id)

            try:
                await self.take(item, current)
            except Exception:
                log.exception("model %s: idle snapshot failed; trying again later", model_id)
                if current():
                    self._unsnapped[model_id] = (item, time.monotonic())
            return  # one model per look: the others' cycles wait for no more than one write


def _upload_files(store: ArtifactStore, key: str, staging: Path) -> None:
    """A snapshot's staged files up to the store under `key` (one try: a store that is away
    fails it at once), then gone from the disk either way."""
    try:
        store.upload(key, staging, wait_s=0)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _look_failed(look: asyncio.Future[bool]) -> None:
    """A look at the store that raised (a bug, not an outage: an outage is a False)."""
    if not look.cancelled() and look.exception() is not None:
        log.error("artifact store: a look failed", exc_info=look.exception())
