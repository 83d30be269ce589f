"""The torch sampler on the engine's multi-slot model (fp32, CPU, tiny models built offline):
logprobs against the engine's own forward, snapshot isolation from training, seeds, stops,
batch composition, snapshot slots, and continuous batching (requests joining a running
generation step by step, snapshots evicted between steps, caches that cannot merge).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from protocol.api import LoraConfig
from protocol.errors import NotFound
from protocol.sampling import SampleOutput, SampleSpec, TargetIds
from tests.engine_helpers import Trainer
from tests.sampling_helpers import (
    TOLERANCE,
    adapter,
    assert_same,
    base_reference,
    forward_logprobs,
    max_diff,
    perturb_b,
    prompt,
    tiny_qwen3_fixture,  # noqa: F401  (the tiny_qwen3 fixture)
    train_step,
)
from workers.sampler import torch_sampler
from workers.sampler.batch import mergeable
from workers.sampler.torch_sampler import TorchSampler
from workers.tiny_model import EOS_ID, build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5")


Setup = tuple[Trainer, TorchSampler]


@pytest.fixture
def make_setup(tiny_qwen3: Path) -> Callable[..., Setup]:
    def make(max_slots: int = 4, model: Path = tiny_qwen3) -> Setup:
        engine = Trainer(str(model), max_slots=max_slots, max_rank=8)
        return engine, engine.sampler()

    return make


# -- 1. parity with the engine's forward -----------------------------------------------------


def test_logprobs_equal_the_engine_forward(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    sampler.load_adapter("policy@1", adapter(engine, "policy", 1, tmp_path / "policy"))
    base = base_reference(engine)
    specs = [
        SampleSpec(prompt(1, 9), num_samples=2, max_tokens=6, seed=3, prompt_logprobs=True),
        SampleSpec(
            prompt(2, 4), max_tokens=7, seed=4, prompt_logprobs=True, topk_prompt_logprobs=3
        ),
    ]
    outputs = sampler.sample([(specs[0], None), (specs[1], "policy@1")])

    for spec, output, model_id in zip(specs, outputs, (base, "policy"), strict=True):
        full = forward_logprobs(engine, model_id, list(spec.prompt))
        expected = full[np.arange(len(spec.prompt) - 1), list(spec.prompt[1:])]
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        assert max_diff(output.prompt_logprobs[1:], expected) <= TOLERANCE
        if spec.topk_prompt_logprobs:
            assert output.topk_prompt_logprobs is not None
            assert output.topk_prompt_logprobs[0] == []
            for row, pairs in zip(full, output.topk_prompt_logprobs[1:], strict=True):
                ids, values = [token for token, _ in pairs], [lp for _, lp in pairs]
                assert len(pairs) == 3
                assert max_diff(values, np.sort(row)[::-1][:3]) <= TOLERANCE
                assert max_diff(values, row[ids]) <= TOLERANCE
        else:
            assert output.topk_prompt_logprobs is None
        assert len(output.sequences) == spec.num_samples
        for seq in output.sequences:
            assert len(seq.tokens) == spec.max_tokens and seq.stop_reason == "length"
            forced = forward_logprobs(engine, model_id, [*spec.prompt, *seq.tokens])
            completion = forced[len(spec.prompt) - 1 :]
            expected = completion[np.arange(len(seq.tokens)), seq.tokens]
            assert max_diff(seq.logprobs, expected) <= TOLERANCE


# -- 2. snapshot isolation --------------------------------------------------------------------


def test_snapshot_is_unchanged_by_training_its_source(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    sampler.load_adapter("policy@1", adapter(engine, "policy", 2, tmp_path / "policy"))
    spec = SampleSpec(prompt(3, 6), num_samples=2, max_tokens=8, seed=7, prompt_logprobs=True)
    [before] = sampler.sample([(spec, "policy@1")])
    live_before = forward_logprobs(engine, "policy", list(spec.prompt))

    for step in range(2):
        train_step(engine, "policy", seed=300 + step)
    assert max_diff(forward_logprobs(engine, "policy", list(spec.prompt)), live_before) > 1e-3

    [after] = sampler.sample([(spec, "policy@1")])
    assert after == before  # bit-identical: same weights, same batch, same seeds


# -- 3. seeds ---------------------------------------------------------------------------------


def test_seed_fixes_tokens_whatever_the_batch(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    sampler.load_adapter("a", adapter(engine, "a", 3, tmp_path / "a"))
    sampler.load_adapter("b", adapter(engine, "b", 4, tmp_path / "b"))
    spec = SampleSpec(prompt(4, 5), num_samples=2, max_tokens=10, seed=11)
    [alone] = sampler.sample([(spec, "a")])
    [again] = sampler.sample([(spec, "a")])
    assert again == alone
    first, second = alone.sequences
    assert first.tokens != second.tokens  # each sample has its own stream

    others = [
        (SampleSpec(prompt(5, 12), num_samples=3, max_tokens=4, seed=1), None),
        (SampleSpec(prompt(6, 2), max_tokens=12, temperature=0.0), "b"),
        (SampleSpec(prompt(7, 7), max_tokens=6), "a"),  # unseeded
    ]
    batched = sampler.sample([others[0], (spec, "a"), *others[1:]])
    assert_same(batched[1], alone)

    [reseeded] = sampler.sample([(SampleSpec(spec.prompt, max_tokens=10, seed=12), "a")])
    assert reseeded.sequences[0].tokens != first.tokens
    unseeded = SampleSpec(spec.prompt, max_tokens=10)
    draws = [sampler.sample([(unseeded, "a")])[0].sequences[0].tokens for _ in range(2)]
    assert draws[0] != draws[1]


def test_top_k_one_and_tiny_top_p_are_greedy(make_setup: Callable[..., Setup]) -> None:
    _, sampler = make_setup()
    tokens = prompt(8, 5)
    greedy = SampleSpec(tokens, max_tokens=8, temperature=0.0, stop_at_eos=False)
    top_k = SampleSpec(tokens, max_tokens=8, temperature=1.5, top_k=1, seed=2, stop_at_eos=False)
    top_p = SampleSpec(tokens, max_tokens=8, top_p=1e-6, seed=3, stop_at_eos=False)
    outputs = sampler.sample([(greedy, None), (top_k, None), (top_p, None)])
    assert outputs[1].sequences[0].tokens == outputs[0].sequences[0].tokens
    assert outputs[2].sequences[0].tokens == outputs[0].sequences[0].tokens


# -- 4. stops -----------------------------------------------------------------------------------


def test_stops_and_greedy(make_setup: Callable[..., Setup]) -> None:
    engine, sampler = make_setup()
    base = base_reference(engine)
    tokens = prompt(9, 6)
    open_ended = SampleSpec(tokens, max_tokens=16, temperature=0.0, stop_at_eos=False)
    [output] = sampler.sample([(open_ended, None)])
    [greedy] = output.sequences
    assert len(greedy.tokens) == 16 and greedy.stop_reason == "length"
    forced = forward_logprobs(engine, base, [*tokens, *greedy.tokens])[len(tokens) - 1 :]
    chosen = forced[np.arange(16), greedy.tokens]
    assert np.all(chosen >= forced.max(axis=-1) - 1e-5)  # each token is an argmax
    assert max_diff(greedy.logprobs, chosen) <= TOLERANCE

    stop_id = greedy.tokens[5]
    cut = greedy.tokens.index(stop_id) + 1
    by_id = SampleSpec(tokens, max_tokens=16, temperature=0.0, stop_token_ids=(stop_id,))
    [[seq]] = [out.sequences for out in sampler.sample([(by_id, None)])]
    assert seq.tokens == greedy.tokens[:cut] and seq.stop_reason == "stop"

    text = sampler.tokenizer.decode(greedy.tokens)
    stop = next(
        text[i : i + 3] for i in range(len(text) // 2, len(text)) if "\ufffd" not in text[i : i + 3]
    )
    cut = next(n for n in range(1, 17) if stop in sampler.tokenizer.decode(greedy.tokens[:n]))
    assert cut < 16
    by_string = SampleSpec(tokens, max_tokens=16, temperature=0.0, stop_strings=("\x00", stop))
    [[seq]] = [out.sequences for out in sampler.sample([(by_string, None)])]
    assert seq.tokens == greedy.tokens[:cut] and seq.stop_reason == "stop"

    short = SampleSpec(tokens, max_tokens=3, temperature=0.0)
    [[seq]] = [out.sequences for out in sampler.sample([(short, None)])]
    assert seq.tokens == greedy.tokens[:3] and seq.stop_reason == "length"


def test_eos_stops_unless_stop_at_eos_is_off(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    engine.create("eos", LoraConfig(rank=8, seed=5))
    perturb_b(engine, "eos", seed=5)
    for step in range(8):
        train_step(engine, "eos", seed=400 + step, targets=EOS_ID)
    engine.save("eos", tmp_path / "eos", kind="sampler_weights", meta={})
    sampler.load_adapter("eos@1", tmp_path / "eos")
    tokens = prompt(10, 5)
    at_eos = SampleSpec(tokens, max_tokens=5, temperature=0.0)
    past_eos = SampleSpec(tokens, max_tokens=5, temperature=0.0, stop_at_eos=False)
    stopped, running = sampler.sample([(at_eos, "eos@1"), (past_eos, "eos@1")])
    assert [(s.tokens, s.stop_reason) for s in stopped.sequences] == [([EOS_ID], "stop")]
    [seq] = running.sequences
    assert seq.tokens[0] == EOS_ID and len(seq.tokens) == 5 and seq.stop_reason == "length"


# -- 5. batch composition -----------------------------------------------------------------------


def mixed_requests() -> list[tuple[SampleSpec, str | None]]:
    return [
        (SampleSpec(prompt(11, 3), num_samples=2, max_tokens=9, seed=1, top_k=50), "a"),
        (SampleSpec(prompt(12, 10), max_tokens=5, temperature=0.0, prompt_logprobs=True), None),
        (SampleSpec(prompt(13, 6), num_samples=3, max_tokens=7, seed=2, top_p=0.9), "b"),
        (SampleSpec(prompt(14, 1), max_tokens=4, seed=3, temperature=0.7), None),
        (SampleSpec(prompt(15, 8), max_tokens=6, seed=4, prompt_logprobs=True), "a"),
    ]


def test_mixed_batch_equals_each_request_alone(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    sampler.load_adapter("a", adapter(engine, "src-a", 6, tmp_path / "a"))
    sampler.load_adapter("b", adapter(engine, "src-b", 7, tmp_path / "b"))
    requests = mixed_requests()
    batched = sampler.sample(requests)
    for request, output in zip(requests, batched, strict=True):
        assert_same(output, sampler.sample([request])[0])
    # The adapters matter: the same request on another adapter differs.
    assert sampler.sample([(requests[0][0], "b")])[0].sequences != batched[0].sequences


# -- snapshot slots ---------------------------------------------------------------------------


def test_snapshots_use_idle_slots_and_never_evict_tenants(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup(max_slots=3)
    directories = [adapter(engine, f"src{i}", 10 + i, tmp_path / f"s{i}") for i in range(3)]
    for model_id in ("src1", "src2"):
        engine.release(model_id)
    # One tenant (src0) and room for two snapshots.
    sampler.load_adapter("s0", directories[0])
    sampler.load_adapter("s1", directories[1])
    spec = SampleSpec(prompt(16, 4), max_tokens=5, seed=9)
    solo = {key: sampler.sample([(spec, key)])[0] for key in ("s0", "s1")}  # s1 used last
    sampler.load_adapter("s2", directories[2])
    assert not sampler.has_adapter("s0") and sampler.has_adapter("s1") and sampler.has_adapter("s2")
    solo["s2"] = sampler.sample([(spec, "s2")])[0]

    # Three snapshots in one call with two idle slots: generated in two waves, same results.
    outputs = sampler.sample([(spec, "s0"), (spec, None), (spec, "s2"), (spec, "s1")])
    for key, output in zip(("s0", "s2", "s1"), (outputs[0], outputs[2], outputs[3]), strict=True):
        assert_same(output, solo[key])

    engine.create("t1", LoraConfig(rank=4, seed=1))  # takes the least recently used snapshot's slot
    engine.create("t2", LoraConfig(rank=4, seed=2))
    assert engine.residency.slots_used() == 3 and not any(
        sampler.has_adapter(f"s{i}") for i in range(3)
    )
    sampler.load_adapter("s0", directories[0])  # every slot is a tenant's: parks the oldest
    assert (
        sampler.has_adapter("s0")
        and engine.residency.slots_used() == 2
        and engine.residency.adapters_total() == 3
    )
    assert_same(sampler.sample([(spec, "s0")])[0], solo["s0"])
    assert engine.has("src0") and engine.has("t1") and engine.has("t2")
    with pytest.raises(NotFound):
        sampler.sample([(spec, "never-loaded")])
    # The base model needs no slot.
    assert_same(sampler.sample([(spec, None)])[0], outputs[1])
    assert sampler.sample([]) == []


# -- Qwen3.5: hybrid linear/full attention ------------------------------------------------------


def test_qwen3_5_batches_with_its_recurrent_cache(
    make_setup: Callable[..., Setup], tiny_qwen3_5: Path, tmp_path: Path
) -> None:
    engine, sampler = make_setup(model=tiny_qwen3_5)
    sampler.load_adapter("a", adapter(engine, "src-a", 8, tmp_path / "a"))
    sampler.load_adapter("b", adapter(engine, "src-b", 9, tmp_path / "b"))
    requests = mixed_requests()
    batched = sampler.sample(requests)
    for request, output in zip(requests, batched, strict=True):
        assert_same(output, sampler.sample([request])[0])
    spec, _ = requests[4]
    output = batched[4]
    full = forward_logprobs(engine, "src-a", [*spec.prompt, *output.sequences[0].tokens])
    targets = [*spec.prompt[1:], *output.sequences[0].tokens]
    expected = full[np.arange(len(targets)), targets]
    assert output.prompt_logprobs is not None
    assert max_diff(output.prompt_logprobs[1:], expected[: len(spec.prompt) - 1]) <= TOLERANCE
    assert max_diff(output.sequences[0].logprobs, expected[len(spec.prompt) - 1 :]) <= TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "deepseek_v3"])
def test_a_prefill_in_chunks_equals_one_prefill(
    arch: str,
    make_setup: Callable[..., Setup],
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Long prompts prefilled a few positions at a time (`PREFILL_TOKENS`: here 7, so chunks
    of 1 to 7 columns over the batch's rows, the cache growing chunk by chunk, Qwen3.5's
    recurrent state carried) give the tokens, logprobs and prompt outputs of one prefill."""
    model = build_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch)
    engine, sampler = make_setup(model=model)
    sampler.load_adapter("a", adapter(engine, "src-a", 8, tmp_path / "a"))
    requests = [(spec, "a" if i % 2 else None) for i, (spec, _) in enumerate(mixed_requests())]
    whole = sampler.sample(requests)
    monkeypatch.setattr(torch_sampler, "PREFILL_TOKENS", 7)
    chunked = sampler.sample(requests)
    for one, other in zip(whole, chunked, strict=True):
        assert_same(other, one)


