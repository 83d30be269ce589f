"""The Twinkle Client protocol's routes under a hostile client, against the session's cluster:
every field the client controls (session header, adapter names, LoRA configs, accumulation,
optimizer and scheduler arguments, batches, clip arguments, checkpoint names) tried wrong,
huge and malformed. Each gets a clear 4xx; the adapter trains on afterwards, its seq spent by
every refused pass, and another tenant sees none of it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import OTHER_TENANT_KEY, Cluster

pytestmark = pytest.mark.e2e


@dataclass
class Twinkle:
    http: httpx.Client
    session_id: str
    model: str  # the base model as the URL names it

    def post(self, call: str, body: Any, *, session: str | None = None) -> httpx.Response:
        headers = {"X-Twinkle-Session-Id": self.session_id if session is None else session}
        if session == "":
            headers = {}
        return self.http.post(
            f"/api/v1/model/{self.model}/twinkle/{call}", json=body, headers=headers
        )


def _client(cluster: Cluster, key: str) -> httpx.Client:
    auth = {"Authorization": f"Bearer {key}", "Twinkle-Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=cluster.base_url, headers=auth, timeout=120)


def _open(cluster: Cluster, key: str, model: Path) -> Twinkle:
    http = _client(cluster, key)
    created = http.post("/api/v1/twinkle/create_session", json={"metadata": {"who": "test"}})
    assert created.status_code == 200, created.text
    return Twinkle(http, created.json()["session_id"], str(model).lstrip("/"))


ROW = {"input_ids": [5, 9, 11, 13, 17, 19], "labels": [-100, -100, 11, 13, 17, 19]}


@pytest.fixture(scope="module")
def twinkle(cluster: Cluster, tiny_model: Path) -> Iterator[Twinkle]:
    ours = _open(cluster, cluster.api_key, tiny_model)
    lora = json.dumps({"r": 4, "target_modules": "all-linear"})
    added = ours.post("add_adapter_to_model", {"adapter_name": "a", "config": lora})
    assert added.status_code == 200, added.text
    for call, body in (
        ("set_loss", {"loss_cls": "CrossEntropyLoss"}),
        ("set_optimizer", {"optimizer_cls": "AdamW", "lr": 1e-3}),
    ):
        assert ours.post(call, {"adapter_name": "a", **body}).status_code == 200
    yield ours
    ours.http.close()


def _trains(twinkle: Twinkle) -> float:
    """A pass of the adapter, answered at once (no refused call left a seq hole)."""
    started = time.monotonic()
    done = twinkle.post("forward_backward", {"adapter_name": "a", "inputs": [ROW]})
    assert done.status_code == 200, done.text
    assert time.monotonic() - started < 60
    return float(done.json()["result"]["loss"])


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("forward_backward", {"adapter_name": "nope", "inputs": [ROW]}, "adapter_name"),
    ("forward_backward", {"adapter_name": "../a", "inputs": [ROW]}, "adapter_name"),
    ("forward_backward", {"adapter_name": "a" * 5000, "inputs": [ROW]}, "adapter_name"),
    ("forward_backward", {"inputs": [ROW]}, "adapter_name"),
    ("forward_backward", {"adapter_name": "a", "inputs": []}, "inputs"),
    ("forward_backward", {"adapter_name": "a", "inputs": "text"}, "inputs"),
    ("forward_backward", {"adapter_name": "a", "inputs": [{"messages": []}]}, "inputs"),
    (
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": [1, 2], "labels": [1]}]},
        "labels",
    ),
    (
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": ["x"], "labels": [1]}]},
        "input_ids",
    ),
    (
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": [], "labels": []}]},
        "input_ids",
    ),
    ("forward_backward", {"adapter_name": "a", "inputs": [ROW] * 5000}, "rows"),
    (
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": [2**40, 1], "labels": [1, 1]}]},
        "32-bit",
    ),
    (  # refused past the gateway, by the worker: the seq it spent is settled
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": [10**6, 1], "labels": [1, 1]}]},
        "vocab|token",
    ),
    (
        "forward_backward",
        {"adapter_name": "a", "inputs": [{"input_ids": [-5, 1], "labels": [1, 1]}]},
        "token|negative|vocab",
    ),
    ("add_adapter_to_model", {"adapter_name": "a"}, "already"),
    ("add_adapter_to_model", {"adapter_name": "b", "config": "{"}, "config"),
    ("add_adapter_to_model", {"adapter_name": "b", "config": json.dumps({"r": -1})}, "rank"),
    ("add_adapter_to_model", {"adapter_name": "b", "config": json.dumps({"r": 10**9})}, "rank"),
    ("add_adapter_to_model", {"adapter_name": "b", "config": json.dumps({"r": "8"})}, "config.r"),
    (
        "add_adapter_to_model",
        {"adapter_name": "b", "config": json.dumps({"target_modules": ["evil"]})},
        "target_modules",
    ),
    (
        "add_adapter_to_model",
        {"adapter_name": "b", "gradient_accumulation_steps": 0},
        "gradient_accumulation_steps",
    ),
    (
        "add_adapter_to_model",
        {"adapter_name": "b", "gradient_accumulation_steps": -3},
        "gradient_accumulation_steps",
    ),
    (
        "add_adapter_to_model",
        {"adapter_name": "b", "gradient_accumulation_steps": 10**12},
        "gradient_accumulation_steps",
    ),
    (
        "add_adapter_to_model",
        {"adapter_name": "b", "gradient_accumulation_steps": "2"},
        "gradient_accumulation_steps",
    ),
    ("set_optimizer", {"adapter_name": "a", "optimizer_cls": "SGD"}, "optimizer_cls"),
    ("set_optimizer", {"adapter_name": "a", "optimizer_cls": "AdamW", "lr": -1}, "lr"),
    ("set_optimizer", {"adapter_name": "a", "optimizer_cls": "AdamW", "lr": "1e-3"}, "lr"),
    (
        "set_optimizer",
        {"adapter_name": "a", "optimizer_cls": "AdamW", "betas": [0.9, 1.5]},
        "betas",
    ),
    ("set_optimizer", {"adapter_name": "a", "optimizer_cls": "AdamW", "params": []}, "params"),
    ("set_lr_scheduler", {"adapter_name": "a", "scheduler_cls": "os.system"}, "scheduler"),
    (
        "set_lr_scheduler",
        {"adapter_name": "a", "scheduler_cls": "LinearLR", "total_iters": -1},
        "total_iters",
    ),
    (
        "set_lr_scheduler",
        {"adapter_name": "a", "scheduler_cls": "StepLR", "step_size": 10**30},
        "step_size",
    ),
    ("set_loss", {"adapter_name": "a", "loss_cls": "GRPOLoss"}, "loss_cls"),
    (
        "set_loss",
        {"adapter_name": "a", "loss_cls": "CrossEntropyLoss", "reduction": "none"},
        "reduction",
    ),
    ("set_template", {"adapter_name": "a", "template_cls": "a.b; rm -rf"}, "template_cls"),
    ("clip_grad_norm", {"adapter_name": "a", "max_grad_norm": 1.0, "norm_type": 1}, "norm_type"),
    ("save", {"adapter_name": "a", "name": "../../etc"}, "name"),
    ("save", {"adapter_name": "a", "name": "x" * 300}, "name"),
    ("load", {"adapter_name": "a", "name": "missing"}, "not found|missing"),
    ("load", {"adapter_name": "a", "name": "twinkle://sess-x:train:0/weights/w"}, "not found"),
    ("load", {"adapter_name": "a", "name": "twinkle://../weights/w"}, "name"),
]


@pytest.mark.parametrize(("call", "body", "field"), REFUSED, ids=lambda v: str(v)[:40])
def test_a_wrong_field_is_a_clear_4xx_and_the_adapter_trains_on(
    twinkle: Twinkle, call: str, body: dict[str, Any], field: str
) -> None:
    refused = twinkle.post(call, body)
    assert 400 <= refused.status_code < 500, refused.text
    assert re.search(field, refused.json()["detail"], re.IGNORECASE), refused.text
    _trains(twinkle)


def test_zero_grad_before_step_discards_the_accumulated_gradients(twinkle: Twinkle) -> None:
    """At a sync, `zero_grad` drops what the passes accumulated: the `step` after it applies
    nothing (the loss stays), the next pass's `step` applies that pass's gradient."""
    first = _trains(twinkle)
    for call in ("zero_grad", "step"):
        done = twinkle.post(call, {"adapter_name": "a"})
        assert done.status_code == 200, done.text
    assert _trains(twinkle) == first
    assert twinkle.post("step", {"adapter_name": "a"}).status_code == 200
    assert _trains(twinkle) < first


def test_the_session_header_scopes_every_adapter_to_its_tenant(
    cluster: Cluster, twinkle: Twinkle, tiny_model: Path
) -> None:
    body = {"adapter_name": "a", "inputs": [ROW]}
    missing = twinkle.post("forward_backward", body, session="")
    assert missing.status_code == 400 and "X-Twinkle-Session-Id" in missing.json()["detail"]
    assert twinkle.post("forward_backward", body, session="sess-none").status_code == 404
    assert twinkle.post("forward_backward", body, session="../x").status_code == 400
    other = _open(cluster, OTHER_TENANT_KEY, tiny_model)
    try:
        # our session id with another tenant's key: not found, and nothing of ours changes
        stolen = Twinkle(other.http, twinkle.session_id, twinkle.model)
        assert stolen.post("forward_backward", body).status_code == 404
        assert stolen.post("save", {"adapter_name": "a", "name": "x"}).status_code == 404
        # its own session has no adapter "a"
        assert other.post("forward_backward", body).status_code == 404
        runs = other.http.get("/api/v1/twinkle/training_runs").json()["training_runs"]
        assert all(run["model_owner"] != "default" for run in runs)
    finally:
        other.http.close()
    _trains(twinkle)


def test_gateway_routes_refuse_malformed_queries_and_paths(twinkle: Twinkle) -> None:
    http = twinkle.http
    for query in ("limit=-1", "limit=abc", "offset=99999999999", "limit=1e3"):
        listed = http.get(f"/api/v1/twinkle/training_runs?{query}")
        assert listed.status_code == 400, (query, listed.text)
    for path in (
        "/api/v1/twinkle/checkpoint_path/sess-x:train:0/weights/..%2F..",
        "/api/v1/twinkle/checkpoint_path/sess-x:train:0/bogus/name",
        "/api/v1/twinkle/training_runs/" + "r" * 3000,
    ):
        got = http.get(path)
        assert 400 <= got.status_code < 500, (path, got.text)
    assert (
        http.post("/api/v1/twinkle/weights_info", json={"twinkle_path": "file:///etc"}).status_code
        == 400
    )
    assert (
        http.post("/api/v1/twinkle/session_heartbeat", json={"session_id": "sess-none"}).status_code
        == 404
    )
    assert http.get("/api/v1/twinkle/healthz").json() == {"status": "ok"}
    capacity = http.get("/api/v1/twinkle/capacity_info").json()
    assert capacity["free_loras"] == capacity["max_loras"] - capacity["used_loras"]
    unauthorized = httpx.get(f"{str(http.base_url).rstrip('/')}/api/v1/twinkle/training_runs")
    assert unauthorized.status_code == 401


def test_a_checkpoint_saved_by_twinkle_is_listed_resolved_and_deleted(twinkle: Twinkle) -> None:
    saved = twinkle.post("save", {"adapter_name": "a", "name": "hostile-kept"})
    assert saved.status_code == 200, saved.text
    path = saved.json()["twinkle_path"]
    run_id, checkpoint_id = path.removeprefix("twinkle://").split("/", 1)
    http = twinkle.http
    listed = http.get(f"/api/v1/twinkle/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert [c["twinkle_path"] for c in listed] == [path]
    assert listed[0]["size_bytes"] > 0
    resolved = http.get(f"/api/v1/twinkle/checkpoint_path/{run_id}/{checkpoint_id}").json()
    assert resolved == {"path": "tinker://" + path.removeprefix("twinkle://"), "twinkle_path": path}
    info = http.post("/api/v1/twinkle/weights_info", json={"twinkle_path": path}).json()
    assert info["training_run_id"] == run_id and info["lora_rank"] == 4
    deleted = http.delete(f"/api/v1/twinkle/training_runs/{run_id}/checkpoints/{checkpoint_id}")
    assert deleted.status_code == 200 and deleted.json()["success"] is True
    assert (
        http.get(f"/api/v1/twinkle/training_runs/{run_id}/checkpoints").json()["checkpoints"] == []
    )


def test_processor_objects_belong_to_their_session_and_tenant(
    cluster: Cluster, twinkle: Twinkle, tiny_model: Path
) -> None:
    """The processor routes (the cluster's processor service) check the session like the model
    routes; an object made in one session is not found from another, nor by another tenant."""
    data = cluster.data_dir / "twinkle-data" / "routes.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text('{"query": "q", "response": "r"}\n' * 4)
    meta = json.dumps({"dataset_id": str(data), "_TWINKLE_TYPE_": "DatasetMeta"})
    body = {"processor_type": "dataset", "class_type": "Dataset", "dataset_meta": meta}

    def post(
        client: Twinkle, call: str, payload: Any, session: str | None = None
    ) -> httpx.Response:
        headers = {"X-Twinkle-Session-Id": client.session_id if session is None else session}
        return client.http.post(f"/api/v1/processor/twinkle/{call}", json=payload, headers=headers)

    created = post(twinkle, "create", body)
    assert created.status_code == 200, created.text
    pid = created.json()["processor_id"]
    length = post(twinkle, "call", {"processor_id": pid, "function": "__len__"})
    assert length.status_code == 200 and length.json()["result"] == 4
    assert post(twinkle, "create", body, session="").status_code == 400
    assert post(twinkle, "create", body, session="sess-none").status_code == 404
    outside = {**body, "dataset_meta": json.dumps({"dataset_id": "/etc/passwd"})}
    assert post(twinkle, "create", outside).status_code == 400
    assert post(twinkle, "call", {"processor_id": pid, "function": "__class__"}).status_code == 400
    mine = _open(cluster, cluster.api_key, tiny_model)
    other = _open(cluster, OTHER_TENANT_KEY, tiny_model)
    try:
        call = {"processor_id": pid, "function": "__len__"}
        assert post(mine, "call", call).status_code == 404  # another session of ours
        assert post(other, "call", call).status_code == 404  # another tenant
        assert post(other, "call", call, session=twinkle.session_id).status_code == 404
    finally:
        mine.http.close()
        other.http.close()


# -- sampler routes ----------------------------------------------------------------------------

TRAJECTORY = {"messages": [{"role": "user", "content": "hello"}]}
FEATURE = {"input_ids": [5, 9, 11, 13]}


def _sampler_post(
    twinkle: Twinkle, call: str, body: Any, session: str | None = None
) -> httpx.Response:
    headers = {"X-Twinkle-Session-Id": twinkle.session_id if session is None else session}
    return twinkle.http.post(
        f"/api/v1/sampler/{twinkle.model}/twinkle/{call}", json=body, headers=headers
    )


@pytest.fixture(scope="module")
def sampler(twinkle: Twinkle) -> Twinkle:
    for call, body in (
        ("create", {}),
        ("set_template", {"template_cls": "Template", "max_length": 64}),
        ("add_adapter_to_sampler", {"adapter_name": "s", "config": {"r": 4}}),
    ):
        done = _sampler_post(twinkle, call, body)
        assert done.status_code == 200, done.text
    return twinkle


def _samples(sampler: Twinkle) -> None:
    """A sample of a trajectory, answered at once with the template's decoding."""
    done = _sampler_post(
        sampler, "sample", {"inputs": [TRAJECTORY], "sampling_params": {"max_tokens": 2}}
    )
    assert done.status_code == 200, done.text
    (seq,) = done.json()["samples"][0]["sequences"]
    assert 1 <= len(seq["tokens"]) <= 2 and isinstance(seq["decoded"], str)  # 1: at EOS


def _sample(inputs: Any = None, **params: Any) -> dict[str, Any]:
    return {"inputs": [FEATURE] if inputs is None else inputs, "sampling_params": params}


SAMPLER_REFUSED: list[tuple[str, Any, str]] = [
    ("set_template", {"template_cls": "os.system"}, "template_cls"),
    ("set_template", {"template_cls": "Template", "trust_remote_code": True}, "setting"),
    ("set_template", {"template_cls": "Template", "max_length": "x"}, "max_length"),
    ("add_adapter_to_sampler", {"adapter_name": "../s", "config": {}}, "adapter_name"),
    ("add_adapter_to_sampler", {"adapter_name": "t", "config": "{"}, "config"),
    ("add_adapter_to_sampler", {"config": {}}, "adapter_name"),
    ("apply_patch", {"patch_cls": "os.system"}, "patch"),
    ("sample", _sample([]), "inputs"),
    ("sample", _sample("text"), "inputs"),
    ("sample", _sample([FEATURE] * 65), "inputs"),
    ("sample", _sample([FEATURE, TRAJECTORY]), "inputs"),
    ("sample", _sample([{"input_ids": []}]), "input_ids"),
    ("sample", _sample([{"input_ids": [2**40]}]), "32-bit"),
    ("sample", _sample([{"input_ids": [10**6]}]), "vocab"),
    ("sample", _sample([{"input_ids": [1, 2], "labels": [1]}]), "labels"),
    ("sample", _sample([{"messages": [{"role": "root", "content": "x"}]}]), "role"),
    ("sample", _sample([{"messages": [{"role": "user", "content": [{"type": "image"}]}]}]), "text"),
    ("sample", _sample([{"messages": [], "images": ["http://x"]}]), "images|messages"),
    (
        "sample",
        _sample([{"messages": [{"role": "user", "content": "x" * (2 << 20)}]}]),
        "large|MB|413|bytes|characters",
    ),
    ("sample", _sample(top_p=0), "top_p"),
    ("sample", _sample(temperature=-1), "temperature"),
    ("sample", _sample(temperature="hot"), "temperature"),
    ("sample", _sample(max_tokens=10**9), "max_tokens|context"),
    ("sample", _sample(max_tokens=-1), "max_tokens"),
    ("sample", _sample(num_samples=0), "num_samples"),
    ("sample", _sample(num_samples=10**6), "num_samples"),
    ("sample", _sample(repetition_penalty=1.2), "repetition_penalty"),
    ("sample", _sample(stop=5), "stop"),
    ("sample", _sample(stop=[1, "x"]), "stop"),
    ("sample", _sample(seed="x"), "seed"),
    ("sample", _sample(logprobs=10**6), "topk|logprobs"),
    ("sample", _sample(n=3), "n"),
    ("sample", {**_sample(), "adapter_uri": "http://example.com/a"}, "adapter_uri"),
    ("sample", {**_sample(), "adapter_uri": "twinkle://sess-x:train:0/weights/nope"}, "not found"),
    ("sample", {**_sample(), "adapter_name": "../../x"}, "adapter_name"),
    ("sample", {"inputs": [FEATURE], "sampling_params": "hot"}, "sampling_params"),
]


@pytest.mark.parametrize(("call", "body", "field"), SAMPLER_REFUSED, ids=lambda v: str(v)[:40])
def test_a_wrong_sampler_field_is_a_clear_4xx_and_the_sampler_samples_on(
    sampler: Twinkle, call: str, body: Any, field: str
) -> None:
    refused = _sampler_post(sampler, call, body)
    assert 400 <= refused.status_code < 500, refused.text
    assert re.search(field, refused.text, re.IGNORECASE), refused.text
    _samples(sampler)


def test_a_sampler_belongs_to_its_session_and_a_checkpoint_to_its_tenant(
    cluster: Cluster, sampler: Twinkle, tiny_model: Path
) -> None:
    body = _sample(max_tokens=1)
    assert _sampler_post(sampler, "sample", body, session="").status_code == 400
    assert _sampler_post(sampler, "sample", body, session="sess-none").status_code == 404
    saved = sampler.post("save", {"adapter_name": "a", "name": "sampled"})
    assert saved.status_code == 200, saved.text
    path = saved.json()["twinkle_path"]
    mine = _sampler_post(sampler, "sample", {**body, "adapter_uri": path})
    assert mine.status_code == 200, mine.text
    other = _open(cluster, OTHER_TENANT_KEY, tiny_model)
    try:
        stolen = Twinkle(other.http, sampler.session_id, sampler.model)
        assert _sampler_post(stolen, "sample", body).status_code == 404
        assert _sampler_post(other, "sample", body).status_code == 404  # no sampler there yet
        assert _sampler_post(other, "create", {}).status_code == 200
        # a trajectory needs its own session's template
        assert _sampler_post(other, "sample", _sample([TRAJECTORY])).status_code == 400
        taken = _sampler_post(other, "sample", {**body, "adapter_uri": path})
        assert taken.status_code == 404, taken.text
    finally:
        other.http.close()
    _samples(sampler)
