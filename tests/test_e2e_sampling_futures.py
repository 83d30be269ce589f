"""`retrieve_futures`, `cancel_future` and `join_sampling_session` through the official SDK (its
flags switched on by the gateway) against a real cluster (torch sampler in the trainer): many
concurrent samples complete through the session poller, pickled clones get their own clone ids
and never collide, a cancelled sample stops the sampler, and hostile or foreign calls to the
three endpoints get clear 4xx answers or change nothing."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import nats
import pytest
import tinker
from nats.aio.msg import Msg
from tinker import types

from protocol import records, subjects, topology
from protocol.jobs import decode_outcome
from protocol.records import WorkerRecord
from tests.cluster_helpers import reader, scrape
from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import PROMPT, kv_values

pytestmark = pytest.mark.e2e

SHORT = types.SamplingParams(max_tokens=5, temperature=1.0, stop=[])


def route_count(cluster: Cluster, route: str) -> float:
    """Requests the gateway answered on `route` with a 2xx, by its `/metrics`."""
    found = scrape(f"{cluster.base_url}/metrics")
    return sum(
        value
        for (name, labels), value in found.items()
        if name == "twinkle_gateway_requests_total"
        and ("route", route) in labels
        and dict(labels).get("status", "").startswith("2")
    )


def post(
    cluster: Cluster, path: str, body: object, key: str | None = None, accept: str = ""
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"X-API-Key": key or cluster.api_key, "Content-Type": "application/json"}
    if accept:
        headers["Accept"] = accept
    return httpx.post(
        f"{cluster.base_url}/api/v1/{path}", content=content, headers=headers, timeout=60
    )


def test_sdk_turns_the_three_endpoints_on(cluster: Cluster) -> None:
    config = post(cluster, "client/config", {"sdk_version": "0.38.0"}).json()
    assert config["sample_use_retrieve_futures"] is True
    assert config["sample_join_sampling_session"] is True
    dynamic = post(cluster, "client/dynamic_config", {"sdk_version": "0.38.0"}).json()
    assert dynamic["sample_cancel_enabled"] is True


def test_concurrent_samples_complete_through_retrieve_futures(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    polls_before = route_count(cluster, "/api/v1/retrieve_futures")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    futures = [sampler.sample(prompt, num_samples=2, sampling_params=SHORT) for _ in range(24)]
    results = [future.result(timeout=180) for future in futures]
    assert all(len(r.sequences) == 2 for r in results)
    assert all(
        len(s.tokens) == 5 and s.stop_reason == "length" for r in results for s in r.sequences
    )
    ids = [s.sequence_id for r in results for s in r.sequences]
    assert len(set(ids)) == 48  # 24 distinct requests, none merged
    assert route_count(cluster, "/api/v1/retrieve_futures") > polls_before


def test_pickled_clones_join_and_never_collide(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    joins_before = route_count(cluster, "/api/v1/join_sampling_session")
    original = service.create_sampling_client(base_model=str(tiny_model)).result()
    clones = [pickle.loads(pickle.dumps(original)) for _ in range(2)]
    prompt = types.ModelInput.from_ints(PROMPT)
    seeded = types.SamplingParams(max_tokens=4, temperature=1.0, seed=77, stop=[])
    # the same body from every client: with colliding seq ids the gateway would hand back the
    # first client's request id (same sequence ids) to the others
    futures = [
        client.sample(prompt, num_samples=1, sampling_params=seeded)
        for client in [original, *clones]
        for _ in range(3)
    ]
    results = [future.result(timeout=180) for future in futures]
    ids = [r.sequences[0].sequence_id for r in results]
    assert len(set(ids)) == 9
    assert len({tuple(r.sequences[0].tokens) for r in results}) == 1  # one seed: one answer
    assert route_count(cluster, "/api/v1/join_sampling_session") == joins_before + 2
    # the gateway counts clones per session: 1, 2, then 3 for the next one that joins
    joined = post(
        cluster, "join_sampling_session", {"sampling_session_id": original._sampling_session_id}
    )
    assert joined.status_code == 200, joined.text
    assert joined.json() == {"type": "join_sampling_session", "client_counter": 3}


async def _sampler_metrics_urls(nats_url: str, base_model: str) -> list[str]:
    """Every sampler of the model's pool: the trainer's torch sampler, and a vLLM sampler's."""
    found = []
    for value in await kv_values(nats_url, subjects.BUCKET_WORKERS):
        record = records.decode(value, WorkerRecord)
        if record.base_model == base_model:
            found.append(record.metrics_url)
    return found


