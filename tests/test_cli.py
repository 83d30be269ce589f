"""The `twinkle-async` command line: argument checks, the tiny-model builder, and `up` stopping
every process it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from tests.conftest import start_cluster, stop_cluster
from twinkle_async.cli import app
from twinkle_async.settings import load_api_keys

runner = CliRunner()


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("up", "gateway", "worker", "make-tiny-model"):
        assert command in result.output


def test_up_refuses_a_key_the_sdk_would_refuse() -> None:
    result = runner.invoke(app, ["up", "--base-model", "x", "--api-key", "sk-not-tinker"])
    assert result.exit_code != 0
    assert "tml-" in result.output


def test_a_key_file_tenant_that_is_no_valid_name_is_refused(tmp_path: Path) -> None:
    # a tenant's name becomes KV keys (`rate.<tenant>`): `a@b` or `a.b` would make every
    # rate-limited call of that tenant fail later, so the file is refused at start
    for tenant in ("a@b", "a.b", "A" * 64, "-x"):
        key_file = tmp_path / "keys.txt"
        key_file.write_text(f"tml-good-key-0123456789 {tenant}\n")
        result = CliRunner().invoke(app, ["up", "--base-model", "x", "--key-file", str(key_file)])
        assert result.exit_code != 0
        assert "not a valid tenant name" in str(result.exception) + result.output, tenant
    key_file.write_text("tml-good-key-0123456789 team-7\ntml-other-key-0123456789\n")
    assert load_api_keys(key_file, None) == {
        "tml-good-key-0123456789": "team-7",
        "tml-other-key-0123456789": "default",
    }


def test_make_tiny_model_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "m"
    subprocess.run(
        [sys.executable, "-m", "twinkle_async", "make-tiny-model", str(out), "--arch", "qwen3"],
        check=True,
    )
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()


def _running(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [pid for pid in found if pid != str(os.getpid())]


def test_up_stops_everything_it_started(tmp_path: Path, tiny_model: Path) -> None:
    cluster = start_cluster(tmp_path / "updata", [tiny_model])
    marker = str(cluster.data_dir)
    assert len(_running(marker)) >= 3  # up itself, nats-server, the worker
    stop_cluster(cluster)
    assert cluster.process.returncode == 0
    deadline = time.monotonic() + 10
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(marker) == []
