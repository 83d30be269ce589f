"""The sampler service: sample jobs of one pool in, protobuf `SampleResponse` outcomes out.

Every sampler of a pool (the torch sampler inside a trainer, or a vLLM sampler process) reads
the shared durable consumer `sample-<pool>` on the work-queue stream `TW_SAMPLE`, so each job is
taken once, and hands it to its backend (`workers.sampler.backends`).
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
(`in_progress`) while they wait. A request that stopped a sampler runs alone, and fails after
`max_attempts` stops (`workers.sampler.guard`). A request still sampling after
`sample_timeout_s` stops the process (the engine cannot be interrupted, and a sampler that
kept its jobs alive for ever would stall their clients for ever): the supervisor restarts it,
and the guard runs the request alone, then fails it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from protocol import api, stability, subjects, text_sampling
from protocol.errors import Cancelled, ServerError, TwinkleError, UserError
from protocol.jobs import Outcome, SampleJob, decode_sample_job, encode_outcome
from protocol.paths import (
    ADAPTER_CONFIG,
    CONTENT_ID_FILE,
    checkpoint_dir,
    checkpoint_key,
    parse_path,
    version_dir,
)
from protocol.sampling import SampleOutput, SampleSpec, encode_sample_response, sample_spec
from protocol.text_sampling import TextProgress
from workers.artifacts import ArtifactStore
from workers.bus import WorkerBus
from workers.metrics import SamplerMetrics
from workers.sampler.backends import FAILED, Prepared, SamplerBackend
from workers.sampler.guard import (
    Gate,
    Pending,
    begin,
    pending_of,
    read_pending,
    too_many_attempts,
    write_answer,
)
from workers.usage import UsageBook
from workers.watchdog import stop_process

log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.05  # a streamed sample's text goes out at most this often
_MAX_CANCELLED = 65536  # request ids of recent cancels a sampler remembers
_REDELIVER_DELAY_S = 1.0  # a job whose answer could not be written runs again after this


def _too_large(size: int, limit: int) -> UserError:
    return UserError(
        f"the answer to this sample request is {size} bytes, over the {limit} bytes one answer"
        " may hold; ask for fewer samples (num_samples), shorter ones (max_tokens) or fewer"
        " logprobs (topk_sample_logprobs, prompt_logprobs) per request"
    )


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
        max_attempts: int = 3,
        sample_timeout_s: float = 600.0,
        store: ArtifactStore | None = None,
    ) -> None:
        self.bus = bus
        self.store = store  # sampler checkpoints in an artifact store; None: `checkpoint_root`
        self.max_attempts = max_attempts
        self.sample_timeout_s = sample_timeout_s
        self._gate = Gate()  # a request some sampler stopped on runs alone
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
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}  # of text jobs' base models
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
                    for item in [item for item in batch if item.attempts]:
                        await self._serve([item])
                    if rest := [item for item in batch if not item.attempts]:
                        await self._serve(rest)
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

    async def _pickup(self, job: SampleJob, msg: Msg) -> Pending | None:
        """The job's pending future, with how often samplers began it before (`sample_guard`);
        None, with the job acked, when its request was cancelled (or answered) before it
        reached the backend."""
        if job.request_id not in self._cancelled:
            future = await read_pending(self.bus, job)
            if future is not None:
                return future
        log.info("skipping sample %s: cancelled by its client", job.request_id)
        await msg.ack()
        self.metrics.request_cancelled("pickup", 0)
        return None

    async def _on_msg(self, msg: Msg) -> None:
        try:
            job = decode_sample_job(msg.data)
        except msgspec.DecodeError:
            log.error("dropping undecodable sample job")
            await msg.term()
            return
        future = await self._pickup(job, msg)
        if future is None:
            return
        if future.outcome.attempts >= self.max_attempts:
            err = too_many_attempts(job.request_id, future.outcome.attempts)
            await self._finish(job, msg, err, future=future)
            return
        try:
            body = api.decode(job.body, api.SampleRequest)
            if job.text is not None:
                body = await asyncio.to_thread(self._tokenized, job, body)
            spec = sample_spec(
                body,
                max_context=self.backend.max_context,
                vocab_size=self.backend.vocab_size,
                vision=self.backend.vision,
                no_images=self.backend.no_images,
            )
            adapter_dir, adapter_key = (
                await asyncio.to_thread(self._adapter_dir, job.adapter_path, job.adapter_content_id)
                if job.adapter_path
                else (None, None)
            )
        except TwinkleError as err:
            await self._finish(job, msg, err, future=future)
            return
        self._held[id(msg)] = msg
        progress = self._progress(job, spec) if job.text is not None and job.text.stream else None
        self._queue.put_nowait(
            Prepared(job, msg, spec, adapter_dir, adapter_key, future, progress=progress)
        )

    def _progress(self, job: SampleJob, spec: SampleSpec) -> Callable[[dict[int, list[int]]], None]:
        """A streamed text job's listener: each sequence's new text, at most every
        `STREAM_INTERVAL_S`, to the gateway that waits (`subjects.sample_stream_subject`)."""
        tokenizer = self.tokenizer(job.base_model)
        streamed = text_sampling.StreamedText(spec.stop_strings)
        subject = subjects.sample_stream_subject(job.request_id)
        last = 0.0

        def heard(drawn: dict[int, list[int]]) -> None:
            # called by the engine's driver: a fault here loses this job's updates only (its
            # answer still gives the text), never the batch the driver steps
            nonlocal last
            now = time.monotonic()
            if now - last < STREAM_INTERVAL_S:
                return
            last = now
            try:
                texts = {
                    i: str(tokenizer.decode(t, skip_special_tokens=True)) for i, t in drawn.items()
                }
                rows = streamed.update(texts)
            except Exception:
                log.exception("sample %s: its stream stops here", job.request_id)
                last = math.inf
                return
            if rows and self.bus.nc is not None:
                sent = asyncio.ensure_future(
                    self.bus.nc.publish(subject, msgspec.json.encode(TextProgress(rows=rows)))
                )
                self._tasks.add(sent)
                sent.add_done_callback(self._published)

        return heard

    def _published(self, task: asyncio.Task[None]) -> None:
        """A stream update sent, or lost (the answer makes it good)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a stream update was not sent: %r", task.exception())

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase:
        """The base model's tokenizer (loaded once, from the model's own files)."""
        tokenizer = self._tokenizers.get(base_model)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(base_model)
            except Exception as exc:
                log.exception("the tokenizer of %s could not be loaded", base_model)
                raise ServerError(f"the tokenizer of {base_model!r} could not be loaded") from exc
            self._tokenizers[base_model] = tokenizer
        return tokenizer

    def _tokenized(self, job: SampleJob, body: api.SampleRequest) -> api.SampleRequest:
        """A text job's body with its prompt's tokens (`protocol.text_sampling`)."""
        assert job.text is not None
        tokenizer = self.tokenizer(job.base_model)

        def chat(messages: list[dict[str, str]]) -> list[int]:
            try:
                encoded: Any = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_dict=True
                )
            except Exception as exc:  # a template that refuses these messages
                raise UserError(f"messages: the chat template refused them: {exc}") from None
            return [int(token) for token in encoded["input_ids"]]

        tokens = text_sampling.prompt_tokens(job.text, tokenizer.encode, chat)
        return text_sampling.with_prompt(body, tokens)

    def _adapter_dir(self, adapter_path: str, content_id: str) -> tuple[Path, str]:
        """The directory holding the content a session is bound to, and its cache key.

        The current content lives at the checkpoint's own directory; content an overwrite
        replaced lives in its version directory. ("": whatever is current.)
        """
        path = parse_path(adapter_path)
        if self.store is not None:
            if not content_id:
                raise UserError(f"sampler checkpoint {adapter_path!r} names no content")
            directory = self.store.download(checkpoint_key(path, content_id))
            return directory, f"{adapter_path}@{content_id}"
        directory = checkpoint_dir(self.checkpoint_root, path)
        id_file = directory / CONTENT_ID_FILE
        current = id_file.read_text().strip() if id_file.exists() else ""
        if content_id and content_id != current:
            directory = version_dir(self.checkpoint_root, path, content_id)
        else:
            content_id = current
        if not (directory / ADAPTER_CONFIG).exists():
            raise UserError(f"sampler checkpoint {adapter_path!r} is not in the checkpoint store")
        return directory, f"{adapter_path}@{content_id}"

    async def _serve(self, batch: list[Prepared]) -> None:
        alone = any(item.attempts for item in batch)
        async with self._gate.alone() if alone else self._gate.shared():
            batch = await self._begin(batch)
            if not batch:
                return
            started = time.perf_counter()
            sampling = asyncio.ensure_future(self.backend.sample_many(batch))
            try:
                await asyncio.wait([sampling], timeout=self.sample_timeout_s)
            except asyncio.CancelledError:  # the service stops: so does the sampling
                sampling.cancel()
                raise
            if not sampling.done():
                stop_process(
                    f"sampling ran past the {self.sample_timeout_s:.1f} s limit of one sample"
                    " request (restarted, the request runs alone, then fails)",
                    [item.job.request_id for item in batch],
                )
            try:
                results = sampling.result()
            except Exception:
                log.exception("sampling a batch of %d failed", len(batch))
                results = [ServerError(FAILED)] * len(batch)
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
                await self._finish(item.job, item.msg, result, item.spec, item.future)
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

    async def _begin(self, batch: list[Prepared]) -> list[Prepared]:
        """Count a start on each request's future (`sample_guard.begin`); the requests that
        may run. One settled meanwhile (cancelled) is acked and dropped; one whose start could
        not be counted goes back to the stream."""
        counted = await asyncio.gather(
            *(
                begin(self.bus, item.job, item.future or Pending(pending_of(item.job), None))
                for item in batch
            ),
            return_exceptions=True,
        )
        ready = []
        for item, future in zip(batch, counted, strict=True):
            if isinstance(future, Pending):
                item.future = future
                ready.append(item)
                continue
            self._held.pop(id(item.msg), None)
            if future is None:
                log.info("skipping sample %s: cancelled by its client", item.job.request_id)
                await item.msg.ack()
                self.metrics.request_cancelled("pickup", 0)
            else:
                log.error("counting the start of %s failed: %r", item.job.request_id, future)
                await self._redeliver(item.msg)
        return ready

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

    def _text_answer(self, job: SampleJob, result: SampleOutput, spec: SampleSpec) -> bytes:
        tokenizer = self.tokenizer(job.base_model)
        return text_sampling.answer(
            result,
            len(spec.prompt),
            spec.stop_strings,
            lambda tokens: str(tokenizer.decode(tokens, skip_special_tokens=True)),
        )

    async def _finish(
        self,
        job: SampleJob,
        msg: Msg,
        result: SampleOutput | TwinkleError,
        spec: SampleSpec | None = None,
        future: Pending | None = None,
    ) -> None:
        """Answer the job over its pending future (`future`: as last seen, else read) and
        ack it."""
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
            text = job.text is not None and spec is not None
            outcome = Outcome(
                request_id=job.request_id,
                state="done",
                request_type="sample",
                payload=self._text_answer(job, result, spec)
                if text and spec is not None
                else encode_sample_response(result, spec),
                payload_type="json" if text else "proto",
                finished_at=time.time(),
                tenant_id=job.tenant_id,
                sampling_session_id=job.sampling_session_id,
                clone_id=job.clone_id,
            )
        encoded = encode_outcome(outcome)
        limit = self.bus.max_value_bytes()
        if len(encoded) > limit:  # what a request asks for may outgrow what one answer holds
            return await self._finish(job, msg, _too_large(len(encoded), limit), future=future)
        if not await write_answer(self.bus, job, encoded, future):
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
