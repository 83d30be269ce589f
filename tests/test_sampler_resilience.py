"""The sampler service when answers cannot be stored, samples run long, or a request stops its
sampler; on a real nats-server, with stand-in backends for the sampling engine:
- a response larger than one KV value may hold fails its own request with a clear user error,
  is acked (never redelivered and recomputed), and the service answers the next request;
- an answer whose write fails is not lost: the job is handed back at once and answered, and the
  service keeps serving;
- a job held past `ack_wait` (queued or sampling) is kept alive, not run a second time;
- a request that stops its sampler runs alone when it comes back, and after `max_attempts`
  stops fails with a server error without running again; the others are answered.
Each for a backend that answers each request on its own (`concurrent`) and one that answers a
batch at once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from protocol import subjects
from protocol.errors import ErrorCategory, TwinkleError
from protocol.jobs import Outcome, SampleJob, decode_outcome, encode_outcome
from protocol.sampling import TEXT_ONLY, SampledSequence, SampleOutput
from tests.wait_helpers import until
from twinkle_async.bus import Bus
from twinkle_async.nats_server import NatsServer
from twinkle_async.settings import BusSettings
from workers.bus import WorkerBus
from workers.sampler.backends import Prepared
from workers.sampler.guard import pending_of
from workers.sampler.service import SamplerService

POOL = "tiny-pool"


def body(num_samples: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "num_samples": num_samples,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "stop": []},
            "seq_id": 3_000_000_001,
        }
    ).encode()


def job(request_id: str, num_samples: int = 1, max_tokens: int = 2) -> SampleJob:
    return SampleJob(
        request_id=request_id,
        tenant_id="t",
        sampling_session_id="sess-1:sample:0",
        base_model="m",
        body=body(num_samples, max_tokens),
    )


class FullLengthBackend:
    """Every sample runs to `max_tokens`, as a model that never says EOS would."""

    name = "full-length"
    vocab_size = 50_000
    max_context = 1_000_000
    vision = None  # a text model's backend: it takes no images
    no_images = TEXT_ONLY

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent
        self.seen: list[str] = []

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        answers: list[SampleOutput | TwinkleError] = []
        for item in items:
            self.seen.append(item.job.request_id)
            n = item.spec.max_tokens
            sequence = SampledSequence(
                [40_000 + i % 9_000 for i in range(n)], [-1.25] * n, "length"
            )
            answers.append(SampleOutput(sequences=[sequence] * item.spec.num_samples))
        return answers


class FlakyWrites(WorkerBus):
    """The real bus, whose first write of an answer to each listed future fails as a dropped
    write would."""

    def __init__(self, url: str, failing: set[str]) -> None:
        super().__init__(url, ack_wait_s=120.0)  # redelivered at once, not after ack_wait
        self.failing = {subjects.future_key(request_id) for request_id in failing}

    async def swap(self, bucket: str, key: str, value: bytes, revision: int | None) -> bool:
        answer = bucket == subjects.BUCKET_FUTURES and decode_outcome(value).state != "pending"
        if answer and key in self.failing:
            self.failing.discard(key)
            raise ConnectionError(f"write of {key} dropped")
        return await super().swap(bucket, key, value, revision)


@pytest.fixture
async def gateway(nats_server: NatsServer) -> AsyncIterator[Bus]:
    bus = Bus(BusSettings(nats_url=nats_server.url))
    await bus.connect()
    yield bus
    await bus.close()


async def outcome(gateway: Bus, request_id: str) -> Outcome | None:
    data = await gateway.get(subjects.BUCKET_FUTURES, subjects.future_key(request_id))
    return decode_outcome(data) if data else None


async def answered(gateway: Bus, *request_ids: str) -> dict[str, Outcome]:
    found: dict[str, Outcome] = {}

    async def all_in() -> bool:
        for request_id in request_ids:
            out = await outcome(gateway, request_id)
            if out is not None and out.state != "pending":
                found[request_id] = out
        return len(found) == len(request_ids)

    await until(all_in, timeout_s=30.0)
    return found


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "batched"])
async def test_an_answer_too_large_to_store_fails_its_own_request_only(
    nats_server: NatsServer, gateway: Bus, tmp_path: Path, concurrent: bool
) -> None:
    worker = WorkerBus(nats_server.url)
    await worker.connect()
    backend = FullLengthBackend(concurrent)
    service = SamplerService(worker, backend, POOL, tmp_path)
    task = asyncio.create_task(service.run())
    try:
        # 128 samples x 20k tokens: about 20 MB of tokens and logprobs, over the 8 MiB a value
        # may hold; the request itself is a few hundred bytes
        await gateway.publish_sample(POOL, job("req-huge", 128, 20_000), "req-huge")
        await gateway.publish_sample(POOL, job("req-small"), "req-small")
        found = await answered(gateway, "req-huge", "req-small")
        huge, small = found["req-huge"], found["req-small"]
        assert huge.state == "error" and huge.category == ErrorCategory.USER, huge
        assert "num_samples" in (huge.error or "") and "max_tokens" in (huge.error or "")
        assert small.state == "done", small
        assert not task.done()  # the service still serves
        await gateway.publish_sample(POOL, job("req-after"), "req-after")
        assert (await answered(gateway, "req-after"))["req-after"].state == "done"
        await asyncio.sleep(0.5)
        assert backend.seen.count("req-huge") == 1  # acked: never redelivered and recomputed
        stream = await gateway.js.stream_info(subjects.STREAM_SAMPLE)  # type: ignore[union-attr]
        assert stream.state.messages == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.close()


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "batched"])
async def test_an_answer_whose_write_fails_is_redelivered_and_the_service_serves_on(
    nats_server: NatsServer,
    gateway: Bus,
    tmp_path: Path,
    concurrent: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = FlakyWrites(nats_server.url, failing={"req-dropped"})
    await worker.connect()
    backend = FullLengthBackend(concurrent)
    service = SamplerService(worker, backend, POOL, tmp_path)
    task = asyncio.create_task(service.run())
    try:
        with caplog.at_level(logging.ERROR):
            await gateway.publish_sample(POOL, job("req-dropped"), "req-dropped")
            await gateway.publish_sample(POOL, job("req-next"), "req-next")
            found = await answered(gateway, "req-dropped", "req-next")
        assert found["req-dropped"].state == "done" and found["req-next"].state == "done"
        assert not task.done()
        assert backend.seen.count("req-dropped") == 2  # sampled again after the failed write
        ours = [r for r in caplog.records if r.name == "workers.sampler.service"]
        assert any("req-dropped" in record.getMessage() for record in ours)
        assert not [r for r in caplog.records if r.name == "asyncio"]  # no exception lost
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.close()


class SlowBackend(FullLengthBackend):
    """Takes `seconds` over each batch, as a long generation does."""

    def __init__(self, concurrent: bool, seconds: float) -> None:
        super().__init__(concurrent)
        self.seconds = seconds

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        answers = await super().sample_many(items)
        await asyncio.sleep(self.seconds)
        return answers


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "batched"])
async def test_a_sample_longer_than_ack_wait_runs_once(
    nats_server: NatsServer, gateway: Bus, tmp_path: Path, concurrent: bool
) -> None:
    """A job held past `ack_wait` (queued behind a long batch, or running) is kept alive, not
    redelivered to run a second time beside the first."""
    worker = WorkerBus(nats_server.url, ack_wait_s=1.5)
    await worker.connect()
    backend = SlowBackend(concurrent, seconds=2.5)
    service = SamplerService(worker, backend, POOL, tmp_path)
    task = asyncio.create_task(service.run())
    try:
        await gateway.publish_sample(POOL, job("req-long"), "req-long")
        await until(lambda: _seen(backend, "req-long"))
        await gateway.publish_sample(POOL, job("req-queued"), "req-queued")
        found = await answered(gateway, "req-long", "req-queued")
        assert {out.state for out in found.values()} == {"done"}
        await asyncio.sleep(2.0)  # a redelivery would have come by now
        assert sorted(backend.seen) == ["req-long", "req-queued"], backend.seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await worker.close()


async def _seen(backend: FullLengthBackend, request_id: str) -> bool:
    return request_id in backend.seen


class PoisonBackend(FullLengthBackend):
    """Never comes back from `poison`, as an engine that dies on it; answers the rest."""

    def __init__(self, concurrent: bool, poison: str) -> None:
        super().__init__(concurrent)
        self.poison = poison

    async def sample_many(self, items: list[Prepared]) -> list[SampleOutput | TwinkleError]:
        if any(item.job.request_id == self.poison for item in items):
            self.seen += [item.job.request_id for item in items]
            await asyncio.Event().wait()
        return await super().sample_many(items)


class Sampler:
    """One sampler process: a service on its own connection, stopped as a crash stops it
    (nothing acked, nothing answered)."""

    def __init__(self, url: str, root: Path, concurrent: bool) -> None:
        self.url, self.root, self.concurrent = url, root, concurrent

    async def __aenter__(self) -> PoisonBackend:
        self.bus = WorkerBus(self.url, ack_wait_s=1.0)
        await self.bus.connect()
        backend = PoisonBackend(self.concurrent, "req-poison")
        service = SamplerService(self.bus, backend, POOL, self.root, max_attempts=2)
        self.task = asyncio.create_task(service.run())
        return backend

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.bus.close()


@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "batched"])
async def test_a_sample_that_stops_its_sampler_runs_alone_then_fails(
    nats_server: NatsServer, gateway: Bus, tmp_path: Path, concurrent: bool
) -> None:
    """A request that stops every sampler it reaches: after a first stop it runs alone (a
    request that comes while it runs waits, and is not counted as begun); after `max_attempts`
    stops it fails with a server error and is not run again; the others are answered."""
    for request_id in ("req-poison", "req-innocent"):
        await gateway.put(
            subjects.BUCKET_FUTURES,
            subjects.future_key(request_id),
            encode_outcome(pending_of(job(request_id))),
        )
    async with Sampler(nats_server.url, tmp_path, concurrent) as first:
        await gateway.publish_sample(POOL, job("req-poison"), "req-poison")
        await gateway.publish_sample(POOL, job("req-innocent"), "req-innocent")
        await until(lambda: _seen(first, "req-poison"))
        await asyncio.sleep(0.3)
    # the first sampler stopped while sampling: both come back; the poison runs alone
    async with Sampler(nats_server.url, tmp_path, concurrent) as second:
        await until(lambda: _seen(second, "req-poison"), timeout_s=20.0)
        await gateway.publish_sample(POOL, job("req-fresh"), "req-fresh")
        await asyncio.sleep(1.5)
        assert second.seen == ["req-poison"] or second.seen[:2] == ["req-innocent", "req-poison"]
    async with Sampler(nats_server.url, tmp_path, concurrent) as third:
        found = await answered(gateway, "req-poison", "req-innocent", "req-fresh")
        assert "req-poison" not in third.seen
    poison = found["req-poison"]
    assert poison.state == "error" and poison.category == ErrorCategory.SERVER, poison
    assert "not run again" in (poison.error or "")
    assert found["req-innocent"].state == "done" and found["req-fresh"].state == "done"


async def test_a_worker_with_another_ack_wait_updates_the_pools_consumer(
    nats_server: NatsServer, gateway: Bus
) -> None:
    """JetStream keeps a durable consumer's settings: the worker started with another
    `ack_wait` sets it, or a changed TWINKLE_ACK_WAIT_S would not take effect."""
    durable = subjects.sample_consumer(POOL)

    async def nothing(msg: object) -> None:
        return None

    for ack_wait_s in (120.0, 7.0, 7.0):
        worker = WorkerBus(nats_server.url, ack_wait_s=ack_wait_s)
        await worker.connect()
        try:
            task = await worker.consume(
                subjects.STREAM_SAMPLE, subjects.sample_subject(POOL), durable, nothing
            )
            assert gateway.js is not None
            info = await gateway.js.consumer_info(subjects.STREAM_SAMPLE, durable)
            assert info.config.ack_wait == ack_wait_s
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            await worker.close()


async def test_a_stream_listener_that_fails_stops_its_own_updates_only(
    nats_server: NatsServer, gateway: Bus, tmp_path: Path
) -> None:
    """The listener runs inside the engine's driver, between steps: a fault in it (here, a
    tokenizer that cannot decode) must not reach the driver, which would fail every request
    it steps."""
    from protocol.jobs import TextPrompt
    from protocol.sampling import SampleSpec

    class Undecodable:
        def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
            raise ValueError("no such token")

    worker = WorkerBus(nats_server.url)
    await worker.connect()
    try:
        service = SamplerService(worker, FullLengthBackend(True), POOL, tmp_path)
        service._tokenizers["m"] = Undecodable()  # type: ignore[assignment]
        streamed = msgspec.structs.replace(
            job("req-stream"), text=TextPrompt(text="hi", stream=True)
        )
        heard = service._progress(streamed, SampleSpec(prompt=(5, 6, 7)))
        heard({0: [5, 6]})  # raised before
        heard({0: [5, 6, 7]})  # and stays quiet
    finally:
        await worker.close()
