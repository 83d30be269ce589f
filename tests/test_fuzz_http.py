"""Bounded property-based fuzzing of every HTTP route of the gateway, against a real cluster.

Every request is checked by `tests.fuzz_harness`: it is answered within 10 s, never with a 5xx,
an error is JSON with `detail` and a known `category`, and another tenant's id is never served.
Bodies come from `tests.hostile_inputs`: arbitrary JSON, valid bodies with one hostile field,
hostile protobuf, random bytes, hostile headers, path and query parameters, unknown routes.
What the gateway accepts is followed further: a created session, model or sampler must read
back, and a checkpoint save or forward_backward submitted in order must finish as a result or
a user error, never as a server error.

Each fuzz test fails on the first answer that breaks a property, with hypothesis's example, run
alone or with the others; `test_cluster_still_trains_after_fuzzing` then checks the cluster
survived. `TWINKLE_FUZZ_SHRINK=1`: hypothesis shrinks each failure to a minimal example (slower).
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import tinker
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.fuzz_harness import (
    API,
    DELETE,
    TIMEOUT_S,
    Fuzzer,
    JsonRoute,
    Target,
    fuzz_settings,
    fuzzer,
    set_field,
    target,
    to_json,
    violation,
)
from tests.hostile_inputs import (
    CHANGES_IN_PLACE,
    HOSTILE_IDS,
    HOSTILE_NAMES,
    ZSTD_BOMB,
    ZSTD_MAGIC,
    change_fwdbwd,
    fwdbwd_requests,
    hostile,
    json_junk,
    valid_fwdbwd,
)
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e
__all__ = ["fuzzer", "target"]  # the fixtures, from tests.fuzz_harness

# -- the JSON routes, each with a valid body and what each field holds ------------------------

# fmt: off
ADAM = {
    "learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
LORA = {"rank": 4, "seed": 0, "train_unembed": True, "train_mlp": True, "train_attn": True}
SAMPLE_PARAMS = {"max_tokens": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0}

# Valid bodies use far-ahead seq ids, so a repeat is deduplicated and no step runs that the fuzzed
# model did not ask for; creations take fresh numbers, so each stores (and reads back) a record.
CREATED = itertools.count(1000)
NLL_GRAPH = {"format": 1, "nodes": [
    {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
    {"op": "call_method", "name": "s", "target": "sum", "args": [{"ref": "logprobs"}], "kwargs": {}},
    {"op": "output", "name": "output", "target": "output",
     "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}], "kwargs": {}},
]}
JSON_ROUTES = [
    JsonRoute(
        "create_custom_loss",
        lambda t: {"session_id": t.session, "custom_loss_seq_id": next(CREATED) % 256, "name": "nll",
                   "inputs": [{"name": "logprobs", "rank": 1}], "graph": copy.deepcopy(NLL_GRAPH),
                   "type": "create_custom_loss"},
        {"session_id": "session", "custom_loss_seq_id": "int", "name": "str", "inputs": "list",
         "graph": "dict", "graph.format": "int", "graph.nodes": "list", "type": "str"},
    ),
    JsonRoute("client/config", lambda t: {"sdk_version": "0.38.0"}, {"sdk_version": "str"}),
    JsonRoute("client/dynamic_config", lambda t: {"sdk_version": "0.38.0"}, {"sdk_version": "str"}),
    JsonRoute(
        "create_session",
        lambda t: {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        {"tags": "list", "user_metadata": "dict", "user_metadata.k": "str", "sdk_version": "str",
         "project_id": "str", "display_name": "str", "type": "str"},
    ),
    JsonRoute(
        "session_heartbeat",
        lambda t: {"session_id": t.session, "type": "session_heartbeat"},
        {"session_id": "session", "type": "str"},
    ),
    JsonRoute(
        "telemetry",
        lambda t: {"events": [], "platform": "Linux", "sdk_version": "0.38.0",
                   "session_id": t.session, "process_uuid": "0"},
        {"events": "list", "session_id": "session", "platform": "str"},
    ),
    JsonRoute(
        "create_model",
        lambda t: {"session_id": t.session, "model_seq_id": next(CREATED), "base_model": t.base_model,
                   "lora_config": dict(LORA), "optimizer_config": {"type": "adamw"},
                   "type": "create_model"},
        {"session_id": "session", "model_seq_id": "int", "base_model": "str", "lora_config": "dict",
         "lora_config.rank": "int", "lora_config.seed": "int", "lora_config.train_mlp": "bool",
         "optimizer_config": "dict", "optimizer_config.type": "str", "user_metadata": "dict",
         "user_metadata.k": "str", "type": "str"},
    ),
    JsonRoute(
        "get_info",
        lambda t: {"model_id": t.model, "type": "get_info"},
        {"model_id": "model", "type": "str"},
    ),
    JsonRoute(
        "optim_step",
        lambda t: {"model_id": t.model, "seq_id": 1000, "type": "optim_step", "adam_params": dict(ADAM)},
        {"model_id": "model", "seq_id": "int", "adam_params": "dict",
         **{f"adam_params.{k}": "float" for k in ADAM}, "optimizer_params": "dict"},
    ),
    JsonRoute(
        "save_weights",
        lambda t: {"model_id": t.model, "path": "fuzz-save", "seq_id": 1001, "type": "save_weights"},
        {"model_id": "model", "path": "name", "seq_id": "int", "ttl_seconds": "int",
         "overwrite": "bool", "user_metadata": "dict", "user_metadata.k": "str"},
    ),
    JsonRoute(
        "save_weights_for_sampler",
        lambda t: {"model_id": t.model, "path": "fuzz-save", "seq_id": 1002, "kind": "snapshot"},
        {"model_id": "model", "path": "name", "seq_id": "int", "ttl_seconds": "int",
         "kind": "str", "sampling_session_seq_id": "int", "user_metadata": "dict"},
    ),
    JsonRoute(
        "save_weights_for_sampler",
        lambda t: {"model_id": t.model, "sampling_session_seq_id": 5, "seq_id": 1003,
                   "kind": "inflight"},
        {"model_id": "model", "sampling_session_seq_id": "int", "seq_id": "int", "kind": "str",
         "path": "name"},
    ),
    JsonRoute(
        "load_weights",
        lambda t: {"session_id": t.session, "model_seq_id": next(CREATED), "path": t.checkpoint,
                   "optimizer": False, "type": "load_weights"},
        {"session_id": "session", "model_seq_id": "int", "path": "path", "optimizer": "bool",
         "model_id": "model", "base_model": "str", "optimizer_config": "dict",
         "weights_access_token": "str", "user_metadata": "dict"},
    ),
    JsonRoute(
        "load_weights",
        lambda t: {"model_id": t.model, "seq_id": 1004, "path": t.checkpoint, "optimizer": True},
        {"model_id": "model", "seq_id": "int", "path": "path", "optimizer": "bool",
         "session_id": "session"},
    ),
    JsonRoute(
        "create_sampling_session",
        lambda t: {"session_id": t.session, "sampling_session_seq_id": next(CREATED),
                   "base_model": t.base_model, "type": "create_sampling_session"},
        {"session_id": "session", "sampling_session_seq_id": "int", "base_model": "str",
         "model_path": "path"},
    ),
    JsonRoute(
        "create_sampling_session",
        lambda t: {"session_id": t.session, "sampling_session_seq_id": next(CREATED),
                   "model_path": t.sampler_checkpoint},
        {"session_id": "session", "sampling_session_seq_id": "int", "model_path": "path",
         "base_model": "str"},
    ),
    JsonRoute(
        "asample",
        lambda t: {"num_samples": 1, "prompt": {"chunks": [{"tokens": [5, 6, 7], "type": "encoded_text"}]},
                   "sampling_params": dict(SAMPLE_PARAMS), "sampling_session_id": t.sampler,
                   "seq_id": 7, "prompt_logprobs": False, "topk_prompt_logprobs": 0,
                   "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "type": "sample"},
        {"sampling_session_id": "sampler", "seq_id": "int", "num_samples": "int",
         "prompt": "dict", "prompt.chunks": "dict", "prompt.chunks.0.tokens": "tokens",
         "prompt.chunks.0.type": "str", "sampling_params": "dict",
         "sampling_params.max_tokens": "int", "sampling_params.temperature": "float",
         "sampling_params.top_p": "float", "sampling_params.top_k": "int",
         "sampling_params.seed": "int", "sampling_params.stop": "stop",
         "topk_prompt_logprobs": "int", "prompt_logprobs": "bool", "base_model": "str",
         "model_path": "path", "target_prompt_logprobs": "dict", "prompt_alt_tokens_k": "int",
         "prompt_logprobs_last_n": "int"},
    ),
    JsonRoute(
        "retrieve_future",
        lambda t: {"request_id": t.request, "allow_metadata_only": False},
        {"request_id": "request", "allow_metadata_only": "bool"},
    ),
    JsonRoute(
        "weights_info", lambda t: {"tinker_path": t.checkpoint}, {"tinker_path": "path"}
    ),
    JsonRoute(
        # a search only filters: another tenant's session id finds nothing (a 200), so ids are
        # fuzzed as plain strings here
        "sessions/search",
        lambda t: {"limit": 5, "owner": {"type": "own"}, "user_metadata": {}},
        {"limit": "int", "session_id": "str", "display_name": "str", "project_ids": "list",
         "user_metadata": "dict", "user_metadata.k": "str", "owner": "dict", "owner.type": "str",
         "owner.owner_urns": "list", "statuses": "list", "cursor": "dict",
         "cursor.last_created_at": "str", "cursor.last_session_id": "str"},
    ),
]
# fmt: on


@given(data=st.data())
@fuzz_settings(1500)
def test_fuzz_json_routes_one_hostile_field(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """A valid body with one field replaced by a hostile value, or removed."""
    t = fuzzer.target
    route = data.draw(st.sampled_from(JSON_ROUTES), label="route")
    body = copy.deepcopy(route.body(t))
    sequenced = "seq_id" in body and route.route != "asample"  # sampling seq ids only name
    dotted = data.draw(st.sampled_from(sorted(route.fields)), label="field")
    value = data.draw(
        st.just(DELETE) | hostile(route.fields[dotted], t) | st.sampled_from(HOSTILE_IDS),
        label="value",
    )
    set_field(body, dotted, value)
    resp = fuzzer.post_json(route.route, body, t.names_other(value) and route.route != "telemetry")
    fuzzer.read_back(route.route, body, resp)
    if sequenced:
        _check_seq_refused(fuzzer, f"POST {route.route}", body.get("seq_id"), to_json(body), resp)


@given(data=st.data())
@fuzz_settings(600)
def test_fuzz_json_routes_random_bodies(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """Any JSON at all, or an object with the route's keys holding any JSON."""
    route = data.draw(st.sampled_from(JSON_ROUTES), label="route")
    keys = sorted({f.split(".")[0] for f in route.fields})
    body = data.draw(
        json_junk() | st.fixed_dictionaries({}, optional={k: json_junk() for k in keys}),
        label="body",
    )
    resp = fuzzer.post_json(route.route, body)
    fuzzer.read_back(route.route, body, resp)