def _sampler_counters(urls: list[str]) -> Callable[..., float]:
    """The sum of a series over every sampler of the pool."""
    readers = [reader(scrape(url)) for url in urls]
    return lambda name, **labels: sum(read(name, **labels) for read in readers)


@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_a_cancelled_sample_stops_the_sampler(
    backend: str, request: pytest.FixtureRequest, tiny_model: Path
) -> None:
    """With `--sampler vllm` the trainer's torch sampler serves the pool too: whichever takes
    the job must drop it (`tests/test_sample_cancel_vllm.py` checks vLLM's abort itself)."""
    cluster: Cluster = request.getfixturevalue("cluster" if backend == "torch" else "vllm_cluster")
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    request.addfinalizer(lambda: service.close("success").result())
    urls = asyncio.run(_sampler_metrics_urls(cluster.nats_url, str(tiny_model)))
    assert len(urls) == (1 if backend == "torch" else 2)
    before = _sampler_counters(urls)
    cancels_before = route_count(cluster, "/api/v1/cancel_future")
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    max_tokens = 4096 - len(PROMPT)
    endless = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, stop=[])
    future = sampler.sample(prompt, num_samples=4, sampling_params=endless)
    time.sleep(0.7)  # generating by now, unless the sampler is busy with other tests' samples
    assert not future.future().done()
    future.future().cancel()  # what the SDK does with an abandoned sample: cancel_future
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = _sampler_counters(urls)
        dropped = after("twinkle_sampler_cancelled_total", stage="sampling") - before(
            "twinkle_sampler_cancelled_total", stage="sampling"
        )
        # a busy sampler may not have taken the job yet: then it is skipped when taken
        skipped = after("twinkle_sampler_cancelled_total", stage="pickup") - before(
            "twinkle_sampler_cancelled_total", stage="pickup"
        )
        moved = dropped + skipped
        if moved:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the sampler never dropped the cancelled sample")
    assert moved == 1
    assert route_count(cluster, "/api/v1/cancel_future") == cancels_before + 1
    # the torch sampler counts what the dropped rows had generated (vLLM: 0, not counted)
    tokens = after("twinkle_sampler_cancelled_tokens_total") - before(
        "twinkle_sampler_cancelled_tokens_total"
    )
    assert tokens < 2 * max_tokens  # its 4 rows stopped, on average, before half-way
    if backend == "torch" and dropped:
        assert tokens > 0
    # it was not answered as a finished sample, and the sampler is free again
    assert after("twinkle_sampler_generated_tokens_total") == before(
        "twinkle_sampler_generated_tokens_total"
    )
    started = time.monotonic()
    quick = sampler.sample(prompt, num_samples=1, sampling_params=SHORT).result(timeout=60)
    assert len(quick.sequences[0].tokens) == 5
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_an_openai_client_that_goes_away_cancels_its_generation(
    backend: str, request: pytest.FixtureRequest, tiny_model: Path
) -> None:
    """`/v1/completions` holds the connection while the sampler generates; a client that
    closes it then has its sample cancelled, as `cancel_future` does. The connection closes
    once a sampler has begun the sample: a client gone before the gateway even took its request
    (a gateway slowed by a busy machine) leaves nothing to cancel, which is right, and would
    not test this."""
    cluster: Cluster = request.getfixturevalue("cluster" if backend == "torch" else "vllm_cluster")
    urls = asyncio.run(_sampler_metrics_urls(cluster.nats_url, str(tiny_model)))
    before = _sampler_counters(urls)
    body = {
        "model": str(tiny_model),
        "prompt": "once upon a time",
        "max_tokens": 4000,
        "temperature": 1.0,
        "n": 4,
        "seed": 5,
    }
    asyncio.run(_abandon_once_begun(cluster, body))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = _sampler_counters(urls)
        moved = sum(
            after("twinkle_sampler_cancelled_total", stage=stage)
            - before("twinkle_sampler_cancelled_total", stage=stage)
            for stage in ("sampling", "pickup")
        )
        if moved:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the sampler never dropped the abandoned generation")
    assert moved == 1
    assert after("twinkle_sampler_generated_tokens_total") == before(
        "twinkle_sampler_generated_tokens_total"
    )


