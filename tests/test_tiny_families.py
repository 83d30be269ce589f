"""workers.tiny_model's other Tinker families (workers.tiny_families): each builds offline from
transformers' own classes, loads the way the worker loads it, trains on a few tokens, has the
module tree LoRA targeting is written against, starts from random routers and builds the same
files from the same arguments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from workers.engine.model import load_causal_lm
from workers.tiny_families import FAMILY_ARCHS, FAMILY_MOE_ARCHS, FAMILY_VL_ARCHS
from workers.tiny_model import (
    MOE_ARCHS,
    MOE_INTERMEDIATE_SIZE,
    NUM_EXPERTS,
    TOP_K,
    VL_ARCHS,
    Arch,
    build_tiny_model,
    main,
)

TEXT = "Hello wörld! The answer is 42.\n<|im_start|>user\nnaïve café<|im_end|>"
H, E, W = 64, NUM_EXPERTS, MOE_INTERMEDIATE_SIZE  # defaults: hidden 64, 8 experts 48 wide

CLASSES = {
    "llama": "LlamaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    # no causal-LM class for these composites: the worker loads them whole, as Qwen3-VL
    "kimi_k25": "Kimi_K25ForConditionalGeneration",
    "inkling_mm_model": "InklingForConditionalGeneration",
}

# MLA as DeepSeek-V3 has it: 2 heads of 16 rotary + 16 plain query/key dims and 32 value dims,
# query rank 48, KV rank 32.
_MLA: dict[str, tuple[int, ...]] = {
    "self_attn.q_a_proj.weight": (48, H),
    "self_attn.q_b_proj.weight": (2 * 32, 48),
    "self_attn.kv_a_proj_with_mqa.weight": (32 + 16, H),
    "self_attn.kv_b_proj.weight": (2 * (16 + 32), 32),
    "self_attn.o_proj.weight": (H, 2 * 32),
}
_DENSE: dict[str, tuple[int, ...]] = {
    "mlp.gate_proj.weight": (2 * H, H),
    "mlp.up_proj.weight": (2 * H, H),
    "mlp.down_proj.weight": (H, 2 * H),
}
_DEEPSEEK_MOE: dict[str, tuple[int, ...]] = {
    "mlp.gate.weight": (E, H),
    "mlp.experts.gate_up_proj": (E, 2 * W, H),  # gate rows, then up rows
    "mlp.experts.down_proj": (E, H, W),
    "mlp.shared_experts.gate_proj.weight": (W, H),
    "mlp.shared_experts.up_proj.weight": (W, H),
    "mlp.shared_experts.down_proj.weight": (H, W),
}
_V4_ATTENTION: dict[str, tuple[int, ...]] = {
    "self_attn.q_a_proj.weight": (48, H),
    "self_attn.q_b_proj.weight": (2 * 32, 48),
    "self_attn.kv_proj.weight": (32, H),  # one KV head
    "self_attn.o_a_proj.weight": (2 * 16, 32),  # 2 groups of one 32-wide head, rank 16 each
    "self_attn.o_b_proj.weight": (H, 2 * 16),
    "self_attn.sinks": (2,),
}
# layer -> parameter -> shape, for the layers that show each block kind
EXPECTED: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {
    "llama": {
        0: {
            "self_attn.q_proj.weight": (H, H),
            "self_attn.k_proj.weight": (32, H),
            "self_attn.v_proj.weight": (32, H),
            "self_attn.o_proj.weight": (H, H),
            **_DENSE,
        }
    },
    "deepseek_v3": {0: _MLA | _DENSE, 1: _MLA | _DEEPSEEK_MOE},
    "kimi_k25": {0: _MLA | _DENSE, 1: _MLA | _DEEPSEEK_MOE},
    "glm_moe_dsa": {
        0: _MLA | _DENSE,
        1: _MLA
        | _DEEPSEEK_MOE
        | {
            "self_attn.indexer.wq_b.weight": (2 * 32, 48),
            "self_attn.indexer.wk.weight": (32, H),
            "self_attn.indexer.weights_proj.weight": (2, H),
        },
    },
    "deepseek_v4": {
        0: _V4_ATTENTION | _DEEPSEEK_MOE | {"attn_hc.fn": (8, 2 * H), "ffn_hc.fn": (8, 2 * H)},
        1: _V4_ATTENTION
        | _DEEPSEEK_MOE
        | {
            "self_attn.compressor.kv_proj.weight": (2 * 32, H),  # CSA: two overlapping halves
            "self_attn.compressor.indexer.q_b_proj.weight": (2 * 16, 48),
        },
        2: _V4_ATTENTION | _DEEPSEEK_MOE | {"self_attn.compressor.kv_proj.weight": (32, H)},
    },
    "nemotron_h": {
        # d_inner 4·32 = 128; in_proj rows z, x (128 each), B, C (2 groups × 16 each), dt (4)
        0: {
            "mixer.in_proj.weight": (2 * 128 + 2 * 2 * 16 + 4, H),
            "mixer.out_proj.weight": (H, 128),
            "mixer.conv1d.weight": (128 + 2 * 2 * 16, 1, 4),
        },
        1: {
            "mixer.q_proj.weight": (H, H),
            "mixer.k_proj.weight": (32, H),
            "mixer.v_proj.weight": (32, H),
            "mixer.o_proj.weight": (H, H),
        },
        2: {
            "mixer.gate.weight": (E, H),
            "mixer.experts.up_proj": (E, W, H),  # relu², not gated: no gate rows
            "mixer.experts.down_proj": (E, H, W),
            "mixer.shared_experts.up_proj.weight": (2 * W, H),
            "mixer.shared_experts.down_proj.weight": (H, 2 * W),
        },
    },
    "inkling_mm_model": {
        0: {  # sliding window, 2 KV heads; dense MLP
            "self_attn.q_proj.weight": (H, H),
            "self_attn.k_proj.weight": (H, H),
            "self_attn.v_proj.weight": (H, H),
            "self_attn.r_proj.weight": (2 * 8, H),
            "self_attn.o_proj.weight": (H, H),
            **_DENSE,
        },
        1: {  # global, 1 KV head; MoE with a bank of 2 shared experts the router also scores
            "self_attn.k_proj.weight": (32, H),
            "self_attn.v_proj.weight": (32, H),
            "self_attn.r_proj.weight": (2 * 8, H),
            "mlp.gate.weight": (E + 2, H),
            "mlp.experts.gate_up_proj": (E, 2 * W, H),
            "mlp.experts.down_proj": (E, H, W),
            "mlp.shared_experts.gate_proj": (2, W, H),
            "mlp.shared_experts.up_proj": (2, W, H),
            "mlp.shared_experts.down_proj": (2, H, W),
        },
    },
}
TOWERS = (".vision_tower.", ".audio_tower.", ".mm_projector.")
# selections computed under no_grad: their weights get no gradient from the loss
NO_GRADIENT = (".indexer.",)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each family with default arguments, built once per module on first use."""
    directories: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in directories:
            directory = tmp_path_factory.mktemp(arch)
            directories[arch] = build_tiny_model(directory, arch)  # type: ignore[arg-type]
        return directories[arch]

    return get


