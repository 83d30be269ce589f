"""What the sampler tests share: the tiny model they sample, adapters trained and saved on a
`tests.engine_helpers.Trainer`, the trainer's own forward as the reference for logprobs, and
the pieces that drive a `TorchBackend` (a prepared job, the engine thread, a step counter).

The fixtures here (`tiny_qwen3`, `executor`) are registered in a module by importing their
functions (`tiny_qwen3_fixture`, `executor_fixture`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from nats.aio.msg import Msg

from protocol.api import AdamParams, LoraConfig
from protocol.jobs import SampleJob
from protocol.sampling import MAX_LOGPROBS_K, SampleOutput, SampleSpec
from protocol.tensors import DatumArrays, FwdBwdRequest
from tests.engine_helpers import Trainer
from workers.sampler.backends import Prepared
from workers.sampler.torch_sampler import TorchSampler
from workers.tiny_model import build_tiny_model

TOLERANCE = 1e-4
# vLLM against the trainer: its own kernels, the same numbers up to this
VLLM_TOLERANCE = 1e-3
# prompts the vLLM tests score on the tiny models (token ids under every tiny vocabulary)
PROMPTS = [
    (1, 472, 198, 40, 41, 42, 43, 44, 45, 46, 47, 48, 2, 198, 1),
    (1, 77, 78, 79, 300, 301, 302, 100, 101),
]
ADAM = AdamParams(learning_rate=1e-2)
REQUEST_NUMBERS = itertools.count()


@pytest.fixture(scope="module", name="tiny_qwen3")
def tiny_qwen3_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_qwen3`: the tiny Qwen3 of `workers.tiny_model`, built once a module."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(name="executor")
def executor_fixture() -> Iterator[ThreadPoolExecutor]:
    """`executor`: the engine thread a `TorchBackend` runs its steps on."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
    yield pool
    pool.shutdown(wait=True)


# -- adapters and the trainer's forward ---------------------------------------------------------


def perturb_b(engine: Trainer, model_id: str, seed: int) -> None:
    """Random non-zero B, so the adapter changes the model's output."""
    generator = torch.Generator().manual_seed(seed)
    rank = engine.spec(model_id).rank
    for _, _, b in engine.bank.slot_views(engine.bank.weights, engine.slot(model_id), rank):
        b.copy_(torch.randn(b.shape, generator=generator) * 0.05)


def train_step(engine: Trainer, model_id: str, seed: int, targets: int | None = None) -> None:
    """One forward_backward + optim_step on random tokens (all targets `targets` if given)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, engine.vocab_size, 12).astype(np.int32)
    target = np.full(12, targets) if targets is not None else np.roll(tokens, -1)
    datum = DatumArrays(tokens, {"target_tokens": target.astype(np.int64)})
    request = FwdBwdRequest(model_id, 1, "cross_entropy", False, {}, [datum])
    engine.forward_backward([(model_id, request)])
    engine.optim_step([(model_id, ADAM)])


def adapter(engine: Trainer, model_id: str, seed: int, directory: Path) -> Path:
    """A trained adapter `model_id`, saved as a sampler checkpoint in `directory`."""
    engine.create(model_id, LoraConfig(rank=8, seed=seed))
    perturb_b(engine, model_id, seed=100 + seed)
    train_step(engine, model_id, seed=200 + seed)
    engine.save(model_id, directory, kind="sampler_weights", meta={})
    return directory


def base_reference(engine: Trainer) -> str:
    """A tenant whose adapter is exactly zero (B = 0): its forward is the base model's."""
    engine.create("base-reference", LoraConfig(rank=1, seed=0))
    return "base-reference"


def forward_logprobs(engine: Trainer, model_id: str, tokens: list[int]) -> np.ndarray:
    """The trainer's forward logprobs of every vocabulary token after each prefix of `tokens`:
    [len(tokens) - 1, vocab], row i predicting tokens[i + 1]. One forward-only request whose
    datums each score `MAX_LOGPROBS_K` of the ids (the widest [N, K] targets a request takes)."""
    n, vocab = len(tokens) - 1, engine.vocab_size
    columns = np.arange(-(-vocab // MAX_LOGPROBS_K) * MAX_LOGPROBS_K, dtype=np.int64) % vocab
    prompt = np.asarray(tokens[:-1], np.int32)
    datums = [
        DatumArrays(prompt, {"target_tokens": np.broadcast_to(ids, (n, ids.size)).copy()})
        for ids in columns.reshape(-1, MAX_LOGPROBS_K)
    ]
    request = FwdBwdRequest(model_id, 1, "cross_entropy", True, {}, datums)
    [result] = engine.forward_backward([(model_id, request)])
    assert not isinstance(result, Exception)
    scored = np.concatenate([out["logprobs"] for out in result.loss_fn_outputs], axis=1)
    return scored[:, :vocab]


def next_token_datum(tokens: list[int]) -> DatumArrays:
    """Next-token targets over `tokens`: row i scores tokens[i + 1]."""
    return DatumArrays(
        tokens=np.asarray(tokens[:-1], dtype=np.int32),
        inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
    )


def reference_logprobs(engine: Trainer, model_id: str, tokens: list[int]) -> np.ndarray:
    """The trainer's logprob of each of tokens[1:] (a forward-only cross-entropy pass)."""
    request = FwdBwdRequest(model_id, 0, "cross_entropy", True, {}, [next_token_datum(tokens)])
    (result,) = engine.forward_backward([(model_id, request)])
    assert not isinstance(result, Exception)
    logprobs: np.ndarray = result.loss_fn_outputs[0]["logprobs"]
    return logprobs


# -- comparing samples ---------------------------------------------------------------------------


def max_diff(a: object, b: object) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def assert_same(got: SampleOutput, want: SampleOutput) -> None:
    """Same tokens and stop reasons; logprobs equal up to fp32 rounding."""
    assert len(got.sequences) == len(want.sequences)
    for seq, ref in zip(got.sequences, want.sequences, strict=True):
        assert seq.tokens == ref.tokens and seq.stop_reason == ref.stop_reason
        assert max_diff(seq.logprobs, ref.logprobs) <= TOLERANCE
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None)
    if got.prompt_logprobs is not None and want.prompt_logprobs is not None:
        assert max_diff(got.prompt_logprobs[1:], want.prompt_logprobs[1:]) <= TOLERANCE


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 500, length))


# -- driving a backend ---------------------------------------------------------------------------


def prepared(spec: SampleSpec, key: str | None = None, directory: Path | None = None) -> Prepared:
    """A sample job as the sampler service hands it to a backend."""
    job = SampleJob(
        request_id=f"req-{next(REQUEST_NUMBERS)}",
        tenant_id="t",
        sampling_session_id="s",
        base_model="m",
    )
    return Prepared(job, cast(Msg, None), spec, directory, key)


def count_steps(
    monkeypatch: pytest.MonkeyPatch, sampler: TorchSampler, hook: Callable[[int], None]
) -> None:
    """Call `hook(n)` (on the engine thread) before the sampler's n-th step."""
    step = sampler.step
    count = 0

    def counted() -> Any:
        nonlocal count
        count += 1
        hook(count)
        return step()

    monkeypatch.setattr(sampler, "step", counted)


async def driver_gone() -> None:
    """The backend's driver task ends once nothing is waiting or generating."""
    for _ in range(200):
        if not any(task.get_name() == "torch-sampler" for task in asyncio.all_tasks()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the torch sampler's driver is still running")
