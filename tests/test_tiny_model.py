"""workers.tiny_model: every architecture builds offline and loads through the Auto classes;
the MoE ones have the fused expert layouts of transformers 5 and route over many experts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info
from torch import nn
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

from twinkle_async.cli import TinyArch
from workers.engine.model import load_causal_lm
from workers.tiny_families import FAMILY_ARCHS
from workers.tiny_model import (
    ARCHS,
    CONTEXT_LENGTH,
    EOS_ID,
    IMAGE_PAD_ID,
    MOE_ARCHS,
    MOE_INTERMEDIATE_SIZE,
    NUM_EXPERTS,
    PAD_ID,
    TOP_K,
    VISION_END_ID,
    VISION_START_ID,
    VISION_TOKENS,
    Arch,
    build_tiny_model,
    main,
)

TEXT = "Hello wörld!  The answer is 42.\n\n<|im_start|>user\nnaïve café 😀<|im_end|>"
# The families of workers.tiny_families have their own module trees and checks
# (tests/test_tiny_families.py); the layouts asserted here are the Qwen and gpt-oss ones.
QWEN_GPT_ARCHS = tuple(arch for arch in ARCHS if arch not in FAMILY_ARCHS)
MOE = sorted(MOE_ARCHS - set(FAMILY_ARCHS))
H = 64  # the default hidden size


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Arch], Path]:
    """Each architecture with default arguments, built once per module on first use."""
    directories: dict[Arch, Path] = {}

    def get(arch: Arch) -> Path:
        if arch not in directories:
            directories[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return directories[arch]

    return get


@pytest.fixture(scope="module", params=QWEN_GPT_ARCHS)
def model_dir(request: pytest.FixtureRequest, built: Callable[[Arch], Path]) -> Path:
    return built(request.param)


def test_tokenizer_round_trips_and_matches_the_model_vocab(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = load_causal_lm(str(model_dir), torch.float32).config.get_text_config()
    assert len(tokenizer) == config.vocab_size == 512
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert max(ids) < config.vocab_size and min(ids) >= 0
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_ID, PAD_ID)
    assert (config.eos_token_id, config.pad_token_id) == (EOS_ID, PAD_ID)
    assert tokenizer.model_max_length == CONTEXT_LENGTH


def test_tokenizer_loads_the_way_the_sdk_asks(model_dir: Path) -> None:
    # TrainingClient.get_tokenizer() ends in AutoTokenizer.from_pretrained(id, fast=True).
    tokenizer = _load_tokenizer_from_model_info(str(model_dir), str(model_dir))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=True, return_dict=False
    )
    assert ids[0] == 1 and EOS_ID in ids


def test_forward_and_backward(model_dir: Path) -> None:
    """The causal LM the worker loads (a Qwen3-VL composite, which has no text-only class:
    its tower sees no image here) runs forward and backward on text."""
    model = load_causal_lm(str(model_dir), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.logits.shape == (1, input_ids.shape[1], model.config.get_text_config().vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    text = [(n, p) for n, p in model.named_parameters() if ".visual." not in n]
    assert all(p.grad is not None for _, p in text if p.requires_grad)


def test_qwen3_5_mixes_linear_and_full_attention(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, "qwen3_5"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    assert model.config.head_dim == 32


def test_builds_are_deterministic_and_leave_the_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    first = build_tiny_model(tmp_path / "a", vocab_size=300, seed=7)
    assert torch.rand(1) == expected
    second = build_tiny_model(tmp_path / "b", vocab_size=300, seed=7)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = build_tiny_model(tmp_path / "c", vocab_size=300, seed=8)
    assert (other_seed / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tmp_path, hidden_size=48)
    with pytest.raises(ValueError, match="MoE archs"):
        build_tiny_model(tmp_path, "qwen3", num_experts=4)
    with pytest.raises(ValueError, match="top_k"):
        build_tiny_model(tmp_path, "qwen3_moe", num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, "mixtral")  # type: ignore[arg-type]


def test_cli_prints_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "cli"), "--arch", "qwen3", "--vocab-size", "300", "--num-layers", "1"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "cli").config.num_hidden_layers == 1


def test_the_cli_offers_every_arch() -> None:
    # twinkle_async never imports workers, so it keeps its own copy of the list.
    assert get_args(TinyArch) == ARCHS


def _expected_moe_shapes(arch: str, experts: int, width: int) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router and expert parameters and their shapes, hidden size H."""
    E, two_i = experts, 2 * width
    if arch == "gpt_oss":
        return {
            "mlp.router.weight": (E, H),
            "mlp.router.bias": (E,),
            "mlp.experts.gate_up_proj": (E, H, two_i),  # gate and up interleaved on the last dim
            "mlp.experts.gate_up_proj_bias": (E, two_i),
            "mlp.experts.down_proj": (E, width, H),
            "mlp.experts.down_proj_bias": (E, H),
            "self_attn.sinks": (H // 32,),  # one per attention head
        }
    shapes = {
        "mlp.gate.weight": (E, H),
        "mlp.experts.gate_up_proj": (E, two_i, H),  # gate rows, then up rows
        "mlp.experts.down_proj": (E, H, width),
    }
    if arch in ("qwen3_5_moe", "qwen3_5_moe_vl"):
        shared = 2 * width
        shapes |= {
            "mlp.shared_expert.gate_proj.weight": (shared, H),
            "mlp.shared_expert.up_proj.weight": (shared, H),
            "mlp.shared_expert.down_proj.weight": (H, shared),
            "mlp.shared_expert_gate.weight": (1, H),
        }
    return shapes


MODEL_CLASSES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_5_moe_vl": "Qwen3_5MoeForCausalLM",  # a composite's text model, as the worker loads it
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",  # no text-only class: the composite
}


