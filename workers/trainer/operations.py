"""The engine-thread side of the trainer worker: jobs in, outcomes out, all synchronous.

`TrainerService` (transport, ordering, cycles) hands each planned group of jobs to one of these
methods on the engine's single thread: `shared_pass` (every forward/forward_backward of a cycle,
across tenants), `optim_steps` (the cycle's fused step), `other` (create, save, load, unload, a
tombstone, an adapter import or a merged export: `workers.trainer.transfer`). Each returns one
outcome per job, in order, with a checkpoint record where a save wrote one.

The way of a forward_backward through here, each step once:
Step 1: decode the job's body (`protocol.tensors.decode_forward_backward`, under the job's
        element budget) and validate it on the model, which looks its loss up
        (`MultiSlotModel.validate`); a bad job fails alone with a `user` error.
Step 2: split the valid ones into transactions of at most `max_slots` tenants
        (`Residency.sub_calls`).
Step 3: per transaction, take the tenants' slots (`Residency.resident`, restoring parked ones)
        and run one shared pass on them (`MultiSlotModel.forward_backward`); a transaction that
        raises is re-run in halves until the jobs that make it fail are alone
        (`workers.engine.isolation`).
Step 4: encode each result as the job's outcome.

Checkpoints are written in the PEFT layout under the checkpoint root (`protocol.paths`); an
overwrite first moves the name's current content to its version directory, where sampling
sessions bound to it keep reading it. With an artifact store (`workers.artifacts`) a save is
written to a staging directory and uploaded as a new content of its name (nothing is moved),
and a load reads the content its job names through the worker's cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from protocol import api, stability
from protocol.errors import ServerError, TwinkleError, UserError
from protocol.jobs import (
    CreateModelJob,
    ExportMergedJob,
    ForwardBackwardJob,
    ImportAdapterJob,
    Job,
    LoadWeightsJob,
    OptimStepJob,
    Outcome,
    SaveWeightsJob,
    TombstoneJob,
    UnloadModelJob,
    request_type_of,
)
from protocol.paths import (
    CONTENT_ID_FILE,
    TinkerPath,
    checkpoint_dir,
    checkpoint_key,
    checkpoint_name_key,
    parse_path,
    version_dir,
)
from protocol.records import CheckpointRecord
from protocol.rules import check_adam
from protocol.tensors import FwdBwdOutput, decode_forward_backward, encode_forward_backward_output
from workers.artifacts import ArtifactStore, staging_dir
from workers.engine.isolation import isolate
from workers.engine.model import MultiSlotModel
from workers.engine.passes import Checked
from workers.metrics import TrainerMetrics
from workers.settings import WorkerSettings
from workers.trainer.parking import SlotState
from workers.trainer.residency import Residency
from workers.trainer.transfer import export_merged, import_adapter

Result = tuple[Outcome, CheckpointRecord | None]
C = TypeVar("C")  # one engine call's item: (model_id, request) or (model_id, AdamParams)
R = TypeVar("R")


def _outcome(job: Job, state: Literal["done", "error"], **fields: Any) -> Outcome:
    return Outcome(
        request_id=job.request_id,
        state=state,
        request_type=request_type_of(job),
        model_id=job.model_id,
        finished_at=time.time(),
        tenant_id=job.tenant_id,
        **fields,
    )


def done_outcome(job: Job, payload: bytes, payload_type: str = "json") -> Outcome:
    return _outcome(job, "done", payload=payload, payload_type=payload_type)


def failed_outcome(job: Job, err: TwinkleError) -> Outcome:
    return _outcome(job, "error", error=err.message, category=err.category)


def settled_outcome(job: TombstoneJob) -> Outcome:
    """The outcome the gateway already stored for a refused call (written again: idempotent)."""
    return _outcome(job, "error", error=job.error, category=job.category)


def _seeded(job: CreateModelJob) -> api.LoraConfig:
    """The job's LoRA config with a seed: its own, else one drawn from its request id. So a
    create draws the same adapter on every rank of a worker group, and again when a new owner
    replays it to rebuild the model."""
    if job.lora.seed is not None:
        return job.lora
    seed = int.from_bytes(hashlib.sha256(job.request_id.encode()).digest()[:4], "big") >> 1
    return msgspec.structs.replace(job.lora, seed=seed)


def run_passes(
    model: MultiSlotModel, residency: Residency, calls: Sequence[tuple[str, Checked]]
) -> list[FwdBwdOutput | TwinkleError]:
    """Step 3 of one transaction: the calls' tenants take their slots, then one shared pass."""
    tenants = residency.resident([model_id for model_id, _ in calls])
    return model.forward_backward([checked for _, checked in calls], [t.slot for t in tenants])


