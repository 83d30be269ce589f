"""The families of Tinker's lineup beyond Qwen and gpt-oss, end to end: one `up` serving a tiny
random model of each (`twinkle-async make-tiny-model --arch …`), the official tinker SDK.

Per family: the worker starts whatever the family cannot adapt; adapters of each kind (full,
MLP-only, attention-only, unembed-only) are created and each learns; a sampler samples from
the full adapter with the trainer's logprobs (each family's own cache: MLA's compressed KV,
Mamba2's conv and SSM state). (An adapter a base model cannot build is refused at
`create_model` from its workers' records: `tests/test_gateway_limits.py`.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import Cluster, build_model, start_cluster, stop_cluster
from tests.sdk_helpers import PROMPT, sdk_service, toy_batch, train_steps, trainer_logprobs

pytestmark = pytest.mark.e2e

FAMILIES = [
    "llama",
    "deepseek_v3",
    "deepseek_v4",
    "glm_moe_dsa",
    "nemotron_h",
    "kimi_k25",
    "inkling_mm_model",
]
KINDS = {
    "full": {},
    "mlp": {"train_attn": False, "train_unembed": False},
    "attn": {"train_mlp": False, "train_unembed": False},
    "unembed": {"train_mlp": False, "train_attn": False},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lineup")
    return {arch: build_model(root / arch, arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def lineup(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("lineup-cluster") / "data",
        list(models.values()),
        "--max-slots",
        "8",
        timeout_s=420.0,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture
def service(lineup: Cluster) -> Iterator[tinker.ServiceClient]:
    with sdk_service(lineup) as client:
        yield client


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_adapter_kind_learns_and_samples(
    arch: str, service: tinker.ServiceClient, models: dict[str, Path]
) -> None:
    base = str(models[arch])
    batch = toy_batch(n=2, length=10, seed=5)
    for kind, flags in KINDS.items():
        client = service.create_lora_training_client(
            base_model=base, rank=4, seed=1, **flags
        ).result()
        losses = train_steps(client, batch, 6, lr=1e-2)
        assert losses[-1] < losses[0], (arch, kind, losses)
        if kind != "full":
            continue
        sampler = client.save_weights_and_get_sampling_client().result()
        sampled = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
        np.testing.assert_allclose(
            np.asarray(sampled[1:], dtype=np.float64), trainer_logprobs(client, PROMPT), atol=1e-4
        )
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[])
        result = sampler.sample(
            types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params
        ).result()
        assert [len(s.tokens) for s in result.sequences] == [5, 5], arch