async def _abandon_once_begun(cluster: Cluster, body: dict[str, object]) -> None:
    """POST `body` to `/v1/completions` and close the connection once a sampler has begun the
    sample (counted its start on the future: `workers.sampler.guard.begin`), seen on the
    futures bucket's update subject."""
    nc = await nats.connect(servers=topology.nats_servers(cluster.nats_url))
    begun: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def heard(msg: Msg) -> None:
        try:
            outcome = decode_outcome(msg.data)
        except Exception:  # a delete marker
            return
        if (
            outcome.sampling_session_id.startswith("openai:")
            and outcome.state == "pending"
            and outcome.attempts >= 1
            and not begun.done()
        ):
            begun.set_result(outcome.request_id)

    try:
        await nc.subscribe(f"$KV.{subjects.BUCKET_FUTURES}.>", cb=heard)
        await nc.flush()
        url = urlsplit(cluster.base_url)
        assert url.hostname == "127.0.0.1" and url.port is not None
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{url.port}\r\n"
            f"Authorization: Bearer {cluster.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        _, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.write(head.encode() + payload)
        await writer.drain()
        await asyncio.wait_for(begun, 60)
        writer.close()  # the client goes away while its sample is generated
        await writer.wait_closed()
    finally:
        await nc.close()


def _sampling_session(service: tinker.ServiceClient, tiny_model: Path) -> str:
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    session_id: str = sampler._sampling_session_id
    return session_id


def _poll(session_id: str, **extra: object) -> dict[str, object]:
    return {"target": {"type": "sampling_session", "sampling_session_id": session_id}, **extra}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prev_cursor", "-1"),
        ("prev_cursor", str(2**60)),
        ("prev_cursor", str(2**70)),
        ("timeout", "-1"),
        ("timeout", "1e9"),
        ("timeout", "1e400"),
        ("timeout", "NaN"),
        ("timeout", '"soon"'),
        ("retrieved_request_ids", json.dumps(["req-1"] * 5000)),
        ("retrieved_request_ids", '["../../etc"]'),
        ("retrieved_request_ids", '"req-1"'),
    ],
)
def test_hostile_polls_get_400(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path, field: str, value: str
) -> None:
    session_id = _sampling_session(service, tiny_model)
    target = json.dumps(_poll(session_id)["target"])
    started = time.monotonic()
    resp = post(cluster, "retrieve_futures", f'{{"target": {target}, "{field}": {value}}}'.encode())
    assert resp.status_code == 400, resp.text
    if value != "NaN":  # not JSON at all: the parser's message names the byte instead
        assert field in resp.text, resp.text
    assert time.monotonic() - started < 5


