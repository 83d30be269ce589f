"""Cancelling a sample in the trainer's torch sampler (`TorchBackend.cancel`, then
`TorchSampler.cancel` on the engine thread): a queued request never reaches the sampler, a
generating one leaves the running batch at the next step while the rows of other requests
carry on exactly as they would have, and an unknown request id changes nothing (fp32, CPU, a
tiny model built offline)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from protocol.errors import Cancelled
from protocol.sampling import SampleOutput, SampleSpec
from tests.engine_helpers import Trainer
from tests.sampling_helpers import (
    assert_same,
    count_steps,
    driver_gone,
    executor_fixture,  # noqa: F401  (the executor fixture)
    prepared,
    prompt,
    tiny_qwen3_fixture,  # noqa: F401  (the tiny_qwen3 fixture)
)
from workers.sampler.backends import TorchBackend

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ENDLESS = SampleSpec(
    prompt(61, 5), num_samples=2, max_tokens=3000, temperature=0.0, stop_at_eos=False
)
SHORT = SampleSpec(prompt(62, 4), max_tokens=24, temperature=0.0, stop_at_eos=False)


async def test_a_generating_request_leaves_the_batch_and_the_others_carry_on(
    tiny_qwen3: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    [alone] = await backend.sample_many([prepared(SHORT)])
    loop = asyncio.get_running_loop()
    stepped = asyncio.Event()

    def on_step(n: int) -> None:
        if n == 8:  # both requests joined at step 1: 7 tokens each so far
            loop.call_soon_threadsafe(stepped.set)

    count_steps(monkeypatch, sampler, on_step)
    endless, short = prepared(ENDLESS), prepared(SHORT)
    task = asyncio.create_task(backend.sample_many([endless, short]))
    await asyncio.wait_for(stepped.wait(), 30)
    backend.cancel(endless.job.request_id)
    cancelled, output = await asyncio.wait_for(task, 60)
    assert isinstance(cancelled, Cancelled)
    # two rows, stopped a few steps in (the cancel lands between two steps)
    assert 2 * 7 <= cancelled.generated_tokens < 2 * SHORT.max_tokens
    assert isinstance(output, SampleOutput)
    assert_same(output, alone)  # the batch it shared lost rows; its own tokens did not change
    assert not sampler.busy
    await driver_gone()


async def test_a_queued_request_never_reaches_the_sampler(
    tiny_qwen3: Path, executor: ThreadPoolExecutor
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    item = prepared(ENDLESS)
    task = asyncio.create_task(backend.sample_many([item]))
    await asyncio.sleep(0)  # queued; the driver has not taken it yet
    backend.cancel(item.job.request_id)
    [result] = await asyncio.wait_for(task, 10)
    assert isinstance(result, Cancelled) and result.generated_tokens == 0
    assert not sampler.busy
    await driver_gone()


async def test_a_request_cancelled_while_it_is_being_submitted_leaves_at_the_next_step(
    tiny_qwen3: Path, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    loop = asyncio.get_running_loop()
    item = prepared(ENDLESS)

    async def cancel() -> None:
        backend.cancel(item.job.request_id)

    def on_step(n: int) -> None:
        if n == 1:  # the step that submits it, before it has a ticket
            asyncio.run_coroutine_threadsafe(cancel(), loop).result(10)

    count_steps(monkeypatch, sampler, on_step)
    [result] = await asyncio.wait_for(backend.sample_many([item]), 30)
    assert isinstance(result, Cancelled)
    assert 0 < result.generated_tokens < ENDLESS.max_tokens
    assert not sampler.busy
    await driver_gone()


async def test_an_unknown_or_finished_request_changes_nothing(
    tiny_qwen3: Path, executor: ThreadPoolExecutor
) -> None:
    engine = Trainer(str(tiny_qwen3), max_slots=2, max_rank=8)
    sampler = engine.sampler()
    backend = TorchBackend(sampler, executor)
    item = prepared(SHORT)
    [first] = await backend.sample_many([item])
    backend.cancel(item.job.request_id)  # finished
    backend.cancel("req-never-seen")
    assert sampler.cancel(12345) is None
    [again] = await backend.sample_many([prepared(SHORT)])
    assert isinstance(first, SampleOutput) and isinstance(again, SampleOutput)
    assert_same(again, first)
    await driver_gone()
