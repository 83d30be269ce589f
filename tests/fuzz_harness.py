"""The fuzz tests' machinery: hypothesis settings, the objects they aim at (tenant A's and
another tenant B's, made once per module by the `target` fixture), and the client (`fuzzer`)
that sends one request and checks every property on its answer.

Properties of every answer: it comes within `TIMEOUT_S`; it is never 5xx; an error is a JSON
object with a string `detail` and a `category` the SDK knows; a request naming another tenant's
id is never answered 2xx. A broken property raises at once, in the test that sent the request,
as a `Violation` class of its own per signature, so hypothesis tells distinct failures apart. A
500 is explained by the exception the gateway logged for its incident, so two different crashes
of one route are two signatures.

The fixtures are registered in a test module by importing them (`target`, `fuzzer`); each module
gets its own. With `TWINKLE_FUZZ_SHRINK=1` hypothesis shrinks each failure to a minimal example
(slower: every shrink step is a request to the cluster).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.wire import Wire

TIMEOUT_S = 10.0
RESULT_TIMEOUT_S = 30.0  # a future of a tiny CPU model; retrieve_future itself holds up to 30 s
API = "/api/v1"
SHRINK = bool(os.environ.get("TWINKLE_FUZZ_SHRINK"))
CATEGORIES = ("server", "unknown", "user")
# aiohttp's own plain-text answers when no route or method matches.
AIOHTTP_DEFAULTS = ("404: Not Found", "405: Method Not Allowed")


def fuzz_settings(max_examples: int) -> settings:
    """Deterministic and bounded: each fuzz module runs in about a minute on two cores."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
        phases=(Phase.explicit, Phase.generate, Phase.shrink)
        if SHRINK
        else (Phase.explicit, Phase.generate),
        print_blob=False,
    )


@dataclass(frozen=True)
class Target:
    """Real objects owned by the caller (tenant A) and by another tenant (B)."""

    base_model: str
    session: str
    finished_session: str  # A's, closed: heartbeats to it get a 410
    spare_session: str  # A's, for the finish route (A's main session must stay open)
    model: str  # A's model for submits that never run (their seq ids are far ahead)
    run_model: str  # A's model whose accepted submits run, in order
    sampler: str
    request: str  # A's finished create_model request
    checkpoint: str  # tinker://…/weights/… of A's model
    sampler_checkpoint: str  # tinker://…/sampler_weights/… of A's model
    other_session: str
    other_model: str
    other_sampler: str
    other_request: str

    @property
    def other_ids(self) -> frozenset[str]:
        return frozenset(
            (self.other_session, self.other_model, self.other_sampler, self.other_request)
        )

    def names_other(self, value: Any) -> bool:
        """True when `value` (any JSON) holds one of B's ids, whole or in a tinker:// path."""
        text = json.dumps(value, default=repr)
        return any(other in text for other in self.other_ids)


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is: numbers json.dumps will not write (`1e400`, `NaN`, `-0`)."""

    text: str


def to_json(value: Any) -> bytes:
    """JSON text with raw tokens; lone surrogates pass through as (invalid) UTF-8 bytes."""

    def write(v: Any) -> str:
        if isinstance(v, Raw):
            return v.text
        if isinstance(v, dict):
            return "{" + ",".join(f"{json.dumps(str(k))}:{write(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ",".join(write(x) for x in v) + "]"
        return json.dumps(v, ensure_ascii=False)

    return write(value).encode("utf-8", "surrogatepass")


def shown(content: bytes | None, limit: int = 400) -> str:
    if content is None:
        return "-"
    text = repr(content[:limit])
    return text + (f"...({len(content)} bytes)" if len(content) > limit else "")


def error_body_problem(resp: httpx.Response) -> str:
    """Why an error answer breaks the contract (JSON, `detail`, known `category`), or ''."""
    if not resp.headers.get("content-type", "").startswith("application/json"):
        return f"not JSON ({resp.headers.get('content-type', 'no content-type')})"
    try:
        body = resp.json()
    except ValueError:
        return "invalid JSON"
    if not isinstance(body, dict):
        return "not a JSON object"
    if not isinstance(body.get("detail"), str):
        return "no string detail"
    if body.get("category") not in CATEGORIES:
        return f"category {body.get('category')!r} not one of {list(CATEGORIES)}"
    return ""


class Violation(AssertionError):
    """A property an answer broke: the request, the answer and the property's signature."""


_VIOLATION_TYPES: dict[tuple[str, ...], type[Violation]] = {}


def violation(signature: tuple[str, ...], request: str, response: str) -> Violation:
    """The error to raise for a broken property. Hypothesis tells failures apart by their
    exception type and where they were raised, and one raise site serves many routes: a class
    of its own per signature keeps two distinct failures of one test apart."""
    if signature not in _VIOLATION_TYPES:
        name = f"Violation{len(_VIOLATION_TYPES)}"
        _VIOLATION_TYPES[signature] = type(name, (Violation,), {})
    return _VIOLATION_TYPES[signature](f"{' | '.join(signature)}\n  {request}\n  -> {response}")


@dataclass
class GatewayLog:
    """The gateway's log, read as it grows: the exception behind each incident it logged."""

    path: Path
    _causes: dict[str, str] = field(default_factory=dict)
    _offset: int = 0

    def cause(self, body: str) -> str:
        """`ExcType at file.py:function` of the gateway's logged incident, if there is one."""
        match = re.search(r"incident ([0-9a-f]+)", body)
        if match is None:
            return re.sub(r"\d+", "N", body)[:80]
        incident = match.group(1)
        for _ in range(40):  # logged before the answer was sent; allow for buffering
            self._read()
            if incident in self._causes:
                return self._causes[incident]
            time.sleep(0.05)
        return "incident not in the gateway log"

    def _read(self) -> None:
        with self.path.open("rb") as log:
            log.seek(self._offset)
            text = log.read().decode(errors="replace")
        records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", text)
        # The last record may still be being written: read it again next time.
        self._offset += len(text.encode()) - len(records[-1].encode())
        for record in records:
            found = re.search(r"crashed \(incident ([0-9a-f]+)\)", record)
            if found is None:
                continue
            frames = re.findall(
                r'File "[^"]*/((?:twinkle_async|protocol)/[^"]+)", line \d+, in (\w+)', record
            )
            exception = record.strip().splitlines()[-1].split(":")[0].strip()
            where = f"{frames[-1][0]}:{frames[-1][1]}" if frames else "?"
            self._causes[found.group(1)] = f"{exception} at {where}"


@dataclass
class Fuzzer:
    """Sends requests as tenant A (unless the headers say otherwise) and checks every answer."""

    http: httpx.Client
    log: GatewayLog
    target: Target
    next_seq: dict[str, int] = field(default_factory=dict)  # per model whose submits run

    def send(
        self,
        method: str,
        path: str,
        route: str,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        names_other: bool = False,
        note: str = "",
    ) -> httpx.Response | None:
        """One request; the first property its answer breaks raises, signed with `route`."""
        summary = f"{note}{method} {path} headers={headers or {}} body={shown(content)}"
        try:
            resp = self.http.request(method, path, content=content, headers=headers)
        except (httpx.InvalidURL, httpx.LocalProtocolError):
            return None  # httpx will not send it (a raw control character): nothing to check
        except httpx.TimeoutException:
            raise violation(("hang", route), summary, f"no answer in {TIMEOUT_S} s") from None
        except httpx.TransportError as exc:
            raise violation(("transport", route, type(exc).__name__), summary, repr(exc)) from exc
        answer = f"{resp.status_code} {resp.headers.get('content-type', '')} {resp.text[:300]!r}"
        status = resp.status_code
        if status >= 500:
            cause = self.log.cause(resp.text)
            raise violation(("5xx", route, str(status), cause), summary, answer)
        problem = error_body_problem(resp) if status >= 400 and method != "HEAD" else ""
        if problem:
            if resp.text in AIOHTTP_DEFAULTS:  # one signature, whichever path or method hit it
                route = "no route matched (aiohttp's default answer)"
            raise violation(("error body", route, str(status), problem), summary, answer)
        if names_other and 200 <= status < 300:
            raise violation(("other tenant's id accepted", route), summary, answer)
        return resp

    def post_json(
        self, route: str, body: Any, names_other: bool = False, note: str = ""
    ) -> httpx.Response | None:
        headers = {"Content-Type": "application/json"}
        path = f"{API}/{route}"
        return self.send("POST", path, f"POST {route}", to_json(body), headers, names_other, note)

    def read_back(self, route: str, body: Any, resp: httpx.Response | None) -> None:
        """After a create was accepted, read the new object back: it must be readable."""
        if resp is None or resp.status_code != 200:
            return
        answer = resp.json()
        note = f"after POST {route} {shown(to_json(body))} answered {resp.text[:120]!r}: "
        if route == "create_session":
            heartbeat = {"session_id": answer["session_id"], "type": "session_heartbeat"}
            self.post_json("session_heartbeat", heartbeat, note=note)
        elif route in ("create_model", "load_weights") and "model_id" in answer:
            run = quote(answer["model_id"], safe=":")
            self.post_json("get_info", {"model_id": answer["model_id"]}, note=note)
            self.send("GET", f"{API}/training_runs/{run}", "GET training_runs/{id}", note=note)
            self.send("GET", f"{API}/training_runs?limit=1000", "GET training_runs", note=note)
        elif route == "create_sampling_session":
            sampler = quote(answer["sampling_session_id"], safe=":")
            self.send("GET", f"{API}/samplers/{sampler}", "GET samplers/{id}", note=note)

    def outcome(self, route: str, resp: httpx.Response, summary: str) -> dict[str, Any] | None:
        """Wait for an accepted submit's future. It must finish, as a result or as a user error
        (a server error means bad input got past the gateway and broke the worker). Returns a
        JSON result, or None."""
        request_id = resp.json()["request_id"]
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        body = {"request_id": request_id, "allow_metadata_only": False}
        while time.monotonic() < deadline:
            poll = self.http.post(
                f"{API}/retrieve_future",
                json=body,
                timeout=45.0,
                headers={"Accept": "application/x-protobuf"},  # as SDK 0.38 asks
            )
            if poll.headers.get("content-type", "").startswith("application/x-protobuf"):
                return None
            answer = poll.json()
            if poll.status_code != 200 or answer.get("type") == "try_again":
                if poll.status_code != 200:
                    raise violation(("future lost", route), summary, poll.text[:300])
                continue
            if "error" in answer:
                if answer.get("category") != "user":
                    error = re.sub(r"\d+", "N", str(answer["error"]))[:80]
                    signature = ("future failed", route, str(answer.get("category")), error)
                    raise violation(signature, summary, poll.text[:300])
                return None
            return dict(answer)
        raise violation(
            ("future never finished", route), summary, f"pending after {RESULT_TIMEOUT_S} s"
        )


# -- what the fuzzing aims at -------------------------------------------------------------------


def _submit(wire: Wire, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = wire.post(path, body)
    resp.raise_for_status()
    result = wire.result(resp.json()["request_id"])
    result.raise_for_status()
    return {**resp.json(), **result.json()}


def _model(wire: Wire, session: str, base_model: str, seq: int = 0) -> tuple[str, str]:
    """(model_id, request_id) of a new rank-4 adapter."""
    lora = {"rank": 4, "seed": 0, "train_unembed": True, "train_mlp": True, "train_attn": True}
    body = {"session_id": session, "model_seq_id": seq, "base_model": base_model}
    created = _submit(wire, "create_model", {**body, "lora_config": lora, "type": "create_model"})
    return created["model_id"], created["request_id"]


def _sampler(wire: Wire, session: str, base_model: str) -> str:
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": base_model}
    resp = wire.post("create_sampling_session", body)
    resp.raise_for_status()
    return str(resp.json()["sampling_session_id"])


@pytest.fixture(scope="module")
def target(cluster: Cluster) -> Iterator[Target]:
    mine = Wire(cluster.base_url, cluster.api_key)
    other = Wire(cluster.base_url, OTHER_TENANT_KEY)
    base_model = cluster.base_models[0]
    session, finished, spare = mine.session(), mine.session(), mine.session()
    mine.post(f"sessions/{finished}/finish", {"reason": {"type": "success"}}).raise_for_status()
    model, request = _model(mine, session, base_model)
    save = {"model_id": model, "type": "save_weights"}
    checkpoint = _submit(mine, "save_weights", {**save, "path": "fuzz-weights", "seq_id": 1})
    for_sampler = {"model_id": model, "path": "fuzz-sampler", "seq_id": 2}
    sampler_ckpt = _submit(mine, "save_weights_for_sampler", for_sampler)
    run_model, _ = _model(mine, session, base_model, seq=1)
    other_session = other.session()
    other_model, other_request = _model(other, other_session, base_model)
    yield Target(
        base_model=base_model,
        session=session,
        finished_session=finished,
        spare_session=spare,
        model=model,
        run_model=run_model,
        sampler=_sampler(mine, session, base_model),
        request=request,
        checkpoint=checkpoint["path"],
        sampler_checkpoint=sampler_ckpt["path"],
        other_session=other_session,
        other_model=other_model,
        other_sampler=_sampler(other, other_session, base_model),
        other_request=other_request,
    )
    mine.close()
    other.close()


@pytest.fixture(scope="module")
def fuzzer(cluster: Cluster, target: Target) -> Iterator[Fuzzer]:
    http = httpx.Client(
        base_url=cluster.base_url, headers={"X-API-Key": cluster.api_key}, timeout=TIMEOUT_S
    )
    log = GatewayLog(cluster.data_dir.parent / f"{cluster.data_dir.name}.log")
    yield Fuzzer(http, log, target)
    http.close()


# -- JSON bodies: a valid one per route, and what each field holds ------------------------------


@dataclass(frozen=True)
class JsonRoute:
    route: str
    body: Callable[[Target], dict[str, Any]]
    fields: dict[str, str]  # dotted path -> kind of value


DELETE = object()


def set_field(body: dict[str, Any], dotted: str, value: Any) -> None:
    """Set (or with DELETE remove) the field at a dotted path, creating containers as needed."""
    keys: list[Any] = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    node: Any = body
    for key in keys[:-1]:
        if isinstance(node, list):
            node = node[key]
        else:
            node = node.setdefault(key, {})
    if value is DELETE:
        if isinstance(node, dict):
            node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