@pytest.mark.parametrize(
    "arch", ["deepseek_v3", "deepseek_v4", "glm_moe_dsa", "nemotron_h", "inkling_mm_model"]
)
def test_each_family_batches_as_each_request_alone(
    arch: str,
    make_setup: Callable[..., Setup],
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """Prompts of different lengths in one batch (left-padded rows, one cache of the family's
    own kind: MLA's compressed KV, DeepSeek-V4's compressor state, Mamba2's conv and SSM state,
    Inkling's short convolutions) give what each gives alone."""
    model = build_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch)
    engine, sampler = make_setup(model=model)
    sampler.load_adapter("a", adapter(engine, "src-a", 8, tmp_path / "a"))
    requests = [(spec, "a" if i % 2 else None) for i, (spec, _) in enumerate(mixed_requests())]
    batched = sampler.sample(requests)
    for request, output in zip(requests, batched, strict=True):
        assert_same(output, sampler.sample([request])[0])


# -- continuous batching ------------------------------------------------------------------------


def run_alone(sampler: TorchSampler, spec: SampleSpec, key: str | None) -> SampleOutput:
    [output] = sampler.sample([(spec, key)])
    return output


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_request_joins_the_running_generation_at_the_next_step(
    arch: str, make_setup: Callable[..., Setup], tiny_qwen3_5: Path, tmp_path: Path
) -> None:
    engine, sampler = make_setup(**({"model": tiny_qwen3_5} if arch == "qwen3_5" else {}))
    sampler.load_adapter("a", adapter(engine, "src-a", 20, tmp_path / "a"))
    sampler.load_adapter("b", adapter(engine, "src-b", 21, tmp_path / "b"))
    first = SampleSpec(prompt(20, 4), num_samples=2, max_tokens=12, seed=5, stop_at_eos=False)
    late = [  # longer and shorter prompts than the running rows' width, other adapters
        (SampleSpec(prompt(21, 9), max_tokens=3, seed=6, prompt_logprobs=True), "b"),
        (SampleSpec(prompt(22, 2), num_samples=2, max_tokens=4, seed=7, top_p=0.9), None),
        (SampleSpec(prompt(23, 5), max_tokens=2, temperature=0.0, stop_at_eos=False), "a"),
    ]
    alone = [run_alone(sampler, first, "a"), *(run_alone(sampler, *r) for r in late)]

    ticket = sampler.submit(first, "a")
    for _ in range(4):
        assert sampler.step() == []
    late_tickets = [sampler.submit(spec, key) for spec, key in late]
    finished: dict[int, int] = {}  # ticket -> the step (counted from the late arrival) it ended
    answers: dict[int, SampleOutput | Exception] = {}
    steps = 0
    while sampler.busy:
        steps += 1
        for done, answer in sampler.step():
            finished[done], answers[done] = steps, answer
    # Each late request joined at the next step and took one step per token; the first request
    # ran on meanwhile and finished last.
    assert [finished[t] for t in late_tickets] == [spec.max_tokens for spec, _ in late]
    assert finished[ticket] == first.max_tokens - 4 == steps
    for done, want in zip([ticket, *late_tickets], alone, strict=True):
        got = answers[done]
        assert isinstance(got, SampleOutput)
        assert_same(got, want)


