"""Cancelling a sample on the vLLM sampler (`VllmBackend.cancel`): the request is aborted in
the engine (nothing left unfinished), its caller gets `Cancelled` long before the generation
could have ended, and the engine serves the next request (tiny random Qwen3, fp32, CPU).

The engine settings are the ones `tests/test_sampling_vllm.py` documents, set before vLLM is
imported.
"""

from __future__ import annotations

import os

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_name, _value)

import asyncio  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

from protocol.errors import Cancelled  # noqa: E402
from protocol.sampling import SampleOutput, SampleSpec  # noqa: E402
from tests.sampling_helpers import prepared  # noqa: E402
from workers.sampler.backends import VllmBackend  # noqa: E402
from workers.sampler.vllm_sampler import VllmSampler  # noqa: E402
from workers.tiny_model import build_tiny_model  # noqa: E402

on_module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPT = (1, 77, 78, 79, 300, 301, 302, 100, 101)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmBackend]:
    model: Path = build_tiny_model(tmp_path_factory.mktemp("vllm-cancel") / "tiny-qwen3")
    sampler = VllmSampler(str(model), max_lora_rank=8, max_loras=1, max_model_len=4096)
    await sampler.start()
    try:
        yield VllmBackend(sampler, sampler.vocab_size, sampler.max_context)
    finally:
        await sampler.close()


@on_module_loop
async def test_a_cancelled_request_is_aborted_in_the_engine(backend: VllmBackend) -> None:
    endless = SampleSpec(
        PROMPT, num_samples=2, max_tokens=4000, temperature=1.0, seed=1, stop_at_eos=False
    )
    item = prepared(endless)
    started = time.monotonic()
    task = asyncio.create_task(backend.sample_many([item]))
    await asyncio.sleep(1.0)  # generating
    assert not task.done()
    backend.cancel(item.job.request_id)
    [result] = await asyncio.wait_for(task, 30)
    assert isinstance(result, Cancelled)
    engine = backend.sampler._started()
    for _ in range(100):  # the abort reaches the engine core asynchronously
        if not engine.output_processor.has_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    assert not engine.output_processor.has_unfinished_requests()
    cancelled_after_s = time.monotonic() - started
    short = SampleSpec(PROMPT, max_tokens=4, temperature=0.0, stop_at_eos=False)
    [after] = await backend.sample_many([prepared(short)])
    assert isinstance(after, SampleOutput) and len(after.sequences[0].tokens) == 4
    assert cancelled_after_s < 20


@on_module_loop
async def test_cancelling_an_unknown_request_changes_nothing(backend: VllmBackend) -> None:
    backend.cancel("req-never-seen")
    short = SampleSpec(PROMPT, max_tokens=3, temperature=0.0, stop_at_eos=False)
    [result] = await backend.sample_many([prepared(short)])
    assert isinstance(result, SampleOutput) and len(result.sequences[0].tokens) == 3
