"""bench/moe_memory.py: its adapter counts for the shipped real MoE configs reproduce Tinker's
per-rank table, agree with what the engine would wrap on the real transformers modules, and the
bench runs without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.moe_memory import CONFIGS, MODELS, PerRank, load, lora_params_per_rank, slot_bytes
from workers.engine.lora import find_expert_modules, find_target_linears

ROOT = Path(__file__).resolve().parents[1]


def test_mlp_counts_reproduce_tinkers_per_rank_table() -> None:
    mlp = {name: lora_params_per_rank(load(CONFIGS / name)[1]).mlp for name in MODELS}
    assert mlp == {
        "Qwen3-30B-A3B": 14_450_688,
        "Qwen3.5-35B-A3B": 16_281_600,
        "gpt-oss-20b": 6_842_880,
    }


@pytest.mark.parametrize("name", MODELS)
def test_counts_match_the_linears_and_experts_the_engine_wraps(name: str) -> None:
    # The real architecture built on the meta device (no memory), and the engine's own choice
    # of targets: every group's Σ (in + out), plus 3·(H + E·I) per fused experts module.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / name))
    modules = dict(model.named_modules())
    groups = {"attn": 0, "mlp": 0, "unembed": 0}
    for path, group in find_target_linears(model).items():
        groups[group] += modules[path].in_features + modules[path].out_features
    for shape in find_expert_modules(model).values():
        groups["mlp"] += 3 * (shape.hidden + shape.num_experts * shape.intermediate)
    assert PerRank(**groups) == lora_params_per_rank(load(CONFIGS / name)[1])


def test_a_slot_holds_four_fp32_values_per_parameter() -> None:
    assert slot_bytes(1) == 16
    # Qwen3-30B-A3B's experts at rank 32: 462 M parameters, ~7.4 GB with grads and Adam.
    assert slot_bytes(14_450_688 * 32) == 7_398_752_256


def test_the_bench_prints_its_table_without_torch() -> None:
    blocked = "import sys, runpy; sys.modules['torch'] = None; "
    run = f"runpy.run_path({str(ROOT / 'bench' / 'moe_memory.py')!r}, run_name='__main__')"
    out = subprocess.run(
        [sys.executable, "-c", blocked + run], capture_output=True, text=True, check=True
    ).stdout
    for name in MODELS:
        assert name in out
    assert "14,450,688" in out and "16,281,600" in out and "6,842,880" in out


@pytest.mark.parametrize("name", ["Qwen3-235B-A22B", "Qwen3.5-397B-A17B"])
def test_sharded_memory_counts_the_base_model_transformers_builds(name: str) -> None:
    """bench/sharded_memory.py's base-model count is the language model transformers builds
    from the shipped config (on the meta device), and the total is the model's name."""
    from bench.sharded_memory import base_params

    config = load(CONFIGS / name)[1]
    routed, text, tower = base_params(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / name))
    built = {"routed": 0, "other": 0}
    for path, parameter in model.named_parameters():
        if path.startswith(("model.visual", "visual")):
            continue
        routed_expert = ".experts." in path and "shared" not in path
        built["routed" if routed_expert else "other"] += parameter.numel()
    assert built == {"routed": routed, "other": text}
    billions = int(name.split("-")[1].removesuffix("B"))
    assert abs((routed + text + tower) / 1e9 - billions) / billions < 0.005
