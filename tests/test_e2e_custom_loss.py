"""Server-side custom losses through the official SDK and a real cluster: `create_custom_loss`
uploads the traced loss, `forward_backward_custom` then runs it on the worker in one
forward_backward (no forward pass, one seq id), with the loss, metrics, logprobs and the
training step the client-side path gives; loss ids are private to their session; a hand-posted
graph calling a forbidden function is a 400 naming the node."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.cluster_helpers import reader, scrape
from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch

pytestmark = pytest.mark.e2e

RANKS: dict[str, Any] = {"logprobs": 1, "advantages": 1, "old": 1}
ADAM = types.AdamParams(learning_rate=2e-2)


def clipped_surrogate(logprobs, advantages, old):  # type: ignore[no-untyped-def]
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.9, 1.1)
    loss = -torch.min(ratio * advantages, clipped * advantages).sum() / logprobs.shape[0]
    return loss, {
        "custom/ratio:mean": ratio.mean(),
        "custom/clipped:sum": (ratio != clipped).float().sum(),
    }


def rl_data(seed: int, n: int = 3) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for i, datum in enumerate(toy_batch(n=n, seed=seed)):
        n = len(datum.loss_fn_inputs["target_tokens"].data)
        advantages = np.full(n, 1.0 if i % 2 == 0 else -0.7, dtype=np.float32)
        old = (-5.3 + rng.normal(0, 0.05, n)).astype(np.float32)  # near a fresh model's logprobs
        inputs = {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "advantages": types.TensorData.from_numpy(advantages),
            "old": types.TensorData.from_numpy(old),
        }
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return data


def targets_only(data: list[types.Datum]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]},
        )
        for d in data
    ]


def logprobs_of(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def forwards_submitted(cluster: Cluster) -> float:
    found = reader(scrape(f"{cluster.base_url}/metrics"))
    return found("twinkle_gateway_futures_submitted_total", request_type="forward")


def test_server_side_custom_loss_matches_the_client_side_path(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    handle = service.create_custom_loss(clipped_surrogate, RANKS).result()
    assert handle.loss_id is not None, "the server did not take the upload"
    server = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=9
    ).result()
    # The same weights and optimizer state in a second model, trained through the client path.
    start = server.save_state("start").result().path
    client = service.create_training_client_from_state_with_optimizer(start).result()
    client_side = dataclasses.replace(handle, loss_id=None)  # the SDK runs it locally
    data = rl_data(seed=2)
    before = logprobs_of(server.forward(targets_only(data), "cross_entropy").result())

    seq_before, forwards_before = server._request_id_counter, forwards_submitted(cluster)
    got = server.forward_backward_custom(data, handle).result()
    assert server._request_id_counter == seq_before + 1  # one forward_backward, no forward
    assert forwards_submitted(cluster) == forwards_before  # no forward pass reached the gateway
    want = client.forward_backward_custom(data, client_side).result()
    assert forwards_submitted(cluster) == forwards_before + 1  # the client path pays one

    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=1e-5)
    for key in ("custom/ratio:mean", "custom/clipped:sum"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], abs=1e-5), key
    assert got.metrics["custom/clipped:sum"] > 0  # the clip is exercised
    assert "surrogate_loss:sum" not in got.metrics and "surrogate_loss:sum" in want.metrics
    for mine, theirs in zip(logprobs_of(got), logprobs_of(want), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)

    server.optim_step(ADAM).result()
    client.optim_step(ADAM).result()
    after_server = logprobs_of(server.forward(targets_only(data), "cross_entropy").result())
    after_client = logprobs_of(client.forward(targets_only(data), "cross_entropy").result())
    for mine, theirs, old in zip(after_server, after_client, before, strict=True):
        assert np.abs(mine - old).max() > 1e-3  # the step moved the model
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


def test_chunked_calls_combine_like_the_client_side_path(
    chunked_cluster: Cluster, tiny_model: Path
) -> None:
    """Chunks of 3 datums: a `:mean` metric of 7 datums combines across chunks to the value the
    client-side path computes over all of them, and each chunk spends one seq id."""
    service = tinker.ServiceClient(
        base_url=chunked_cluster.base_url, api_key=chunked_cluster.api_key
    )
    try:
        handle = service.create_custom_loss(clipped_surrogate, RANKS).result()
        server = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, seed=2
        ).result()
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, seed=3
        ).result()
        data = rl_data(seed=7, n=7)
        seq_before = server._request_id_counter
        got = server.forward_backward_custom(data, handle).result()
        assert server._request_id_counter == seq_before + 3  # 3 chunks, no forward
        want = client.forward_backward_custom(data, dataclasses.replace(handle, loss_id=None))
        want_out = want.result()
        for key in ("loss:sum", "custom/ratio:mean", "custom/clipped:sum"):
            assert got.metrics[key] == pytest.approx(want_out.metrics[key], abs=1e-5), key
        assert len(got.loss_fn_outputs) == 7
    finally:
        service.close("success").result()


def test_a_failing_custom_loss_is_a_user_error_of_its_request(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    def past_the_end(logprobs, advantages, old):  # type: ignore[no-untyped-def]
        return -(logprobs[500] * advantages[0] + old[0]), {}

    handle = service.create_custom_loss(past_the_end, RANKS).result()
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=4
    ).result()
    data = rl_data(seed=3)
    with pytest.raises(tinker.RequestFailedError) as err:
        client.forward_backward_custom(data, handle).result()
    assert err.value.category == types.RequestErrorCategory.User
    assert "past_the_end" in str(err.value) and "IndexError" in str(err.value)
    # The model's next calls run: the failed one settled its seq and left no gradient.
    client.forward_backward(toy_batch(n=1), "cross_entropy").result()
    client.optim_step(ADAM).result()


def test_loss_ids_belong_to_their_session(cluster: Cluster, tiny_model: Path) -> None:
    owner = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    same_tenant = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    other_tenant = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    try:
        handle = owner.create_custom_loss(clipped_surrogate, RANKS).result()
        assert handle.loss_id is not None
        data = rl_data(seed=4)
        for stranger in (same_tenant, other_tenant):
            client = stranger.create_lora_training_client(
                base_model=str(tiny_model), rank=8, seed=1
            ).result()
            # The SDK refuses another session's handle, so the id is sent by hand.
            with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as err:
                client.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result()
            assert "loss_fn_config.loss_id" in str(err.value)
            assert "not a custom loss of this model's session" in str(err.value)
            client.forward_backward(toy_batch(n=1), "cross_entropy").result()  # seq settled
    finally:
        for service in (owner, same_tenant, other_tenant):
            service.close("success").result()


def post(cluster: Cluster, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/api/v1/{route}",
        json=body,
        headers={"X-API-Key": cluster.api_key},
        timeout=30,
    )


def test_a_hand_posted_forbidden_graph_is_refused_naming_the_node(cluster: Cluster) -> None:
    session = post(cluster, "create_session", {"tags": [], "sdk_version": "0.38.0"})
    session_id = session.json()["session_id"]
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
        {
            "op": "call_function",
            "name": "pwn",
            "target": "builtins.eval",
            "args": ["__import__('os').system('true')"],
            "kwargs": {},
        },
        {
            "op": "output",
            "name": "output",
            "target": "output",
            "args": [{"tuple": [{"ref": "pwn"}, {"dict": {}}]}],
            "kwargs": {},
        },
    ]
    body = {
        "session_id": session_id,
        "custom_loss_seq_id": 0,
        "name": "evil",
        "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"format": 1, "nodes": nodes},
        "type": "create_custom_loss",
    }
    resp = post(cluster, "create_custom_loss", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["category"] == "user"
    assert "graph.nodes['pwn']" in error["detail"] and "'builtins.eval'" in error["detail"]

    # The same seq with an allowed graph is then accepted, and resolves to its loss id.
    nodes[1] = {
        "op": "call_method",
        "name": "pwn",
        "target": "sum",
        "args": [{"ref": "logprobs"}],
        "kwargs": {},
    }
    resp = post(cluster, "create_custom_loss", body)
    assert resp.status_code == 200, resp.text
    future = post(cluster, "retrieve_future", {"request_id": resp.json()["request_id"]})
    assert future.json() == {"loss_id": f"{session_id}:loss:0", "type": "create_custom_loss"}
    # A different graph under the same seq is refused; the original stays.
    body["name"] = "other"
    resp = post(cluster, "create_custom_loss", body)
    assert resp.status_code == 400 and "custom_loss_seq_id" in resp.json()["detail"]
