"""Every built-in loss through the official SDK and a real cluster: each returns per-token
logprobs and a `loss:sum` equal to the documented formula evaluated on those logprobs; `forward`
matches `forward_backward` and leaves the next step alone; `forward_backward_custom` trains;
chunked metrics combine to the unchunked values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e

BETA = 0.05


def lp_arrays(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def rl_batch(base: list[types.Datum], sampler: list[np.ndarray], loss: str) -> list[types.Datum]:
    """RL data: sampler logprobs near the learner's, advantages of both signs, prompt masked."""
    rng = np.random.default_rng(5)
    data = []
    for i, (datum, q) in enumerate(zip(base, sampler, strict=True)):
        n = len(q)
        adv = np.full(n, 1.0 if i % 2 == 0 else -0.5, dtype=np.float32)
        adv[:2] = 0.0  # "prompt" positions
        inputs = {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": (q + rng.normal(0, 0.3, n)).astype(np.float32),
            "advantages": adv,
        }
        if loss == "gspo":
            mask = np.ones(n, dtype=np.float32)
            mask[:2] = 0.0
            inputs["sequence_ratio_mask"] = mask
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return data


def expected_loss(
    loss: str, data: list[types.Datum], lps: list[np.ndarray], config: dict[str, float]
) -> float:
    """The documented per-token formulas (docs/compatibility.md), summed, from the returned logprobs."""
    total = 0.0
    for datum, lp in zip(data, lps, strict=True):
        q = np.asarray(datum.loss_fn_inputs["logprobs"].data, dtype=np.float64)
        a = np.asarray(datum.loss_fn_inputs["advantages"].data, dtype=np.float64)
        r = np.exp(lp - q)
        if loss == "importance_sampling":
            total += float(np.sum(-r * a))
        elif loss == "ppo":
            lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
            total += float(np.sum(-np.minimum(r * a, np.clip(r, lo, hi) * a)))
        elif loss == "cispo":
            lo, hi = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
            total += float(np.sum(-np.clip(r, lo, hi) * lp * a))
        elif loss == "dro":
            total += float(np.sum(-(lp * a - 0.5 * config["beta"] * (lp - q) ** 2)))
        elif loss == "gspo":
            mask = np.asarray(datum.loss_fn_inputs["sequence_ratio_mask"].data) != 0
            s = np.exp(np.mean(lp[mask] - q[mask]))
            lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
            total += float(np.sum(-np.minimum(s * a, np.clip(s, lo, hi) * a)))
    return total


LOSSES = [
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("dro", {"beta": BETA}),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
]


@pytest.mark.parametrize(("loss", "config"), LOSSES, ids=[name for name, _ in LOSSES])
def test_each_rl_loss_end_to_end(
    service: tinker.ServiceClient, tiny_model: Path, loss: str, config: dict[str, float]
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=3
    ).result()
    base = toy_batch(n=4, seed=2)
    sampler = lp_arrays(client.forward(base, "cross_entropy").result())
    data = rl_batch(base, sampler, loss)
    out = client.forward_backward(data, loss, config or None).result()
    lps = lp_arrays(out)
    assert [len(x) for x in lps] == [len(x) for x in sampler]
    np.testing.assert_allclose(np.concatenate(lps), np.concatenate(sampler), atol=1e-5)
    want = expected_loss(loss, data, lps, config)
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    metrics = (
        client.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=1e6)).result().metrics
    )
    assert metrics is not None and metrics["unclipped_grad_l2:mean"] > 0


def test_forward_matches_forward_backward_and_adds_no_gradient(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    batch = toy_batch(n=3, seed=4)
    probe = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=8).result()
    control = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=8
    ).result()
    forward_lps = lp_arrays(probe.forward(batch, "cross_entropy").result())
    fb = probe.forward_backward(batch, "cross_entropy").result()
    for a, b in zip(forward_lps, lp_arrays(fb), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    probe.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    control.forward_backward(batch, "cross_entropy").result()
    control.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_probe = lp_arrays(probe.forward(batch, "cross_entropy").result())
    after_control = lp_arrays(control.forward(batch, "cross_entropy").result())
    for a, b in zip(after_probe, after_control, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_forward_backward_custom_trains(service: tinker.ServiceClient, tiny_model: Path) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=6
    ).result()
    batch = toy_batch(n=2, seed=6)

    def mean_nll(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = torch.stack([-lp.mean() for lp in logprobs]).sum()
        return loss, {"nll:mean": float(loss.detach()) / len(logprobs)}

    losses = []
    for _ in range(8):
        out = client.forward_backward_custom(batch, mean_nll).result()
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(out.metrics["nll:mean"])
    assert losses[-1] < 0.8 * losses[0], losses


def test_bad_loss_inputs_and_optimizers_are_clear_user_errors(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    from tinker.types.request_error_category import RequestErrorCategory

    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=1
    ).result()
    batch = toy_batch(n=1)
    ppo_without_advantages = [
        types.Datum(
            model_input=batch[0].model_input,
            loss_fn_inputs={"target_tokens": batch[0].loss_fn_inputs["target_tokens"]},
        )
    ]
    with pytest.raises(tinker.RequestFailedError) as err:
        client.forward_backward(ppo_without_advantages, "ppo").result()
    assert err.value.category == RequestErrorCategory.User and "advantages" in str(err.value)
    assert train_steps(client, batch, 2)  # the client keeps training after both errors
    with pytest.raises(tinker.BadRequestError) as dimuon:
        service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, optimizer=types.DimuonOptimizerConfig()
        ).result()
    assert "dimuon" in str(dimuon.value) and "adamw" in str(dimuon.value)


def test_chunked_metrics_combine_to_the_unchunked_values(
    cluster: Cluster, chunked_cluster: Cluster, tiny_model: Path
) -> None:
    base = toy_batch(n=7, seed=12)
    results = {}
    for name, where in (("one", cluster), ("chunked", chunked_cluster)):
        service = tinker.ServiceClient(base_url=where.base_url, api_key=where.api_key)
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, seed=30
        ).result()
        sampler = [
            np.asarray(d.loss_fn_inputs["target_tokens"].data, dtype=np.float32) * 0 - 5.0
            for d in base
        ]
        data = rl_batch(base, sampler, "ppo")
        results[name] = client.forward_backward(data, "ppo").result()
        service.close("success").result()
    one, chunked = results["one"], results["chunked"]
    assert set(one.metrics) == set(chunked.metrics) and "loss:sum" in one.metrics
    for key, value in one.metrics.items():
        assert chunked.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