def _layers(arch: str) -> str:
    return "model.language_model.layers" if arch in FAMILY_VL_ARCHS else "model.layers"


def test_the_families_are_registered() -> None:
    assert set(FAMILY_ARCHS) == set(CLASSES) == set(EXPECTED)
    assert FAMILY_MOE_ARCHS <= MOE_ARCHS and "llama" not in MOE_ARCHS
    assert FAMILY_VL_ARCHS <= VL_ARCHS


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_loads_as_the_worker_does_and_trains(arch: str, built: Callable[[str], Path]) -> None:
    directory = built(arch)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    auto = AutoModelForImageTextToText if arch in FAMILY_VL_ARCHS else AutoModelForCausalLM
    info: dict[str, list[str]]
    _, info = auto.from_pretrained(directory, output_loading_info=True)  # type: ignore[misc]
    assert not any(info.values()), info  # every saved tensor read back, none missing
    model = load_causal_lm(str(directory), torch.float32)
    assert type(model).__name__ == CLASSES[arch]
    vocab_size = model.config.get_text_config().vocab_size
    assert vocab_size == len(tokenizer) == 512
    input_ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.logits.shape == (1, input_ids.shape[1], vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [
        name
        for name, p in model.named_parameters()
        if p.grad is None and not any(part in name for part in TOWERS + NO_GRADIENT)
    ]
    assert missing == []


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_module_tree(arch: str, built: Callable[[str], Path]) -> None:
    """The names and shapes LoRA targeting works against, layer by layer."""
    model = load_causal_lm(str(built(arch)), torch.float32)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for layer, expected in EXPECTED[arch].items():
        for name, shape in expected.items():
            assert shapes.get(f"{_layers(arch)}.{layer}.{name}") == shape, (layer, name)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (arch == "llama")  # as Llama-3.2-1B/3B; the other families' heads are apart


def test_block_kinds(built: Callable[[str], Path]) -> None:
    def config(arch: str) -> object:
        return load_causal_lm(str(built(arch)), torch.float32).config.get_text_config()

    v4 = config("deepseek_v4")
    assert v4.layer_types == [  # type: ignore[attr-defined]
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert v4.mlp_layer_types == ["hash_moe", "moe", "moe"]  # type: ignore[attr-defined]
    nemotron = config("nemotron_h")
    assert nemotron.layers_block_type == [  # type: ignore[attr-defined]
        "linear_attention",
        "full_attention",
        "moe",
        "linear_attention",
        "moe",
    ]
    assert nemotron.mlp_hidden_act == "relu2"  # type: ignore[attr-defined]
    for arch in ("deepseek_v3", "glm_moe_dsa", "kimi_k25"):
        assert config(arch).first_k_dense_replace == 1, arch  # type: ignore[attr-defined]
    inkling = config("inkling_mm_model")
    assert inkling.layer_types == ["hybrid_sliding", "hybrid"]  # type: ignore[attr-defined]
    assert inkling.mlp_layer_types == ["dense", "sparse"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", sorted(FAMILY_MOE_ARCHS))
def test_routers_start_random(arch: str, built: Callable[[str], Path]) -> None:
    model = load_causal_lm(str(built(arch)), torch.float32)
    routers = {
        name: p
        for name, p in model.named_parameters()
        if name.endswith(("mlp.gate.weight", "mixer.gate.weight"))
    }
    assert routers
    for name, weight in routers.items():
        assert weight.std() > 0.05, name  # drawn like the weights (0.1), not zero


def _routed_experts(model: nn.Module, input_ids: torch.Tensor) -> dict[str, set[int]]:
    """The experts each MoE block of the model sends tokens to in one forward."""
    picked: dict[str, set[int]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            picked[name] = set()

            def record(
                _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name
            ) -> None:  # every family's experts take (hidden_states, top_k_index, top_k_weights)
                top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
                picked[name].update(top_k_index.flatten().tolist())

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return picked


@pytest.mark.parametrize("arch", sorted(FAMILY_MOE_ARCHS))
def test_routing_spreads_tokens_over_several_experts(
    arch: str, built: Callable[[str], Path]
) -> None:
    # Zero routers would tie every logit and send every token to the same TOP_K experts.
    model = load_causal_lm(str(built(arch)), torch.float32)
    # ids past the vision tokens (3-6), which a composite would take for an image's
    input_ids = torch.randint(7, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    picked = _routed_experts(model, input_ids)
    assert picked
    for name, experts in picked.items():
        assert len(experts) > TOP_K and experts <= set(range(E)), (name, experts)


def test_deepseek_v4_hash_routing_spreads_over_distinct_experts(
    built: Callable[[str], Path],
) -> None:
    model = load_causal_lm(str(built("deepseek_v4")), torch.float32)
    table = dict(model.named_buffers())["model.layers.0.mlp.gate.tid2eid"]
    assert table.shape == (512, 2)
    assert bool((table[:, 0] != table[:, 1]).all())  # two different experts per token
    assert set(table.flatten().tolist()) == set(range(E))


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_builds_are_deterministic(arch: Arch, tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", arch, vocab_size=300, seed=3)
    second = build_tiny_model(tmp_path / "b", arch, vocab_size=300, seed=3)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "c", arch, vocab_size=300, seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_the_cli_shapes_depth_and_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nemotron"
    main([str(out), "--arch", "nemotron_h", "--vocab-size", "300", "--num-layers", "3"])
    assert capsys.readouterr().out.strip() == str(out)
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert config.layers_block_type == ["linear_attention", "full_attention", "moe"]
    deepseek = build_tiny_model(
        tmp_path / "deepseek",
        "deepseek_v3",
        vocab_size=300,
        num_experts=4,
        top_k=1,
        moe_intermediate_size=16,
    )
    shapes = {
        name: tuple(p.shape)
        for name, p in AutoModelForCausalLM.from_pretrained(deepseek).named_parameters()
    }
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (4, 32, H)
    assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (16, H)
    with pytest.raises(ValueError, match="MoE archs"):
        build_tiny_model(tmp_path / "llama", "llama", num_experts=4)
