"""forward_backward bodies a hostile client sizes, refused by the gateway with a 4xx that settles
the call's seq: an in-process gateway on a real nats-server, with no worker.

- `target_tokens` of shape [N, K] with K outside 1..MAX_LOGPROBS_K: a pass pads every datum's
  targets to the widest K it holds, so a few bytes of sparse CSR declaring K = 2**22 would be an
  out-of-memory for every tenant sharing the pass.
- A job bigger than one message on the bus (the server's max_payload): the publish would fail
  after the seq was claimed, leaving a hole that stalls the model's next call.

Each refusal must publish the tombstone of its seq, so the worker runs the next call at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from msgspec.structs import replace

from protocol import records, subjects
from protocol import tinker_wire_pb2 as pb
from protocol.api import LoraConfig
from protocol.jobs import ForwardBackwardJob, Job, TombstoneJob, decode_job
from protocol.records import RunRecord, SamplerRecord, WorkerRecord
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import decode_forward_backward
from twinkle_async.gateway.app import build_app
from twinkle_async.gateway.state import BUS, REGISTRY
from twinkle_async.nats_server import MAX_PAYLOAD_BYTES, NatsServer
from twinkle_async.registry import Registry
from twinkle_async.settings import BusSettings, GatewaySettings

API_KEY = "tml-limits-test-key"
TENANT = "t"
MODEL_ID = "sess-limits:train:0"
BODY_LIMIT_BYTES = MAX_PAYLOAD_BYTES + 2 * 1024 * 1024  # above one bus message, on purpose


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[TestClient[object, object]]:
    settings = GatewaySettings(
        api_keys={API_KEY: TENANT},
        bus=BusSettings(nats_url=nats_server.url),
        max_request_bytes=BODY_LIMIT_BYTES,
        max_json_bytes=BODY_LIMIT_BYTES,  # an operator's choice: sample bodies that big
    )
    async with TestClient(TestServer(build_app(settings))) as test_client:
        run = RunRecord(
            model_id=MODEL_ID,
            tenant_id=TENANT,
            session_id="sess-limits",
            base_model="base",
            lora=LoraConfig(),
            created_at=0.0,
            last_request_time=0.0,
        )
        await test_client.app[REGISTRY].put_run(run)
        yield test_client


def _worker(**fields: Any) -> WorkerRecord:
    """A live trainer's record for base model "base", with `fields` set."""
    return WorkerRecord(
        worker_id="w",
        pool=subjects.pool_of("base"),
        base_model="base",
        arch="qwen3",
        vocab_size=16,
        max_context=10**7,
        max_rank=8,
        slots_total=1,
        slots_used=0,
        heartbeat_at=time.time() + 60,
        **fields,
    )


def _body(seq_id: int, n_tokens: int = 1, targets: pb.Tensor | None = None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=MODEL_ID, seq_id=seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.ones(n_tokens, "<i4").tobytes()
    if targets is not None:
        datum.loss_fn_inputs["target_tokens"].CopyFrom(targets)
    body: bytes = msg.SerializeToString()
    return body


def _empty_sparse_targets(k: int) -> pb.Tensor:
    """[1, k] int64 target ids in sparse CSR with no entries: a few bytes whatever k is."""
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1, k])
    tensor.sparse_csr.crow_indices = np.zeros(2, "<i8").tobytes()
    return tensor


async def _post(client: TestClient[object, object], body: bytes) -> tuple[int, dict[str, str]]:
    resp = await client.post(
        "/api/v1/forward_backward",
        data=body,
        headers={"X-API-Key": API_KEY, "Content-Type": "application/x-protobuf"},
    )
    return resp.status, await resp.json()


async def _published(client: TestClient[object, object], seq_id: int) -> Job:
    """The one job the worker finds on the ops stream for the model's `seq_id`."""
    js = client.app[BUS].js
    assert js is not None
    state = (await js.stream_info(subjects.STREAM_OPS)).state
    jobs = [
        decode_job((await js.get_msg(subjects.STREAM_OPS, seq)).data)
        for seq in range(state.first_seq, state.last_seq + 1)
    ]
    mine = [job for job in jobs if job.model_id == MODEL_ID and job.seq_id == seq_id]
    assert len(mine) == 1, jobs
    return mine[0]