def run_steps(
    model: MultiSlotModel, residency: Residency, steps: Sequence[tuple[str, api.AdamParams]]
) -> list[dict[str, float] | TwinkleError]:
    """One fused optimizer step of one transaction (each model once, its settings checked)."""
    model_ids = [model_id for model_id, _ in steps]
    if len(set(model_ids)) < len(model_ids):
        raise ServerError(f"optim_step lists a model_id twice in one step: {model_ids}")
    tenants = residency.resident(model_ids)
    return model.optim_step([t.slot for t in tenants], [adam for _, adam in steps])


def transactions(
    residency: Residency,
    run: Callable[[list[C]], Sequence[R]],
    calls: list[C],
    model_ids: list[str],
    describe: Callable[[int], str] = str,
) -> list[R | TwinkleError]:
    """`run(calls)` one transaction at a time (Step 2: `Residency.sub_calls`, split once); a
    transaction that raises has changed nothing and is re-run in halves until the calls that
    make it fail are alone (`workers.engine.isolation`), so only those fail."""
    results: dict[int, R | TwinkleError] = {}
    for group in residency.sub_calls(model_ids):
        outputs = isolate(
            lambda indices: run([calls[i] for i in indices]), group, describe=describe
        )
        results.update(zip(group, outputs, strict=True))
    return [results[i] for i in range(len(calls))]


class TrainerOps(Protocol):
    """Every call the trainer service makes on the engine thread: the jobs of a cycle, and the
    state moves of a takeover, a handover and a snapshot. `EngineOps` runs them on this
    process's model; a worker group's rank 0 runs them on every rank (`workers.group.mirror`)."""

    model: MultiSlotModel
    residency: Residency
    metrics: TrainerMetrics
    store: ArtifactStore | None
    failed: dict[str, str]

    def failure(self, model_id: str) -> ServerError | None: ...
    def shared_pass(self, jobs: list[Job]) -> list[Result]: ...
    def optim_steps(self, jobs: list[Job]) -> list[Result]: ...
    def other(self, jobs: list[Job]) -> list[Result]: ...
    def release(self, model_id: str) -> None: ...
    def adopt(self, model_id: str, state: SlotState) -> None: ...
    def capture(self, model_id: str) -> SlotState: ...


