"""Mixture-of-Experts base models end to end: the official tinker SDK against the shared cluster,
whose tiny random Qwen3-MoE worker trains Tinker's shared-outer expert LoRA.

An MLP-only adapter (the configuration that used to crash-loop a worker) trains the experts and
its checkpoint holds them in PEFT's `target_parameters` layout; state resumes exactly with its
optimizer; the torch sampler samples from the adapter with the trainer's logprobs; tenants of
the pool are merged in one pass and each gets its solo result.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import tinker
from tinker import types

from tests.conftest import Cluster
from tests.sdk_helpers import PROMPT, toy_batch, train_steps, trainer_logprobs

pytestmark = pytest.mark.e2e


def _files(cluster: Cluster, path: str) -> Path:
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    return cluster.data_dir / "checkpoints" / run_id / kind / name


def test_an_mlp_only_adapter_trains_the_experts(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model_moe: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model_moe), rank=8, seed=1, train_attn=False, train_unembed=False
    ).result()
    losses = train_steps(client, toy_batch(seed=21), 12, lr=2e-2)
    assert losses[-1] < 0.8 * losses[0], losses
    path = client.save_state("mlp-only").result().path
    tensors = safetensors.numpy.load_file(str(_files(cluster, path) / "adapter_model.safetensors"))
    experts = [key for key in tensors if ".mlp.experts." in key]
    assert experts, sorted(tensors)
    # PEFT's target_parameters: gate_up_proj (inner wrapper) at rank 2r, down_proj at rank r
    gate_up_a = next(key for key in experts if key.endswith("experts.base_layer.lora_A.weight"))
    gate_up_b = gate_up_a.replace("lora_A", "lora_B")
    down_a = gate_up_a.replace(".base_layer", "")
    n = tensors[down_a].shape[0] // 8
    assert n > 1 and tensors[gate_up_a].shape[0] == 16 * n and tensors[gate_up_b].shape[1] == 16 * n
    # gate's and up's shared A, the same for every expert
    per_expert = tensors[gate_up_a].reshape(n, 16, -1)
    assert (per_expert == per_expert[:1]).all()
    assert not any("self_attn" in key or "lm_head" in key for key in tensors)
    assert all(np.abs(tensors[key]).max() > 0 for key in experts if "lora_B" in key)


def test_state_resumes_exactly_with_its_optimizer(
    service: tinker.ServiceClient, tiny_model_moe: Path
) -> None:
    batch = toy_batch(seed=22)
    client = service.create_lora_training_client(
        base_model=str(tiny_model_moe), rank=4, seed=2
    ).result()
    train_steps(client, batch, 4)
    path = client.save_state("after-4").result().path
    original = train_steps(client, batch, 3)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    again = train_steps(resumed, batch, 3)
    assert max(abs(a - b) for a, b in zip(original, again, strict=True)) <= 1e-5, (original, again)


def test_the_torch_sampler_samples_the_adapter_with_the_trainers_logprobs(
    service: tinker.ServiceClient, tiny_model_moe: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model_moe), rank=8, seed=3
    ).result()
    train_steps(client, toy_batch(seed=23), 3, lr=2e-2)
    sampler = client.save_weights_and_get_sampling_client().result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    np.testing.assert_allclose(
        np.asarray(sampled[1:], dtype=np.float64), trainer_logprobs(client, PROMPT), atol=1e-4
    )
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params
    ).result()
    assert [len(s.tokens) for s in result.sequences] == [6, 6]


def test_tenants_merged_in_one_pool_get_their_solo_results(
    service: tinker.ServiceClient, tiny_model_moe: Path
) -> None:
    """Two tenants stepping at once (merged passes) end where each ends alone."""

    def run(seed: int, results: dict[int, list[float]]) -> None:
        client = service.create_lora_training_client(
            base_model=str(tiny_model_moe), rank=4, seed=seed
        ).result()
        results[seed] = train_steps(client, toy_batch(seed=seed), 4)

    together: dict[int, list[float]] = {}
    threads = [threading.Thread(target=run, args=(seed, together)) for seed in (31, 32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    alone: dict[int, list[float]] = {}
    for seed in (31, 32):
        run(seed, alone)
    for seed in (31, 32):
        assert max(abs(a - b) for a, b in zip(together[seed], alone[seed], strict=True)) <= 1e-4