def test_hostile_targets_and_ids_get_4xx(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    session_id = _sampling_session(service, tiny_model)
    target = {"type": "sampling_session", "sampling_session_id": session_id}
    cases: list[tuple[str, object, int, str]] = [
        ("retrieve_futures", b'{"target": {"sampling_session_id": "x"}, "timeout": NaN}', 400, ""),
        ("retrieve_futures", {"prev_cursor": 0}, 400, "target"),
        ("retrieve_futures", {"target": {**target, "cloned_sampler_id": -1}}, 400, "cloned"),
        ("retrieve_futures", {"target": {**target, "cloned_sampler_id": 10**12}}, 400, "cloned"),
        ("retrieve_futures", {"target": {**target, "type": "model"}}, 400, "target"),
        ("retrieve_futures", _poll("no/such:session"), 400, "sampling_session_id"),
        ("retrieve_futures", _poll("sess-nope:sample:0", timeout=0), 404, "not found"),
        ("cancel_future", {"request_id": ""}, 400, "request_id"),
        ("cancel_future", {"request_id": "req/../x"}, 400, "request_id"),
        ("cancel_future", {"request_id": "r" * 500}, 400, "request_id"),
        ("cancel_future", {}, 400, "request_id"),
        ("cancel_future", {"request_id": "req-0-sample"}, 404, "not found"),
        ("join_sampling_session", {"sampling_session_id": "a b"}, 400, "sampling_session_id"),
        ("join_sampling_session", {"sampling_session_id": "sess-nope:sample:0"}, 404, ""),
        ("join_sampling_session", {"sampling_session_id": session_id, "type": "x"}, 400, ""),
    ]
    for path, body, status, text in cases:
        resp = post(cluster, path, body)
        assert resp.status_code == status, (path, body, resp.text)
        assert text in resp.text, (path, resp.text)


def test_polls_answer_within_their_timeout(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    session_id = _sampling_session(service, tiny_model)
    for extra, most_s in [
        ({"timeout": 0}, 2.0),
        ({"timeout": 1.5}, 5.0),
        ({"prev_cursor": 1, "timeout": 0.5}, 5.0),
    ]:
        started = time.monotonic()
        resp = post(cluster, "retrieve_futures", _poll(session_id, **extra))
        elapsed = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["completions"] == [] and isinstance(body["cursor"], int)
        assert elapsed < most_s, (extra, elapsed)
        if extra.get("timeout") == 1.5:
            assert elapsed >= 1.4  # a held poll waits for a completion
    # a cursor no gateway handed out (newer than any): answered at once too
    resp = post(cluster, "retrieve_futures", _poll(session_id, prev_cursor=2**53, timeout=0))
    assert resp.status_code == 200 and resp.json()["completions"] == []


def test_another_tenant_can_neither_poll_join_nor_cancel(
    service: tinker.ServiceClient, cluster: Cluster, tiny_model: Path
) -> None:
    sampler = service.create_sampling_client(base_model=str(tiny_model)).result()
    session_id = sampler._sampling_session_id
    prompt = {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}
    submitted = post(
        cluster,
        "asample",
        {
            "sampling_session_id": session_id,
            "seq_id": 0,
            "num_samples": 1,
            "prompt": prompt,
            "sampling_params": {"max_tokens": 300, "temperature": 1.0, "stop": []},
        },
    )
    assert submitted.status_code == 200, submitted.text
    request_id = submitted.json()["request_id"]
    other = OTHER_TENANT_KEY
    assert post(cluster, "retrieve_futures", _poll(session_id, timeout=0), other).status_code == 404
    joined = post(cluster, "join_sampling_session", {"sampling_session_id": session_id}, other)
    assert joined.status_code == 404
    # another tenant's cancel reads like an unknown id's, and nothing happens
    foreign = post(cluster, "cancel_future", {"request_id": request_id}, other)
    unknown = post(cluster, "cancel_future", {"request_id": "req-0-sample"}, other)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["detail"].replace(request_id, "x") == unknown.json()["detail"].replace(
        "req-0-sample", "x"
    )
    deadline = time.monotonic() + 120
    completions: list[dict[str, object]] = []
    cursor = before = 0
    while not completions and time.monotonic() < deadline:
        before = cursor
        polled = post(
            cluster, "retrieve_futures", _poll(session_id, prev_cursor=cursor, timeout=10)
        )
        assert polled.status_code == 200, polled.text
        completions, cursor = polled.json()["completions"], polled.json()["cursor"]
    # the other tenant acknowledging this id in its own session's poll drops nothing of ours
    with tinker.ServiceClient(base_url=cluster.base_url, api_key=other) as other_service:
        own = other_service.create_sampling_client(base_model=str(tiny_model)).result()
        acknowledged = post(
            cluster,
            "retrieve_futures",
            _poll(own._sampling_session_id, timeout=0, retrieved_request_ids=[request_id]),
            other,
        )
        assert acknowledged.status_code == 200, acknowledged.text
        assert acknowledged.json()["completions"] == []
    again = post(cluster, "retrieve_futures", _poll(session_id, prev_cursor=before, timeout=0))
    assert again.json()["completions"] == completions
    assert completions == [
        {
            "state": "finished",
            "request_id": request_id,
            "response_payload_uncompressed_size": completions[0][
                "response_payload_uncompressed_size"
            ],
        }
    ]
    # protobuf to a client that asks for it, as SDK 0.38 does; JSON to one that does not
    asked = post(
        cluster, "retrieve_future", {"request_id": request_id}, accept="application/x-protobuf"
    )
    assert asked.headers["content-type"].startswith("application/x-protobuf")
    result = post(cluster, "retrieve_future", {"request_id": request_id})
    assert result.headers["content-type"].startswith("application/json")
    assert len(result.json()["sequences"][0]["tokens"]) > 0
    # cancelling a finished future is harmless; the acknowledged one is not repeated
    assert post(cluster, "cancel_future", {"request_id": request_id}).status_code == 200
    polled = post(
        cluster,
        "retrieve_futures",
        _poll(session_id, prev_cursor=cursor, timeout=0, retrieved_request_ids=[request_id]),
    )
    assert polled.json()["completions"] == []
