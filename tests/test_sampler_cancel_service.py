"""The sampler service and cancels, on a real nats-server (a recording backend stands in for
the sampling engine): a job whose future was cancelled while it waited in the stream is acked
at pickup and never reaches the backend, a cancel published on `tw.v1.cancel.<pool>` reaches
the backend of every sampler of the pool, and the service writes no outcome over the
gateway's for a cancelled request while it answers the others with their session and clone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from protocol import subjects
from protocol.errors import Cancelled, ErrorCategory, TwinkleError
from protocol.jobs import Outcome, SampleJob, decode_outcome, encode_outcome
from protocol.sampling import TEXT_ONLY, SampledSequence, SampleOutput
from tests.wait_helpers import until
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings
from workers.bus import WorkerBus
from workers.sampler.backends import Prepared
from workers.sampler.service import SamplerService

POOL = "tiny-pool"
BODY = json.dumps(
    {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0.0, "stop": []},
        "seq_id": 3_000_000_001,
    }
).encode()


class HoldingBackend:
    """Answers each request when released; records what it was given and what was cancelled."""

    name = "recording"
    concurrent = True
    vocab_size = 1000
    max_context = 512
    vision = None  # a text model's backend: it takes no images
    no_images = TEXT_ONLY

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.cancelled: list[str] = []
        self._held: dict[str, asyncio.Future[SampleOutput | TwinkleError]] = {}

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        loop = asyncio.get_running_loop()
        answers = []
        for item in items:
            self.seen.append(item.job.request_id)
            answers.append(self._held.setdefault(item.job.request_id, loop.create_future()))
        return list(await asyncio.gather(*answers))

    def release(self, request_id: str) -> None:
        sequence = SampledSequence([1, 2], [-0.5, -0.5], "length")
        self._held[request_id].set_result(SampleOutput(sequences=[sequence]))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        held = self._held.get(request_id)
        if held is not None and not held.done():
            held.set_result(Cancelled(generated_tokens=1))


def job(request_id: str) -> SampleJob:
    return SampleJob(
        request_id=request_id,
        tenant_id="t",
        sampling_session_id="sess-1:sample:0",
        base_model="m",
        body=BODY,
        clone_id=3,
    )


def pending(request_id: str, state: str = "pending") -> Outcome:
    return Outcome(
        request_id=request_id,
        state=state,  # type: ignore[arg-type]
        request_type="sample",
        tenant_id="t",
        sampling_session_id="sess-1:sample:0",
        clone_id=3,
        category=ErrorCategory.USER if state == "error" else None,
    )


async def outcome_of(bus: Bus, request_id: str) -> Outcome | None:
    data = await bus.get(subjects.BUCKET_FUTURES, subjects.future_key(request_id))
    return decode_outcome(data) if data else None


async def submit(gateway: Bus, request_id: str, state: str = "pending") -> None:
    """As the gateway submits a sample: its future first, then the job."""
    await gateway.put(
        subjects.BUCKET_FUTURES,
        subjects.future_key(request_id),
        encode_outcome(pending(request_id, state)),
    )
    await gateway.publish_sample(POOL, job(request_id), request_id)


async def cancel_future(gateway: Bus, request_id: str) -> Outcome:
    """The first half of the gateway's cancel: the future fails (the message comes after)."""
    failed = msgspec.structs.replace(pending(request_id), state="error", error=Cancelled().message)
    await gateway.put(
        subjects.BUCKET_FUTURES, subjects.future_key(request_id), encode_outcome(failed)
    )
    return failed


@dataclass
class Rig:
    gateway: Bus
    backend: HoldingBackend
    service: SamplerService

    async def seen(self, *request_ids: str) -> None:
        async def all_seen() -> bool:
            return sorted(self.backend.seen) == sorted(request_ids)

        await until(all_seen)

    async def done(self, request_id: str) -> None:
        async def answered() -> bool:
            out = await outcome_of(self.gateway, request_id)
            return out is not None and out.state == "done"

        await until(answered)


@pytest.fixture
async def rig(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Rig]:
    """A gateway's bus and a sampler service over a holding backend; the test runs it."""
    gateway = Bus(BusSettings(nats_url=nats_server.url))
    await gateway.connect()
    worker = WorkerBus(nats_server.url)
    await worker.connect()
    yield Rig(
        gateway, (backend := HoldingBackend()), SamplerService(worker, backend, POOL, tmp_path)
    )
    await worker.close()
    await gateway.close()


async def test_cancelled_jobs_never_reach_or_leave_the_backend(rig: Rig) -> None:
    gateway, backend, service = rig.gateway, rig.backend, rig.service
    queued, running, kept = "req-queued-sample", "req-running-sample", "req-kept-sample"
    # cancelled while it waited in the stream: the gateway already failed its future
    await submit(gateway, queued, "error")
    task = asyncio.create_task(service.run())
    try:
        for request_id in (running, kept):
            await submit(gateway, request_id)
        await rig.seen(running, kept)
        # the gateway's cancel: the future fails, then the samplers are told
        failed = await cancel_future(gateway, running)
        assert gateway.nc is not None
        await gateway.nc.publish(subjects.sample_cancel_subject(POOL), running.encode())
        await gateway.nc.publish(subjects.sample_cancel_subject("another-pool"), kept.encode())

        async def cancelled() -> bool:
            value = service.metrics.registry.get_sample_value
            return value("twinkle_sampler_cancelled_total", {"stage": "sampling"}) == 1

        await until(cancelled)
        backend.release(kept)
        await rig.done(kept)
        assert backend.cancelled == [running]  # another pool's cancel is not ours
        assert queued not in backend.seen
        value = service.metrics.registry.get_sample_value
        assert value("twinkle_sampler_cancelled_total", {"stage": "pickup"}) == 1
        assert value("twinkle_sampler_cancelled_tokens_total") == 1
        assert await outcome_of(gateway, running) == failed  # not overwritten
        done = await outcome_of(gateway, kept)
        assert done is not None
        assert (done.sampling_session_id, done.clone_id) == ("sess-1:sample:0", 3)
        stream = await gateway.js.stream_info(subjects.STREAM_SAMPLE)  # type: ignore[union-attr]
        assert stream.state.messages == 0  # every job acked, the skipped one included
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_cancel_whose_message_was_lost_still_stands(rig: Rig) -> None:
    """The gateway failed the future, but the cancel message never reached the sampler (a core
    NATS message is lost across a reconnect): the answer that comes later does not overwrite
    the cancel, and the job is acked."""
    gateway, backend, service = rig.gateway, rig.backend, rig.service
    lost, kept = "req-lost-cancel", "req-answered"
    task = asyncio.create_task(service.run())
    try:
        for request_id in (lost, kept):
            await submit(gateway, request_id)
        await rig.seen(lost, kept)
        failed = await cancel_future(gateway, lost)
        backend.release(lost)  # no cancel message: the sampler finishes the sample
        backend.release(kept)
        await rig.done(kept)

        async def all_acked() -> bool:
            stream = await gateway.js.stream_info(subjects.STREAM_SAMPLE)  # type: ignore[union-attr]
            return stream.state.messages == 0

        await until(all_acked)
        assert await outcome_of(gateway, lost) == failed
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