@pytest.mark.parametrize("k", [0, MAX_LOGPROBS_K + 1, 2**22 - 1])
async def test_target_tokens_wider_than_top_k_are_refused_and_settle_the_seq(
    client: TestClient[object, object], k: int
) -> None:
    body = _body(1, targets=_empty_sparse_targets(k))
    assert len(body) < 100
    status, answer = await _post(client, body)
    assert status == 400 and answer["category"] == "user", answer
    assert "target_tokens" in answer["detail"] and f"1..{MAX_LOGPROBS_K}" in answer["detail"]
    tombstone = await _published(client, 1)
    assert isinstance(tombstone, TombstoneJob) and "target_tokens" in tombstone.error
    status, answer = await _post(client, _body(2, targets=_empty_sparse_targets(MAX_LOGPROBS_K)))
    assert status == 200, answer  # the widest top-K targets pass
    assert isinstance(await _published(client, 2), ForwardBackwardJob)


async def test_a_job_over_the_bus_message_limit_is_refused_and_settles_the_seq(
    client: TestClient[object, object],
) -> None:
    n_tokens = (MAX_PAYLOAD_BYTES + 1024 * 1024) // 4
    body = _body(1, n_tokens=n_tokens)
    assert MAX_PAYLOAD_BYTES < len(body) <= BODY_LIMIT_BYTES
    status, answer = await _post(client, body)
    assert status == 413 and answer["category"] == "user", answer
    assert "job bus" in answer["detail"], answer
    tombstone = await _published(client, 1)
    assert isinstance(tombstone, TombstoneJob) and tombstone.request_type == "forward_backward"
    status, answer = await _post(client, _body(2))
    assert status == 200, answer
    assert isinstance(await _published(client, 2), ForwardBackwardJob)