class EngineOps:
    """Runs planned jobs on the model and its slots; see the module docstring."""

    def __init__(
        self,
        model: MultiSlotModel,
        residency: Residency,
        settings: WorkerSettings,
        metrics: TrainerMetrics | None = None,
        *,
        writes: bool = True,
    ) -> None:
        self.model = model
        self.residency = residency
        self.settings = settings
        # Whether this process writes checkpoint files and uploads: every rank of a worker group
        # runs the same jobs (`workers.group.mirror`) for the collectives inside; rank 0 writes.
        self.writes = writes
        self.metrics = metrics if metrics is not None else TrainerMetrics()
        self.store = settings.open_store()  # None: files under `settings.checkpoint_root`
        # Models whose every request fails here, and why: their state could not be recovered,
        # or stopped matching what their clients were told (`TrainerService._fail_model`).
        self.failed: dict[str, str] = {}

    def failure(self, model_id: str) -> ServerError | None:
        """The error every request of a failed model answers; None for a model that is fine."""
        why = self.failed.get(model_id)
        if why is None:
            return None
        return ServerError(
            f"model_id {model_id!r} {why}; load your last checkpoint (list_checkpoints) into a"
            " new training client"
        )

    # The state moves the service makes outside the jobs (they are the calls a group mirrors).

    def release(self, model_id: str) -> None:
        """Forget a model's adapter (handed over, failed, or half-adopted)."""
        self.residency.release(model_id)

    def adopt(self, model_id: str, state: SlotState) -> None:
        """Take a snapshot's state as the model's adapter (a takeover)."""
        self.residency.adopt(model_id, state)

    def capture(self, model_id: str) -> SlotState:
        """A host copy of the model's state, for its snapshot."""
        return self.residency.capture(model_id)

    def _require_model(self, job: Job) -> None:
        failure = self.failure(job.model_id)
        if failure is not None:
            raise failure
        if not self.residency.has(job.model_id):
            raise UserError(
                f"model_id {job.model_id!r} is not loaded (its create_model or load failed)"
            )

    def shared_pass(self, jobs: list[Job]) -> list[Result]:
        outcomes: dict[int, Outcome] = {}
        calls: list[tuple[str, Checked]] = []
        called: list[int] = []
        for i, job in enumerate(jobs):
            assert isinstance(job, ForwardBackwardJob)
            try:  # Step 1
                self._require_model(job)
                request = decode_forward_backward(
                    job.body, job.max_elements, job.custom_loss, vision=self.model.geometry
                )
                if request.loss_fn == stability.LOSS_NAME:
                    stability.apply_slices(request, stability.decode_slices(job.provenance))
                calls.append((job.model_id, self.model.validate(request)))
            except TwinkleError as err:
                outcomes[i] = failed_outcome(job, err)
                continue
            called.append(i)
        if calls:
            started = time.perf_counter()
            results = transactions(  # Steps 2 and 3
                self.residency,
                lambda group: run_passes(self.model, self.residency, group),
                calls,
                [model_id for model_id, _ in calls],
                describe=lambda n: jobs[called[n]].request_id,
            )
            self.metrics.observe_pass(
                time.perf_counter() - started,
                tokens=sum(checked.request.n_tokens for _, checked in calls),
                tenants=len({model_id for model_id, _ in calls}),
            )
            for i, result in zip(called, results, strict=True):  # Step 4
                if isinstance(result, TwinkleError):
                    outcomes[i] = failed_outcome(jobs[i], result)
                    continue
                payload = encode_forward_backward_output(
                    result.loss_fn_outputs, result.metrics, result.loss_fn_output_type
                )
                outcomes[i] = done_outcome(jobs[i], payload, "proto")
        return [(outcomes[i], None) for i in range(len(jobs))]

    def optim_steps(self, jobs: list[Job]) -> list[Result]:
        outcomes: dict[int, Outcome] = {}
        steps: list[tuple[str, api.AdamParams]] = []
        called: list[int] = []
        discards: list[int] = []
        for i, job in enumerate(jobs):
            assert isinstance(job, OptimStepJob)
            try:
                self._require_model(job)
                check_adam(job.adam)
            except TwinkleError as err:
                outcomes[i] = failed_outcome(job, err)
                continue
            if job.discard:
                discards.append(i)
                continue
            steps.append((job.model_id, job.step_adam()))
            called.append(i)
        if discards:
            ids = [jobs[i].model_id for i in discards]
            cleared = transactions(
                self.residency,
                lambda group: self.model.discard_gradients(
                    [t.slot for t in self.residency.resident(group)]
                ),
                ids,
                ids,
                describe=lambda n: jobs[discards[n]].request_id,
            )
            for i, verdict in zip(discards, cleared, strict=True):
                outcomes[i] = (
                    failed_outcome(jobs[i], verdict)
                    if isinstance(verdict, TwinkleError)
                    else done_outcome(jobs[i], api.encode(api.OptimStepResponse(metrics={})))
                )
        if steps:
            started = time.perf_counter()
            results = transactions(
                self.residency,
                lambda group: run_steps(self.model, self.residency, group),
                steps,
                [model_id for model_id, _ in steps],
                describe=lambda n: jobs[called[n]].request_id,
            )
            self.metrics.observe_optim_step(time.perf_counter() - started)
            for i, result in zip(called, results, strict=True):
                if isinstance(result, TwinkleError):
                    outcomes[i] = failed_outcome(jobs[i], result)
                else:
                    outcomes[i] = done_outcome(
                        jobs[i], api.encode(api.OptimStepResponse(metrics=result))
                    )
        return [(outcomes[i], None) for i in range(len(jobs))]

    def other(self, jobs: list[Job]) -> list[Result]:
        (job,) = jobs
        try:
            if isinstance(job, CreateModelJob):
                if not self.residency.has(job.model_id):
                    self.residency.create(job.model_id, _seeded(job))
                return [
                    (
                        done_outcome(
                            job, api.encode(api.CreateModelResponse(model_id=job.model_id))
                        ),
                        None,
                    )
                ]
            if isinstance(job, SaveWeightsJob):
                return [self._save(job)]
            if isinstance(job, TombstoneJob):
                return [(settled_outcome(job), None)]
            if isinstance(job, LoadWeightsJob):
                return [(self._load(job), None)]
            if isinstance(job, UnloadModelJob):
                return [self._unload(job)]
            root = self.settings.checkpoint_root
            data_dir = self.settings.data_dir
            if not self.writes and isinstance(job, ImportAdapterJob | ExportMergedJob):
                # files only, no slot: rank 0 of a group writes them alone
                return [(done_outcome(job, b"{}"), None)]
            if isinstance(job, ImportAdapterJob):
                answer, record = import_adapter(
                    self.model, self.residency, root, job, self.store, data_dir
                )
                return [(done_outcome(job, api.encode(answer)), record)]
            if isinstance(job, ExportMergedJob):
                exported = export_merged(
                    self.model, self.residency, root, job, self.store, data_dir
                )
                return [(done_outcome(job, api.encode(exported)), None)]
            raise ServerError(f"op {type(job).__name__} cannot run here")
        except TwinkleError as err:
            return [(failed_outcome(job, err), None)]

    def _checkpoint_dir(self, path: TinkerPath) -> Path:
        return checkpoint_dir(self.settings.checkpoint_root, path)

    def _retire(self, path: TinkerPath, directory: Path) -> None:
        """Move a checkpoint's current content aside before an overwrite replaces it.

        Sampling sessions bound to that content keep reading it from its version directory.
        """
        id_file = directory / CONTENT_ID_FILE
        old_id = id_file.read_text().strip() if id_file.exists() else ""
        target = version_dir(self.settings.checkpoint_root, path, old_id or "unversioned")
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(directory, target)

    def _save(self, job: SaveWeightsJob) -> tuple[Outcome, CheckpointRecord | None]:
        self._require_model(job)
        path = TinkerPath(run_id=job.model_id, kind=job.kind, name=job.name)
        if self.store is not None:
            exists = self.store.exists(checkpoint_name_key(path))
            directory = staging_dir(self.settings.data_dir, job.model_id)
        else:
            directory = self._checkpoint_dir(path)
            exists = directory.exists()
        # In a worker group rank 0's answer stands: the others look while rank 0 may be writing.
        exists = bool(self.model.collective.agree_max([int(exists and self.writes)])[0])
        if exists and not job.overwrite:
            # Checked again here, in seq order: two pipelined saves of one name both pass the
            # gateway's check before either has run.
            raise UserError(
                f"path: checkpoint {str(path)!r} already exists; choose another name or"
                " pass overwrite=True"
            )
        if exists and self.store is None and self.writes:
            self._retire(path, directory)
        try:
            return self._write(job, path, directory)
        finally:
            if self.store is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def _write(
        self, job: SaveWeightsJob, path: TinkerPath, directory: Path
    ) -> tuple[Outcome, CheckpointRecord | None]:
        """The checkpoint's files into `directory`, and up to the store if there is one (a
        content of its own, never overwritten); its record and answer."""
        content_id = uuid.uuid4().hex[:16]
        now = time.time()
        meta = {
            "model_id": job.model_id,
            "seq_id": job.seq_id,
            "base_model": self.settings.base_model,
            "saved_at": now,
        }
        # an external export is the PEFT adapter alone, exactly what a sampler checkpoint holds
        files: Literal["weights", "sampler_weights"] = (
            "weights" if job.kind == "weights" else "sampler_weights"
        )
        size = self.residency.save(job.model_id, directory, kind=files, meta=meta)
        store_key = digest = ""
        if self.writes:
            (directory / CONTENT_ID_FILE).write_text(content_id)
        if self.store is not None and self.writes:
            store_key = checkpoint_key(path, content_id)
            uploaded = self.store.upload(store_key, directory)
            size, digest = uploaded.size_bytes, uploaded.sha256
        record = CheckpointRecord(
            run_id=job.model_id,
            tenant_id=job.tenant_id,
            checkpoint_id=path.checkpoint_id,
            kind=job.kind,
            path=str(path),
            directory="" if self.store is not None else str(directory),
            created_at=now,
            size_bytes=size,
            base_model=self.settings.base_model,
            lora=self.residency.spec(job.model_id),
            with_optimizer=job.kind == "weights",
            expires_at=now + job.ttl_seconds if job.ttl_seconds else None,
            user_metadata=dict(job.user_metadata),
            content_id=content_id,
            store_key=store_key,
            sha256=digest,
        )
        if job.kind == "weights":
            body = api.encode(api.SaveWeightsResponse(path=str(path)))
        elif job.kind == "external_weights":
            body = api.encode(api.SaveWeightsExternalResponse(path=str(path), size_bytes=size))
        elif job.sampling_session_id:
            body = api.encode(
                api.SaveWeightsForSamplerResponse(sampling_session_id=job.sampling_session_id)
            )
        else:
            body = api.encode(api.SaveWeightsForSamplerResponse(path=str(path)))
        return done_outcome(job, body), record

    def _unload(self, job: UnloadModelJob) -> tuple[Outcome, CheckpointRecord | None]:
        """Release the model's adapter, saving it first when asked (`save_as`)."""
        record = None
        if self.residency.has(job.model_id):
            if job.save_as:
                save = SaveWeightsJob(
                    request_id=job.request_id,
                    model_id=job.model_id,
                    tenant_id=job.tenant_id,
                    seq_id=job.seq_id,
                    name=job.save_as,
                    kind="weights",
                    overwrite=True,
                )
                _, record = self._save(save)
            self.residency.release(job.model_id)
        body = api.encode(api.UnloadModelResponse(model_id=job.model_id))
        return done_outcome(job, body), record

    def _load(self, job: LoadWeightsJob) -> Outcome:
        path = parse_path(job.path)
        if self.store is not None:
            if not job.content_id:
                raise UserError(f"checkpoint {job.path!r} has no content in the artifact store")
            directory = self.store.download(checkpoint_key(path, job.content_id))
        else:
            directory = self._checkpoint_dir(path)
        if not directory.is_dir():
            raise UserError(f"checkpoint {job.path!r} not found in the checkpoint store")
        if not job.create:
            self._require_model(job)
        self.residency.load(job.model_id, directory, with_optimizer=job.with_optimizer)
        return done_outcome(
            job, api.encode(api.LoadWeightsResponse(path=job.path, model_id=job.model_id))
        )
