"""The vLLM sampling backend on a tiny random Qwen3 (fp32, CPU), one engine for the module:
prompt and sampled-token logprobs against the trainer engine (base and trained adapters),
seeded sampling alone and in concurrent mixed batches, stop reasons, and the adapters the
backend refuses.

The engine core runs as one child process with one thread (settings below; see
docs/architecture.md, "Sampling"). They are set before this module imports vLLM; they are
defaults only, so a CI environment can override them.
"""

from __future__ import annotations

import os

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # model runner inside the engine-core process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_name, _value)

import asyncio  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from protocol.api import AdamParams, LoraConfig  # noqa: E402
from protocol.errors import ServerError, UserError  # noqa: E402
from protocol.sampling import SampleOutput, SampleSpec, TargetIds  # noqa: E402
from protocol.tensors import FwdBwdRequest  # noqa: E402
from tests.engine_helpers import Trainer  # noqa: E402
from tests.sampling_helpers import (  # noqa: E402
    PROMPTS,
    forward_logprobs,
    next_token_datum,
    reference_logprobs,
)
from tests.sampling_helpers import VLLM_TOLERANCE as TOLERANCE  # noqa: E402
from workers.sampler.vllm_mapping import SEED_RANGE, sampling_params  # noqa: E402
from workers.sampler.vllm_sampler import (  # noqa: E402
    LORA_TARGET_MODULES,
    VllmSampler,
    modules_outside,
    trains_unembed,
)
from workers.tiny_model import build_tiny_model  # noqa: E402

MAX_LORA_RANK = 8

# The async tests share the module's event loop, which owns the module's engine.
on_module_loop = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Checkpoints:
    """The trainer engine (kept for reference passes) and its saved sampler checkpoints."""

    model: Path
    engine: Trainer
    # "a": rank 8, attention + MLP; "b": rank 4, MLP only (both trained); "unembed": + lm_head
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpoints]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm")
    model = build_tiny_model(root / "tiny-qwen3")
    engine = Trainer(str(model), max_slots=4, max_rank=16)
    # "base": a fresh adapter (B = 0) is the base model exactly.
    engine.create("base", LoraConfig(rank=MAX_LORA_RANK, seed=0, train_unembed=False))
    engine.create("a", LoraConfig(rank=8, seed=1, train_unembed=False))
    engine.create("b", LoraConfig(rank=4, seed=2, train_attn=False, train_unembed=False))
    engine.create("unembed", LoraConfig(rank=8, seed=3))
    rng = np.random.default_rng(0)
    for model_id in ("a", "b"):
        for _ in range(3):
            tokens = rng.integers(3, 500, size=24).tolist()
            request = FwdBwdRequest(
                model_id, 0, "cross_entropy", False, {}, [next_token_datum(tokens)]
            )
            engine.forward_backward([(model_id, request)])
            engine.optim_step([(model_id, AdamParams(learning_rate=0.05))])
    adapters = {}
    for model_id in ("a", "b", "unembed"):
        adapters[model_id] = root / "sampler_weights" / model_id
        engine.save(model_id, adapters[model_id], kind="sampler_weights", meta={})
    yield Checkpoints(model, engine, adapters)
    torch.set_num_threads(previous)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sampler(checkpoints: Checkpoints) -> AsyncIterator[VllmSampler]:
    sampler = VllmSampler(
        str(checkpoints.model), max_lora_rank=MAX_LORA_RANK, max_loras=4, max_model_len=512
    )
    await sampler.start()
    try:
        yield sampler
    finally:
        await sampler.close()


def _adapter(checkpoints: Checkpoints, name: str | None) -> tuple[Path | None, str | None]:
    if name is None:
        return None, None
    return checkpoints.adapters[name], f"run-1/sampler_weights/{name}"


@on_module_loop
async def test_prompt_logprobs_match_the_trainer(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    # Base and both adapters in one concurrent batch: also the prompt_logprobs + LoRA batch
    # that crashes vLLM without the lora_target_modules work-around.
    cases = [(name, prompt) for name in (None, "a", "b") for prompt in PROMPTS]
    specs = [
        SampleSpec(prompt=prompt, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3)
        for _, prompt in cases
    ]
    outputs = await asyncio.gather(
        *(
            sampler.sample(spec, *_adapter(checkpoints, name))
            for spec, (name, _) in zip(specs, cases, strict=True)
        )
    )
    references = {}
    for (name, prompt), output in zip(cases, outputs, strict=True):
        expected = reference_logprobs(checkpoints.engine, name or "base", list(prompt))
        references[name, prompt] = expected
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        got = np.asarray(output.prompt_logprobs[1:], dtype=np.float64)
        np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)

        topk = output.topk_prompt_logprobs
        assert topk is not None and len(topk) == len(prompt) and topk[0] == []
        for row, actual in zip(topk[1:], got, strict=True):
            assert len(row) == 3
            values = [logprob for _, logprob in row]
            assert values == sorted(values, reverse=True) and values[0] >= actual - 1e-6
    # The adapters are not trivially the base model.
    for name in ("a", "b"):
        shift = np.abs(references[name, PROMPTS[0]] - references[None, PROMPTS[0]]).max()
        assert shift > 0.05, (name, shift)


