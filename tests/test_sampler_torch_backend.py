"""The trainer's torch sampler behind the sampler service (`TorchBackend`): requests join the
running generation and are answered as they finish, training calls run between two steps, and
a failed step fails only the requests it held (fp32, CPU, a tiny model built offline)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import NotFound, ServerError
from protocol.sampling import SampleOutput, SampleSpec
from tests.engine_helpers import Trainer
from tests.sampling_helpers import (
    adapter,
    assert_same,
    count_steps,
    driver_gone,
    executor_fixture,  # noqa: F401  (the executor fixture)
    prepared,
    prompt,
    tiny_qwen3_fixture,  # noqa: F401  (the tiny_qwen3 fixture)
    train_step,
)
from workers.sampler.backends import TorchBackend

pytestmark = pytest.mark.usefixtures("torch_one_thread")


async def test_a_late_request_is_answered_first_and_training_runs_between_steps(
    tiny_qwen3: Path, tmp_path: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=4, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    directory = adapter(engine, "policy", 1, tmp_path / "policy")
    long = SampleSpec(prompt(50, 6), num_samples=2, max_tokens=120, seed=1, stop_at_eos=False)
    short = SampleSpec(prompt(51, 9), max_tokens=3, seed=2, stop_at_eos=False)
    sampler.load_adapter("policy@1", directory)
    [long_alone], [short_alone] = (
        sampler.sample([(long, "policy@1")]),
        sampler.sample([(short, None)]),
    )

    generating = threading.Event()
    count_steps(monkeypatch, sampler, lambda n: generating.set() if n == 3 else None)
    first = asyncio.create_task(backend.sample_many([prepared(long, "policy@1", directory)]))
    assert await asyncio.to_thread(generating.wait, 60)
    # Training the snapshot's source on the engine thread, and a late request, while it runs.
    trained = asyncio.get_running_loop().run_in_executor(executor, train_step, engine, "policy", 9)
    [late] = await backend.sample_many([prepared(short)])
    await trained
    assert not first.done()
    [output] = await first
    assert isinstance(late, SampleOutput) and isinstance(output, SampleOutput)
    assert_same(late, short_alone)
    assert_same(output, long_alone)  # the snapshot is not the trained tenant
    await driver_gone()


async def test_callers_answered_by_one_step(tiny_qwen3: Path, executor: ThreadPoolExecutor) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    backend = TorchBackend(engine.sampler(), executor)
    spec = SampleSpec(prompt(54, 4), max_tokens=3, temperature=0.0, stop_at_eos=False)
    calls = [backend.sample_many([prepared(spec)]) for _ in range(3)]
    outputs = [output for [output] in await asyncio.gather(*calls)]
    assert all(isinstance(output, SampleOutput) for output in outputs)
    assert outputs[0] == outputs[1] == outputs[2]
    await driver_gone()


async def test_a_failed_step_fails_its_requests_and_sampling_goes_on(
    tiny_qwen3: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    spec = SampleSpec(prompt(52, 4), max_tokens=4, temperature=0.0)

    def fail_second(n: int) -> None:
        if n == 2:
            raise RuntimeError("boom")

    count_steps(monkeypatch, sampler, fail_second)
    results = await backend.sample_many([prepared(spec), prepared(spec, "never-loaded")])
    # the unknown adapter is answered at the first step; the other request fails at the second
    assert [type(result) for result in results] == [ServerError, NotFound]
    assert not sampler.busy
    [again] = await backend.sample_many([prepared(spec)])
    assert isinstance(again, SampleOutput) and len(again.sequences[0].tokens) == 4
    await driver_gone()


async def test_cancelled_waiters_stop_the_driver(
    tiny_qwen3: Path, executor: ThreadPoolExecutor
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    backend = TorchBackend(engine.sampler(), executor)
    endless = SampleSpec(prompt(53, 4), max_tokens=100_000, temperature=0.0, stop_at_eos=False)
    waiter = asyncio.create_task(backend.sample_many([prepared(endless)]))
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await driver_gone()


async def test_a_request_taken_by_the_step_that_answers_another_caller_is_answered(
    tiny_qwen3: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first caller, answered, looks for anyone still waiting before it stops the driver:
    a request the driver is submitting at that moment waits too."""
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    spec = SampleSpec(prompt(55, 4), max_tokens=3, temperature=0.0, stop_at_eos=False)
    steps: list[int] = []
    count_steps(monkeypatch, sampler, steps.append)
    await backend.sample_many([prepared(spec)])
    last = len(steps)  # the step that answers a request alone
    await driver_gone()

    loop = asyncio.get_running_loop()
    late: list[asyncio.Task[list[SampleOutput | Any]]] = []

    async def queue_late() -> None:
        late.append(asyncio.create_task(backend.sample_many([prepared(spec)])))
        await asyncio.sleep(0)  # it is queued for the driver's next step

    def on_step(n: int) -> None:
        if n == last:  # before the step that answers the first caller
            asyncio.run_coroutine_threadsafe(queue_late(), loop).result(10)

    count_steps(monkeypatch, sampler, on_step)
    steps.clear()
    [first] = await backend.sample_many([prepared(spec)])
    [second] = await asyncio.wait_for(late[0], 30)
    assert isinstance(first, SampleOutput) and isinstance(second, SampleOutput)
    assert first == second
    await driver_gone()
