"""The web console in a real browser (Debian's headless chromium, driven by Playwright) against
the session's cluster: a tenant that trained through the official SDK logs in, sees its run's
loss curve with the SDK's losses as its points, publishes a checkpoint, sets its TTL, downloads
and deletes checkpoints, samples one in the playground and reads its usage; another tenant sees
none of it; the operator sees the workers and the queue. The session's rules (no key in a URL,
a CSRF token on every call, a revoked key ends its session) are checked over plain HTTP.

Screenshots go to `tmp_path`, or to `$CONSOLE_SCREENSHOTS` when set (the docs' pictures:
`CONSOLE_SCREENSHOTS=docs/console .venv/bin/python -m pytest tests/test_e2e_console.py`).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from playwright.sync_api import Browser, Page, sync_playwright
from tinker import types

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch
from tests.wait_helpers import wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
# as root, with the machine's closed network: no sandbox, no background connections
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STEPS = 4
TENANT = "default"  # the tenant of the cluster's `--api-key`


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: `make test` installs it (apt chromium)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )
        yield launched
        launched.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("CONSOLE_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


class Trained:
    def __init__(self, run_id: str, losses: list[float], sampler: str, state: str) -> None:
        self.run_id, self.losses, self.sampler, self.state = run_id, losses, sampler, state


@pytest.fixture(scope="module")
def trained(cluster: Cluster, tiny_model: Path) -> Iterator[Trained]:
    """A run of `STEPS` steps through the SDK, with a sampler checkpoint and a saved state."""
    service = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    batch = toy_batch(seed=61)
    losses = []
    for _ in range(STEPS):
        passed = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(float(passed.metrics["loss:sum"]))
    sampler = str(client.save_weights_for_sampler("console-sampler").result().path)
    state = str(client.save_state("console-state").result().path)
    yield Trained(client.model_id, losses, sampler, state)
    service.close("success").result()


def _open(browser: Browser, cluster: Cluster, key: str) -> tuple[Page, list[str]]:
    """A fresh browser context logged in with `key` through the login form; the page and the
    errors its console printed (a CSP violation or a failed script shows there)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{cluster.base_url}/console")
    page.fill("#key", key)
    page.click("#login button[type=submit]")
    page.wait_for_selector("body[data-ready]")
    assert key not in page.url
    return page, errors


def _goto(page: Page, hash_: str) -> None:
    page.evaluate("h => { location.hash = h }", hash_)
    page.wait_for_function("h => document.body.dataset.ready === h", arg=hash_)


def _rest(cluster: Cluster, path: str, key: str | None = None) -> Any:
    got = httpx.get(
        f"{cluster.base_url}{path}", headers={"X-API-Key": key or cluster.api_key}, timeout=30
    )
    assert got.status_code == 200, got.text
    return got.json()


def _checkpoint(cluster: Cluster, trained: Trained, path: str) -> dict[str, Any] | None:
    listed = _rest(cluster, f"/api/v1/training_runs/{trained.run_id}/checkpoints")["checkpoints"]
    return next((c for c in listed if c["tinker_path"] == path), None)


def _actions(page: Page, path: str) -> Any:
    return page.locator(f'div.actions[data-path="{path}"]')