@pytest.mark.parametrize("arch", MOE)
def test_moe_archs_have_fused_experts_in_every_layer(
    arch: Arch, built: Callable[[Arch], Path]
) -> None:
    model = load_causal_lm(str(built(arch)), torch.float32)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    config = model.config.get_text_config()
    layers = "model.language_model.layers" if arch == "qwen3_vl_moe" else "model.layers"
    assert (config.head_dim, config.num_experts_per_tok) == (32, TOP_K)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, like the dense ones
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for layer in range(config.num_hidden_layers):
        for name, shape in _expected_moe_shapes(arch, NUM_EXPERTS, MOE_INTERMEDIATE_SIZE).items():
            assert parameters[f"{layers}.{layer}.{name}"] == shape, (layer, name)
    if arch == "gpt_oss":
        # SDPA would silently drop the sinks; the eager kernel applies them.
        assert config._attn_implementation == "eager"
        assert config.layer_types == ["sliding_attention", "full_attention"]
    if arch in ("qwen3_5_moe", "qwen3_5_moe_vl"):
        assert config.layer_types == ["linear_attention", "full_attention"]
    if arch in ("qwen3_moe", "qwen3_vl_moe"):
        assert (config.decoder_sparse_step, config.mlp_only_layers) == (1, [])


def _routed_experts(model: nn.Module, input_ids: torch.Tensor) -> dict[str, set[int]]:
    """The experts each router of the model picks for the tokens of one forward."""
    picked: dict[str, set[int]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "mlp.router")):
            picked[name] = set()

            def record(_m: nn.Module, _i: object, out: tuple[torch.Tensor, ...], name=name) -> None:
                picked[name].update(out[2].flatten().tolist())  # (logits, weights, indices)

            handles.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return picked


@pytest.mark.parametrize("arch", MOE)
def test_moe_routing_spreads_tokens_over_several_experts(
    arch: Arch, built: Callable[[Arch], Path]
) -> None:
    # Routers initialised to zero tie every logit, so every token would go to the same TOP_K
    # experts; more distinct experts than that means the routing is a real choice.
    model = load_causal_lm(str(built(arch)), torch.float32)
    config = model.config.get_text_config()
    # ids past the vision tokens (3-6): a composite would take those for an image's
    input_ids = torch.randint(
        7, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)
    )
    picked = _routed_experts(model, input_ids)
    assert len(picked) == config.num_hidden_layers
    for name, experts in picked.items():
        assert len(experts) > TOP_K, (name, experts)