async def test_a_sample_over_the_bus_message_limit_is_refused_with_nothing_left_pending(
    client: TestClient[object, object],
) -> None:
    """A sample job fails its publish the same way; before, its future was recorded pending
    first, and stayed pending for ever behind a 500."""
    bus, registry = client.app[BUS], client.app[REGISTRY]
    worker = _worker(sampler_backend="torch")  # a trainer that samples too
    await bus.put(subjects.BUCKET_WORKERS, "w", records.encode(worker))
    deadline = time.monotonic() + 10
    while not registry.sampler_backends("base"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    sampler = SamplerRecord(
        sampling_session_id="sess-limits:sample:0",
        tenant_id=TENANT,
        session_id="sess-limits",
        base_model="base",
        model_path=None,
        created_at=time.time(),
    )
    await registry.put_sampler(sampler)
    n_tokens = (MAX_PAYLOAD_BYTES + 1024 * 1024) // 2  # "1," per token
    body = {
        "type": "sample",
        "sampling_session_id": sampler.sampling_session_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1] * n_tokens}]},
        "sampling_params": {"max_tokens": 1},
    }
    data = json.dumps(body, separators=(",", ":")).encode()
    assert MAX_PAYLOAD_BYTES < len(data) <= BODY_LIMIT_BYTES
    resp = await client.post(
        "/api/v1/asample",
        data=data,
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    answer = await resp.json()
    assert resp.status == 413 and "job bus" in answer["detail"], answer
    assert await bus.keys(subjects.BUCKET_FUTURES) == []  # no future was left pending


@pytest.mark.parametrize("route", ["create_session", "optim_step"])
async def test_deeply_nested_json_is_a_400_not_a_500(
    client: TestClient[object, object], route: str
) -> None:
    """A body nested a million levels deep (2 MB) once raised RecursionError in the decoder: a
    500 and a logged traceback. `optim_step` is read first for its `model_id` and `seq_id`."""
    depth = 1_000_000
    nested = b"[" * depth + b"]" * depth
    body = b'{"model_id":"' + MODEL_ID.encode() + b'","user_metadata":{"a":' + nested + b"}}"
    resp = await client.post(
        f"/api/v1/{route}",
        data=body,
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    answer = await resp.json()
    assert resp.status == 400 and answer["category"] == "user", answer
    assert "nested too deeply" in answer["detail"], answer


async def test_session_labels_are_bounded_in_bytes(client: TestClient[object, object]) -> None:
    """64 tags and 64 metadata entries of 1024 four-byte characters: a 786 KB session record
    that every listing and sweep would read, once accepted because characters were counted."""
    wide = "\U0001f600" * 1023
    body = {
        "type": "create_session",
        "sdk_version": "0.38.0",
        "tags": [f"{i}{wide}" for i in range(64)],
        "user_metadata": {f"{i}{wide}": wide for i in range(64)},
    }
    headers = {"X-API-Key": API_KEY}
    resp = await client.post("/api/v1/create_session", json=body, headers=headers)
    answer = await resp.json()
    assert resp.status == 400 and answer["category"] == "user", answer
    assert "bytes of UTF-8" in answer["detail"], answer
    honest = {"type": "create_session", "tags": ["rl"], "user_metadata": {"epoch": 3}}
    resp = await client.post("/api/v1/create_session", json=honest, headers=headers)
    assert resp.status == 200, await resp.text()


async def test_a_flag_the_base_model_cannot_train_is_refused_at_create_model(
    client: TestClient[object, object],
) -> None:
    """A worker whose base model cannot train `train_mlp` (its experts are a layout the bank
    does not adapt) says so in its record; `create_model` refuses such an adapter with a 400
    naming the module, before any job is published, and accepts the same model without it."""
    bus, registry = client.app[BUS], client.app[REGISTRY]
    reason = "train_mlp: this base model's expert block model.layers.0.mlp.experts is not laid out"
    worker = _worker(refused={"train_mlp": reason})
    await bus.put(subjects.BUCKET_WORKERS, "w", records.encode(worker))
    deadline = time.monotonic() + 10
    while "base" not in registry.served_models():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    headers = {"X-API-Key": API_KEY}
    session = await client.post(
        "/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=headers
    )
    session_id = (await session.json())["session_id"]

    async def create(seq: int, lora: dict[str, object]) -> tuple[int, dict[str, str]]:
        body = {"session_id": session_id, "model_seq_id": seq, "base_model": "base"}
        resp = await client.post(
            "/api/v1/create_model", json={**body, "lora_config": lora}, headers=headers
        )
        return resp.status, await resp.json()

    status, answer = await create(0, {"rank": 4})
    assert status == 400 and answer["detail"] == reason
    status, answer = await create(1, {"rank": 4, "train_mlp": False})
    assert status == 200 and answer["request_id"], answer


async def test_a_datum_over_the_workers_plan_is_refused_and_settles_the_seq(
    client: TestClient[object, object],
) -> None:
    """A worker's record carries its memory plan (`max_train_tokens`); a forward_backward whose
    longest datum is over it is a 400 naming the datum and the limit, its seq settled, and
    `get_server_capabilities` shows the plan."""
    bus, registry = client.app[BUS], client.app[REGISTRY]
    await bus.put(
        subjects.BUCKET_WORKERS,
        "w",
        records.encode(_worker(max_train_tokens=8, max_sample_tokens=16)),
    )
    deadline = time.monotonic() + 10
    while "base" not in registry.served_models():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    for tokens in (9, 2**20):
        status, answer = await _post(client, _body(1 if tokens == 9 else 2, n_tokens=tokens))
        assert status == 400 and answer["category"] == "user", answer
        assert f"datums[0].model_input: {tokens} tokens exceed the 8 tokens" in answer["detail"]
    tombstone = await _published(client, 1)
    assert isinstance(tombstone, TombstoneJob) and "exceed the 8 tokens" in tombstone.error
    status, answer = await _post(client, _body(3, n_tokens=8))
    assert status == 200, answer
    assert isinstance(await _published(client, 3), ForwardBackwardJob)
    resp = await client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY})
    [model] = (await resp.json())["supported_models"]
    assert (model["max_train_tokens"], model["max_sample_tokens"]) == (8, 16)


def test_a_sample_is_checked_against_the_tightest_samplers_plan() -> None:
    """A sample request may reach any live sampler of its base model, the trainers' own and a
    standalone one (vLLM, whose plan is its `max_model_len`): the limit is the least of their
    plans; a stale record, a trainer that does not sample, or one without a plan does not count."""
    registry = Registry(cast(Any, None))
    assert registry.longest_sample("base") is None
    registry.workers = {
        "t": _worker(max_sample_tokens=16, sampler_backend="torch"),
        "v": replace(
            _worker(max_sample_tokens=10, sampler_backend="vllm"), worker_id="v", role="sampler"
        ),
        "old": replace(
            _worker(max_sample_tokens=2, sampler_backend="torch"), worker_id="old", heartbeat_at=0
        ),
        "none": replace(_worker(max_sample_tokens=3), worker_id="none"),
        "quiet": replace(_worker(sampler_backend="vllm"), worker_id="quiet"),
        "other": replace(_worker(max_sample_tokens=1, sampler_backend="torch"), base_model="x"),
    }
    assert registry.longest_sample("base") == 10


