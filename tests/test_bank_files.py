"""Banks, one-A GLUs and the linears named by their weight in PEFT files
(`workers/trainer/bank_files.py`, `workers/trainer/checkpoints.py`): the trainer's pairs become
PEFT's wrappers and come back bit-exactly; a file whose shared factor differs is refused naming
its tensor; the linears PEFT would not adapt as modules are named in `target_parameters`."""

from __future__ import annotations

import pytest
import torch

from protocol.errors import UserError
from workers.engine.moe_lora import ExpertShape
from workers.trainer import bank_files
from workers.trainer.checkpoints import ModelTargets, by_weight_paths
from workers.trainer.expert_files import AdapterScales, adapter_key
from workers.trainer.transfer import check_target_modules

BANK, GLU = "model.layers.1.mlp.shared_experts", "model.layers.0.mlp"
N, INTER, HIDDEN, RANK = 2, 5, 6, 3
BANKS = {BANK: (N, INTER, HIDDEN)}
GLUS = {GLU: 7}
SCALES = AdapterScales({}, RANK, 32.0)


def _trainer_form() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        adapter_key(f"{GLU}.gate_up_proj", "A"): torch.randn(RANK, HIDDEN, generator=g),
        adapter_key(f"{GLU}.gate_up_proj", "B"): torch.randn(14, RANK, generator=g),
        adapter_key(f"{GLU}.down_proj", "A"): torch.randn(RANK, 7, generator=g),
    }
    for name in ("gate_proj", "up_proj"):
        tensors[adapter_key(f"{BANK}.{name}", "A")] = torch.randn(RANK, HIDDEN, generator=g)
        tensors[adapter_key(f"{BANK}.{name}", "B")] = torch.randn(N * INTER, RANK, generator=g)
    tensors[adapter_key(f"{BANK}.down_proj", "A")] = torch.randn(RANK, N * INTER, generator=g)
    tensors[adapter_key(f"{BANK}.down_proj", "B")] = torch.randn(HIDDEN, RANK, generator=g)
    return tensors


def test_banks_and_glus_round_trip_bit_exactly_in_peft_wrappers() -> None:
    tensors = _trainer_form()
    written = bank_files.to_file(tensors, BANKS, GLUS, "peft")
    # the GLU as its two linears with one A; the bank as three nested parameter wrappers
    gate_a, up_a = (written[adapter_key(f"{GLU}.{n}_proj", "A")] for n in ("gate", "up"))
    assert torch.equal(gate_a, up_a) and written[adapter_key(f"{GLU}.up_proj", "B")].shape == (7, 3)
    assert written[adapter_key(f"{BANK}.base_layer.base_layer", "A")].shape == (N * RANK, HIDDEN)
    assert written[adapter_key(f"{BANK}.base_layer", "B")].shape == (INTER, RANK * N)
    assert written[adapter_key(BANK, "A")].shape == (N * RANK, INTER)
    back = bank_files.from_file(written, BANKS, GLUS, SCALES)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[key], tensors[key]) for key in tensors)
    assert bank_files.to_file(tensors, BANKS, GLUS, "tinker") == tensors


def test_an_expert_of_the_bank_computes_its_side_by_side_share() -> None:
    """Expert e of a PEFT wrapper (A rows e·r + k, B columns k·n + e) is B_e·A_e: the bank
    pair's rows of expert e for gate and up, its columns of expert e for down."""
    tensors = _trainer_form()
    written = bank_files.to_file(tensors, BANKS, GLUS, "peft")
    for name, nesting in bank_files.BANK_NESTING.items():
        a, b = written[adapter_key(BANK + nesting, "A")], written[adapter_key(BANK + nesting, "B")]
        delta = (
            tensors[adapter_key(f"{BANK}.{name}", "B")]
            @ tensors[adapter_key(f"{BANK}.{name}", "A")]
        )
        for e in range(N):
            per_expert = b[:, [k * N + e for k in range(RANK)]] @ a[e * RANK : (e + 1) * RANK]
            want = (
                delta[:, e * INTER : (e + 1) * INTER]
                if name == "down_proj"
                else delta[e * INTER : (e + 1) * INTER]
            )
            assert torch.allclose(per_expert, want, atol=1e-6), (name, e)


@pytest.mark.parametrize(
    "key,change,message",
    [
        (f"{GLU}.up_proj", "A", "expert 1 differs"),
        (f"{BANK}.base_layer.base_layer", "A", "expert 1 differs"),
        (BANK, "B", "expert 1 differs"),
    ],
)
def test_a_shared_factor_that_differs_is_refused(key: str, change: str, message: str) -> None:
    written = bank_files.to_file(_trainer_form(), BANKS, GLUS, "peft")
    tensor = written[adapter_key(key, change)]
    if key == BANK:  # the down wrapper's B: column k·n + 1 is expert 1's
        tensor[:, 1] += 1.0
    elif key.endswith("up_proj"):
        tensor[0, 0] += 1.0
    else:
        tensor[RANK, 0] += 1.0  # expert 1's first row
    with pytest.raises(UserError, match=message):
        bank_files.from_file(written, BANKS, GLUS, SCALES)


def test_half_a_glu_or_a_wrongly_shaped_wrapper_is_refused() -> None:
    written = bank_files.to_file(_trainer_form(), BANKS, GLUS, "peft")
    del written[adapter_key(f"{GLU}.up_proj", "B")]
    with pytest.raises(UserError, match="up_proj.lora_B.weight is missing"):
        bank_files.from_file(written, BANKS, GLUS, SCALES)
    written = bank_files.to_file(_trainer_form(), BANKS, GLUS, "peft")
    written[adapter_key(BANK, "A")] = torch.zeros(N * RANK, INTER + 1)
    with pytest.raises(UserError, match=r"shared_experts.lora_A.weight has shape \(6, 6\)"):
        bank_files.from_file(written, BANKS, GLUS, SCALES)


def test_linears_peft_would_move_onto_fused_experts_are_named_by_their_weight() -> None:
    experts = {"model.layers.1.mlp.experts": ExpertShape(4, 6, 8, False, True, False)}
    linears = [
        "model.layers.0.mlp.gate_proj",  # a dense layer's MLP beside fused experts
        "model.layers.1.mlp.shared_experts.down_proj",
        "model.layers.0.self_attn.o_proj",
    ]
    assert by_weight_paths(linears, ModelTargets(experts=experts)) == linears[:2]
    # without fused experts, PEFT adapts an MLP's linears as modules
    assert by_weight_paths(linears, ModelTargets()) == []


def test_an_import_may_name_an_adapted_linear_by_its_weight() -> None:
    adaptable = ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    check_target_modules(
        {"target_modules": [], "target_parameters": ["model.layers.0.mlp.gate_proj.weight"]},
        adaptable,
    )
    for target in ("model.layers.0.mlp.gate_proj.bias", "model.layers.0.mlp.other.weight", 3):
        with pytest.raises(UserError, match="target parameter"):
            check_target_modules({"target_modules": [], "target_parameters": [target]}, adaptable)
