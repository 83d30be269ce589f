"""The engine on a worker group of 2 and 4 CPU ranks (gloo, loopback) against one device: a
MoE model's experts split over the ranks (Qwen3-MoE, gpt-oss, Qwen3.5-MoE, DeepSeek-V3, GLM-5.3,
DeepSeek-V4, Inkling, and Nemotron-H's non-gated ones), a dense Qwen3 model's frozen decoder linears split (gathered for
each use), the same scenario (`tests.group_harness`) gives the same losses, log-probs, gradient
norms, checkpoints, states and final adapters (≤ 1e-5, fp32), a failing tenant failing alone on
every rank alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.engine_helpers import Trainer
from tests.group_harness import cross_check, run_alone
from workers.group.runtime import free_port
from workers.tiny_model import build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5


def run_group(model: Path, world: int, workdir: Path, *extra: str) -> dict[str, torch.Tensor]:
    """The scenario on a group of `world` ranks (one process each); rank 0's observations."""
    workdir.mkdir(parents=True)
    port, out = free_port(), workdir / "rank0.safetensors"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.group_harness",
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--model",
                str(model),
                "--workdir",
                str(workdir),
                "--out",
                str(out),
                *extra,
            ],
            cwd=ROOT,
            env=env,
        )
        for rank in range(world)
    ]
    try:
        codes = [rank.wait(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0] * world, codes
    return safetensors.torch.load_file(str(out)) if out.exists() else {}


def assert_same(alone: dict[str, torch.Tensor], group: dict[str, torch.Tensor]) -> None:
    assert sorted(group) == sorted(alone)
    for key, want in alone.items():
        if key.startswith("meta."):
            continue
        got = group[key]
        assert got.shape == want.shape, key
        if not want.numel():
            continue
        bound = TOLERANCE * max(1.0, float(want.abs().max()))
        diff = float((got - want).abs().max())
        assert diff <= bound, f"{key}: {diff:.3g} > {bound:.3g}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "arch",
    [
        "qwen3_moe",
        "qwen3",
        "gpt_oss",
        "qwen3_5_moe",
        "deepseek_v3",
        "nemotron_h",
        "glm_moe_dsa",
        "deepseek_v4",
        "inkling_mm_model",
    ],
)
def test_a_group_of_2_and_4_ranks_trains_as_one_device(arch: str, tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", arch)
    alone = run_alone(model, tmp_path / "alone")
    assert "bad.t1.error" in alone and "bad.t0.loss" in alone  # the failing tenant alone
    for world in (2, 4) if arch in ("qwen3", "qwen3_moe") else (2,):
        # the group loads, at its end, the checkpoint one device saved
        foreign = tmp_path / "alone" / "final-t3"
        group = run_group(model, world, tmp_path / f"group-{world}", "--foreign", str(foreign))
        if arch != "qwen3":  # each rank holds its share of the experts and their factors
            assert group["meta.experts"].tolist() == [n // world for n in alone["meta.experts"]]
            assert int(group["meta.row"]) < int(alone["meta.row"])
        else:  # the frozen decoder linears are split; the adapters are whole on every rank
            assert int(group["meta.row"]) == int(alone["meta.row"])
        assert int(group["meta.base"]) < int(alone["meta.base"])
        assert_same(alone, group)
        # and one device loads what the group saved
        engine = Trainer(str(model), max_slots=4, max_rank=16)
        again = cross_check(engine, tmp_path / f"group-{world}" / "final-t3")
        assert_same({k: v for k, v in alone.items() if k.startswith("cross.")}, again)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_a_group_recomputing_its_layers_trains_as_one_device_keeping_them(
    arch: str, tmp_path: Path
) -> None:
    """Layers recomputed in the backward (`workers.engine.recompute`) on 2 ranks: the experts'
    exchanges, or the frozen linears' gathers, run again in the recomputation on every rank
    alike, and the scenario's results equal one device's without recomputation."""
    model = build_tiny_model(tmp_path / "model", arch)
    alone = run_alone(model, tmp_path / "alone")
    foreign = tmp_path / "alone" / "final-t3"
    group = run_group(model, 2, tmp_path / "group", "--foreign", str(foreign), "--recompute")
    assert_same(alone, group)


@pytest.mark.timeout(120)
def test_the_ranks_load_one_after_the_other(tmp_path: Path) -> None:
    """Each rank loads the whole checkpoint on the host and keeps its share; the ranks take
    turns (`Collective.in_turns`, which the engine loads through), so the host holds one
    whole model at a time."""
    turns = tmp_path / "turns.txt"
    run_group(tmp_path / "no-model", 4, tmp_path / "group", "--turns", str(turns))
    spans = sorted(
        (float(began), float(ended), int(rank))
        for rank, began, ended in (line.split() for line in turns.read_text().splitlines())
    )
    assert [rank for _, _, rank in spans] == [0, 1, 2, 3]
    for (_, ended, _), (began, _, _) in zip(spans, spans[1:], strict=False):
        assert began >= ended


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("arch", "world", "extra"),
    [
        ("qwen3", 2, ()),
        ("qwen3", 4, ()),
        ("qwen3_moe", 2, ("--recompute",)),
        ("deepseek_v3", 2, ()),
        ("qwen3_5", 2, ()),
        ("qwen3_5_moe", 2, ("--recompute",)),
    ],
)
def test_a_group_splits_long_datums_by_position_and_trains_as_one_device(
    arch: str, world: int, extra: tuple[str, ...], tmp_path: Path
) -> None:
    """Datums over the pass token budget, each in a pass of its own, split by position over
    the ranks (`workers.engine.context_parallel`: the keys and values all-gathered per layer,
    the experts' tokens gathered and their outputs reduced, Qwen3.5's Gated DeltaNet state and
    convolution window carried from rank to rank, the log-probabilities gathered): beside
    ordinary passes of the same tenant in the same call, the log-probabilities, losses,
    gradient norms and saved adapters equal one device's; with layers recomputed too."""
    model = build_tiny_model(tmp_path / "model", arch)
    alone = run_alone(model, tmp_path / "alone", long=True)
    group = run_group(model, world, tmp_path / "group", "--long", *extra)
    assert int(alone["meta.splits"]) == 0
    assert int(group["meta.splits"]) == 5  # the 301- and 129/130-token datums, the forward
    assert_same(alone, group)


@pytest.mark.timeout(600)
def test_a_group_splitting_every_pass_of_packed_rows_trains_as_one_device(
    tmp_path: Path,
) -> None:
    """Every pass split (`--context`), rows packed with several datums each (the attention
    masked block-diagonally across the ranks' positions): the whole scenario, with experts
    split too, equals one device."""
    model = build_tiny_model(tmp_path / "model", "qwen3_moe")
    alone = run_alone(model, tmp_path / "alone")
    foreign = tmp_path / "alone" / "final-t3"
    group = run_group(model, 2, tmp_path / "group", "--foreign", str(foreign), "--context")
    assert_same(alone, group)


@pytest.mark.parametrize(
    ("arch", "reason"),
    [
        ("qwen3", None),
        ("qwen3_5", None),
        ("nemotron_h", "layers include"),
        ("inkling_mm_model", "sliding-window"),
    ],
)
def test_which_models_split_passes_by_position(
    arch: str, reason: str | None, tmp_path: Path
) -> None:
    """Attention and Gated DeltaNet models split; a model with other layers that mix
    positions (Nemotron-H's Mamba2 and MoE blocks) or a sliding window (Inkling) says why
    it does not, and runs its long datums whole on every rank."""
    engine = Trainer(str(build_tiny_model(tmp_path / "model", arch)), max_slots=1, max_rank=4)
    refused = engine.core.passes.context.refused
    assert refused is None if reason is None else reason in str(refused)


def test_which_passes_a_group_splits(tmp_path: Path) -> None:
    """A pass over the pass token budget of at least `SPLIT_FLOOR` positions, or longer than a
    rank's plan holds whole; never one within the budget, nor rows too narrow to give every
    rank `MIN_CHUNK` positions."""
    from transformers import AutoModelForCausalLM

    from workers.engine.collective import Collective
    from workers.engine.context_parallel import MIN_CHUNK, SPLIT_FLOOR, ContextParallel

    class TwoRanks(Collective):
        world = 2

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "model", "qwen3"))
    context = ContextParallel(model, TwoRanks())
    assert context.supported
    floor = SPLIT_FLOOR
    assert not context.splits(floor, floor, pass_tokens=2 * floor)  # within the budget
    assert context.splits(floor, floor, pass_tokens=512)
    assert not context.splits(floor - 1, floor - 1, pass_tokens=512)  # under the floor
    context.whole_tokens = floor // 2  # ... unless a rank cannot hold it whole
    assert context.splits(floor - 1, floor - 1, pass_tokens=512)
    assert not context.splits(floor, 2 * MIN_CHUNK - 1, pass_tokens=512)  # narrow rows
    assert not ContextParallel(model, Collective()).splits(floor, floor, pass_tokens=512)
