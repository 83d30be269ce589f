"""Expert LoRA on fused MoE blocks: the grouped computation equals every expert's dense `W + ΔW`.

For Qwen3-MoE (gate/up concatenated, `[E, 2I, H]`) and gpt-oss (transposed, interleaved, biases),
one slot and mixed slots of different ranks, forward and backward (≤ 1e-5 fp32), and the layer
counts of Tinker's shared-outer adapter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.moe_reference import dense_reference
from workers.engine import moe_kernels
from workers.engine.lora import (
    BASE_SLOT,
    LoraBank,
    Segment,
    SlotRouting,
    find_target_linears,
    find_unwrappable_experts,
)
from workers.engine.moe_lora import MultiSlotLoraExperts, expert_shape

H, I_MOE, E, TOP_K = 64, 32, 8, 2


def _qwen3_moe() -> nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=H,
        intermediate_size=2 * H,
        moe_intermediate_size=I_MOE,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def _gpt_oss() -> nn.Module:
    config = GptOssConfig(
        vocab_size=300,
        hidden_size=H,
        intermediate_size=I_MOE,
        num_local_experts=E,
        num_experts_per_tok=TOP_K,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():  # biases are zero at init; make them count
        for module in model.modules():
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                bias = getattr(module, name, None)
                if isinstance(bias, torch.Tensor):
                    bias.normal_(0, 0.1)
    return model


def _nemotron_h() -> nn.Module:
    """Non-gated relu² experts (`up_proj [E, I, H]`, `down_proj [E, H, I]`) behind an attention
    block and a Mamba2 block."""
    config = NemotronHConfig(
        vocab_size=300,
        hidden_size=H,
        layers_block_type=["mamba", "attention", "moe"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=8,
        n_routed_experts=E,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=I_MOE,
        moe_shared_expert_intermediate_size=2 * I_MOE,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    return NemotronHForCausalLM(config).eval()


def _bank(model: nn.Module, ranks: list[int]) -> tuple[LoraBank, SlotRouting]:
    model.requires_grad_(False)
    routing = SlotRouting()
    bank = LoraBank(
        model,
        max_slots=len(ranks),
        max_rank=max(ranks),
        routing=routing,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(1)
    for slot, rank in enumerate(ranks):
        bank.init_slot(slot, rank=rank, groups=["mlp"], lora_alpha=16.0, generator=generator)
        with torch.no_grad():  # B starts at 0; give every factor a value so ΔW is not zero
            for _, a, b in bank.slot_views(bank.weights, slot, rank):
                b.normal_(0, 0.2, generator=generator)
                a.mul_(2.0)
    return bank, routing


def _inputs(n_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(n_tokens, H, generator=generator)
    logits = torch.randn(n_tokens, E, generator=generator)
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return x, index, weights


def _assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    """Equal to 1e-5 of the tensor's largest value (fp32 sums in another order)."""
    assert actual is not None and expected is not None
    actual, expected = actual.detach(), expected.detach()
    error = float((actual - expected).abs().max())
    assert error <= 1e-5 * float(expected.abs().max()), error


