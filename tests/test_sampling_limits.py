"""The torch sampler against hostile sampling options, on the tiny Qwen3 (fp32, CPU): a
near-zero temperature is greedy and leaves every other request alone, non-finite logits draw
the most likely token, a request whose prompt outputs fail fails alone, and full-vocabulary
prompt logits exist only for the prompts that ask for them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import DynamicCache

from protocol.errors import ServerError, TwinkleError
from protocol.sampling import SampleOutput, SampleSpec, TargetIds
from tests.engine_helpers import Trainer
from workers.engine.lora import BASE_SLOT
from workers.sampler.batch import Request, Row, RunningBatch, fill_prompt_outputs
from workers.sampler.torch_sampler import TorchSampler

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOLERANCE = 1e-4


@pytest.fixture
def sampler(tiny_model: Path) -> Iterator[TorchSampler]:
    yield Trainer(str(tiny_model), max_slots=2, max_rank=8).sampler()


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 500, length))


def assert_same(got: SampleOutput, want: SampleOutput) -> None:
    """Same tokens and alternative draws; logprobs equal up to fp32 rounding."""
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for seq, ref in zip(got.sequences, want.sequences, strict=True):
        assert np.allclose(seq.logprobs, ref.logprobs, atol=TOLERANCE)
    assert got.prompt_alt_tokens == want.prompt_alt_tokens
    for name in ("prompt_logprobs", "target_prompt_logprobs", "prompt_alt_logprobs"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            a = np.array([math.nan if v is None else v for v in np.ravel(mine)], np.float64)
            b = np.array([math.nan if v is None else v for v in np.ravel(theirs)], np.float64)
            assert np.allclose(a, b, atol=TOLERANCE, equal_nan=True), name


def run_alone(sampler: TorchSampler, spec: SampleSpec) -> SampleOutput:
    [output] = sampler.sample([(spec, None)])
    return output


def test_a_near_zero_temperature_is_greedy_and_spares_the_batch(sampler: TorchSampler) -> None:
    tokens = prompt(1, 9)
    tiny = SampleSpec(tokens, num_samples=2, max_tokens=6, temperature=1e-300, stop_at_eos=False)
    tiny_alt = replace(tiny, prompt_alt_tokens_k=2, prompt_logprobs=True)
    other = SampleSpec(prompt(2, 7), num_samples=2, max_tokens=6, seed=5, stop_at_eos=False)
    outputs = sampler.sample([(tiny, None), (tiny_alt, None), (other, None)])

    greedy = run_alone(sampler, replace(tiny, temperature=0.0))
    assert_same(outputs[0], greedy)
    assert_same(outputs[1], run_alone(sampler, replace(tiny_alt, temperature=0.0)))
    assert_same(outputs[2], run_alone(sampler, other))
    alt = outputs[1]
    assert alt.prompt_alt_tokens is not None and alt.prompt_alt_logprobs is not None
    assert alt.prompt_logprobs is not None
    assert np.isfinite(alt.prompt_alt_logprobs).all()
    assert np.isfinite([s.logprobs for s in outputs[1].sequences]).all()
    # every draw is the most likely token, scored with the raw (temperature-free) logprob
    for row, (draws, logprobs) in enumerate(
        zip(alt.prompt_alt_tokens, alt.prompt_alt_logprobs, strict=True)
    ):
        assert draws[0] == draws[1] and logprobs[0] == logprobs[1]
        if tokens[row + 1] == draws[0]:
            assert abs(logprobs[0] - alt.prompt_logprobs[row + 1]) <= TOLERANCE


def test_non_finite_logits_take_the_most_likely_token(sampler: TorchSampler) -> None:
    vocab = sampler.model.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = math.inf  # row 1 predicts prompt token 2: all its mass is on token 7
    spec = SampleSpec((3, 4, 5, 6), temperature=1.0, seed=1, prompt_alt_tokens_k=3)
    output = SampleOutput(sequences=[])
    fill_prompt_outputs(output, spec, logits)
    assert output.prompt_alt_tokens is not None and output.prompt_alt_tokens[1] == [7, 7, 7]

    def row(spec: SampleSpec, seed: int) -> Row:
        generator = torch.Generator().manual_seed(seed)
        return Row(Request(seed, spec, None), 0, BASE_SLOT, generator, frozenset(), 8)

    batch = RunningBatch(
        [row(spec, 1), row(spec, 2)],
        DynamicCache(config=sampler.model.model.config),
        torch.ones(2, 1, dtype=torch.long),
        logits[:2].clone(),
    )
    batch.draw(sampler.tokenizer)
    assert batch.rows[1].tokens == [7]
    assert 0 <= batch.rows[0].tokens[0] < vocab


def test_a_request_whose_prompt_outputs_fail_fails_alone(sampler: TorchSampler) -> None:
    tokens = prompt(3, 5)
    # An id no validation would let through: its prompt outputs fail inside the sampler.
    broken = SampleSpec(
        tokens, max_tokens=4, target_prompt_logprobs=TargetIds(4, 1, (10**9, 1, 2, 3))
    )
    good = SampleSpec(prompt(4, 8), num_samples=2, max_tokens=4, seed=3, prompt_logprobs=True)
    tickets = [sampler.submit(broken, None), sampler.submit(good, None)]
    answers: dict[int, SampleOutput | TwinkleError] = {}
    while sampler.busy:
        answers.update(sampler.step())
    assert isinstance(answers[tickets[0]], ServerError)
    answer = answers[tickets[1]]
    assert isinstance(answer, SampleOutput)
    assert_same(answer, run_alone(sampler, good))


def test_full_vocabulary_logits_only_for_the_prompts_that_ask(sampler: TorchSampler) -> None:
    head = sampler.model.passes.head
    linear = getattr(head, "base_layer", head)
    assert isinstance(linear, nn.Linear)
    vocab = sampler.model.vocab_size
    rows_seen: list[int] = []

    def count(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
        rows_seen.append(out.numel() // vocab)

    long_plain = SampleSpec(prompt(5, 300), num_samples=2, max_tokens=3, seed=1)
    short_scored = SampleSpec(
        prompt(6, 6), max_tokens=3, seed=2, prompt_logprobs=True, prompt_alt_tokens_k=2
    )
    handle = linear.register_forward_hook(count)
    try:
        batched = sampler.sample([(long_plain, None), (short_scored, None)])
    finally:
        handle.remove()
    # The prefill: one row per request for the first token, and the short prompt's own rows;
    # never [requests, longest prompt, vocabulary].
    assert max(rows_seen) <= len(short_scored.prompt)
    assert_same(batched[0], run_alone(sampler, long_plain))
    assert_same(batched[1], run_alone(sampler, short_scored))
