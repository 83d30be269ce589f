"""An idle worker group never reaches its collectives' timeout: rank 0 sends keepalives (an
eighth of the timeout apart), so a group idle for longer than its timeout still runs the next
call; without them, the waiting rank times out and the group stops as one (`tests.group_idle`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_an_idle_group_outlives_its_timeout_only_with_keepalives(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", "qwen3_moe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.group_idle", str(model), *extra],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    kept = run()
    assert kept.returncode == 0 and "created" in kept.stdout, kept.stderr[-3000:]
    dropped = run("--no-keepalive")
    assert dropped.returncode == 70 and "created" not in dropped.stdout, dropped.stderr[-3000:]
    assert "the group stops" in dropped.stderr


@pytest.mark.timeout(300)
def test_a_group_calibrates_with_every_rank_in_step(tmp_path: Path) -> None:
    """Each rank times the same passes and they agree on the slowest rank's timing, so they
    choose alike and no collective is left waiting; the choice is kept for the next start."""
    model = build_tiny_model(tmp_path / "model", "qwen3_moe")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    directory = tmp_path / "calibration"

    def run() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tests.group_idle", str(model), "--calibrate", str(directory)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    first = run()
    assert "cached" not in first and "pass_tokens" in first
    again = run()
    assert "cached" in again
    assert again.split("pass_tokens")[1] == first.split("pass_tokens")[1]
