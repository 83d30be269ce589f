"""A hostile or careless client against a real cluster: refused calls never stall the next one,
sequence numbers are checked, hostile bodies cost nothing, listings leak nothing, and no tenant
can touch another's ids, futures or sequence.

Every test runs the official SDK or raw HTTP against `twinkle-async up` (real nats-server,
gateway and torch worker).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.proto.response_conv import deserialize_sample_response
from tinker.types.request_error_category import RequestErrorCategory

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps
from tests.wire import Wire

pytestmark = pytest.mark.e2e


@pytest.fixture
def wire(cluster: Cluster) -> Iterator[Wire]:
    client = Wire(cluster.base_url, cluster.api_key)
    yield client
    client.close()


@pytest.fixture
def other(cluster: Cluster) -> Iterator[Wire]:
    client = Wire(cluster.base_url, OTHER_TENANT_KEY)
    yield client
    client.close()


def _adam(lr: float = 1e-2) -> dict[str, float]:
    return {
        "learning_rate": lr,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }


def _optim(wire: Wire, model_id: str, seq_id: object, lr: float = 1e-2) -> httpx.Response:
    return wire.post(
        "optim_step",
        {"model_id": model_id, "seq_id": seq_id, "type": "optim_step", "adam_params": _adam(lr)},
    )


def _final(wire: Wire, request_id: str) -> httpx.Response:
    resp = wire.result(request_id, timeout_s=30.0)
    assert resp.status_code == 200, resp.text
    return resp


# -- every seq the SDK spends is settled ---------------------------------------------------------


def test_a_call_the_gateway_refuses_never_stalls_the_next_one(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=1
    ).result()
    batch = toy_batch(n=2)
    client.forward_backward(batch, "cross_entropy").result()
    refusals = {
        "bad name": lambda: client.save_state("../x").result(),
        "long emoji name": lambda: client.save_state("\N{GRINNING FACE}" * 200).result(),
        "newline name": lambda: client.save_state("a\nb").result(),
        "NUL name": lambda: client.save_state("a\x00b").result(),
        "negative learning rate": lambda: client.optim_step(
            types.AdamParams(learning_rate=-1.0)
        ).result(),
        "unsupported option": lambda: client.save_weights_external(
            "x", age_encryption_recipients=["age1notsupportedhere"]
        ).result(),
    }
    for what, refuse in refusals.items():
        with pytest.raises((tinker.BadRequestError, tinker.NotFoundError)) as refused:
            refuse()
        assert "Internal" not in str(refused.value), what
        started = time.monotonic()
        client.forward_backward(batch, "cross_entropy").result()
        elapsed = time.monotonic() - started
        assert elapsed < 2.0, f"after a refused {what}, the next call took {elapsed:.1f} s"
    # and the client trains on as if nothing happened
    losses = train_steps(client, batch, 3)
    assert losses[-1] < losses[0]


def test_bad_sequence_numbers_are_refused_and_leave_nothing_pending(
    wire: Wire, tiny_model: Path
) -> None:
    session = wire.session()
    model_id = wire.create_model(session, str(tiny_model))
    batch = toy_batch(n=2)
    first = wire.forward_backward(wire.fwdbwd_body(model_id, 1, batch))
    assert first.status_code == 200, first.text
    first_id = first.json()["request_id"]

    for bad in (-1, 0, 2**31 - 1, 2**40, 70_000):
        resp = _optim(wire, model_id, bad)
        assert resp.status_code == 400 and "seq_id" in resp.json()["detail"], (bad, resp.text)
    resp = wire.forward_backward(wire.fwdbwd_body(model_id, -3, batch))
    assert resp.status_code == 400 and "seq_id" in resp.json()["detail"], resp.text
    # a different call reusing seq 1 is refused; a genuine retry gets the first request id
    reused = _optim(wire, model_id, 1)
    assert reused.status_code == 400 and "already used" in reused.json()["detail"]
    retry = wire.forward_backward(wire.fwdbwd_body(model_id, 1, batch))
    assert retry.json()["request_id"] == first_id
    # a legacy load_weights without seq_id cannot borrow the creation's seq 0
    load = wire.post("load_weights", {"model_id": model_id, "path": "tinker://x/weights/y"})
    assert load.status_code == 400 and "seq_id" in load.json()["detail"], load.text

    # an endpoint this server lacks settles the seq it was given
    unknown = wire.post("not_a_tinker_call", {"model_id": model_id, "seq_id": 2})
    assert unknown.status_code == 404 and "not supported" in unknown.json()["detail"]
    # nothing else was spent by the refusals: seq 3 runs at once, no future is left pending
    step = _optim(wire, model_id, 3)
    assert step.status_code == 200, step.text
    started = time.monotonic()
    _final(wire, first_id)
    metrics = _final(wire, step.json()["request_id"]).json()["metrics"]
    assert metrics["learning_rate:mean"] > 0 and metrics["unclipped_grad_l2:mean"] >= 0
    assert time.monotonic() - started < 10.0


def test_another_tenants_model_is_404_and_its_sequence_is_untouched(
    wire: Wire, other: Wire, tiny_model: Path
) -> None:
    session = wire.session()
    model_id = wire.create_model(session, str(tiny_model))
    batch = toy_batch(n=2)
    # the other tenant names our model with our next seq: 404, and nothing is settled
    for resp in (
        _optim(other, model_id, 1),
        other.forward_backward(other.fwdbwd_body(model_id, 1, batch)),
        other.post("save_weights", {"model_id": model_id, "seq_id": 1, "path": "x"}),
        other.post("save_weights_external", {"model_id": model_id, "seq_id": 1, "path": "x"}),
    ):
        assert resp.status_code == 404, resp.text
    mine = wire.forward_backward(wire.fwdbwd_body(model_id, 1, batch))
    assert mine.status_code == 200
    output = wire.fwdbwd_output(_final(wire, mine.json()["request_id"]))
    assert len(output.loss_fn_outputs) == 2
    # and our futures are not theirs to read
    unknown = other.post("retrieve_future", {"request_id": mine.json()["request_id"]})
    assert unknown.status_code == 404


def test_sample_results_belong_to_their_tenant(wire: Wire, other: Wire, tiny_model: Path) -> None:
    session = wire.session()
    created = wire.post(
        "create_sampling_session",
        {
            "session_id": session,
            "sampling_session_seq_id": 0,
            "base_model": str(tiny_model),
            "type": "create_sampling_session",
        },
    )
    assert created.status_code == 200, created.text
    sample = wire.post(
        "asample",
        {
            "sampling_session_id": created.json()["sampling_session_id"],
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 2, "temperature": 1.0},
            "num_samples": 1,
            "type": "sample",
        },
    )
    assert sample.status_code == 200, sample.text
    request_id = sample.json()["request_id"]
    assert _final(wire, request_id).headers["content-type"].startswith("application/x-protobuf")
    assert other.post("retrieve_future", {"request_id": request_id}).status_code == 404


# -- hostile bodies cost nothing -----------------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _gateway_pid(cluster: Cluster) -> int:
    """The gateway `up` runs as a child process."""
    for children in Path(f"/proc/{cluster.process.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"twinkle_async" in argv and b"gateway" in argv:
                return int(pid)
    raise AssertionError("no gateway process")


def _sparse_bomb(model_id: str, seq_id: int) -> bytes:
    """A few hundred bytes declaring six [1, 2**26] sparse tensors with no values."""
    msg = public_pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="ppo")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00"
    for name in ("target_tokens", "logprobs", "advantages", "weights", "mask", "extra"):
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = public_pb.DTYPE_FLOAT32
        tensor.shape.extend([1, 2**26])
        tensor.sparse_csr.crow_indices = b"\x00" * 16
    body: bytes = msg.SerializeToString()
    return body


def test_a_sparse_bomb_is_refused_at_once_without_allocating(
    wire: Wire, cluster: Cluster, tiny_model: Path
) -> None:
    session = wire.session()
    model_id = wire.create_model(session, str(tiny_model))
    warm = wire.forward_backward(_sparse_bomb(model_id, 1))
    assert warm.status_code == 413 and warm.json()["category"] == "user", warm.text
    gateway = _gateway_pid(cluster)
    before = _rss_bytes(gateway)
    timings = []
    for seq in range(2, 12):
        body = _sparse_bomb(model_id, seq)
        assert len(body) < 400
        started = time.perf_counter()
        resp = wire.forward_backward(body)
        timings.append(time.perf_counter() - started)
        assert resp.status_code == 413 and "at most" in resp.json()["detail"], resp.text
    grown = _rss_bytes(gateway) - before
    assert sorted(timings)[len(timings) // 2] < 0.05, timings
    assert grown < 50 * 1024 * 1024, f"gateway grew {grown / 2**20:.1f} MiB"
    # the refusals settled their seqs: the model's next call runs
    ok = wire.forward_backward(wire.fwdbwd_body(model_id, 12, toy_batch(n=1)))
    assert ok.status_code == 200
    _final(wire, ok.json()["request_id"])


# -- ids and names are checked at the edge -------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["", "a b", "a*b", "a>b", "..", "x" * 300, "\N{SNOWMAN}"])
def test_malformed_ids_are_a_400_naming_the_field(wire: Wire, bad_id: str) -> None:
    checks = [
        (wire.post("get_info", {"model_id": bad_id, "type": "get_info"}), "model_id"),
        (wire.post("retrieve_future", {"request_id": bad_id}), "request_id"),
        (wire.post("session_heartbeat", {"session_id": bad_id}), "session_id"),
        (_optim(wire, bad_id, 1), "model_id"),
        (
            wire.post(
                "create_model",
                {
                    "session_id": bad_id,
                    "model_seq_id": 0,
                    "base_model": "x",
                    "type": "create_model",
                },
            ),
            "session_id",
        ),
    ]
    for resp, field in checks:
        assert resp.status_code == 400, (field, resp.text)
        assert field in resp.json()["detail"] and resp.json()["category"] == "user"
    if bad_id not in ("", ".."):  # those two do not survive URL normalisation
        resp = wire.http.get(f"/api/v1/samplers/{bad_id}")
        assert resp.status_code == 400, resp.text


def test_checkpoint_names_are_immutable_unless_overwritten(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=2
    ).result()
    batch = toy_batch(n=2)
    train_steps(client, batch, 1)
    first = client.save_state("kept").result().path
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as taken:
        client.save_state("kept").result()
    assert "already exists" in str(taken.value)
    train_steps(client, batch, 1)
    assert client.save_state("kept", overwrite=True).result().path == first
    # two saves of one new name in flight: the second fails in the worker, in order
    a = client.save_state("twice")
    b = client.save_state("twice")
    assert a.result().path.endswith("/twice")
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as raced:
        b.result()
    assert "already exists" in str(raced.value)
    assert isinstance(raced.value, tinker.BadRequestError) or (
        raced.value.category == RequestErrorCategory.User  # type: ignore[attr-defined]
    )
    client.forward_backward(batch, "cross_entropy").result()


# -- reads leak nothing --------------------------------------------------------------------------


async def _consumer_count(nats_url: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        return sum(info.state.consumer_count for info in await js.streams_info())
    finally:
        await nc.close()


def test_a_burst_of_listings_answers_and_leaves_no_consumer(
    wire: Wire, cluster: Cluster, tiny_model: Path
) -> None:
    session = wire.session()
    for seq in range(15):
        resp = wire.post(
            "create_model",
            {
                "session_id": session,
                "model_seq_id": seq,
                "base_model": str(tiny_model),
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        )
        assert resp.status_code == 200
    before = asyncio.run(_consumer_count(cluster.nats_url))

    async def burst() -> list[int]:
        limit = asyncio.Semaphore(20)
        async with httpx.AsyncClient(
            base_url=cluster.base_url, headers={"X-API-Key": cluster.api_key}, timeout=60.0
        ) as http:

            async def one() -> int:
                async with limit:
                    resp = await http.get("/api/v1/training_runs", params={"limit": 100})
                    return resp.status_code

            return await asyncio.gather(*(one() for _ in range(300)))

    statuses = asyncio.run(burst())
    assert statuses.count(200) == 300, sorted(set(statuses))
    after = asyncio.run(_consumer_count(cluster.nats_url))
    assert after == before
    listed = wire.http.get("/api/v1/training_runs", params={"limit": 1000}).json()
    assert sum(run["training_run_id"].startswith(session) for run in listed["training_runs"]) == 15


# -- a sampling session never changes, even when its checkpoint's name is overwritten ----------


def _prompt_logprobs(wire: Wire, sampling_session_id: str, prompt: list[int]) -> list[float]:
    resp = wire.post(
        "asample",
        {
            "sampling_session_id": sampling_session_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": 1, "temperature": 0.0},
            "num_samples": 1,
            "prompt_logprobs": True,
            "type": "sample",
        },
    )
    assert resp.status_code == 200, resp.text
    sample = deserialize_sample_response(_final(wire, resp.json()["request_id"]).content)
    assert sample.prompt_logprobs is not None
    return [float(v) for v in sample.prompt_logprobs[1:]]


def _sampling_session(wire: Wire, session: str, seq: int, model_path: str) -> str:
    resp = wire.post(
        "create_sampling_session",
        {
            "session_id": session,
            "sampling_session_seq_id": seq,
            "model_path": model_path,
            "type": "create_sampling_session",
        },
    )
    assert resp.status_code == 200, resp.text
    return str(resp.json()["sampling_session_id"])


def test_an_overwritten_sampler_checkpoint_keeps_its_sessions_on_their_content(
    wire: Wire, tiny_model: Path
) -> None:
    session = wire.session()
    model_id = wire.create_model(session, str(tiny_model), seed=4)
    batch = toy_batch(n=2)
    prompt = [5, 9, 13, 17, 21]

    def step(seq: int) -> None:
        fwd = wire.forward_backward(wire.fwdbwd_body(model_id, seq, batch))
        opt = _optim(wire, model_id, seq + 1, lr=0.05)
        _final(wire, fwd.json()["request_id"])
        _final(wire, opt.json()["request_id"])

    def save(seq: int, overwrite: bool) -> httpx.Response:
        return wire.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "seq_id": seq, "path": "shared", "overwrite": overwrite},
        )

    step(1)
    saved = save(3, False)
    path = _final(wire, saved.json()["request_id"]).json()["path"]
    old_session = _sampling_session(wire, session, 0, path)
    old = _prompt_logprobs(wire, old_session, prompt)

    step(4)
    refused = save(6, False)
    assert refused.status_code == 400 and "already exists" in refused.json()["detail"]
    replaced = save(7, True)
    assert _final(wire, replaced.json()["request_id"]).json()["path"] == path
    new_session = _sampling_session(wire, session, 1, path)

    assert _prompt_logprobs(wire, old_session, prompt) == old
    assert _prompt_logprobs(wire, new_session, prompt) != old
