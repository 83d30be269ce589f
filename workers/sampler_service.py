"""The sampler service: sample jobs of one pool in, protobuf `SampleResponse` outcomes out.

Every sampler of a pool (the torch sampler inside a trainer, or a vLLM sampler process) reads
the shared durable consumer `sample-<pool>` on the work-queue stream `TW_SAMPLE`, so each job is
taken once. Both backends are concurrent: each job is submitted at once, the engine batches
continuously, and each job is answered as soon as its request is done:
- torch (`TorchBackend`): jobs join the trainer's running generation at its next step, one
  step per call on the engine's thread, between training calls (`workers.sampling_torch`);
- vLLM (`VllmBackend`): each job is one request of the vLLM engine.
(A backend that is not `concurrent` gets everything waiting as one `sample_many` call, served
one call at a time.)
A sampling session names an immutable sampler checkpoint; adapters load by its path and are
cached by it, so training never changes what a session samples.
Every answered request, its time (`observe_batch` of one) and generated token is observed on `self.metrics`.

Cancels (`cancel_future`): the gateway fails the future itself and names the request on the
core subject `tw.v1.cancel.<pool>`; every sampler of the pool drops it if it holds it (the
torch sampler takes its rows out of the running batch at the next step, vLLM aborts the
request), answers nothing for it, and acks its job. A job taken after its cancel is skipped:
its request is on the cancelled list, or its future is no longer pending in KV.

Answers: a job is acked once its answer is written over the pending future (a compare-and-set:
a cancel that landed first stands); an answer over the KV value limit fails its own request;
a write that fails hands the job back at once. Jobs queued or sampling are kept alive
(`in_progress`) while they wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
from nats.aio.msg import Msg

from protocol import api, stability, subjects
from protocol.errors import Cancelled, ServerError, TwinkleError, UserError
from protocol.jobs import Outcome, SampleJob, decode_outcome, decode_sample_job, encode_outcome
from protocol.paths import CONTENT_ID_FILE, checkpoint_dir, parse_path, version_dir
from protocol.sampling import SampleOutput, SampleSpec, encode_sample_response, sample_spec
from workers.bus import WorkerBus
from workers.metrics import SamplerMetrics
from workers.usage import UsageBook

log = logging.getLogger(__name__)

_FAILED = "the sampler failed on this request; see the sampler log"
_MAX_CANCELLED = 65536  # request ids of recent cancels a sampler remembers
_REDELIVER_DELAY_S = 1.0  # a job whose answer could not be written runs again after this


def _too_large(size: int, limit: int) -> UserError:
    return UserError(
        f"the answer to this sample request is {size} bytes, over the {limit} bytes one answer"
        " may hold; ask for fewer samples (num_samples), shorter ones (max_tokens) or fewer"
        " logprobs (topk_sample_logprobs, prompt_logprobs) per request"
    )


@dataclass
class Prepared:
    """A sample job, validated, with its adapter resolved to a checkpoint directory."""

    job: SampleJob
    msg: Msg
    spec: SampleSpec
    adapter_dir: Path | None
    adapter_key: str | None = None  # names the adapter's content: a cache key that never goes stale


Answer = asyncio.Future[SampleOutput | TwinkleError]


class SamplerBackend(Protocol):
    """What the service needs of a sampling engine."""

    name: str
    concurrent: bool
    vocab_size: int
    max_context: int

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]: ...


class TorchBackend:
    """The trainer's torch sampler, batching continuously on the engine thread.

    `sample_many` queues its items and awaits their answers. One driver task (started by the
    first item, ended when nothing is waiting or generating) hands every newly queued item to the
    sampler and runs one `TorchSampler.step` per executor call, so the engine's single thread
    interleaves training calls between two steps; each answer resolves its future as soon as
    the step that finished it returns. A step that raises fails every request in the sampler.
    """

    name = "torch"
    concurrent = True

    def __init__(self, sampler: Any, engine: Any, executor: Executor) -> None:
        self.sampler = sampler
        self.executor = executor
        self.vocab_size = int(engine.vocab_size)
        self.max_context = int(engine.max_context)
        self._queued: list[tuple[Prepared, Answer]] = []
        self._submitting: list[tuple[Prepared, Answer]] = []  # in the step now running
        self._cancel_later: set[str] = set()  # request ids cancelled while being submitted
        self._waiters: dict[int, tuple[Prepared, Answer]] = {}  # by sampler ticket
        self._cancels: list[int] = []  # tickets to drop from the sampler at the next step
        self._cancelling: dict[int, tuple[Prepared, Answer]] = {}  # answered once dropped
        self._driver: asyncio.Task[None] | None = None

    def cancel(self, request_id: str) -> None:
        """Drop a request: at once if not yet handed to the sampler, else at the next step."""
        for n, (item, answer) in enumerate(self._queued):
            if item.job.request_id == request_id:
                del self._queued[n]
                if not answer.done():
                    answer.set_result(Cancelled())
                return
        if any(item.job.request_id == request_id for item, _ in self._submitting):
            self._cancel_later.add(request_id)  # it gets its ticket when the step returns
            return
        for ticket, (item, _) in list(self._waiters.items()):
            if item.job.request_id == request_id:
                self._cancelling[ticket] = self._waiters.pop(ticket)
                self._cancels.append(ticket)
                return

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        loop = asyncio.get_running_loop()
        answers: list[Answer] = [loop.create_future() for _ in items]
        self._queued.extend(zip(items, answers, strict=True))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive(), name="torch-sampler")
        try:
            return list(await asyncio.gather(*answers))
        finally:
            for answer in answers:
                answer.cancel()  # a no-op once answered
            held = [
                *self._queued,
                *self._submitting,
                *self._waiters.values(),
                *self._cancelling.values(),
            ]
            awaited = [answer for _, answer in held]
            driver = self._driver  # None if another caller that finished at once stopped it
            if driver is not None and all(answer.done() for answer in awaited):
                # Nobody waits: stop driving (the service may be stopping). A later item starts
                # a fresh driver; rows left in the sampler finish in its steps, unanswered.
                driver.cancel()
                self._driver = None

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            busy = True
            while busy or self._queued or self._cancels:
                self._submitting, self._queued = self._queued, []
                cancels, self._cancels = self._cancels, []
                stepped = await loop.run_in_executor(
                    self.executor, self._step, [item for item, _ in self._submitting], cancels
                )
                self._waiters.update(zip(stepped.tickets, self._submitting, strict=True))
                self._submitting = []
                for request_id in self._cancel_later:
                    self.cancel(request_id)
                self._cancel_later.clear()
                for ticket, tokens in stepped.cancelled:
                    cancelled = self._cancelling.pop(ticket, None)
                    if cancelled is not None and not cancelled[1].done():
                        cancelled[1].set_result(Cancelled(generated_tokens=tokens))
                results = stepped.finished
                if stepped.failed:  # the sampler dropped everything it held
                    log.error(
                        "a sampling step failed; failing request_ids %s",
                        [item.job.request_id for item, _ in self._waiters.values()],
                    )
                    results = [(ticket, ServerError(_FAILED)) for ticket in self._waiters]
                for ticket, result in results:
                    waiter = self._waiters.pop(ticket, None)
                    if waiter is not None and not waiter[1].done():
                        waiter[1].set_result(result)
                busy = stepped.busy
        except Exception:
            waiting = [
                *self._waiters.values(),
                *self._cancelling.values(),
                *self._submitting,
                *self._queued,
            ]
            log.exception(
                "the torch sampler's driver failed; failing request_ids %s",
                [item.job.request_id for item, _ in waiting],
            )
            self._waiters.clear()
            self._cancelling.clear()
            self._submitting = []
            self._cancel_later.clear()
            self._queued.clear()
            for _, answer in waiting:
                if not answer.done():
                    answer.set_result(ServerError(_FAILED))

    def _step(self, items: list[Prepared], cancels: list[int]) -> _Stepped:
        """On the engine thread: drop `cancels`, submit `items`, then take one step."""
        cancelled = [(ticket, self.sampler.cancel(ticket) or 0) for ticket in cancels]
        tickets = [
            self.sampler.submit(item.spec, item.adapter_key, item.adapter_dir) for item in items
        ]
        try:
            return _Stepped(tickets, self.sampler.step(), self.sampler.busy, cancelled=cancelled)
        except Exception:
            log.exception("a sampling step failed")
            self.sampler.abort()
            return _Stepped(tickets, [], busy=False, failed=True, cancelled=cancelled)


@dataclass
class _Stepped:
    """What one step on the engine thread gives back to the driver."""

    tickets: list[int]  # for the items it submitted, in order
    finished: Sequence[tuple[int, SampleOutput | TwinkleError]]  # (ticket, answer)
    busy: bool  # requests still waiting or generating
    failed: bool = False  # the step raised, and the sampler dropped every request it held
    cancelled: Sequence[tuple[int, int]] = ()  # (ticket, tokens it had generated), dropped


class VllmBackend:
    """A vLLM engine: every job is submitted at once; vLLM batches continuously."""

    name = "vllm"
    concurrent = True

    def __init__(self, sampler: Any, vocab_size: int, max_context: int) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_context = max_context
        self._requests: dict[str, asyncio.Task[SampleOutput]] = {}  # by request id

    def cancel(self, request_id: str) -> None:
        """Abort a request: vLLM aborts a generation whose stream is cancelled."""
        task = self._requests.get(request_id)
        if task is not None:
            task.cancel()

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        async def one(item: Prepared) -> SampleOutput | TwinkleError:
            request_id = item.job.request_id
            task = asyncio.ensure_future(
                self.sampler.sample(item.spec, item.adapter_dir, item.adapter_key)
            )
            self._requests[request_id] = task
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()  # the service is stopping
                raise
            finally:
                self._requests.pop(request_id, None)
            if task.cancelled():
                return Cancelled()
            try:
                result: SampleOutput = task.result()
            except TwinkleError as err:
                return err
            return result

        return list(await asyncio.gather(*(one(item) for item in items)))


class SamplerService:
    """Consumes a pool's sample jobs and answers them through KV `tw_futures`."""

    def __init__(
        self,
        bus: WorkerBus,
        backend: SamplerBackend,
        pool: str,
        checkpoint_root: Path,
        usage: UsageBook | None = None,
        metrics: SamplerMetrics | None = None,
        flush_s: float = 5.0,
    ) -> None:
        self.bus = bus
        # a trainer's sampler shares (and the trainer flushes) the trainer's book
        self._owns_usage = usage is None
        self.usage = usage or UsageBook(f"sampler-{uuid.uuid4().hex[:8]}")
        self.flush_s = flush_s
        self.metrics = metrics if metrics is not None else SamplerMetrics()
        self.backend = backend
        self.pool = pool
        self.checkpoint_root = checkpoint_root
        self._queue: asyncio.Queue[Prepared] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        # jobs taken and not yet answered (queued or sampling), by id(msg): kept alive
        self._held: dict[int, Msg] = {}
        self.served = 0

    async def run(self) -> None:
        await self.bus.consume(
            subjects.STREAM_SAMPLE,
            subjects.sample_subject(self.pool),
            subjects.sample_consumer(self.pool),
            self._on_msg,
        )
        assert self.bus.nc is not None
        cancels = await self.bus.nc.subscribe(
            subjects.sample_cancel_subject(self.pool), cb=self._on_cancel
        )
        log.info("sampler (%s) serving pool %s", self.backend.name, self.pool)
        if self._owns_usage:
            flusher = asyncio.create_task(self._flush_loop(), name="usage")
            self._tasks.add(flusher)
        self._tasks.add(asyncio.create_task(self._keepalive_loop(), name="sample-keepalive"))
        try:
            while True:
                first = await self._queue.get()
                batch = [first]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                if self.backend.concurrent:  # each request answered as soon as it is done
                    for item in batch:
                        task = asyncio.create_task(self._serve([item]))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                else:
                    await self._serve(batch)
        finally:
            await cancels.unsubscribe()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.usage.flush(self.bus.put)
            except Exception:
                log.exception("writing sample usage failed; retrying")

    async def _keepalive_loop(self) -> None:
        """A job queued behind a long batch, or sampling for longer than `ack_wait`, stays
        taken: JetStream would otherwise hand it out again and it would run twice."""
        while True:
            await asyncio.sleep(self.bus.ack_wait_s / 3)
            for msg in list(self._held.values()):
                try:
                    await msg.in_progress()
                except Exception:
                    log.debug("in_progress failed", exc_info=True)

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = msg.data.decode(errors="replace")
        self._cancelled[request_id] = None
        while len(self._cancelled) > _MAX_CANCELLED:
            self._cancelled.popitem(last=False)
        cancel = getattr(self.backend, "cancel", None)
        if cancel is not None:
            cancel(request_id)

    async def _skip_cancelled(self, job: SampleJob, msg: Msg) -> bool:
        """Ack a job whose request was cancelled before it reached the backend."""
        if job.request_id not in self._cancelled:
            data = await self.bus.get(subjects.BUCKET_FUTURES, subjects.future_key(job.request_id))
            if not data or decode_outcome(data).state == "pending":
                return False
        log.info("skipping sample %s: cancelled by its client", job.request_id)
        await msg.ack()
        self.metrics.request_cancelled("pickup", 0)
        return True

    async def _on_msg(self, msg: Msg) -> None:
        try:
            job = decode_sample_job(msg.data)
        except msgspec.DecodeError:
            log.error("dropping undecodable sample job")
            await msg.term()
            return
        if await self._skip_cancelled(job, msg):
            return
        try:
            body = api.decode(job.body, api.SampleRequest)
            spec = sample_spec(
                body, max_context=self.backend.max_context, vocab_size=self.backend.vocab_size
            )
            adapter_dir, adapter_key = (
                self._adapter_dir(job.adapter_path, job.adapter_content_id)
                if job.adapter_path
                else (None, None)
            )
        except TwinkleError as err:
            await self._finish(job, msg, err)
            return
        self._held[id(msg)] = msg
        self._queue.put_nowait(
            Prepared(job=job, msg=msg, spec=spec, adapter_dir=adapter_dir, adapter_key=adapter_key)
        )

    def _adapter_dir(self, adapter_path: str, content_id: str) -> tuple[Path, str]:
        """The directory holding the content a session is bound to, and its cache key.

        The current content lives at the checkpoint's own directory; content an overwrite
        replaced lives in its version directory. ("": whatever is current.)
        """
        path = parse_path(adapter_path)
        directory = checkpoint_dir(self.checkpoint_root, path)
        id_file = directory / CONTENT_ID_FILE
        current = id_file.read_text().strip() if id_file.exists() else ""
        if content_id and content_id != current:
            directory = version_dir(self.checkpoint_root, path, content_id)
        else:
            content_id = current
        if not (directory / "adapter_config.json").exists():
            raise UserError(f"sampler checkpoint {adapter_path!r} is not in the checkpoint store")
        return directory, f"{adapter_path}@{content_id}"

    async def _serve(self, batch: list[Prepared]) -> None:
        started = time.perf_counter()
        try:
            results = await self.backend.sample_many(batch)
        except Exception:
            log.exception("sampling a batch of %d failed", len(batch))
            results = [ServerError(_FAILED)] * len(batch)
        elapsed_s = time.perf_counter() - started
        self.metrics.observe_batch(elapsed_s, results)
        for item, result in zip(batch, results, strict=True):
            if item.spec.record_stability_info and not isinstance(result, TwinkleError):
                try:
                    await self._record_stability(item, result)
                except Exception:  # the bus failed: the sample fails, it is not half-answered
                    log.exception("recording stability info of %s failed", item.job.request_id)
                    result = ServerError("could not record the samples' stability info; retry")
            try:
                await self._finish(item.job, item.msg, result, item.spec)
            except Exception:
                # the answer was not written: the job goes back to the stream and runs again
                # (a concurrent task's exception would otherwise be lost, and a batch's would
                # stop this service)
                log.exception("answering sample %s failed; it will run again", item.job.request_id)
                await self._redeliver(item.msg)
            finally:
                self._held.pop(id(item.msg), None)
        self.served += len(batch)
        log.debug("sampled %d requests in %.1f ms", len(batch), elapsed_s * 1e3)

    async def _redeliver(self, msg: Msg) -> None:
        try:
            await msg.nak(delay=_REDELIVER_DELAY_S)
        except Exception:  # the bus is away: JetStream redelivers after ack_wait all the same
            log.warning("could not hand a sample job back; it returns after ack_wait")

    async def _record_stability(self, item: Prepared, result: SampleOutput) -> None:
        """Keep every sequence for stable_reinforce (`protocol.stability`), before the answer
        is written, so a client that has its samples finds their records."""
        now = time.time()
        records = [
            stability.new_record(
                sequence=stability.sequence_id(item.job.request_id, index),
                tenant_id=item.job.tenant_id,
                sampling_session_id=item.job.sampling_session_id,
                prompt_length=len(item.spec.prompt),
                tokens=seq.tokens,
                logprobs=seq.logprobs,
                written_at=now,
            )
            for index, seq in enumerate(result.sequences)
        ]
        await asyncio.gather(
            *(
                self.bus.put(
                    subjects.BUCKET_STABILITY,
                    stability.sequence_key(record.sequence_id),
                    stability.encode_record(record),
                )
                for record in records
            )
        )

    async def _finish(
        self,
        job: SampleJob,
        msg: Msg,
        result: SampleOutput | TwinkleError,
        spec: SampleSpec | None = None,
    ) -> None:
        if isinstance(result, Cancelled) or job.request_id in self._cancelled:
            # the gateway already failed the future; a result that beat the cancel is dropped
            await msg.ack()
            tokens = result.generated_tokens if isinstance(result, Cancelled) else 0
            log.info("dropped cancelled sample %s (%d tokens generated)", job.request_id, tokens)
            self.metrics.request_cancelled("sampling", tokens)
            return
        if isinstance(result, TwinkleError):
            outcome = Outcome(
                request_id=job.request_id,
                state="error",
                request_type="sample",
                error=result.message,
                category=result.category,
                finished_at=time.time(),
                tenant_id=job.tenant_id,
                sampling_session_id=job.sampling_session_id,
                clone_id=job.clone_id,
            )
        else:
            outcome = Outcome(
                request_id=job.request_id,
                state="done",
                request_type="sample",
                payload=encode_sample_response(result, spec),
                payload_type="proto",
                finished_at=time.time(),
                tenant_id=job.tenant_id,
                sampling_session_id=job.sampling_session_id,
                clone_id=job.clone_id,
            )
        encoded = encode_outcome(outcome)
        limit = self.bus.max_value_bytes()
        if len(encoded) > limit:  # what a request asks for may outgrow what one answer holds
            return await self._finish(job, msg, _too_large(len(encoded), limit))
        if not await self._answer(subjects.future_key(job.request_id), encoded):
            # settled already: by the gateway's cancel, whose message this sampler missed (a
            # core NATS message is lost across a reconnect), or by this job's own answer
            # before a redelivery; what is there stands
            await msg.ack()
            log.info("dropped sample %s: its future was settled before the answer", job.request_id)
            return
        if not isinstance(result, TwinkleError):
            self.usage.add(
                job.tenant_id,
                samples=len(result.sequences),
                sampled_tokens=sum(len(seq.tokens) for seq in result.sequences),
            )
        await msg.ack()
        self.metrics.request_finished(outcome.state, outcome.category)

    async def _answer(self, key: str, encoded: bytes) -> bool:
        """Write an answer over a pending future only (compare-and-set, as the gateway's cancel
        does): False when the future was settled already."""
        current = await self.bus.entry(subjects.BUCKET_FUTURES, key)
        if current is not None and decode_outcome(current[0]).state != "pending":
            return False
        revision = None if current is None else current[1]
        return await self.bus.swap(subjects.BUCKET_FUTURES, key, encoded, revision)
