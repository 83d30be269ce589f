"""The measured pass size: a size from the measured curve, no slot left behind, cached once;
the workers of `up` measure it when no --token-budget is given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import Cluster
from workers.engine.model import MultiSlotModel
from workers.trainer.calibration import cached_or_measured, measure

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_measure_picks_a_measured_size_and_frees_its_slot(random_qwen3: Path) -> None:
    model = MultiSlotModel(str(random_qwen3), max_slots=2, max_rank=8, pass_tokens=777)
    found = measure(model, smallest=64, largest=512, max_pass_s=5.0, repeats=1)
    sizes = [size for size, _ in found.curve]
    assert sizes[0] == 64 and sizes == sorted(sizes) and found.pass_tokens in sizes
    assert all(rate > 0 for _, rate in found.curve)
    assert model.pass_tokens == 777
    assert not model.bank.grads.any() and not model.bank.weights.any()
    assert not model.optimizer.exp_avg.any() and not model.optimizer.exp_avg_sq.any()


def test_the_result_is_cached_per_model_and_device(
    random_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = MultiSlotModel(str(random_qwen3), max_slots=2, max_rank=8)
    monkeypatch.setattr("workers.trainer.calibration.measure", lambda e: _fixed(512))
    first = cached_or_measured(model, tmp_path, threads=1)
    monkeypatch.setattr(
        "workers.trainer.calibration.measure", lambda e: pytest.fail("measured twice")
    )
    assert cached_or_measured(model, tmp_path, threads=1) == first
    assert first.pass_tokens == 512
    monkeypatch.setattr("workers.trainer.calibration.measure", lambda e: _fixed(1024))
    assert cached_or_measured(model, tmp_path, threads=2).pass_tokens == 1024  # another key


def _fixed(size: int):  # type: ignore[no-untyped-def]
    from workers.trainer.calibration import Calibration

    return Calibration(size, ((size, 1000.0),))


def test_the_session_clusters_workers_measured_their_pass_size(cluster: Cluster) -> None:
    """`up` with no --token-budget: each trainer measures before it serves, and serves passes
    of the size it chose (the other test clusters are given a fixed size)."""
    log = (cluster.data_dir.parent / f"{cluster.data_dir.name}.log").read_text()
    for model in cluster.base_models:
        chosen = re.search(rf"calibrated {re.escape(model)}: passes of (\d+) tokens", log)
        assert chosen, model
        assert f"engine {model} on cpu (torch.float32): passes of {chosen[1]} tokens" in log