@on_module_loop
async def test_sampled_logprobs_are_raw_model_logprobs(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    # Temperature and top-k change which tokens are drawn, not the logprobs reported for them.
    for name in (None, "a"):
        spec = SampleSpec(
            prompt=PROMPTS[1], max_tokens=6, temperature=0.7, top_k=50, seed=11, stop_at_eos=False
        )
        output = await sampler.sample(spec, *_adapter(checkpoints, name))
        (sequence,) = output.sequences
        assert len(sequence.tokens) == 6 and sequence.stop_reason == "length"
        full = [*PROMPTS[1], *sequence.tokens]
        expected = reference_logprobs(checkpoints.engine, name or "base", full)[-6:]
        np.testing.assert_allclose(sequence.logprobs, expected, atol=TOLERANCE, rtol=0)


def _tokens(output: SampleOutput) -> list[list[int]]:
    return [sequence.tokens for sequence in output.sequences]


@on_module_loop
async def test_seeds_reproduce_alone_and_in_concurrent_batches(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    seeded = SampleSpec(
        prompt=PROMPTS[0], num_samples=3, max_tokens=12, seed=1234, stop_at_eos=False
    )
    # Greedy with num_samples > 1 (vLLM refuses n > 1 when greedy; the backend repeats one).
    greedy = SampleSpec(
        prompt=PROMPTS[1], num_samples=2, max_tokens=12, temperature=0.0, stop_at_eos=False
    )
    calls = [(spec, name) for name in (None, "a", "b") for spec in (seeded, greedy)]

    one_by_one = [await sampler.sample(spec, *_adapter(checkpoints, n)) for spec, n in calls]
    together = await asyncio.gather(
        *(sampler.sample(spec, *_adapter(checkpoints, n)) for spec, n in calls)
    )
    assert [_tokens(o) for o in together] == [_tokens(o) for o in one_by_one]

    for output, (spec, name) in zip(one_by_one, calls, strict=True):
        samples = _tokens(output)
        assert all(len(tokens) == 12 for tokens in samples)
        if spec is seeded:
            # n > 1 with one seed: distinct samples (vLLM seeds sample i with seed + i).
            assert len({tuple(tokens) for tokens in samples}) == 3, name
        else:
            assert samples[0] == samples[1], name
    # Adapters change what is sampled; a different seed changes it too.
    base = _tokens(one_by_one[0]) + _tokens(one_by_one[1])
    assert base != _tokens(one_by_one[2]) + _tokens(one_by_one[3])
    reseeded = await sampler.sample(replace(seeded, seed=4321), None, None)
    assert _tokens(reseeded) != _tokens(one_by_one[0])


@on_module_loop
async def test_progress_hears_the_tokens_as_they_are_drawn(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    """A streamed request's listener hears each growing prefix of the final tokens; a request
    of n > 1 is answered whole (vLLM's last output of n holds one sequence) and heard never."""
    heard: list[dict[int, list[int]]] = []
    spec = SampleSpec(prompt=PROMPTS[0], max_tokens=16, seed=7, stop_at_eos=False)
    (run,) = (await sampler.sample(spec, None, None, heard.append)).sequences
    (alone,) = (await sampler.sample(spec, None, None)).sequences
    assert run.tokens == alone.tokens and len(run.tokens) == 16
    assert len(heard) >= 2
    for drawn in heard:
        assert list(drawn) == [0] and run.tokens[: len(drawn[0])] == drawn[0]
    assert [len(d[0]) for d in heard] == sorted(len(d[0]) for d in heard)
    many: list[dict[int, list[int]]] = []
    output = await sampler.sample(replace(spec, num_samples=3), None, None, many.append)
    assert len(output.sequences) == 3 and all(len(s.tokens) == 16 for s in output.sequences)
    assert many == []


@on_module_loop
async def test_stop_token_stop_string_and_length(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    # Seeded, not greedy: the random base model's greedy output is one special token repeated.
    free = SampleSpec(prompt=PROMPTS[0], max_tokens=16, seed=7, stop_at_eos=False)
    (run,) = (await sampler.sample(free, None, None)).sequences
    assert run.stop_reason == "length" and len(run.tokens) == 16
    tokens = run.tokens

    # A stop token ends the sequence at its first occurrence, and is returned.
    stop_id = tokens[4]
    stop_at = tokens.index(stop_id)
    (by_token,) = (
        await sampler.sample(replace(free, stop_token_ids=(stop_id,)), None, None)
    ).sequences
    assert by_token.stop_reason == "stop"
    assert by_token.tokens == tokens[: stop_at + 1]
    assert by_token.logprobs == pytest.approx(run.logprobs[: stop_at + 1], abs=1e-5)

    # A stop string spanning two sampled tokens: vLLM trims the text, but the returned tokens
    # run through the token that completes the string.
    tokenizer = AutoTokenizer.from_pretrained(checkpoints.model)

    def text_of(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    stop = next(
        text_of(tokens[i : i + 1])[-2:] + text_of(tokens[i + 1 : i + 2])[:1]
        for i in range(2, len(tokens) - 1)
        if all(text_of([t]).isascii() and text_of([t]).strip() for t in tokens[i : i + 2])
    )
    completes = next(n for n in range(1, len(tokens) + 1) if stop in text_of(tokens[:n]))
    (by_string,) = (await sampler.sample(replace(free, stop_strings=(stop,)), None, None)).sequences
    assert by_string.stop_reason == "stop", stop
    assert by_string.tokens == tokens[:completes], stop

    (capped,) = (await sampler.sample(replace(free, max_tokens=3), None, None)).sequences
    assert capped.stop_reason == "length" and capped.tokens == tokens[:3]

    # EOS (stop_at_eos, the default when the client sends no `stop`) ends a sequence as "stop",
    # and the EOS token is returned; with EOS ignored it may appear mid-sequence.
    eos = tokenizer.eos_token_id
    many = SampleSpec(prompt=PROMPTS[1], num_samples=16, max_tokens=64, seed=3)
    by_eos = (await sampler.sample(many, None, None)).sequences
    ended = [sequence for sequence in by_eos if sequence.stop_reason == "stop"]
    assert ended, "no sample reached EOS; pick another seed"
    for sequence in by_eos:
        assert eos not in sequence.tokens[:-1]
        assert (sequence.tokens[-1] == eos) == (sequence.stop_reason == "stop")
        assert sequence.stop_reason == "stop" or len(sequence.tokens) == 64


def _copy_with_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return target


@on_module_loop
async def test_refuses_unembed_and_oversized_adapters(
    sampler: VllmSampler, checkpoints: Checkpoints, tmp_path: Path
) -> None:
    unembed = checkpoints.adapters["unembed"]
    assert "lm_head" in json.loads((unembed / "adapter_config.json").read_text())["target_modules"]
    spec = SampleSpec(prompt=PROMPTS[1], max_tokens=2)
    with pytest.raises(UserError, match="train_unembed are served by the torch sampler"):
        await sampler.sample(spec, unembed, "run-1/sampler_weights/unembed")

    # The same adapter described by a regex, PEFT's other target_modules form.
    regex = _copy_with_config(
        unembed, tmp_path / "regex", target_modules=r"model\.layers\.0\.mlp\.up_proj|lm_head"
    )
    with pytest.raises(UserError, match="train_unembed"):
        await sampler.sample(spec, regex, None)

    too_big = _copy_with_config(checkpoints.adapters["a"], tmp_path / "r16", r=16)
    with pytest.raises(UserError, match="rank 16 exceeds .* max_lora_rank 8"):
        await sampler.sample(spec, too_big, None)

    # A refusal leaves the engine serving.
    output = await sampler.sample(spec, *_adapter(checkpoints, "a"))
    assert len(output.sequences[0].tokens) >= 1


def test_trains_unembed_reads_every_target_modules_form() -> None:
    assert trains_unembed(["q_proj", "lm_head"], None)
    assert trains_unembed(["model.layers.0.self_attn.q_proj", "lm_head"], None)
    assert trains_unembed(["q_proj"], ["embed_tokens"])
    assert trains_unembed(r"(.*\.)?(q_proj|lm_head)", None)
    assert trains_unembed("lm_head", None)
    assert not trains_unembed(["q_proj", "k_proj", "v_proj", "o_proj"], None)
    assert not trains_unembed(r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj", None)
    assert not trains_unembed(None, None)


def test_an_adapter_of_modules_the_engine_does_not_adapt_is_named() -> None:
    """vLLM's engine adapts only its pinned target modules, and a load of anything else fails
    its engine step: MLA's `q_a_proj` (DeepSeek-V3, GLM-5), Mamba2's `in_proj` (Nemotron-H) and
    Gated DeltaNet's `in_proj_qkv` are named before the adapter reaches vLLM."""

    def key(path: str, matrix: str = "A") -> str:
        return f"base_model.model.{path}.lora_{matrix}.weight"

    served = [
        key("model.layers.0.self_attn.q_proj"),
        key("model.layers.0.mlp.down_proj", "B"),
        key("lm_head"),
        key("model.layers.1.mlp.experts.base_layer"),  # PEFT's 3-D experts
        key("model.layers.1.mlp.experts.3.gate_proj"),  # per-expert
    ]
    assert modules_outside(served, LORA_TARGET_MODULES) == []
    mla = [*served, key("model.layers.0.self_attn.q_a_proj"), key("model.layers.0.mixer.in_proj")]
    assert modules_outside(mla, LORA_TARGET_MODULES) == [
        "model.layers.0.mixer.in_proj",
        "model.layers.0.self_attn.q_a_proj",
    ]


def test_sampling_params_mapping() -> None:
    spec = SampleSpec(prompt=(1, 2), num_samples=4, seed=2**64 + 5, stop_token_ids=(7,))
    params = sampling_params(spec)
    assert params.n == 4 and params.logprobs == 0 and params.prompt_logprobs is None
    assert params.stop_token_ids == [7] and not params.ignore_eos and not params.detokenize
    assert params.seed is not None and 0 <= params.seed < SEED_RANGE
    greedy = sampling_params(replace(spec, temperature=0.0, stop_at_eos=False, stop_strings=("x",)))
    assert greedy.n == 1 and greedy.ignore_eos and greedy.detokenize and greedy.stop == ["x"]
    near_zero = sampling_params(replace(spec, temperature=1e-300))  # greedy, never divided by
    assert near_zero.n == 1 and near_zero.temperature == 0.0
    scored = sampling_params(replace(spec, prompt_logprobs=True, topk_prompt_logprobs=5))
    assert scored.prompt_logprobs == 5
    with pytest.raises(UserError, match="not a valid regex"):
        trains_unembed("(unclosed", None)


@on_module_loop
async def test_sample_options_match_the_trainer(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    prompt = PROMPTS[1]  # 9 tokens: 8 scored rows
    ids = np.full((8, 2), -1, dtype=np.int64)
    ids[0] = [5, 300]
    ids[6, 1] = 42
    spec = SampleSpec(
        prompt=prompt,
        num_samples=2,
        max_tokens=4,
        seed=5,
        temperature=0.8,
        stop_at_eos=False,
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=3,
        target_prompt_logprobs=TargetIds(8, 2, tuple(ids.ravel().tolist())),
        prompt_alt_tokens_k=4,
        prompt_logprobs_last_n=3,
    )
    output = await sampler.sample(spec, *_adapter(checkpoints, "a"))
    full = forward_logprobs(checkpoints.engine, "a", list(prompt))
    assert output.prompt_logprobs is not None and output.topk_prompt_logprobs is not None
    assert output.prompt_logprobs[:6] == [None] * 6
    np.testing.assert_allclose(
        output.prompt_logprobs[6:], full[[5, 6, 7], list(prompt[6:])], atol=TOLERANCE
    )
    assert output.topk_prompt_logprobs[:6] == [[]] * 6
    assert all(len(row) == 2 for row in output.topk_prompt_logprobs[6:])

    assert output.target_prompt_logprobs is not None
    want = np.where(ids >= 0, full[np.arange(8)[:, None], np.maximum(ids, 0)], 0.0)
    np.testing.assert_allclose(
        np.reshape(output.target_prompt_logprobs, (8, 2)), want, atol=TOLERANCE
    )

    alt, alt_lps = output.prompt_alt_tokens, output.prompt_alt_logprobs
    assert alt is not None and alt_lps is not None and np.shape(alt) == (8, 4)
    np.testing.assert_allclose(alt_lps, full[np.arange(8)[:, None], alt], atol=TOLERANCE)
    again = await sampler.sample(spec, *_adapter(checkpoints, "a"))
    assert again.prompt_alt_tokens == alt  # seeded draws repeat

    for seq in output.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        forced = forward_logprobs(checkpoints.engine, "a", [*prompt, *seq.tokens])
        for row, pairs in zip(forced[len(prompt) - 1 :], seq.topk_logprobs, strict=True):
            assert len(pairs) == 3
            np.testing.assert_allclose(
                [lp for _, lp in pairs], np.sort(row)[::-1][:3], atol=TOLERANCE
            )
            np.testing.assert_allclose(
                [lp for _, lp in pairs], row[[t for t, _ in pairs]], atol=TOLERANCE
            )


@on_module_loop
async def test_seeded_samples_repeat_20_times_under_concurrent_load(
    sampler: VllmSampler, checkpoints: Checkpoints
) -> None:
    seeded = SampleSpec(prompt=PROMPTS[0], num_samples=3, max_tokens=8, seed=77, stop_at_eos=False)
    load = [
        SampleSpec(prompt=PROMPTS[1], num_samples=2, max_tokens=16, stop_at_eos=False),
        SampleSpec(prompt=PROMPTS[0], max_tokens=1, prompt_logprobs=True),
        SampleSpec(prompt=PROMPTS[1], max_tokens=6, temperature=0.5, top_k=20, top_p=0.9),
    ]
    rng = np.random.default_rng(3)

    async def later(spec: SampleSpec, name: str | None) -> SampleOutput:
        await asyncio.sleep(float(rng.random()) * 0.05)
        return await sampler.sample(spec, *_adapter(checkpoints, name))

    runs = []
    for repetition in range(10):
        calls = [later(seeded, "a"), later(seeded, "a")]
        calls += [
            later(spec, (None, "a", "b")[(repetition + i) % 3]) for i, spec in enumerate(load)
        ]
        outputs = await asyncio.gather(*calls)
        runs += [_tokens(output) for output in outputs[:2]]
    assert len(runs) == 20
    assert all(run == runs[0] for run in runs), {tuple(map(tuple, run)) for run in runs}
    assert len({tuple(tokens) for tokens in runs[0]}) == 3


async def test_a_model_vllm_cannot_load_here_is_named_with_the_way_out(tmp_path: Path) -> None:
    """vLLM's Qwen3.5 classes import torchvision when vLLM inspects them; without it (as on a
    CPU build) the sampler fails to start with a message naming it and the torch sampler."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM loads the model")
    model = build_tiny_model(tmp_path / "vl", "qwen3_5_vl")
    sampler = VllmSampler(str(model), max_lora_rank=MAX_LORA_RANK, max_loras=1)
    with pytest.raises(
        ServerError, match="imports torchvision, which is not installed.*--sampler torch"
    ):
        await sampler.start()


# Run in a process of its own: vLLM registers its own config classes for some model types
# (DeepSeek-V4, Inkling) in transformers' auto classes, and patches kernels when an engine
# starts, which later engines and models of this process would otherwise see.
FAMILY_PROBE = """
import asyncio, json, sys

from protocol.errors import ServerError
from protocol.sampling import SampleSpec
from workers.sampler.vllm_sampler import VllmSampler


async def main(model):
    sampler = VllmSampler(model, max_lora_rank=8, max_loras=1, max_model_len=64)
    try:
        await sampler.start()
    except ServerError as error:
        return {"refused": str(error)}
    try:
        output = await sampler.sample(SampleSpec(prompt=(3, 4, 5), max_tokens=2), None, None)
        return {"tokens": list(output.sequences[0].tokens)}
    finally:
        await sampler.close()


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main(sys.argv[1]))))
"""


@pytest.mark.parametrize(
    "arch", ["deepseek_v3", "glm_moe_dsa", "deepseek_v4", "nemotron_h", "inkling_mm_model"]
)
def test_each_family_samples_or_is_refused_naming_the_torch_sampler(
    arch: str, tmp_path: Path
) -> None:
    """The lineup's families on the installed vLLM: a family this build runs samples from the
    base model; one it cannot run (a CPU build: MLA of this head size, sparse attention,
    non-gated MoE) fails at `start`, at its first step rather than at a tenant's request, with
    an error naming the model, its type and the torch sampler."""
    import subprocess
    import sys

    model = build_tiny_model(tmp_path / arch, arch)
    probe = tmp_path / "probe.py"
    probe.write_text(FAMILY_PROBE)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(probe), str(model)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    if "refused" in result:
        message = result["refused"]
        assert f"cannot run {model} (model type {arch})" in message, message
        assert message.endswith("sample this model with the torch sampler (--sampler torch)")
    else:
        assert len(result["tokens"]) == 2, result
