"""The admin API over HTTP: one small class over `httpx.Client`, with a timeout.

Every call sends the admin key in `X-Admin-Key` and returns the decoded JSON answer. Whatever goes
wrong (a refused request, an unreachable gateway, an answer that is not JSON) is raised as one
`AdminError` whose message is a single line, ready to print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

API_PREFIX = "/admin/v1"


class AdminError(Exception):
    """A failed admin call; `message` is one line, `status` the HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def segment(value: str) -> str:
    """One path segment, escaped so an id with `/` or `?` cannot reach another route."""
    return quote(value, safe="")


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


class AdminClient:
    """Calls `/admin/v1/<path>` on one gateway with one admin key."""

    def __init__(self, gateway: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self.gateway = gateway.rstrip("/")
        self._http = httpx.Client(
            base_url=self.gateway, headers={"X-Admin-Key": admin_key}, timeout=timeout_s
        )

    def close(self) -> None:
        self._http.close()

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str | None] | None = None,
    ) -> Any:
        """`method /admin/v1/<path>`; query parameters given as None are left out."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self._send(
            lambda: self._http.request(method, f"{API_PREFIX}/{path}", json=body, params=query)
        )

    def upload(self, path: str, files: dict[str, Path], params: dict[str, str | None]) -> Any:
        """`POST /admin/v1/<path>` with `files` as multipart parts, streamed from disk."""
        query = {k: v for k, v in params.items() if v is not None}
        handles = {name: source.open("rb") for name, source in files.items()}
        try:
            parts = {
                name: (name, handle, "application/octet-stream") for name, handle in handles.items()
            }
            return self._send(
                lambda: self._http.post(f"{API_PREFIX}/{path}", files=parts, params=query)
            )
        finally:
            for handle in handles.values():
                handle.close()

    def fetch(self, url: str, target: Path) -> int:
        """Download a signed URL (no admin key needed) into `target`; bytes written."""
        written = 0

        def stream() -> httpx.Response:
            nonlocal written
            with httpx.stream("GET", url, timeout=self._http.timeout) as resp:
                if not resp.is_success:
                    resp.read()
                    return resp
                with target.open("wb") as out:
                    for chunk in resp.iter_bytes(1 << 20):
                        out.write(chunk)
                        written += len(chunk)
                return resp

        resp = self._send(stream, raw=True)
        if not resp.is_success:
            _answer(resp)
        return written

    def _send(self, call: Any, raw: bool = False) -> Any:
        try:
            resp = call()
        except httpx.TimeoutException as exc:
            raise AdminError(
                f"cannot reach the gateway at {self.gateway}: timed out ({type(exc).__name__})"
            ) from None
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            reason = _one_line(str(exc)) or type(exc).__name__
            raise AdminError(f"cannot reach the gateway at {self.gateway}: {reason}") from None
        return resp if raw else _answer(resp)


def _answer(resp: httpx.Response) -> Any:
    """The JSON of a 2xx answer; anything else becomes an `AdminError` carrying its `detail`."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    if resp.is_success:
        if data is None:
            raise AdminError(
                f"the gateway answered {resp.status_code} without JSON: {_one_line(resp.text)!r}",
                resp.status_code,
            )
        return data
    if isinstance(data, dict) and isinstance(data.get("detail"), str):
        raise AdminError(_one_line(data["detail"]), resp.status_code)
    shown = _one_line(resp.text) or resp.reason_phrase
    raise AdminError(f"the gateway answered {resp.status_code}: {shown}", resp.status_code)
