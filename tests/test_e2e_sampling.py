"""Sampling with LoRA through the official SDK and a real cluster (torch sampler in the
trainer): logprobs that match the trainer's, immutable snapshots, an RL loop whose reward rises,
and clear errors for bad sampling input."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from examples import rl
from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import PROMPT, toy_batch, train_steps, trainer_logprobs

pytestmark = pytest.mark.e2e


def test_prompt_logprobs_match_the_trainer(service: tinker.ServiceClient, tiny_model: Path) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=3
    ).result()
    train_steps(client, toy_batch(seed=8), 3)
    sampler = client.save_weights_and_get_sampling_client().result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert sampled[0] is None and len(sampled) == len(PROMPT)
    np.testing.assert_allclose(
        np.asarray(sampled[1:], dtype=np.float64), trainer_logprobs(client, PROMPT), atol=1e-4
    )


@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_a_snapshot_never_changes(
    backend: str, request: pytest.FixtureRequest, tiny_model: Path
) -> None:
    cluster: Cluster = request.getfixturevalue("cluster" if backend == "torch" else "vllm_cluster")
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    request.addfinalizer(lambda: service.close("success").result())
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=4, train_unembed=False
    ).result()
    train_steps(client, toy_batch(seed=9), 2)
    snapshot = client.save_weights_and_get_sampling_client().result()
    # seeded sampling, 3 samples, on both backends (test_e2e_sampling_options repeats it 20
    # times under load)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1234, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    before = snapshot.sample(prompt, num_samples=3, sampling_params=params).result()
    before_lps = snapshot.compute_logprobs(prompt).result()
    train_steps(client, toy_batch(seed=9), 3)
    after_lps = snapshot.compute_logprobs(prompt).result()
    np.testing.assert_allclose(np.asarray(before_lps[1:]), np.asarray(after_lps[1:]), atol=1e-4)
    after = snapshot.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in before.sequences] == [s.tokens for s in after.sequences]
    # vLLM may serve the second call from its prefix cache: equal up to float rounding
    for x, y in zip(before.sequences, after.sequences, strict=True):
        np.testing.assert_allclose(np.asarray(x.logprobs), np.asarray(y.logprobs), atol=1e-4)
    assert all(len(s.tokens) == 8 and s.stop_reason == "length" for s in after.sequences)
    newer = client.save_weights_and_get_sampling_client().result()
    newer_lps = newer.compute_logprobs(prompt).result()
    assert max(abs(a - b) for a, b in zip(before_lps[1:], newer_lps[1:], strict=True)) > 1e-3


def test_named_sampler_checkpoint_and_base_model_sessions(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=5
    ).result()
    train_steps(client, toy_batch(seed=10), 2)
    path = client.save_weights_for_sampler("named").result().path
    by_path = service.create_sampling_client(model_path=path).result()
    np.testing.assert_allclose(
        np.asarray(by_path.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:]),
        trainer_logprobs(client, PROMPT),
        atol=1e-4,
    )
    base = service.create_sampling_client(base_model=str(tiny_model)).result()
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    out = base.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=greedy
    ).result()
    assert len(out.sequences) == 2 and out.sequences[0].tokens == out.sequences[1].tokens


def test_vllm_sampler_logprobs_match_the_trainer(vllm_cluster: Cluster, tiny_model: Path) -> None:
    service = tinker.ServiceClient(base_url=vllm_cluster.base_url, api_key=vllm_cluster.api_key)
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=3, train_unembed=False
    ).result()
    train_steps(client, toy_batch(seed=8), 3)
    sampler = client.save_weights_and_get_sampling_client().result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert sampled[0] is None
    np.testing.assert_allclose(
        np.asarray(sampled[1:], dtype=np.float64), trainer_logprobs(client, PROMPT), atol=1e-3
    )
    service.close("success").result()


def test_openai_completions_on_the_vllm_cluster_answer_the_sdks_tokens(
    vllm_cluster: Cluster, tiny_model: Path
) -> None:
    """A text job (`/v1/completions`, `/v1/chat/completions`) through a pool that vLLM serves:
    tokenized and detokenized by the sampler, the greedy tokens those of the SDK's sample."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    service = tinker.ServiceClient(base_url=vllm_cluster.base_url, api_key=vllm_cluster.api_key)
    base = service.create_sampling_client(base_model=str(tiny_model)).result()
    headers = {"Authorization": f"Bearer {vllm_cluster.api_key}"}
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    want = base.sample(types.ModelInput.from_ints(ids), 1, greedy).result().sequences[0].tokens
    done = httpx.post(
        f"{vllm_cluster.base_url}/v1/completions",
        json={"model": str(tiny_model), "prompt": prompt, "max_tokens": 6, "temperature": 0},
        headers=headers,
        timeout=120,
    )
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert done.json()["usage"]["prompt_tokens"] == len(ids)
    chat = httpx.post(
        f"{vllm_cluster.base_url}/v1/chat/completions",
        json={
            "model": str(tiny_model),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        headers=headers,
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert chat.json()["usage"]["completion_tokens"] <= 4

    # streamed: the same greedy text, in pieces as it is drawn
    long = {"model": str(tiny_model), "prompt": "once upon", "max_tokens": 48, "temperature": 0}
    unstreamed = httpx.post(
        f"{vllm_cluster.base_url}/v1/completions", json=long, headers=headers, timeout=120
    ).json()
    pieces = []
    with httpx.stream(
        "POST",
        f"{vllm_cluster.base_url}/v1/completions",
        json={**long, "stream": True},
        headers=headers,
        timeout=120,
    ) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                pieces += [c["text"] for c in json.loads(line[6:])["choices"] if c["text"]]
    assert "".join(pieces) == unstreamed["choices"][0]["text"]
    if unstreamed["usage"]["completion_tokens"] >= 24:
        assert len(pieces) >= 2, pieces
    service.close("success").result()


@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_rl_loop_raises_the_reward(
    backend: str, request: pytest.FixtureRequest, tiny_model: Path
) -> None:
    cluster: Cluster = request.getfixturevalue("cluster" if backend == "torch" else "vllm_cluster")
    history = rl.run(cluster.base_url, cluster.api_key, str(tiny_model), iterations=20)
    first, last = float(np.mean(history[:5])), float(np.mean(history[-5:]))
    assert last > first + 0.2, history


def test_bad_sampling_input_is_a_clear_error(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=6
    ).result()
    path = client.save_weights_for_sampler("mine").result().path
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    ok = types.SamplingParams(max_tokens=4)
    with pytest.raises(tinker.BadRequestError, match="context"):
        sampler.sample(types.ModelInput.from_ints([5] * 5000), 1, ok).result()
    for n in (0, 100000):
        with pytest.raises(tinker.BadRequestError, match="num_samples"):
            sampler.sample(prompt, n, ok).result()
    with pytest.raises(tinker.BadRequestError, match="top_p"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, top_p=1.5)).result()
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(
            model_path=f"tinker://{client.model_id}/sampler_weights/nope"
        ).result()
    other = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=path).result()
    other.close("success").result()
    # still serving
    assert len(sampler.sample(prompt, 2, ok).result().sequences) == 2


def test_more_clients_than_slots(tmp_path: Path, tiny_model: Path) -> None:
    """A worker with 2 adapter slots serves 3 training clients and their samplers: idle
    adapters are parked in host memory and come back on their next request."""
    from tests.conftest import start_cluster, stop_cluster

    small = start_cluster(tmp_path / "two-slots", [tiny_model], "--max-slots", "2")
    try:
        service = tinker.ServiceClient(base_url=small.base_url, api_key=small.api_key)
        clients = [
            service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=i).result()
            for i in range(3)
        ]
        batch = toy_batch(n=2, seed=20)
        losses = [[] for _ in clients]
        for _ in range(3):
            for i, client in enumerate(clients):
                losses[i] += train_steps(client, batch, 1)
        for i, client in enumerate(clients):
            sampler = client.save_weights_and_get_sampling_client().result()
            out = sampler.sample(
                types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4)
            ).result()
            assert len(out.sequences) == 2
            assert losses[i][-1] < losses[i][0], losses[i]
        service.close("success").result()
    finally:
        stop_cluster(small)
