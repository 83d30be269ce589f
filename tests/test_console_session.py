"""The console's session cookie and CSRF token (`twinkle_async.gateway.console_session`), and the
vendored chart library against the hashes recorded when it was fetched from the npm registry."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from twinkle_async.gateway import console_session as cs

SECRET = b"s" * 32
VENDOR = Path(__file__).resolve().parents[1] / "twinkle_async" / "gateway" / "console" / "vendor"


def test_a_session_reads_back_until_it_lapses() -> None:
    cookie = cs.issue(SECRET, "tenant", "abc123", now=1000.0)
    session = cs.read(SECRET, cookie, now=1000.0 + cs.SESSION_S - 1)
    assert session == cs.Session(kind="tenant", key_hash="abc123", expires=1000 + cs.SESSION_S)
    assert cs.read(SECRET, cookie, now=1000.0 + cs.SESSION_S) is None
    assert "abc123" not in cookie or len(cookie) < cs.MAX_COOKIE_CHARS


def test_a_cookie_from_another_secret_or_tampered_is_refused() -> None:
    cookie = cs.issue(SECRET, "admin", "h", now=0.0)
    assert cs.read(SECRET, cookie, now=1.0) is not None
    assert cs.read(b"t" * 32, cookie, now=1.0) is None
    body, _, mac = cookie.partition(".")
    forged = cs.issue(b"t" * 32, "admin", "h", now=0.0).partition(".")[2]
    assert cs.read(SECRET, f"{body}.{forged}", now=1.0) is None
    other_body = cs.issue(SECRET, "tenant", "h", now=0.0).partition(".")[0]
    assert cs.read(SECRET, f"{other_body}.{mac}", now=1.0) is None  # a body swapped in
    for junk in ("", ".", "a.b.c", "!!!.!!!", "x" * 5000, f"{body}.", f".{mac}", "é.é"):
        assert cs.read(SECRET, junk, now=1.0) is None, junk


def test_the_csrf_token_belongs_to_its_cookie() -> None:
    one, two = cs.issue(SECRET, "tenant", "a"), cs.issue(SECRET, "tenant", "b")
    token = cs.csrf_token(SECRET, one)
    assert cs.csrf_ok(SECRET, one, token)
    assert not cs.csrf_ok(SECRET, two, token)
    assert not cs.csrf_ok(SECRET, one, "")
    assert not cs.csrf_ok(b"t" * 32, one, token)


def test_the_vendored_chart_library_is_what_the_registry_served() -> None:
    record = json.loads((VENDOR / "VENDOR.json").read_text())
    assert record["package"] == "uplot" and record["integrity"].startswith("sha512-")
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name


def test_recent_errors_keep_the_last_failures_only() -> None:
    from protocol.errors import ErrorCategory
    from protocol.jobs import Outcome
    from twinkle_async.gateway.console_routes import RecentErrors

    kept = RecentErrors(size=3)
    kept.record(Outcome(request_id="ok", state="done", finished_at=1.0))
    for i in range(5):
        kept.record(
            Outcome(
                request_id=f"r{i}",
                state="error",
                error="x" * 1000,
                category=ErrorCategory.USER,
                tenant_id="t",
                finished_at=float(i),
            )
        )
    assert [e["request_id"] for e in kept.entries] == ["r2", "r3", "r4"]
    assert all(len(e["error"]) == 500 and e["category"] == "user" for e in kept.entries)


def test_token_rates_are_over_the_last_minute() -> None:
    from twinkle_async.gateway.console_routes import TokenRates

    rates = TokenRates()
    assert rates.add(100.0, {"w": 1000}) == {"w": None}  # one reading: no rate yet
    assert rates.add(110.0, {"w": 3000, "new": 5}) == {"w": 200.0, "new": None}
    assert rates.add(200.0, {"w": 3000}) == {"w": 0.0}  # the older readings dropped
    assert rates.add(210.0, {"w": 2000}) == {"w": 0.0}  # a restarted worker counts from zero
