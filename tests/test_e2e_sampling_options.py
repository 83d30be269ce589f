"""The sampling options through the official SDK and a real cluster, on both sampler backends:
top-k sampled logprobs, target-id prompt logprobs (dense and sparse), alternative prompt
tokens and the last-n prompt logprobs, each against the trainer's forward; hostile option
values as 400s; a seeded 3-sample request repeated 20 times under concurrent load; and only
the backend a cluster was started with takes its sample jobs; an answer too large to store fails
its own request."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from protocol.sampling import MAX_LOGPROBS_K
from tests.conftest import ADMIN_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e

PROMPT = [7, 19, 23, 42, 101, 7, 19, 250]
ATOL = 1e-3


def trainer_full(client: tinker.TrainingClient, tokens: list[int], vocab: int) -> np.ndarray:
    """The trainer's logprob of every vocabulary token after each prefix: [len - 1, vocab].
    One forward whose datums each score `MAX_LOGPROBS_K` of the ids, the widest [N, K]
    targets a request takes."""
    n = len(tokens) - 1
    columns = np.arange(-(-vocab // MAX_LOGPROBS_K) * MAX_LOGPROBS_K, dtype=np.int64) % vocab
    datums = []
    for ids in columns.reshape(-1, MAX_LOGPROBS_K):
        targets = np.broadcast_to(ids, (n, ids.size)).copy()
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(targets),
                    "weights": types.TensorData.from_numpy(np.zeros(targets.shape, np.float32)),
                },
            )
        )
    out = client.forward(datums, "cross_entropy").result()
    scored = [o["logprobs"].to_numpy().reshape(n, MAX_LOGPROBS_K) for o in out.loss_fn_outputs]
    return np.concatenate(scored, axis=1)[:, :vocab]


@pytest.fixture(params=["torch", "vllm"])
def setup(
    request: pytest.FixtureRequest, tiny_model: Path
) -> tuple[tinker.TrainingClient, tinker.SamplingClient]:
    cluster: Cluster = request.getfixturevalue(
        "cluster" if request.param == "torch" else "vllm_cluster"
    )
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    request.addfinalizer(lambda: service.close("success").result())
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=12, train_unembed=False
    ).result()
    train_steps(client, toy_batch(seed=13), 2)
    return client, client.save_weights_and_get_sampling_client().result()


def test_every_option_matches_the_trainer(
    setup: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    client, sampler = setup
    prompt = types.ModelInput.from_ints(PROMPT)
    ids = torch.full((len(PROMPT) - 1, 4), -1, dtype=torch.int64)
    ids[0, :2] = torch.tensor([5, 300])
    ids[5, 1] = 42
    params = types.SamplingParams(max_tokens=4, temperature=0.8, seed=3, stop=[])
    out = sampler.sample(
        prompt,
        2,
        params,
        include_prompt_logprobs=True,
        topk_sample_logprobs=3,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(ids, pad_value=-1),
        prompt_alt_tokens_k=4,
        prompt_logprobs_last_n=3,
    ).result()
    vocab = 512
    full = trainer_full(client, PROMPT, vocab)

    assert out.prompt_logprobs is not None and out.prompt_logprobs[:5] == [None] * 5
    np.testing.assert_allclose(out.prompt_logprobs[5:], full[[4, 5, 6], PROMPT[5:]], atol=ATOL)

    target = out.target_prompt_logprobs
    assert target is not None and target.sparse_crow_indices is not None
    want = np.where(ids >= 0, full[np.arange(7)[:, None], ids.clamp(min=0).numpy()], 0.0)
    np.testing.assert_allclose(target.to_numpy(), want, atol=ATOL)

    alt = out.prompt_alt_tokens
    assert alt is not None
    tokens = alt.tokens.to_numpy()
    assert tokens.shape == (7, 4)
    np.testing.assert_allclose(
        alt.logprobs.to_numpy(), full[np.arange(7)[:, None], tokens], atol=ATOL
    )

    for seq in out.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        forced = trainer_full(client, [*PROMPT, *seq.tokens], vocab)[len(PROMPT) - 1 :]
        for row, pairs in zip(forced, seq.topk_logprobs, strict=True):
            assert pairs is not None and len(pairs) == 3
            np.testing.assert_allclose([lp for _, lp in pairs], np.sort(row)[::-1][:3], atol=ATOL)

    # A dense target tensor comes back dense.
    dense = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=1),
        target_prompt_logprobs=types.TensorData.from_torch(ids.clamp(min=0)),
    ).result()
    assert dense.target_prompt_logprobs is not None
    np.testing.assert_allclose(
        dense.target_prompt_logprobs.to_numpy(),
        full[np.arange(7)[:, None], ids.clamp(min=0).numpy()],
        atol=ATOL,
    )


HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"topk_sample_logprobs": 1000}, "topk_sample_logprobs"),
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"topk_prompt_logprobs": 10**6}, "topk_prompt_logprobs"),
    ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 8}, "prompt_logprobs_last_n"),
    (
        {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((7, 1), 512))},
        "target_prompt_logprobs",
    ),
    (
        {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((3, 1), 5))},
        "target_prompt_logprobs",
    ),
    (
        {"target_prompt_logprobs": types.TensorData.from_numpy(np.full((7, 50), 5))},
        "target_prompt_logprobs",
    ),
]


def test_hostile_option_values_are_400s(
    setup: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    _, sampler = setup
    prompt = types.ModelInput.from_ints(PROMPT)
    for fields, named in HOSTILE:
        with pytest.raises(tinker.BadRequestError, match=named):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), **fields).result()
    # still serving
    assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences)


def test_seeded_samples_repeat_20_times_under_load(
    setup: tuple[tinker.TrainingClient, tinker.SamplingClient],
) -> None:
    """On a vLLM cluster every request is served by the vLLM sampler: a trainer that also took
    some (with its torch sampler, another RNG) gave a second token set for the same seed."""
    _, sampler = setup
    prompt = types.ModelInput.from_ints(PROMPT)
    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1234, stop=[])
    noisy = types.SamplingParams(max_tokens=12, temperature=0.9, stop=[])
    runs: list[Future[types.SampleResponse]] = []
    load: list[Any] = []
    for i in range(20):
        load.append(sampler.sample(types.ModelInput.from_ints(PROMPT[i % 3 :]), 2, noisy))
        runs.append(sampler.sample(prompt, 3, seeded))
        if i % 4 == 0:
            load.append(sampler.compute_logprobs(prompt))
    tokens = [[seq.tokens for seq in run.result().sequences] for run in runs]
    for future in load:
        future.result()
    assert all(run == tokens[0] for run in tokens), {str(run) for run in tokens}
    assert len({tuple(sample) for sample in tokens[0]}) == 3


@pytest.mark.parametrize(("fixture", "backend"), [("cluster", "torch"), ("vllm_cluster", "vllm")])
def test_one_backend_serves_the_pool(
    request: pytest.FixtureRequest, tiny_model: Path, fixture: str, backend: str
) -> None:
    """Only the backend `up --sampler` names takes the pool's sample jobs (with a vLLM sampler
    the trainer's torch sampler once took a share, so a seed's tokens depended on the process)."""
    cluster: Cluster = request.getfixturevalue(fixture)
    answer = httpx.get(
        f"{cluster.base_url}/admin/v1/workers", headers={"X-Admin-Key": ADMIN_KEY}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    rows = [row for row in answer.json()["workers"] if row["base_model"] == str(tiny_model)]
    assert {row["role"] for row in rows} >= {"trainer"}
    assert {row["sampler_backend"] for row in rows} - {""} == {backend}, rows


def test_an_answer_too_large_to_hold_fails_that_request_only(cluster: Cluster) -> None:
    """128 samples of 600 tokens with their top-20 logprobs make about 13 MB of answer, over the
    8 MiB one result may hold: that request fails with a user error naming what to ask less of,
    at the cost of its own sampling; the sampler answers the next request."""
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        sampler = service.create_sampling_client(base_model=cluster.base_models[0]).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        huge = types.SamplingParams(max_tokens=600, temperature=1.0, stop=[])
        with pytest.raises(tinker.RequestFailedError, match="num_samples.*max_tokens"):
            sampler.sample(prompt, 128, huge, topk_sample_logprobs=20).result(timeout=300)
        after = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, stop=[])).result()
        assert [len(seq.tokens) for seq in after.sequences] == [4, 4]
    finally:
        service.close("success").result()
