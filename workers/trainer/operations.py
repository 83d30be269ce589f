"""The engine-thread side of the trainer worker: jobs in, outcomes out, all synchronous.

`TrainerService` (transport, ordering, cycles) hands each planned group of jobs to one of these
methods on the engine's single thread: `shared_pass` (every forward/forward_backward of a cycle,
across tenants), `optim_steps` (the cycle's fused step), `other` (create, save, load, unload, a
tombstone, an adapter import or a merged export: `workers.trainer.transfer`). Each returns one outcome per job, in order, with a checkpoint record where a save
wrote one. A bad job fails alone with a `user` error; an engine call that raises is re-run in
halves until the jobs that make it fail are alone (`workers.engine.isolation`).

Checkpoints are written in the PEFT layout under the checkpoint root (`protocol.paths`); an
overwrite first moves the name's current content to its version directory, where sampling
sessions bound to it keep reading it. With an artifact store (`workers.artifacts`) a save is
written to a staging directory and uploaded as a new content of its name (nothing is moved),
and a load reads the content its job names through the worker's cache.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

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
from protocol.tensors import FwdBwdRequest, decode_forward_backward, encode_forward_backward_output
from workers.artifacts import staging_dir
from workers.engine.isolation import isolate
from workers.metrics import TrainerMetrics
from workers.settings import WorkerSettings
from workers.trainer.engine import Engine
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


class EngineOps:
    """Runs planned jobs on the engine; see the module docstring."""

    def __init__(self, engine: Engine, settings: WorkerSettings, metrics: TrainerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
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

    def _require_model(self, job: Job) -> None:
        failure = self.failure(job.model_id)
        if failure is not None:
            raise failure
        if not self.engine.has(job.model_id):
            raise UserError(
                f"model_id {job.model_id!r} is not loaded (its create_model or load failed)"
            )

    def shared_pass(self, jobs: list[Job]) -> list[Result]:
        outcomes: dict[int, Outcome] = {}
        batch: list[tuple[str, FwdBwdRequest]] = []
        batch_index: list[int] = []
        for i, job in enumerate(jobs):
            assert isinstance(job, ForwardBackwardJob)
            try:
                self._require_model(job)
                request = decode_forward_backward(
                    job.body, job.max_elements, job.custom_loss, vision=self.engine.geometry
                )
                if request.loss_fn == stability.LOSS_NAME:
                    stability.apply_slices(request, stability.decode_slices(job.provenance))
                self.engine.validate(job.model_id, request)
            except TwinkleError as err:
                outcomes[i] = failed_outcome(job, err)
                continue
            batch.append((job.model_id, request))
            batch_index.append(i)
        if batch:
            called = [jobs[i] for i in batch_index]
            started = time.perf_counter()
            results = self._transactions(self.engine.forward_backward, batch, called)
            self.metrics.observe_pass(
                time.perf_counter() - started,
                tokens=sum(request.n_tokens for _, request in batch),
                tenants=len({model_id for model_id, _ in batch}),
            )
            for i, result in zip(batch_index, results, strict=True):
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
        index: list[int] = []
        for i, job in enumerate(jobs):
            assert isinstance(job, OptimStepJob)
            try:
                self._require_model(job)
                self.engine.validate_optim_step(job.model_id, job.adam)
            except TwinkleError as err:
                outcomes[i] = failed_outcome(job, err)
                continue
            steps.append((job.model_id, job.adam))
            index.append(i)
        if steps:
            called = [jobs[i] for i in index]
            started = time.perf_counter()
            results = self._transactions(self.engine.optim_step, steps, called)
            self.metrics.observe_optim_step(time.perf_counter() - started)
            for i, result in zip(index, results, strict=True):
                if isinstance(result, TwinkleError):
                    outcomes[i] = failed_outcome(jobs[i], result)
                else:
                    outcomes[i] = done_outcome(
                        jobs[i], api.encode(api.OptimStepResponse(metrics=result))
                    )
        return [(outcomes[i], None) for i in range(len(jobs))]

    def _transactions(
        self, run: Callable[[list[C]], Sequence[R]], calls: list[C], jobs: list[Job]
    ) -> list[R | TwinkleError]:
        """`run(calls)` one engine transaction at a time (`Engine.sub_calls`); a transaction
        that raises has changed nothing and is re-run in halves until the requests that make it
        fail are alone (`workers.engine.isolation`), so only those fail."""
        results: dict[int, R | TwinkleError] = {}
        for group in self.engine.sub_calls([job.model_id for job in jobs]):
            outputs = isolate(
                lambda indices: run([calls[i] for i in indices]),
                group,
                describe=lambda i: jobs[i].request_id,
            )
            results.update(zip(group, outputs, strict=True))
        return [results[i] for i in range(len(calls))]

    def other(self, jobs: list[Job]) -> list[Result]:
        (job,) = jobs
        try:
            if isinstance(job, CreateModelJob):
                if not self.engine.has(job.model_id):
                    self.engine.create(job.model_id, job.lora)
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
            if isinstance(job, ImportAdapterJob):
                answer, record = import_adapter(self.engine, root, job, self.store, data_dir)
                return [(done_outcome(job, api.encode(answer)), record)]
            if isinstance(job, ExportMergedJob):
                exported = export_merged(self.engine, root, job, self.store, data_dir)
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
        if exists and not job.overwrite:
            # Checked again here, in seq order: two pipelined saves of one name both pass the
            # gateway's check before either has run.
            raise UserError(
                f"path: checkpoint {str(path)!r} already exists; choose another name or"
                " pass overwrite=True"
            )
        if exists and self.store is None:
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
        size = self.engine.save(job.model_id, directory, kind=files, meta=meta)
        (directory / CONTENT_ID_FILE).write_text(content_id)
        store_key = digest = ""
        if self.store is not None:
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
            lora=self.engine.spec(job.model_id),
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
        if self.engine.has(job.model_id):
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
            self.engine.release(job.model_id)
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
        self.engine.load(job.model_id, directory, with_optimizer=job.with_optimizer)
        return done_outcome(
            job, api.encode(api.LoadWeightsResponse(path=job.path, model_id=job.model_id))
        )