# -- forward_backward: protobuf -----------------------------------------------------------------


def _post_proto(
    fuzzer: Fuzzer, body: bytes, headers: dict[str, str] | None = None, note: str = ""
) -> httpx.Response | None:
    headers = headers or {"Content-Type": "application/x-protobuf"}
    other = fuzzer.target.other_model.encode() in body and "X-API-Key" not in headers
    route = "POST forward_backward"
    return fuzzer.send("POST", f"{API}/forward_backward", route, body, headers, other, note)


def _check_seq_refused(
    fuzzer: Fuzzer, route: str, seq_id: Any, body: bytes, resp: httpx.Response | None
) -> None:
    """A training call's seq_id counts from 1 (0 is the model's creation): a missing one, or one
    below 1, is refused."""
    below = isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id < 1
    if resp is not None and resp.status_code == 200 and (seq_id is None or below):
        request = f"{route} (seq_id {seq_id}) body={body[:300]!r}"
        raise violation(("seq_id missing or < 1 accepted", route), request, resp.text[:300])


@given(data=st.data())
@fuzz_settings(800)
def test_fuzz_forward_backward_hostile_protobuf(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """Well-formed protobuf whose every field may be hostile."""
    msg = data.draw(fwdbwd_requests(fuzzer.target), label="request")
    body = msg.SerializeToString()
    resp = _post_proto(fuzzer, body)
    _check_seq_refused(fuzzer, "POST forward_backward", msg.seq_id, body, resp)


@given(data=st.data())
@fuzz_settings(800)
def test_fuzz_forward_backward_one_hostile_change(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """The SDK's own valid body with one hostile change (shapes, dtypes, sparse, ids, sizes)."""
    msg = valid_fwdbwd(fuzzer.target.model, 1000)
    what = change_fwdbwd(data.draw, msg, fuzzer.target)
    body = msg.SerializeToString()
    resp = _post_proto(fuzzer, body, note=f"[{what}] ")
    _check_seq_refused(fuzzer, "POST forward_backward", msg.seq_id, body, resp)


@given(body=st.binary(max_size=300), compress=st.booleans())
@fuzz_settings(300)
def test_fuzz_forward_backward_raw_bytes(fuzzer: Fuzzer, body: bytes, compress: bool) -> None:
    """Random bytes, as is or zstd-compressed (a valid frame around garbage)."""
    if compress:
        _post_proto(
            fuzzer,
            zstandard.ZstdCompressor().compress(body),
            {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
        )
    else:
        _post_proto(fuzzer, body)


# -- headers ------------------------------------------------------------------------------------

HEADER_ROUTES = ["forward_backward", "optim_step", "get_info", "create_session", "asample",
                 "retrieve_future", "telemetry", "create_model"]  # fmt: skip


def _valid_body(route: str, t: Target) -> bytes:
    if route == "forward_backward":
        return valid_fwdbwd(t.model, 1005).SerializeToString()
    spec = next(r for r in JSON_ROUTES if r.route == route)
    return to_json(spec.body(t))


@given(data=st.data())
@fuzz_settings(800)
def test_fuzz_headers(fuzzer: Fuzzer, data: st.DataObject, cluster: Cluster) -> None:
    """Content-Encoding, Content-Type and API key variations over valid and broken bodies."""
    t = fuzzer.target
    route = data.draw(st.sampled_from(HEADER_ROUTES), label="route")
    valid = _valid_body(route, t)
    kind = data.draw(
        st.sampled_from(["valid", "zstd", "garbage", "zstd garbage", "magic", "empty", "bomb"]),
        label="body",
    )
    body = {
        "valid": valid,
        "zstd": zstandard.ZstdCompressor().compress(valid),
        "garbage": data.draw(st.binary(max_size=64)),
        "zstd garbage": zstandard.ZstdCompressor().compress(data.draw(st.binary(max_size=64))),
        "magic": ZSTD_MAGIC + data.draw(st.binary(max_size=64)),
        "empty": b"",
        "bomb": ZSTD_BOMB,
    }[kind]
    headers: dict[str, str] = {}
    content_type = data.draw(
        st.sampled_from(
            [None, "application/json", "application/x-protobuf", "text/plain", "",
             "multipart/form-data; boundary=zz", "application/x-www-form-urlencoded",
             "application/json; charset=latin-1", "x" * 500]
        ),
        label="content-type",
    )  # fmt: skip
    encoding = data.draw(
        st.sampled_from(
            [None, "zstd", "ZSTD", "gzip", "br", "deflate", "identity", "zstd, gzip",
             "", "x" * 300]
        ),
        label="content-encoding",
    )  # fmt: skip
    key = data.draw(
        st.sampled_from(
            ["mine", "other", "missing", "", "tml-", cluster.api_key[:-1], cluster.api_key + "x",
             cluster.api_key.upper(), "x" * 300]
        ),
        label="api key",
    )  # fmt: skip
    if content_type is not None:
        headers["Content-Type"] = content_type
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    headers["X-API-Key"] = {"mine": cluster.api_key, "other": OTHER_TENANT_KEY}.get(key, key)
    if key == "missing":
        del headers["X-API-Key"]
    # B's key on a body naming A's objects must not be served (telemetry and sessions name none).
    other = key == "other" and route not in ("create_session", "telemetry")
    fuzzer.send("POST", f"{API}/{route}", f"POST {route}", body, headers, other)


# -- path and query parameters, unknown routes and methods --------------------------------------

PATH_ROUTES = [
    ("GET", "training_runs/{id}", "model"),
    ("GET", "training_runs/{id}/checkpoints", "model"),
    ("GET", "samplers/{id}", "sampler"),
    ("POST", "sessions/{id}/finish", "spare"),
    ("GET", "sessions/{id}", "session"),
    ("GET", "sessions/{id}/trace_export", "session"),
    # A's checkpoint is `weights/fuzz-weights`; unpublishing it changes nothing the others see
    ("DELETE", "training_runs/{id}/checkpoints/weights/fuzz-weights/publish", "model"),
    ("GET", "training_runs/{id}/checkpoints/weights/fuzz-weights/external_weights_urls", "model"),
    ("GET", "training_runs/{id}/checkpoints/weights/fuzz-weights/archive", "model"),
]


@given(data=st.data())
@fuzz_settings(600)
def test_fuzz_path_parameters(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """Hostile ids in the path, encoded three ways (all escaped, ':' kept as the SDK does, raw)."""
    t = fuzzer.target
    method, template, kind = data.draw(st.sampled_from(PATH_ROUTES), label="route")
    real = {
        "model": [t.model, t.other_model, t.session],
        "sampler": [t.sampler, t.other_sampler],
        "spare": [t.spare_session, t.other_session, t.model],  # never A's main session
        "session": [t.session, t.other_session, t.model],
    }[kind]
    value = data.draw(
        st.sampled_from(real) | st.sampled_from(HOSTILE_IDS) | st.text(max_size=30), label="id"
    )
    encode = data.draw(st.sampled_from(["all", "colon", "raw"]), label="encoding")
    shown = {"all": quote(value, safe=""), "colon": quote(value, safe=":"), "raw": value}[encode]
    body = to_json({"reason": {"type": "success"}, "detail": None}) if method == "POST" else None
    fuzzer.send(
        method,
        f"{API}/{template.replace('{id}', shown)}",
        f"{method} {template}",
        body,
        {"Content-Type": "application/json"} if body else None,
        names_other=value in t.other_ids,
    )


@given(
    params=st.dictionaries(
        st.sampled_from(
            ["limit", "offset", "access_scope", "project_id", "cursor", "starting_on",
             "ending_before", "day", "event_type"]
        ),
        st.sampled_from(
            ["-1", "0", "1", "1e3", "0x10", "1_000", " 5", "\uff19", "9" * 4400, "", "owned",
             "public", "\x00", str(2**64), "nan"]
        )
        | st.text(max_size=10),
    ),
    listing=st.sampled_from(
        ["training_runs", "checkpoints", "sessions", "audit", "billing/usage/events",
         "billing/usage/checkpoints/current"]
    ),
)  # fmt: skip
@fuzz_settings(300)
def test_fuzz_query_parameters(fuzzer: Fuzzer, params: dict[str, str], listing: str) -> None:
    """The paged listings with hostile paging parameters."""
    query = "&".join(f"{quote(k)}={quote(v, safe='')}" for k, v in params.items())
    if len(query) > 8000:
        return  # past aiohttp's request-line limit: its HTTP parser answers, not the gateway
    fuzzer.send("GET", f"{API}/{listing}?{query}", f"GET {listing}")


KNOWN_PATHS = sorted(
    {f"{API}/{r.route}" for r in JSON_ROUTES}
    | {f"{API}/forward_backward", f"{API}/get_server_capabilities", f"{API}/healthz", "/healthz"}
    | {
        f"{API}/{name}"
        for name in (
            "save_weights_external", "copy_weights", "unload_model", "checkpoints", "sessions",
            "sessions/x", "training_runs/x/checkpoints/weights/y",
            "training_runs/x/checkpoints/weights/y/publish",
            "training_runs/x/checkpoints/weights/y/ttl", "sessions/search", "audit",
            "billing/usage/events", "billing/usage/checkpoints/current", "retrieve_futures",
            "cancel_future", "join_sampling_session",
        )
    }
    | {"/files/v1/checkpoints/x/weights/y/adapter_config.json", "/files/v1/archives/x/weights/y"}
)  # fmt: skip
UNKNOWN_PATHS = [
    f"{API}/{name}"
    for name in (
        "nope", "auth/token", "forward",
        "training_runs/x/checkpoints/weights/y/z", "", "/", "..", "healthz/x",
    )
] + ["/", "/api", "/api/v2/create_session", "/API/V1/healthz", "/files/v1/x"]  # fmt: skip


@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    path=st.sampled_from(KNOWN_PATHS + UNKNOWN_PATHS)
    | st.text(max_size=20).map(lambda s: f"{API}/{quote(s)}"),
)
@fuzz_settings(300)
def test_fuzz_unknown_routes_and_methods(fuzzer: Fuzzer, method: str, path: str) -> None:
    """A route that does not exist, or a method a route does not take: a JSON 4xx."""
    known = path in KNOWN_PATHS
    route = f"{'wrong method on a route' if known else 'unknown route'} ({method})"
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    fuzzer.send(method, path, route, body)


def test_oversized_and_bombed_bodies(fuzzer: Fuzzer) -> None:
    """Over the request limit plainly and through zstd: a JSON 413, not a crash or a hang."""
    big = b'{"sdk_version": "' + b"x" * (7 * 1024 * 1024) + b'"}'
    fuzzer.send("POST", f"{API}/create_session", "POST create_session", big)
    zstd = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    fuzzer.send("POST", f"{API}/forward_backward", "POST forward_backward", ZSTD_BOMB, zstd)
    fuzzer.send("POST", f"{API}/telemetry", "POST telemetry", big)


# -- what the gateway accepts must run ---------------------------------------------------------


def _in_order(fuzzer: Fuzzer) -> int:
    """The next seq id of the model whose submits run; taken only when a submit is accepted."""
    return fuzzer.next_seq.setdefault(fuzzer.target.run_model, 1)


@given(data=st.data())
@fuzz_settings(60)
def test_fuzz_forward_backward_runs_or_fails_as_user_error(
    fuzzer: Fuzzer, data: st.DataObject
) -> None:
    """A hostile change the gateway lets through reaches the worker in order: it must come back
    as a result or a user error (a server error means the worker met input nobody checked)."""
    t = fuzzer.target
    seq_id = _in_order(fuzzer)
    msg = valid_fwdbwd(t.run_model, seq_id)
    what = change_fwdbwd(data.draw, msg, t, CHANGES_IN_PLACE)
    body = msg.SerializeToString()
    resp = _post_proto(fuzzer, body, note=f"[{what}] ")
    if resp is not None and resp.status_code == 200:
        fuzzer.next_seq[t.run_model] = seq_id + 1
        fuzzer.outcome("POST forward_backward", resp, f"[{what}] seq {seq_id}: {body[:300]!r}")


@given(
    name=st.sampled_from(HOSTILE_NAMES) | st.text(max_size=40),
    route=st.sampled_from(["save_weights", "save_weights_for_sampler"]),
)
@fuzz_settings(60)
def test_fuzz_checkpoint_names_save_and_read_back(fuzzer: Fuzzer, name: str, route: str) -> None:
    """A checkpoint name the gateway accepts must save (or fail as a user error), and the
    checkpoint must then be listed and described."""
    t = fuzzer.target
    seq_id = _in_order(fuzzer)
    body = {"model_id": t.run_model, "path": name, "seq_id": seq_id}
    resp = fuzzer.post_json(route, body)
    if resp is None or resp.status_code != 200:
        return
    fuzzer.next_seq[t.run_model] = seq_id + 1
    result = fuzzer.outcome(f"POST {route}", resp, f"POST {route} {to_json(body)!r}")
    if result is None:
        return
    note = f"after POST {route} {to_json(body)!r} saved {result.get('path')!r}: "
    fuzzer.post_json("weights_info", {"tinker_path": result.get("path")}, note=note)
    run = quote(t.run_model, safe=":")
    route_label = "GET training_runs/{id}/checkpoints"
    fuzzer.send("GET", f"{API}/training_runs/{run}/checkpoints", route_label, note=note)


# -- afterwards ---------------------------------------------------------------------------------


def test_cluster_still_trains_after_fuzzing(cluster: Cluster, target: Target) -> None:
    """The fuzzing left the cluster serving: health answers, and a fresh client learns."""
    assert cluster.process.poll() is None, "the cluster exited during the fuzzing"
    with httpx.Client(base_url=cluster.base_url, timeout=TIMEOUT_S) as http:
        for path in ("/healthz", f"{API}/healthz"):
            resp = http.get(path)
            assert resp.status_code == 200 and resp.json() == {"status": "ok"}, resp.text
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    try:
        client = service.create_lora_training_client(
            base_model=target.base_model, rank=8, seed=13
        ).result()
        losses = train_steps(client, toy_batch(seed=13), 4)
    finally:
        service.close("success").result()
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses
