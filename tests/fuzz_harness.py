"""The fuzz tests' client: sends one request, checks every property on its answer, and keeps the
violations found, by signature, each with its smallest example.

Properties of every answer: it comes within `TIMEOUT_S`; it is never 5xx; an error is a JSON
object with a string `detail` and a `category` the SDK knows; a request naming another tenant's
id is never answered 2xx. A 500 is explained by the exception the gateway logged for its
incident, so two different crashes of one route count as two findings.

With `TWINKLE_FUZZ_SHRINK=1` a violation raises at once, as an exception class of its own per
signature, so hypothesis shrinks each distinct failure to a minimal example. Hypothesis stops
looking soon after the first failures it finds, so `TWINKLE_FUZZ_SHRINK=<text>` raises only for
signatures containing that text (e.g. `_densify_csr`) and lets the others pass.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

TIMEOUT_S = 10.0
RESULT_TIMEOUT_S = 30.0  # a future of a tiny CPU model; retrieve_future itself holds up to 30 s
API = "/api/v1"
SHRINK = os.environ.get("TWINKLE_FUZZ_SHRINK", "")
CATEGORIES = ("server", "unknown", "user")
# aiohttp's own plain-text answers when no route or method matches.
AIOHTTP_DEFAULTS = ("404: Not Found", "405: Method Not Allowed")


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


@dataclass
class Example:
    request: str
    response: str


@dataclass
class Findings:
    """Violations by signature, each with its smallest example; 500s explained by the log."""

    log_path: Path
    examples: dict[tuple[str, ...], Example] = field(default_factory=dict)
    counts: Counter[tuple[str, ...]] = field(default_factory=Counter)
    requests: int = 0
    _causes: dict[str, str] = field(default_factory=dict)
    _log_offset: int = 0
    _failure_types: dict[tuple[str, ...], type[AssertionError]] = field(default_factory=dict)

    def violate(self, signature: tuple[str, ...], request: str, response: str) -> None:
        self.counts[signature] += 1
        known = self.examples.get(signature)
        if known is None or len(request) < len(known.request):
            self.examples[signature] = Example(request, response)
        if SHRINK == "1" or (SHRINK and SHRINK in " | ".join(signature)):
            kind = self._failure_types.setdefault(
                signature, type(f"Violation{len(self._failure_types)}", (AssertionError,), {})
            )
            raise kind(f"{' | '.join(signature)}\n  {request}\n  -> {response}")

    def cause(self, body: str) -> str:
        """`ExcType at file.py:function` of the gateway's logged incident, if there is one."""
        match = re.search(r"incident ([0-9a-f]+)", body)
        if match is None:
            return re.sub(r"\d+", "N", body)[:80]
        incident = match.group(1)
        for _ in range(40):  # logged before the answer was sent; allow for buffering
            self._read_log()
            if incident in self._causes:
                return self._causes[incident]
            time.sleep(0.05)
        return "incident not in the gateway log"

    def _read_log(self) -> None:
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            text = log.read().decode(errors="replace")
        records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", text)
        # The last record may still be being written: read it again next time.
        self._log_offset += len(text.encode()) - len(records[-1].encode())
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

    def report(self) -> str:
        lines = [f"{len(self.examples)} distinct violations in {self.requests} requests:"]
        for signature, example in sorted(self.examples.items()):
            lines.append(f"- [{self.counts[signature]}x] {' | '.join(signature)}")
            lines.append(f"    {example.request}")
            lines.append(f"    -> {example.response}")
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        rows = [
            {"signature": list(signature), "count": self.counts[signature], **vars(example)}
            for signature, example in sorted(self.examples.items())
        ]
        Path(path).write_text(json.dumps({"requests": self.requests, "findings": rows}, indent=1))


@dataclass
class Fuzzer:
    """Sends requests as tenant A (unless the headers say otherwise) and checks every answer."""

    http: httpx.Client
    findings: Findings
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
        """One request; every property its answer breaks is recorded under `route`."""
        self.findings.requests += 1
        summary = f"{note}{method} {path} headers={headers or {}} body={shown(content)}"
        try:
            resp = self.http.request(method, path, content=content, headers=headers)
        except (httpx.InvalidURL, httpx.LocalProtocolError):
            return None  # httpx will not send it (a raw control character): nothing to check
        except httpx.TimeoutException:
            self.findings.violate(("hang", route), summary, f"no answer in {TIMEOUT_S} s")
            return None
        except httpx.TransportError as exc:
            self.findings.violate(("transport", route, type(exc).__name__), summary, repr(exc))
            return None
        answer = f"{resp.status_code} {resp.headers.get('content-type', '')} {resp.text[:300]!r}"
        status = resp.status_code
        if status >= 500:
            cause = self.findings.cause(resp.text)
            self.findings.violate(("5xx", route, str(status), cause), summary, answer)
        problem = error_body_problem(resp) if status >= 400 and method != "HEAD" else ""
        if problem:
            if resp.text in AIOHTTP_DEFAULTS:  # one finding, whichever path or method hit it
                route = "no route matched (aiohttp's default answer)"
            self.findings.violate(("error body", route, str(status), problem), summary, answer)
        if names_other and 200 <= status < 300:
            self.findings.violate(("other tenant's id accepted", route), summary, answer)
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
            poll = self.http.post(f"{API}/retrieve_future", json=body, timeout=45.0)
            if poll.headers.get("content-type", "").startswith("application/x-protobuf"):
                return None
            answer = poll.json()
            if poll.status_code != 200 or answer.get("type") == "try_again":
                if poll.status_code != 200:
                    self.findings.violate(("future lost", route), summary, poll.text[:300])
                    return None
                continue
            if "error" in answer:
                if answer.get("category") != "user":
                    error = re.sub(r"\d+", "N", str(answer["error"]))[:80]
                    signature = ("future failed", route, str(answer.get("category")), error)
                    self.findings.violate(signature, summary, poll.text[:300])
                return None
            return dict(answer)
        self.findings.violate(
            ("future never finished", route), summary, f"pending after {RESULT_TIMEOUT_S} s"
        )
        return None