@pytest.mark.parametrize("arch", MOE)
def test_moe_builds_are_deterministic(arch: Arch, tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", arch, vocab_size=300, num_layers=1)
    second = build_tiny_model(tmp_path / "b", arch, vocab_size=300, num_layers=1)
    for name in ("model.safetensors", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_cli_shapes_the_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpt_oss"
    main(
        [str(out), "--arch", "gpt_oss", "--vocab-size", "300", "--num-layers", "1"]
        + ["--num-experts", "4", "--top-k", "1", "--moe-intermediate-size", "16"]
    )
    assert capsys.readouterr().out.strip() == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (4, 1)
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, shape in _expected_moe_shapes("gpt_oss", 4, 16).items():
        assert parameters[f"model.layers.0.{name}"] == shape, name


def test_make_tiny_model_passes_the_moe_flags_on(tmp_path: Path) -> None:
    out = tmp_path / "m"
    command = [sys.executable, "-m", "twinkle_async", "make-tiny-model", str(out)]
    options = ["--arch", "qwen3_moe", "--num-experts", "4", "--top-k", "3"]
    subprocess.run(command + options + ["--moe-intermediate-size", "16"], check=True)
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == (
        "qwen3_moe",
        4,
        3,
    )
    assert config.moe_intermediate_size == 16


def _image(seed: int, width: int, height: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


VL_CLASSES = {
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
}


@pytest.mark.parametrize("arch", sorted(VL_CLASSES))
def test_the_vl_archs_are_composites_with_their_image_processor(
    arch: Arch, built: Callable[[Arch], Path]
) -> None:
    """The VL archs load as the real Qwen3.5 checkpoints do: the composite with its vision
    tower and image processor, or its text model alone. An image becomes prod(grid) / 4 image
    tokens between the vision start and end tokens, and changes what the model predicts after
    it; with no image the composite and its text model compute the same logits."""
    composite_class, text_class = VL_CLASSES[arch]
    directory = built(arch)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.convert_tokens_to_ids(VISION_TOKENS) == [3, 4, 5, 6]
    processor = AutoImageProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory)
    assert type(model).__name__ == composite_class
    assert model.config.image_token_id == IMAGE_PAD_ID
    assert model.config.text_config.rope_parameters["mrope_section"] == [2, 1, 1]

    def inputs(seed: int) -> dict[str, torch.Tensor]:
        image = processor(images=[_image(seed, 96, 64)], return_tensors="pt")
        assert image["image_grid_thw"].tolist() == [[1, 4, 6]]  # 64×96 pixels, 16-pixel patches
        n_tokens = int(image["image_grid_thw"].prod()) // 4  # 2×2 patches merged per token
        text = tokenizer("a picture of")["input_ids"]
        ids = torch.tensor(
            [[*text, VISION_START_ID, *[IMAGE_PAD_ID] * n_tokens, VISION_END_ID, *text]]
        )
        return {
            "input_ids": ids,
            "mm_token_type_ids": (ids == IMAGE_PAD_ID).long(),
            "pixel_values": image["pixel_values"],
            "image_grid_thw": image["image_grid_thw"],
        }

    first, second = inputs(1), inputs(2)
    assert int((first["input_ids"] == IMAGE_PAD_ID).sum()) == 6
    logits = model(**first).logits
    assert logits.shape == (1, first["input_ids"].shape[1], len(tokenizer))
    assert (logits[0, -1] - model(**second).logits[0, -1]).abs().max() > 1e-4  # the image counts
    logits.sum().backward()
    assert model.model.visual.patch_embed.proj.weight.grad is not None  # the tower is wired in

    text_ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    text_model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(text_model).__name__ == text_class
    with torch.no_grad():
        torch.testing.assert_close(
            text_model(input_ids=text_ids).logits,
            model(input_ids=text_ids).logits,
            atol=1e-5,
            rtol=0,
        )