def test_a_tenant_sees_its_loss_curve_manages_checkpoints_and_samples(
    trained: Trained, browser: Browser, cluster: Cluster, shots: Path
) -> None:
    page, errors = _open(browser, cluster, cluster.api_key)
    assert page.evaluate("document.body.dataset.ready") == "#/runs"
    row = page.locator("tr", has=page.locator(f'a:text-is("{trained.run_id}")'))
    assert row.count() == 1
    cells = row.locator("td").all_inner_texts()
    assert cells[1] == "active" and cells[3] == "4" and cells[4] == str(STEPS), cells
    page.screenshot(path=str(shots / "runs.png"), full_page=True)

    # the run's loss curve: its points are the SDK's losses, drawn by uPlot on a canvas
    row.locator("a").first.click()
    page.wait_for_function("() => document.body.dataset.ready.startsWith('#/run/')")
    chart = page.locator("#metric-chart")
    assert chart.get_attribute("data-metric") == "loss:sum"
    points = json.loads(chart.get_attribute("data-points") or "[]")
    assert [y for _, y in points] == pytest.approx(trained.losses, rel=1e-6)
    assert [x for x, _ in points] == sorted(x for x, _ in points)
    assert chart.locator("canvas").count() == 1
    page.screenshot(path=str(shots / "run.png"), full_page=True)
    page.select_option("#metric", "unclipped_grad_l2:mean")  # an optim_step's, one a step
    assert len(json.loads(chart.get_attribute("data-points") or "[]")) == STEPS

    # publish the sampler checkpoint, then give it a TTL of two hours
    _goto(page, "#/checkpoints")
    actions = _actions(page, trained.sampler)
    actions.locator('button:text-is("Publish")').click()
    wait_until(
        lambda: (_checkpoint(cluster, trained, trained.sampler) or {}).get("public") is True,
        30,
        "the checkpoint published",
    )
    page.wait_for_selector(f'div.actions[data-path="{trained.sampler}"] >> text=Unpublish')
    before = time.time()
    _actions(page, trained.sampler).locator("input.ttl").fill("2")
    _actions(page, trained.sampler).locator('button:text-is("Set TTL")').click()

    def expiry() -> float | None:
        found = (_checkpoint(cluster, trained, trained.sampler) or {}).get("expires_at")
        return None if found is None else _timestamp(found)

    wait_until(lambda: expiry() is not None, 30, "the TTL set")
    assert before + 7200 - 5 <= (expiry() or 0) <= time.time() + 7200 + 5
    page.wait_for_selector("text=public")
    page.screenshot(path=str(shots / "checkpoints.png"), full_page=True)

    # download the saved state: the signed link gives a tar of its adapter files
    with page.expect_download() as download:
        _actions(page, trained.state).locator('button:text-is("Download")').click()
    with tarfile.open(fileobj=io.BytesIO(Path(download.value.path()).read_bytes())) as tar:
        names = tar.getnames()
    assert any(name.endswith("adapter_model.safetensors") for name in names), names

    # try the published checkpoint in the playground: greedy, so the OpenAI route (and the
    # SDK's sampler behind it) gives the same text
    _goto(page, f"#/playground/{trained.sampler}")
    assert page.input_value("#pg-model") == trained.sampler
    page.fill("#pg-prompt", "Hello there")
    page.fill("#pg-max-tokens", "8")
    page.click("#pg-sample")
    page.wait_for_selector("#pg-answer[data-finish]", timeout=120_000)
    shown = page.text_content("#pg-answer")
    direct = httpx.post(
        f"{cluster.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        json={"model": trained.sampler, "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert direct.status_code == 200, direct.text
    answer = direct.json()
    assert shown == answer["choices"][0]["text"]
    assert page.text_content("#pg-usage") == (
        f"{answer['usage']['prompt_tokens']} prompt tokens,"
        f" {answer['usage']['completion_tokens']} sampled;"
        f" finish: {answer['choices'][0]['finish_reason']}"
    )
    page.screenshot(path=str(shots / "playground.png"), full_page=True)

    # usage: the run's trained tokens, as the tenant's usage API counts them
    _goto(page, "#/usage")
    usage = _rest(cluster, "/api/v1/usage?days=14")
    mine = next(r for r in usage["runs"] if r["run_id"] == trained.run_id)
    row = page.locator("#usage-runs tr", has=page.locator(f'a:text-is("{trained.run_id}")'))
    assert row.locator("td").nth(2).inner_text() == f"{mine['tokens_trained']:,}"
    page.screenshot(path=str(shots / "usage.png"), full_page=True)

    # delete the saved state (the page asks first)
    _goto(page, "#/checkpoints")
    page.once("dialog", lambda dialog: dialog.accept())
    _actions(page, trained.state).locator('button:text-is("Delete")').click()
    wait_until(
        lambda: _checkpoint(cluster, trained, trained.state) is None, 30, "the state deleted"
    )
    assert not errors, errors
    page.context.close()


def _timestamp(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_another_tenant_sees_none_of_it(
    trained: Trained, browser: Browser, cluster: Cluster
) -> None:
    page, errors = _open(browser, cluster, OTHER_TENANT_KEY)
    assert page.locator(f"text={trained.run_id}").count() == 0
    _goto(page, "#/checkpoints")
    assert page.locator(f"text={trained.sampler}").count() == 0
    _goto(page, f"#/run/{trained.run_id}")
    assert "not found" in page.inner_text("main").lower()
    _goto(page, "#/usage")
    assert page.locator(f"text={trained.run_id}").count() == 0, page.inner_text("main")
    page.context.close()
    assert not [e for e in errors if "404" not in e], errors


def test_the_operator_sees_workers_queues_and_errors(
    trained: Trained, browser: Browser, cluster: Cluster, shots: Path, tiny_model: Path
) -> None:
    # a request the sampler refuses (its prompt, tokenized there, outgrows the context)
    refused = httpx.post(
        f"{cluster.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        json={"model": str(tiny_model), "prompt": "hello " * 6000, "max_tokens": 4},
        timeout=120,
    )
    assert refused.status_code == 400, refused.text
    workers = httpx.get(
        f"{cluster.base_url}/admin/v1/workers",
        headers={"X-Admin-Key": cluster.admin_key},
        timeout=30,
    ).json()["workers"]
    page, errors = _open(browser, cluster, cluster.admin_key)
    assert page.evaluate("document.body.dataset.ready") == "#/operator"
    table = page.inner_text("#workers")
    for worker in workers:
        assert worker["worker_id"] in table and worker["base_model"] in table
    assert "ops" in page.inner_text("#queues").lower()
    assert "other" in page.inner_text("#tenants")
    errors_shown = page.inner_text("#errors")
    assert refused.json()["detail"][:60] in errors_shown and TENANT in errors_shown
    # the page reads the workers again every 5 s: from the second reading, a rate a worker
    page.wait_for_function(
        "() => !document.getElementById('workers').innerText.includes('…')", timeout=30_000
    )
    page.screenshot(path=str(shots / "operator.png"), full_page=True)
    assert not errors, errors
    # a tenant's pages are not the operator's, nor the operator's a tenant's
    assert (
        page.evaluate(
            "async () => (await fetch('/console/api/runs', {headers: {'X-Console-CSRF': 'x'}})).status"
        )
        == 401
    )
    page.context.close()


# -- the session's rules, over plain HTTP ---------------------------------------------------------


def _login(cluster: Cluster, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/console/login", json={"key": key}, headers=headers, timeout=30
    )


def test_the_console_session_needs_its_token_and_a_valid_key(cluster: Cluster) -> None:
    base = cluster.base_url
    opened = _login(cluster, cluster.api_key)
    assert opened.status_code == 200, opened.text
    cookie = opened.cookies["twinkle_console"]
    set_cookie = opened.headers["Set-Cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    assert cluster.api_key not in set_cookie  # the cookie holds no key
    csrf = opened.json()["csrf"]
    jar = {"twinkle_console": cookie}

    def call(path: str, token: str | None = csrf, cookies: dict[str, str] = jar) -> int:
        headers = {} if token is None else {"X-Console-CSRF": token}
        return httpx.get(f"{base}{path}", headers=headers, cookies=cookies, timeout=30).status_code

    assert call("/api/v1/training_runs") == 200
    assert call("/console/api/runs") == 200
    assert call("/api/v1/training_runs", token=None) == 401  # the cookie alone is not enough
    assert call("/api/v1/training_runs", token="forged") == 401
    assert call("/console/api/runs", token=None) == 401
    assert call("/admin/v1/tenants") == 401  # a tenant's session is no operator's
    assert call("/console/api/workers") == 403
    tampered = {"twinkle_console": cookie[:-2] + ("AA" if not cookie.endswith("AA") else "BB")}
    assert call("/api/v1/training_runs", cookies=tampered) == 401
    for junk in ("", "x", "a.b.c", "." * 600, "%C3%A9.%C3%A9"):
        assert call("/api/v1/training_runs", cookies={"twinkle_console": junk}) == 401
    session = httpx.get(f"{base}/console/session", cookies=jar, timeout=30)
    assert session.status_code == 200 and session.json()["csrf"] == csrf
    assert session.json()["tenant"] == TENANT

    # login refusals: a wrong key, another site's page, malformed bodies
    assert _login(cluster, "tml-not-a-key-000000000000").status_code == 401
    assert _login(cluster, "").status_code == 401
    assert _login(cluster, cluster.api_key, Origin="https://evil.example").status_code == 403
    for body in (b"not json", b'{"key": 5}', b'{"key": "x", "extra": 1}', b"[]", b"x" * 5000):
        bad = httpx.post(f"{base}/console/login", content=body, timeout=30)
        assert bad.status_code == 400, (body[:20], bad.text)

    # the operator's session reaches the admin API and no tenant's routes
    admin = _login(cluster, cluster.admin_key)
    assert admin.status_code == 200 and admin.json()["kind"] == "admin"
    admin_jar = {"twinkle_console": admin.cookies["twinkle_console"]}
    admin_csrf = admin.json()["csrf"]
    assert call("/admin/v1/tenants", token=admin_csrf, cookies=admin_jar) == 200
    assert call("/console/api/workers", token=admin_csrf, cookies=admin_jar) == 200
    assert call("/api/v1/training_runs", token=admin_csrf, cookies=admin_jar) == 401
    assert call("/admin/v1/tenants", token=csrf, cookies=admin_jar) == 401  # not its token

    # a key revoked after login ends its session at the next request
    made = httpx.post(
        f"{base}/admin/v1/keys",
        json={"tenant": "other", "label": "console"},
        headers={"X-Admin-Key": cluster.admin_key},
        timeout=30,
    )
    assert made.status_code == 200, made.text
    fresh = _login(cluster, made.json()["key"])
    assert fresh.status_code == 200
    fresh_jar = {"twinkle_console": fresh.cookies["twinkle_console"]}
    assert call("/api/v1/training_runs", token=fresh.json()["csrf"], cookies=fresh_jar) == 200
    revoked = httpx.post(
        f"{base}/admin/v1/keys/{made.json()['key_id']}/revoke",
        headers={"X-Admin-Key": cluster.admin_key},
        timeout=30,
    )
    assert revoked.status_code == 200
    wait_until(
        lambda: call("/api/v1/training_runs", token=fresh.json()["csrf"], cookies=fresh_jar) == 401,
        40,
        "the revoked key's session ending",
    )
    assert httpx.get(f"{base}/console/session", cookies=fresh_jar, timeout=30).json() == {
        "kind": None,
        "tenant": "",
        "csrf": "",
    }

    # logout clears the cookie
    out = httpx.post(f"{base}/console/logout", cookies=jar, timeout=30)
    assert out.status_code == 200 and 'twinkle_console=""' in out.headers["Set-Cookie"]


def test_the_console_serves_only_its_own_files(cluster: Cluster) -> None:
    base = cluster.base_url
    page = httpx.get(f"{base}/console", timeout=30)
    assert page.status_code == 200 and "console.js" in page.text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert page.headers["X-Frame-Options"] == "DENY"
    for name in ("console.js", "console.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"):
        assert httpx.get(f"{base}/console/static/{name}", timeout=30).status_code == 200, name
    for name in (
        "../console_routes.py",
        "..%2Fconsole_routes.py",
        "index.html",
        "vendor/VENDOR.json",
        "nope.js",
        "x" * 3000,
    ):
        assert httpx.get(f"{base}/console/static/{name}", timeout=30).status_code in (400, 404)


def test_hostile_console_calls_get_a_clear_4xx(cluster: Cluster, trained: Trained) -> None:
    """The console's own routes, with what a hostile tenant could send."""
    other = _login(cluster, OTHER_TENANT_KEY)
    jar = {"twinkle_console": other.cookies["twinkle_console"]}
    headers = {"X-Console-CSRF": other.json()["csrf"]}

    def download(path: str) -> httpx.Response:
        return httpx.get(
            f"{cluster.base_url}/console/api/download",
            params={"path": path},
            headers=headers,
            cookies=jar,
            timeout=30,
        )

    assert download(trained.state).status_code == 404  # another tenant's checkpoint
    for path in ("", "tinker://", "tinker://../../etc/passwd", "x" * 5000, "tinker://a/b/c/d/e"):
        got = download(path)
        assert got.status_code in (400, 404), (path[:30], got.status_code, got.text)
        assert got.json()["detail"]
    assert (
        httpx.get(
            f"{cluster.base_url}/console/api/download", headers=headers, cookies=jar, timeout=30
        ).status_code
        == 400
    )  # no path at all
    # the operator's routes are not a tenant's, and a key far too long is no key
    assert (
        httpx.get(
            f"{cluster.base_url}/console/api/errors", headers=headers, cookies=jar, timeout=30
        ).status_code
        == 403
    )
    assert _login(cluster, "tml-" + "x" * 4000).status_code == 401
