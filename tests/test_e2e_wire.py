"""Wire-level behaviour through a real cluster: retried submits apply once, chunked requests
equal one chunk, and bad input is answered clearly while the cluster keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from tests.conftest import Cluster
from tests.sdk_helpers import toy_batch, train_steps
from tests.wire import Wire

pytestmark = pytest.mark.e2e


@pytest.fixture
def wire(cluster: Cluster) -> Iterator[Wire]:
    client = Wire(cluster.base_url, cluster.api_key)
    yield client
    client.close()


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float32) for o in out.loss_fn_outputs]


def test_retried_submits_get_the_same_request_and_apply_once(wire: Wire, tiny_model: Path) -> None:
    batch = toy_batch(n=2)
    session = wire.session()
    twice = wire.create_model(session, str(tiny_model), seq=0, seed=7)
    once = wire.create_model(session, str(tiny_model), seq=1, seed=7)

    for model_id, repeats in ((twice, 2), (once, 1)):
        body = wire.fwdbwd_body(model_id, 1, batch)
        fwd_ids = {wire.forward_backward(body).json()["request_id"] for _ in range(repeats)}
        opt_ids = {wire.optim_step(model_id, 2).json()["request_id"] for _ in range(repeats)}
        assert len(fwd_ids) == 1 and len(opt_ids) == 1
        wire.fwdbwd_output(wire.result(fwd_ids.pop()))
        assert set(wire.result(opt_ids.pop()).json()["metrics"]) == {
            "unclipped_grad_l2:mean",
            "learning_rate:mean",
        }

    after = {}
    for model_id in (twice, once):
        resp = wire.forward_backward(wire.fwdbwd_body(model_id, 3, batch, forward_only=True))
        after[model_id] = _logprobs(wire.fwdbwd_output(wire.result(resp.json()["request_id"])))
    for a, b in zip(after[twice], after[once], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_chunked_out_of_order_equals_one_chunk(
    cluster: Cluster, chunked_cluster: Cluster, tiny_model: Path
) -> None:
    batch = toy_batch(n=10, seed=11)
    results = {}
    for name, where in (("one", cluster), ("chunked", chunked_cluster)):
        service = tinker.ServiceClient(base_url=where.base_url, api_key=where.api_key)
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, seed=21
        ).result()
        first = client.forward_backward(batch, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out = first.result()
        nxt = client.forward_backward(batch, "cross_entropy").result()
        results[name] = (out, nxt)
        service.close("success").result()
    (one, one_next), (chunked, chunked_next) = results["one"], results["chunked"]
    assert len(chunked.loss_fn_outputs) == len(one.loss_fn_outputs) == 10
    for a, b in zip(_logprobs(one), _logprobs(chunked), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert one.metrics["loss:sum"] == pytest.approx(chunked.metrics["loss:sum"], abs=1e-4)
    assert one_next.metrics["loss:sum"] == pytest.approx(chunked_next.metrics["loss:sum"], abs=1e-4)


def test_bad_input_is_a_clear_user_error_and_the_cluster_keeps_serving(
    wire: Wire, service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=0
    ).result()
    good = toy_batch(n=2)

    # unknown model_id
    resp = wire.forward_backward(wire.fwdbwd_body("sess-nope:train:0", 1, good))
    assert (
        resp.status_code == 404
        and resp.json()["category"] == "user"
        and "model_id" in resp.json()["detail"]
    )
    # malformed protobuf
    resp = wire.forward_backward(b"\xff\xff\xff not a protobuf")
    assert resp.status_code == 400 and resp.json()["category"] == "user"
    # a token id >= vocab size
    bad_token = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 10**6]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
    ]
    with pytest.raises(tinker.RequestFailedError) as err:
        client.forward_backward(bad_token, "cross_entropy").result()
    assert err.value.category == RequestErrorCategory.User and "vocab" in str(err.value)
    # target_tokens length differs from the input
    bad_len = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
        )
    ]
    with pytest.raises(tinker.RequestFailedError) as err:
        client.forward_backward(bad_len, "cross_entropy").result()
    assert err.value.category == RequestErrorCategory.User and "target_tokens" in str(err.value)
    # unknown loss name (sent raw: the SDK only builds known names)
    session = wire.session()
    model_id = wire.create_model(session, str(tiny_model))
    resp = wire.result(
        wire.forward_backward(wire.fwdbwd_body(model_id, 1, good, loss_fn="nope")).json()[
            "request_id"
        ]
    )
    assert resp.json()["category"] == "user" and "nope" in resp.json()["error"]
    # unknown base model: the message lists the served ones
    with pytest.raises(tinker.BadRequestError) as bad_model:
        service.create_lora_training_client(base_model="nobody/no-such-model", rank=8).result()
    assert "no-such-model" in str(bad_model.value) and str(tiny_model) in str(bad_model.value)
    # oversized request
    resp = wire.forward_backward(b"\x00" * (7 * 1024 * 1024))
    assert resp.status_code == 413 and resp.json()["category"] == "user"
    # bad API key
    with pytest.raises(tinker.AuthenticationError):
        bad = tinker.ServiceClient(base_url=cluster.base_url, api_key="tml-wrong-key")
        bad.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
    # load_weights of a path that does not exist
    with pytest.raises(tinker.NotFoundError) as missing:
        service.create_training_client_from_state(
            "tinker://sess-nope:train:0/weights/nothing"
        ).result()
    assert "not found" in str(missing.value)

    # still serving, and the client that saw errors still trains
    losses = train_steps(client, good, 3)
    assert losses[-1] < losses[0]


def test_zstd_compressed_forward_backward(wire: Wire, tiny_model: Path) -> None:
    import zstandard

    batch = toy_batch(n=2)
    session = wire.session()
    plain_model = wire.create_model(session, str(tiny_model), seq=0, seed=3)
    zstd_model = wire.create_model(session, str(tiny_model), seq=1, seed=3)
    plain = wire.forward_backward(wire.fwdbwd_body(plain_model, 1, batch, forward_only=True))
    body = zstandard.ZstdCompressor().compress(
        wire.fwdbwd_body(zstd_model, 1, batch, forward_only=True)
    )
    packed = wire.post(
        "forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert packed.status_code == 200, packed.text
    a = _logprobs(wire.fwdbwd_output(wire.result(plain.json()["request_id"])))
    b = _logprobs(wire.fwdbwd_output(wire.result(packed.json()["request_id"])))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    garbage = wire.post(
        "forward_backward", content=b"not zstd", headers={"Content-Encoding": "zstd"}
    )
    assert garbage.status_code == 400 and garbage.json()["category"] == "user"