def test_evicted_snapshots_come_back_between_steps(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup(max_slots=3)
    directories = [adapter(engine, f"src{i}", 30 + i, tmp_path / f"s{i}") for i in range(3)]
    for model_id in ("src1", "src2"):
        engine.release(model_id)
    sampler.load_adapter("s1", directories[1])
    sampler.load_adapter("s2", directories[2])
    requests = [
        (SampleSpec(prompt(30, 5), max_tokens=8, seed=1, stop_at_eos=False), "s1"),
        (SampleSpec(prompt(31, 3), max_tokens=8, seed=2, stop_at_eos=False), "s2"),
        (SampleSpec(prompt(32, 4), max_tokens=8, seed=3, stop_at_eos=False), None),
    ]
    alone = [run_alone(sampler, *request) for request in requests]

    tickets = [sampler.submit(spec, key) for spec, key in requests]
    sampler.step()
    # A training call between two steps takes a slot: only one snapshot fits now, and the
    # least recently used one is evicted. The rows step in two groups, reloading as they go.
    engine.create("t1", LoraConfig(rank=4, seed=1))
    assert engine.residency.snapshot_capacity() == 1
    answers: dict[int, SampleOutput | Exception] = {}
    while sampler.busy:
        answers.update(sampler.step())
    for ticket, want in zip(tickets, alone, strict=True):
        got = answers[ticket]
        assert isinstance(got, SampleOutput)
        assert_same(got, want)
    assert engine.has("src0") and engine.has("t1")


def test_waiting_for_a_snapshot_slot_keeps_arrival_order(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup(max_slots=2)
    directories = [adapter(engine, f"src{i}", 40 + i, tmp_path / f"s{i}") for i in range(2)]
    engine.release("src1")  # one tenant (src0), room for one snapshot
    spec = SampleSpec(prompt(40, 3), max_tokens=3, temperature=0.0, stop_at_eos=False)
    sampler.submit(spec, "s1", directories[1])
    sampler.step()
    blocked = sampler.submit(spec, "s0", directories[0])  # needs a second snapshot slot
    later_s1 = sampler.submit(spec, "s1")  # its snapshot is running, but it came later
    base = sampler.submit(spec, None)  # needs no slot: passes
    order = []
    while sampler.busy:
        order += [ticket for ticket, _ in sampler.step()]
    assert order.index(base) < order.index(blocked) < order.index(later_s1)


def test_never_loaded_adapter_fails_only_its_request(make_setup: Callable[..., Setup]) -> None:
    _, sampler = make_setup()
    spec = SampleSpec(prompt(41, 3), max_tokens=2, temperature=0.0)
    good, bad = sampler.submit(spec, None), sampler.submit(spec, "never-loaded")
    answers: dict[int, SampleOutput | Exception] = {}
    while sampler.busy:
        answers.update(sampler.step())
    assert isinstance(answers[bad], NotFound) and isinstance(answers[good], SampleOutput)


def test_a_cache_that_cannot_merge_joins_only_an_empty_batch(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    sliding = tmp_path / "sliding"
    shutil.copytree(tiny_qwen3, sliding)
    config = json.loads((sliding / "config.json").read_text())
    config.update(
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    (sliding / "config.json").write_text(json.dumps(config))
    assert mergeable(Trainer(str(tiny_qwen3), max_slots=1, max_rank=8).model.config)
    engine = Trainer(str(sliding), max_slots=1, max_rank=8)
    assert not mergeable(engine.model.config)
    sampler = engine.sampler()
    first = SampleSpec(prompt(42, 3), max_tokens=6, seed=1, stop_at_eos=False)
    late = SampleSpec(prompt(43, 7), max_tokens=2, seed=2, stop_at_eos=False)
    alone = [run_alone(sampler, first, None), run_alone(sampler, late, None)]
    tickets = [sampler.submit(first, None)]
    sampler.step()
    tickets.append(sampler.submit(late, None))
    order, answers = [], {}
    while sampler.busy:
        for ticket, answer in sampler.step():
            order.append(ticket)
            answers[ticket] = answer
    assert order == tickets  # the late request waited for the running one
    for ticket, want in zip(tickets, alone, strict=True):
        got = answers[ticket]
        assert isinstance(got, SampleOutput)
        assert_same(got, want)


# -- 8. the prompt and sample options: top-k sampled, target ids, alternative draws, last n ----


def test_sample_options_equal_the_engine_forward(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    engine, sampler = make_setup()
    sampler.load_adapter("policy@1", adapter(engine, "policy", 8, tmp_path / "policy"))
    tokens = prompt(11, 7)
    ids = np.full((6, 3), -1, dtype=np.int64)
    ids[0] = [5, 9, 400]
    ids[4, 1] = 77
    target = TargetIds(6, 3, tuple(ids.ravel().tolist()))
    # the same cells as CSR: rows 0 and 4 only
    sparse = TargetIds(6, 3, (5, 9, 400, 77), (0, 3, 3, 3, 3, 4, 4), (0, 1, 2, 1))
    spec = SampleSpec(
        tokens,
        num_samples=2,
        max_tokens=5,
        seed=21,
        temperature=0.8,
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=4,
        target_prompt_logprobs=target,
        prompt_alt_tokens_k=3,
        prompt_logprobs_last_n=2,
    )
    [output, sparse_output] = sampler.sample(
        [(spec, "policy@1"), (replace(spec, target_prompt_logprobs=sparse), "policy@1")]
    )
    full = forward_logprobs(engine, "policy", list(tokens))

    # last n: only the last 2 prompt positions are scored, the top-k rows likewise
    assert output.prompt_logprobs is not None and output.topk_prompt_logprobs is not None
    assert output.prompt_logprobs[:5] == [None] * 5
    assert max_diff(output.prompt_logprobs[5:], full[[4, 5], list(tokens[5:])]) <= TOLERANCE
    assert output.topk_prompt_logprobs[:5] == [[]] * 5
    assert (
        max_diff([lp for _, lp in output.topk_prompt_logprobs[6]], np.sort(full[5])[::-1][:2])
        <= TOLERANCE
    )

    # target ids: the engine's logprob at each named cell, 0.0 where -1; sparse gives the same
    assert output.target_prompt_logprobs is not None
    got = np.asarray(output.target_prompt_logprobs).reshape(6, 3)
    want = np.where(ids >= 0, full[np.arange(6)[:, None], np.maximum(ids, 0)], 0.0)
    assert max_diff(got, want) <= TOLERANCE
    assert sparse_output.target_prompt_logprobs is not None
    assert max_diff(sparse_output.target_prompt_logprobs, want[ids >= 0]) <= TOLERANCE

    # alternative tokens: k draws per position after the first, each with its raw logprob
    alt, alt_lps = output.prompt_alt_tokens, output.prompt_alt_logprobs
    assert alt is not None and alt_lps is not None
    assert np.asarray(alt).shape == (6, 3)
    assert max_diff(alt_lps, full[np.arange(6)[:, None], np.asarray(alt)]) <= TOLERANCE
    assert sparse_output.prompt_alt_tokens == alt  # seeded: the same draws

    # top-k of every sampled position: the engine's k most likely tokens there
    for seq in output.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        forced = forward_logprobs(engine, "policy", [*tokens, *seq.tokens])[len(tokens) - 1 :]
        for row, pairs in zip(forced, seq.topk_logprobs, strict=True):
            assert len(pairs) == 4
            assert max_diff([lp for _, lp in pairs], np.sort(row)[::-1][:4]) <= TOLERANCE
            assert max_diff([lp for _, lp in pairs], row[[t for t, _ in pairs]]) <= TOLERANCE

    # greedy alternatives are the most likely token, k times
    [greedy] = sampler.sample([(replace(spec, temperature=0.0, num_samples=1), "policy@1")])
    assert greedy.prompt_alt_tokens == [[int(np.argmax(row))] * 3 for row in full]


def test_seeded_samples_repeat_under_continuous_batching(
    make_setup: Callable[..., Setup], tmp_path: Path
) -> None:
    """20 seeded requests of 3 samples, each joining the running generation at a different
    step among other requests, give the tokens of the request alone."""
    engine, sampler = make_setup()
    sampler.load_adapter("a", adapter(engine, "a", 9, tmp_path / "a"))
    spec = SampleSpec(prompt(12, 6), num_samples=3, max_tokens=8, seed=99, stop_at_eos=False)
    [alone] = sampler.sample([(spec, "a")])
    assert len({tuple(seq.tokens) for seq in alone.sequences}) == 3
    rng = np.random.default_rng(5)
    tickets = []
    answers: dict[int, object] = {}
    for repetition in range(20):
        for n in range(int(rng.integers(0, 3))):
            other = SampleSpec(prompt(100 + repetition, 3 + n), max_tokens=int(rng.integers(2, 12)))
            sampler.submit(other, "a" if n % 2 else None)
        tickets.append(sampler.submit(spec, "a"))
        for _ in range(int(rng.integers(0, 4))):
            answers.update(sampler.step())
    while sampler.busy:
        answers.update(sampler.step())
    for ticket in tickets:
        output = answers[ticket]
        assert isinstance(output, SampleOutput)
        assert [seq.tokens for seq in output.sequences] == [seq.tokens for seq in alone.sequences]