BUILDERS = {"qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss, "nemotron_h": _nemotron_h}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize(
    "ranks,segments",
    [
        ([4], [Segment(0, 0, 6)]),
        (
            [8, 2, 4],
            [Segment(1, 0, 2), Segment(BASE_SLOT, 2, 3), Segment(0, 3, 5), Segment(2, 5, 6)],
        ),
    ],
    ids=["one-slot", "mixed-ranks"],
)
@pytest.mark.parametrize("products", ["per-expert", "grouped-gemm"])
def test_grouped_expert_lora_equals_the_dense_reference(
    arch: str,
    ranks: list[int],
    segments: list[Segment],
    products: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The frozen experts' products as one grouped GEMM (CUDA's path), run here by torch's CPU
    # kernel of the same op, or one matmul per expert.
    monkeypatch.setattr(moe_kernels, "grouped_experts", lambda *_: products == "grouped-gemm")
    model = BUILDERS[arch]()
    bank, routing = _bank(model, ranks)
    [(path, layer)] = list(bank.expert_layers.items())[:1]
    assert isinstance(layer, MultiSlotLoraExperts)
    rows, per_row = 6, 3
    x, index, weights = _inputs(rows * per_row)
    token_slots = torch.tensor(
        [s.slot for s in segments for _ in range((s.stop - s.start) * per_row)]
    )

    x1 = x.clone().requires_grad_(True)
    with routing.bind(segments):
        grouped = layer(x1, index, weights)
    grouped.pow(2).sum().backward()
    grads_grouped = bank.grads.clone()
    x_grad_grouped = x1.grad
    bank.grads.zero_()

    x2 = x.clone().requires_grad_(True)
    reference = dense_reference(layer, x2, index, weights, token_slots)
    reference.pow(2).sum().backward()
    _assert_close(grouped, reference)
    _assert_close(x_grad_grouped, x2.grad)
    _assert_close(grads_grouped, bank.grads)
    assert grads_grouped.abs().sum() > 0
    # the other layer's factors got nothing: it did not run
    for other_path, other in bank.expert_layers.items():
        if other_path != path:
            assert all(
                p.grad is None or not p.grad.any() for p in other.parameters() if p.requires_grad
            )


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_rows_without_an_adapter_compute_exactly_the_base(arch: str) -> None:
    model = BUILDERS[arch]()
    x, index, weights = _inputs(6)
    base_out = [m(x, index, weights) for m in model.modules() if expert_shape(m) is not None]
    bank, routing = _bank(model, [4])
    layers = list(bank.expert_layers.values())
    with torch.no_grad():
        assert all(
            torch.equal(layer(x, index, weights), out)
            for layer, out in zip(layers, base_out, strict=True)
        )
        with routing.bind([Segment(BASE_SLOT, 0, 6)]):
            assert all(
                torch.equal(layer(x, index, weights), out)
                for layer, out in zip(layers, base_out, strict=True)
            )


def test_tinkers_shared_outer_parameter_count() -> None:
    """3·(H + E·I)·r per MoE layer: Tinker's published count for a MoE block."""
    model = _qwen3_moe()
    rank = 4
    bank, _ = _bank(model, [rank])
    expert_params = sum(
        a.numel() + b.numel()
        for layout, a, b in bank.slot_views(bank.weights, 0, rank)
        if layout.path.rsplit(".", 1)[-1] in {"w1", "w2", "w3"}
    )
    assert expert_params == 2 * 3 * (H + E * I_MOE) * rank


def test_non_gated_experts_count_two_projections_and_mixers_are_classified() -> None:
    """Nemotron-H: 2·(H + E·I)·r per MoE block (up, down), its shared expert with the MLP, its
    Mamba2 mixer's and attention's linears with attention, the router nowhere."""
    model = _nemotron_h()
    rank = 4
    bank, _ = _bank(model, [rank])
    [path] = bank.expert_layers
    expert_params = sum(
        a.numel() + b.numel()
        for layout, a, b in bank.slot_views(bank.weights, 0, rank)
        if layout.path.startswith(path + ".")
    )
    assert expert_params == 2 * (H + E * I_MOE) * rank
    groups = {path: layer.group for path, layer in bank.layers.items()}
    assert groups["model.layers.0.mixer.out_proj"] == "attn"
    assert groups["model.layers.1.mixer.q_proj"] == "attn"
    assert groups["model.layers.2.mixer.shared_experts.up_proj"] == "mlp"
    assert not any(p.endswith("mixer.gate") for p in groups)


def test_routers_are_never_targets_and_moe_blocks_are_found() -> None:
    model = _qwen3_moe()
    targets = find_target_linears(model)
    assert not any(path.endswith((".gate", ".router", "shared_expert_gate")) for path in targets)
    assert find_unwrappable_experts(model) == []


def test_per_expert_module_lists_are_detected() -> None:
    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(8, 4), nn.Linear(4, 8), nn.Linear(8, 4)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 2)
            self.experts = nn.ModuleList([Expert(), Expert()])

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block_sparse_moe = Block()

    model = nn.Module()
    model.layers = nn.ModuleList([Layer()])
    assert find_unwrappable_experts(model) == ["layers.0.block_sparse_moe.experts"]
