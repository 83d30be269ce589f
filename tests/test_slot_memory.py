"""Slots planned from free memory: the arithmetic, and a multi-slot model that plans its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.memory import MAX_SLOTS_CAP, plan_slots, slot_bytes
from workers.engine.model import MultiSlotModel


def test_half_the_free_memory_holds_slots_of_five_fp32_copies() -> None:
    numel = 1_000_000  # 20 MB a slot
    assert slot_bytes(numel) == 20_000_000
    assert plan_slots(200_000_000, numel).max_slots == 5
    assert plan_slots(10_000_000, numel).max_slots == 1  # always one
    assert plan_slots(10**15, numel).max_slots == MAX_SLOTS_CAP


def test_a_qwen3_30b_a3b_rank_32_slot_is_planned_from_its_size() -> None:
    # 494,088,192 adapter parameters on every group (bench/moe_memory.py), 80 GB free
    plan = plan_slots(80 * 10**9, 494_088_192)
    assert plan.max_slots == 4
    assert "4" in plan.describe() and "GiB free" in plan.describe()


def test_a_model_without_max_slots_plans_them(
    random_qwen3: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="workers.engine.model"):
        model = MultiSlotModel(str(random_qwen3), max_slots=None, max_rank=8)
    assert 1 <= model.max_slots <= MAX_SLOTS_CAP
    assert model.bank.weights.shape[0] == model.max_slots
    assert any("max_slots=" in record.getMessage() for record in caplog.records)
