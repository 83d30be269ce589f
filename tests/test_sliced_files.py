"""A sliced linear's adapter in files (`workers/trainer/sliced_files.py`): the trainer's per-slice
pairs become one block LoRA of rank k·r in PEFT's layouts and come back bit-exactly; a file whose
block is not block-diagonal, or of the wrong rank or shape, is refused naming its tensor."""

from __future__ import annotations

import pytest
import torch

from protocol.errors import UserError
from workers.engine.sliced_lora import LinearSlice, SlicedLinear, part_path
from workers.trainer import sliced_files
from workers.trainer.expert_files import AdapterScales, adapter_key

PATH = "model.layers.0.mixer.in_proj"
# Mamba2's in_proj: z [0, 8), x [8, 16), then B, C and dt rows no slice adapts
SLICED = {PATH: SlicedLinear(22, (LinearSlice("gate_proj", 0, 8), LinearSlice("x_proj", 8, 16)))}
RANK, HIDDEN = 4, 6


def test_a_slice_is_kept_beside_its_linear_under_tinkers_name() -> None:
    # tinker-cookbook's merge reads Mamba2's z and x as `mixer.gate_proj` and `mixer.x_proj`
    assert [part_path(PATH, piece) for piece in SLICED[PATH].slices] == [
        "model.layers.0.mixer.gate_proj",
        "model.layers.0.mixer.x_proj",
    ]


def _trainer_form() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {adapter_key("model.layers.0.mixer.out_proj", "A"): torch.randn(RANK, 8)}
    for piece in SLICED[PATH].slices:
        part = part_path(PATH, piece)
        tensors[adapter_key(part, "A")] = torch.randn(RANK, HIDDEN, generator=generator)
        tensors[adapter_key(part, "B")] = torch.randn(8, RANK, generator=generator)
    return tensors


def _scales(rank_pattern: dict[str, int]) -> AdapterScales:
    alpha = {path: 32.0 * rank // RANK for path, rank in rank_pattern.items()}
    return AdapterScales({"rank_pattern": rank_pattern, "alpha_pattern": alpha}, RANK, 32.0)


def test_a_block_lora_round_trips_bit_exactly() -> None:
    tensors = _trainer_form()
    written = sliced_files.to_file(tensors, SLICED, "peft")
    a, b = written[adapter_key(PATH, "A")], written[adapter_key(PATH, "B")]
    assert a.shape == (2 * RANK, HIDDEN) and b.shape == (22, 2 * RANK)
    assert not b[:8, RANK:].any() and not b[8:16, :RANK].any() and not b[16:].any()
    fields = sliced_files.peft_config_fields([PATH], SLICED, RANK, 32.0)
    assert fields == {"rank_pattern": {PATH: 2 * RANK}, "alpha_pattern": {PATH: 64.0}}
    back = sliced_files.from_file(written, SLICED, _scales({PATH: 2 * RANK}))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[key], tensors[key]) for key in tensors)
    assert sliced_files.to_file(tensors, SLICED, "tinker") == tensors


def test_a_block_that_is_not_block_diagonal_is_refused() -> None:
    written = sliced_files.to_file(_trainer_form(), SLICED, "peft")
    written[adapter_key(PATH, "B")][20, 0] = 1e-3  # a dt row, which no slice adapts
    with pytest.raises(UserError, match="not block-diagonal"):
        sliced_files.from_file(written, SLICED, _scales({PATH: 2 * RANK}))


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((RANK, HIDDEN), (22, RANK)), ((2 * RANK, HIDDEN), (16, 2 * RANK)), ((2 * RANK,), (22, 8))],
    ids=["rank-r", "rows-of-the-slices-only", "a-not-2d"],
)
def test_a_block_of_the_wrong_shape_is_refused(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    tensors = {
        adapter_key(PATH, "A"): torch.zeros(a_shape),
        adapter_key(PATH, "B"): torch.zeros(b_shape),
    }
    with pytest.raises(UserError, match="adapted per slice"):
        sliced_files.from_file(tensors, SLICED, _scales({PATH: 2 * RANK}))


def test_a_half_pair_a_wrong_scale_and_a_slice_given_twice_are_refused() -> None:
    written = sliced_files.to_file(_trainer_form(), SLICED, "peft")
    twice = {**written, **{k: v for k, v in _trainer_form().items() if ".gate_proj." in k}}
    with pytest.raises(UserError, match="given twice"):
        sliced_files.from_file(twice, SLICED, _scales({PATH: 2 * RANK}))
    half = {k: v for k, v in written.items() if k != adapter_key(PATH, "B")}
    with pytest.raises(UserError, match="no complete A/B pair"):
        sliced_files.from_file(half, SLICED, _scales({PATH: 2 * RANK}))
    # rank 2r without the alpha 2·alpha that keeps its scale alpha/r
    scales = AdapterScales({"rank_pattern": {PATH: 2 * RANK}}, RANK, 32.0)
    with pytest.raises(UserError, match="only one scale"):
        sliced_files.from_file(written, SLICED, scales)
