"""The engines behind the sampler service (`workers.sampler.service`), and the job they get.

Both backends are concurrent: each job is submitted at once, the engine batches continuously,
and each job is answered as soon as its request is done:
- torch (`TorchBackend`): jobs join the trainer's running generation at its next step, one
  step per call on the engine's thread, between training calls (`workers.sampler.torch_sampler`);
- vLLM (`VllmBackend`): each job is one request of the vLLM engine.
(A backend that is not `concurrent` gets everything waiting as one `sample_many` call, served
one call at a time.) A cancel (`cancel`) takes a request's rows out of the torch sampler's
running batch at the next step, or aborts it in vLLM; the request answers `Cancelled`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nats.aio.msg import Msg

from protocol.errors import Cancelled, ServerError, TwinkleError
from protocol.images import VisionGeometry
from protocol.jobs import SampleJob
from protocol.sampling import TEXT_ONLY, SampleOutput, SampleSpec
from workers.sampler.guard import Pending

if TYPE_CHECKING:  # the backends' engines import torch and vLLM; the service needs neither
    from workers.sampler.torch_sampler import TorchSampler
    from workers.sampler.vllm_sampler import VllmSampler

log = logging.getLogger(__name__)

FAILED = "the sampler failed on this request; see the sampler log"


@dataclass
class Prepared:
    """A sample job, validated, with its adapter resolved to a checkpoint directory."""

    job: SampleJob
    msg: Msg
    spec: SampleSpec
    adapter_dir: Path | None
    adapter_key: str | None = None  # names the adapter's content: a cache key that never goes stale
    future: Pending | None = None  # its pending future as last read or written
    # a streamed job's listener: each sequence's tokens so far, after a step that drew some
    progress: Callable[[dict[int, list[int]]], None] | None = None

    @property
    def attempts(self) -> int:
        """Times a sampler began it before and never answered it (`sample_guard`)."""
        return self.future.outcome.attempts if self.future is not None else 0


Answer = asyncio.Future[SampleOutput | TwinkleError]


class SamplerBackend(Protocol):
    """What the service needs of a sampling engine."""

    name: str
    concurrent: bool
    vocab_size: int
    max_context: int
    vision: VisionGeometry | None  # a VL model's image geometry, if this backend takes images
    no_images: str  # why it takes none, when it does not

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

    def __init__(
        self, sampler: TorchSampler, executor: Executor, steps: StepRunner | None = None
    ) -> None:
        self.sampler = sampler
        self.executor = executor
        # how one step runs: here, or on every rank of a worker group (`workers.group.mirror`)
        self.steps: StepRunner = steps or run_step
        self.vocab_size = sampler.model.vocab_size
        self.max_context = sampler.model.max_context
        self.vision: VisionGeometry | None = sampler.model.geometry
        self.no_images = TEXT_ONLY
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
                self._report_progress()
                results = stepped.finished
                if stepped.failed:  # the sampler dropped everything it held
                    log.error(
                        "a sampling step failed; failing request_ids %s",
                        [item.job.request_id for item, _ in self._waiters.values()],
                    )
                    results = [(ticket, ServerError(FAILED)) for ticket in self._waiters]
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
                    answer.set_result(ServerError(FAILED))

    def _report_progress(self) -> None:
        """Streamed requests still generating: their tokens so far, between two steps (no step
        runs while the driver is here, so the rows hold still)."""
        for ticket, (item, _) in self._waiters.items():
            if item.progress is not None:
                drawn = self.sampler.drawn(ticket)
                if drawn:
                    item.progress(drawn)

    def _step(self, items: list[Prepared], cancels: list[int]) -> Stepped:
        """On the engine thread: drop `cancels`, submit `items`, then take one step."""
        submits = [(item.spec, item.adapter_key, item.adapter_dir) for item in items]
        return self.steps(self.sampler, submits, cancels)


Submit = tuple[SampleSpec, str | None, Path | None]  # a request, its adapter key and directory


def run_step(sampler: TorchSampler, submits: list[Submit], cancels: list[int]) -> Stepped:
    """Drop `cancels`, submit `submits`, then take one step of the torch sampler: what the
    driver needs back. A step that raises drops everything the sampler held."""
    cancelled = [(ticket, sampler.cancel(ticket) or 0) for ticket in cancels]
    tickets = [sampler.submit(spec, key, directory) for spec, key, directory in submits]
    try:
        return Stepped(tickets, sampler.step(), sampler.busy, cancelled=cancelled)
    except Exception:
        log.exception("a sampling step failed")
        sampler.abort()
        return Stepped(tickets, [], busy=False, failed=True, cancelled=cancelled)


StepRunner = Callable[["TorchSampler", list[Submit], list[int]], "Stepped"]


@dataclass
class Stepped:
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

    def __init__(self, sampler: VllmSampler, vocab_size: int, max_context: int) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.vision: VisionGeometry | None = None
        self.no_images = (
            "the vLLM sampler does not take images yet; sample with images on the trainer's"
            " torch sampler (--sampler torch)"
        )
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
                self.sampler.sample(item.spec, item.adapter_dir, item.adapter_key, item.progress)
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