def _json_body(seq_id: int, tokens: list[int], key: str = "forward_backward_input") -> bytes:
    """A JSON body as tinker 0.16.1 sends it."""
    n = len(tokens)
    datum = {
        "loss_fn_inputs": {
            "target_tokens": {"data": [1] * n, "dtype": "int64", "shape": [n]},
            "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
        },
        "model_input": {"chunks": [{"tokens": tokens}]},
    }
    body = {key: {"data": [datum], "loss_fn": "cross_entropy"}, "model_id": MODEL_ID}
    return json.dumps({**body, "seq_id": seq_id}).encode()


async def test_json_bodies_of_older_sdks_run_and_their_refusals_spend_the_seq(
    client: TestClient[object, object],
) -> None:
    """tinker 0.16.1's JSON `forward_backward` and `forward` (on its own route), with the key as
    a Bearer token: published as the protobuf call. A JSON body refused for a field, or a
    protobuf body damaged after its seq, is a 400 that settles its seq (a tombstone), so the
    model's next call runs at once; a body that names no seq is a plain 400."""
    bearer = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def post(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        resp = await client.post(path, data=body, headers=headers)
        return resp.status, await resp.json()

    status, answer = await post("/api/v1/forward_backward", _json_body(1, [3, 4, 5]), bearer)
    assert status == 200, answer
    job = await _published(client, 1)
    assert isinstance(job, ForwardBackwardJob) and not job.forward_only
    assert decode_forward_backward(job.body).datums[0].tokens.tolist() == [3, 4, 5]
    twinkle = {"Twinkle-Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    status, answer = await post("/api/v1/forward", _json_body(2, [6], "forward_input"), twinkle)
    assert status == 200, answer
    job = await _published(client, 2)
    assert isinstance(job, ForwardBackwardJob) and job.forward_only
    # refused before it decodes: the seq is settled
    status, answer = await post("/api/v1/forward_backward", _json_body(3, [2**40]), bearer)
    assert status == 400 and "outside int32" in answer["detail"], answer
    tombstone = await _published(client, 3)
    assert isinstance(tombstone, TombstoneJob) and "outside int32" in tombstone.error
    message = pb.ForwardBackwardRequest(model_id=MODEL_ID, seq_id=4, loss_fn="cross_entropy")
    damaged = message.SerializeToString() + b"\x1a\xff\xff"  # a datum cut short
    status, answer = await _post(client, damaged)
    assert status == 400 and "not a valid ForwardBackwardRequest" in answer["detail"], answer
    assert isinstance(await _published(client, 4), TombstoneJob)
    status, answer = await post("/api/v1/forward_backward", _json_body(5, [7]), bearer)
    assert status == 200, answer  # the next call at once
    # nothing names a seq: refused, nothing spent
    status, answer = await post("/api/v1/forward_backward", b"{broken", bearer)
    assert status == 400, answer
    status, answer = await _post(client, b"\x0a\x05ab")
    assert status == 400, answer
    # a wrong Bearer key is no key
    wrong = {"Authorization": "Bearer tml-not-a-key", "Content-Type": "application/json"}
    status, _ = await post("/api/v1/forward_backward", _json_body(6, [1]), wrong)
    assert status == 401


async def test_a_client_that_leaves_mid_body_is_no_server_fault(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A body cut off by its client's disconnect: logged as the client's leaving, not as a
    crash with an incident id (what used to fill the log when SDK processes exited). Served as
    `serve` serves it (aiohttp's test server cancels such a handler instead)."""
    caplog.set_level(logging.INFO, logger="twinkle_async.gateway.middleware")
    settings = GatewaySettings(
        api_keys={API_KEY: TENANT}, bus=BusSettings(nats_url=nats_server.url)
    )
    runner = web.AppRunner(build_app(settings), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /api/v1/retrieve_futures HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        deadline = time.monotonic() + 5
        while not any("went away" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            await asyncio.sleep(0.05)
        assert not [r for r in caplog.records if "crashed" in r.getMessage()]
    finally:
        await runner.cleanup()
