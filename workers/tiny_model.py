"""Build a tiny random-init causal LM and its tokenizer, fully offline, for tests and demos.

No hub access and no download: the tokenizer is a byte-level BPE trained with the `tokenizers`
library on a corpus generated here from a fixed seed, and the model is freshly initialised in one
of these architectures:
- `qwen3`: dense Qwen3;
- `qwen3_5`: the dense Qwen3.5 text model, which mixes linear- and full-attention layers;
- `qwen3_moe`: Qwen3-MoE, every layer sparse, experts fused as `mlp.experts.gate_up_proj
  [E, 2I, H]` and `down_proj [E, H, I]`, router `mlp.gate`;
- `qwen3_5_moe`: the Qwen3.5-MoE text model, the same mixed layers and fused experts plus a
  shared expert (`mlp.shared_expert`, gated by `mlp.shared_expert_gate`);
- `gpt_oss`: gpt-oss, experts fused as `gate_up_proj [E, H, 2I]` (gate and up interleaved) and
  `down_proj [E, I, H]` with biases, router `mlp.router`, attention sinks;
- `qwen3_5_vl`: the Qwen3.5 vision-language composite (`Qwen3_5ForConditionalGeneration`): a
  one-block vision tower (patch 16, 2×2 merge, as the real models) before the `qwen3_5` text
  model, multimodal RoPE, and its image processor (`preprocessor_config.json`);
- `qwen3_5_moe_vl`: the Qwen3.5-MoE composite (`Qwen3_5MoeForConditionalGeneration`), the same
  tower before the `qwen3_5_moe` text model, as the real Qwen3.5-35B-A3B checkpoints are;
- `qwen3_vl`: the Qwen3-VL composite (`Qwen3VLForConditionalGeneration`): a two-block tower
  whose "deepstack" features also enter the first two decoder layers, before a Qwen3 decoder
  with multimodal RoPE. transformers has no causal-LM class for its text model alone: it
  loads with `AutoModelForImageTextToText`;
- `qwen3_vl_moe`: the same with a Qwen3-MoE decoder (fused experts in every layer), as
  Qwen3-VL-30B-A3B is;
- `llama`, `deepseek_v3`, `glm_moe_dsa`, `deepseek_v4`, `nemotron_h`, `kimi_k25` and
  `inkling_mm_model`: the other families of the Tinker lineup, built in
  `workers.tiny_families` (whose docstring lists each one's modules). `kimi_k25` is the
  Kimi-K2.5 composite over a DeepSeek-V3 text model, `inkling_mm_model` Inkling; neither
  writes an image processor (transformers' need torchvision).
All but the composites without a causal-LM class (Qwen3-VL, Kimi-K2.5, Inkling) load with
`AutoModelForCausalLM.from_pretrained(dir)`, those with `AutoModelForImageTextToText`, and all
with `AutoTokenizer.from_pretrained(dir)`, exactly like a real checkpoint, which is what the
trainer, the samplers and the SDK's `get_tokenizer()` do (a composite loads its text model so);
the Qwen VL ones also with `AutoModelForImageTextToText` and `AutoImageProcessor`.

Invariants: the same arguments give the same files; special tokens are `<|endoftext|>` = 0 (pad),
`<|im_start|>` = 1 and `<|im_end|>` = 2 (eos), and in a VL tokenizer `<|vision_start|>`,
`<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>` = 3, 4, 5, 6; the model's `vocab_size` equals
the tokenizer's length, so every id the tokenizer produces is a valid model input. `head_dim` is
32, a size vLLM's CPU attention supports. `num_layers` defaults to 2, or to the depth that shows
every block kind of a family (`workers.tiny_families.FAMILY_NUM_LAYERS`). The MoE routers start
from random (not zero) weights, so a short random input already spreads its tokens over several
experts of every layer.

Run as `python -m workers.tiny_model DIR [--arch ARCH] [--num-experts E] [--top-k K]
[--moe-intermediate-size I]`; it prints DIR.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLTextConfig,
)
from transformers.models.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5_moe import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)
from transformers.models.qwen3_vl_moe import (
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeTextConfig,
)
from transformers.utils import logging as transformers_logging

from workers.tiny_families import (
    FAMILY_MODEL_CLASSES,
    FAMILY_NUM_LAYERS,
    family_config,
    finish_family_model,
)

Arch = Literal[
    "qwen3",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_5_moe",
    "gpt_oss",
    "qwen3_5_vl",
    "qwen3_5_moe_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llama",
    "deepseek_v3",
    "glm_moe_dsa",
    "deepseek_v4",
    "nemotron_h",
    "kimi_k25",
    "inkling_mm_model",
]
ARCHS: tuple[Arch, ...] = get_args(Arch)
MOE_ARCHS: frozenset[Arch] = frozenset(
    {
        "qwen3_moe",
        "qwen3_5_moe",
        "gpt_oss",
        "qwen3_5_moe_vl",
        "qwen3_vl_moe",
        "deepseek_v3",
        "glm_moe_dsa",
        "deepseek_v4",
        "nemotron_h",
        "kimi_k25",
        "inkling_mm_model",
    }
)
VL_ARCHS: frozenset[Arch] = frozenset(
    {"qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_vl", "qwen3_vl_moe", "kimi_k25", "inkling_mm_model"}
)
# The VL archs whose image processor is written beside the model (the others' need torchvision)
_QWEN_VL_ARCHS = frozenset(arch for arch in VL_ARCHS if arch.startswith("qwen"))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = 3, 4, 5, 6
# The real models' vision geometry: 16-pixel patches, 2×2 of them merged into one token, two
# frames per temporal patch (a still image is repeated). Images are resized to between 4 and
# 1024 tokens here.
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
MIN_IMAGE_PIXELS, MAX_IMAGE_PIXELS = 4 * 32 * 32, 1024 * 32 * 32
HEAD_DIM = 32
CONTEXT_LENGTH = 4096
# Tiny MoE defaults: enough experts that routing is a real choice, few enough to stay fast. The
# expert width is chosen so that I, 2I and the hidden size 64 all differ: a fused expert tensor
# read in the wrong layout then fails on its shape instead of passing by coincidence.
NUM_EXPERTS, TOP_K, MOE_INTERMEDIATE_SIZE = 8, 2, 48

_MODEL_CLASSES: dict[Arch, type[PreTrainedModel]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "qwen3_5_vl": Qwen3_5ForConditionalGeneration,
    "qwen3_5_moe_vl": Qwen3_5MoeForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
    "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
    **FAMILY_MODEL_CLASSES,  # type: ignore[dict-item]  # its keys are Arch names
}

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find user assistant "
    "system model train loss step sample token weight answer question hello world yes"
).split()
_ROLES = ("system", "user", "assistant")


def _corpus(lines: int = 4000) -> list[str]:
    """A fixed training text: English words, pseudo-words, numbers, punctuation and chat turns.

    Pseudo-words from random syllables give the BPE enough distinct pairs to reach a few
    thousand merges; the fixed seed makes the trained vocabulary identical on every build.
    """
    rng = random.Random(20261129)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu"]
    pseudo = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    text: list[str] = []
    for i in range(lines):
        words = [
            rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(pseudo)
            for _ in range(rng.randint(3, 14))
        ]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 5))))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":", ""])
        text.append(f"{_ROLES[i % 3]}\n{line}\n" if i % 5 == 0 else line)
    return text


def build_tokenizer(vocab_size: int, *, vision: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab_size` tokens (fewer if the corpus runs out of merges);
    `vision`: with the four vision special tokens after the three others."""
    specials = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    least = len(specials) + 256  # every byte is a token, so any text round-trips
    if vocab_size < least:
        raise ValueError(
            f"vocab_size must be at least {least} ({len(specials)} special tokens + 256 bytes)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,  # first, so they get ids 0, 1, 2 (, 3, 4, 5, 6)
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hybrid_layer_types(num_layers: int) -> list[str]:
    # Qwen3.5 puts one full-attention layer after every three linear-attention (gated DeltaNet)
    # layers; a shorter period keeps both kinds present in a 2-layer model.
    period = min(4, num_layers)
    return [
        "full_attention" if (i + 1) % period == 0 else "linear_attention" for i in range(num_layers)
    ]


_VISION_TOKEN_IDS: dict[str, Any] = dict(
    image_token_id=IMAGE_PAD_ID,
    video_token_id=VIDEO_PAD_ID,
    vision_start_token_id=VISION_START_ID,
    vision_end_token_id=VISION_END_ID,
)


def _tower(hidden_size: int, **options: Any) -> dict[str, Any]:
    """A tiny vision tower's config with the real geometry (16-pixel patches, 2×2 merge, two
    frames per temporal patch), its output as wide as the text model, an 8×8 grid of position
    embeddings interpolated to each image's; `options` override."""
    return {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": hidden_size,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "num_position_embeddings": 64,
        "initializer_range": 0.1,
        **options,
    }


def _config(
    arch: Arch,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    moe_intermediate_size: int,
) -> PretrainedConfig:
    if hidden_size % HEAD_DIM or hidden_size < HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}")
    if num_layers < 1:
        raise ValueError("num_layers must be at least 1")
    heads = hidden_size // HEAD_DIM
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        # Wider than the usual 0.02 so that a random model's logits have some range: with tiny
        # embeddings a LoRA on attention/MLP alone can barely move the output distribution.
        # The MoE routers are drawn from the same normal, which is what spreads the tokens.
        initializer_range=0.1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    linear_attention: dict[str, Any] = dict(
        layer_types=_hybrid_layer_types(num_layers),
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
    )
    moe: dict[str, Any] = dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
    )
    if arch in FAMILY_MODEL_CLASSES:
        return family_config(
            arch,
            shared={
                key: common[key]
                for key in (
                    "vocab_size",
                    "hidden_size",
                    "max_position_embeddings",
                    "initializer_range",
                    "eos_token_id",
                    "pad_token_id",
                )
            },
            vision_token_ids=_VISION_TOKEN_IDS,
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=moe_intermediate_size,
        )
    if arch == "qwen3":
        return Qwen3Config(**common, intermediate_size=2 * hidden_size)
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, intermediate_size=2 * hidden_size, **linear_attention)
    if arch == "qwen3_moe":
        # Every layer sparse, as in Qwen3-30B-A3B; routing weights renormalised over the top-k.
        return Qwen3MoeConfig(
            **common, **moe, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True
        )
    if arch == "qwen3_5_moe":
        # The real models use the same width for the shared and the routed experts; a different
        # one here makes a test fail if code mixes the two up.
        return Qwen3_5MoeTextConfig(
            **common,
            **moe,
            **linear_attention,
            shared_expert_intermediate_size=2 * moe_intermediate_size,
        )
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        # Qwen3-VL: a plain Qwen3 decoder with multimodal RoPE over the whole head (16
        # frequency pairs, interleaved), and a tower whose deepstack mergers feed the features
        # of its blocks 0 and 1 into the first two decoder layers
        text_options: dict[str, Any] = dict(
            **{k: v for k, v in common.items() if k != "tie_word_embeddings"},
            intermediate_size=2 * hidden_size,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        )
        if arch == "qwen3_vl_moe":  # every layer sparse, as in Qwen3-VL-30B-A3B
            qwen3_vl_text: PretrainedConfig = Qwen3VLMoeTextConfig(
                **text_options, **moe, decoder_sparse_step=1, mlp_only_layers=[]
            )
        else:
            qwen3_vl_text = Qwen3VLTextConfig(**text_options)
        vl_composite = Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else Qwen3VLConfig
        return vl_composite(
            text_config=qwen3_vl_text.to_dict(),
            vision_config=_tower(hidden_size, depth=2, deepstack_visual_indexes=[0, 1]),
            **_VISION_TOKEN_IDS,
            tie_word_embeddings=True,
        )
    if arch in VL_ARCHS:
        text: PretrainedConfig
        if arch == "qwen3_5_moe_vl":
            text = Qwen3_5MoeTextConfig(
                **common,
                **moe,
                **linear_attention,
                shared_expert_intermediate_size=2 * moe_intermediate_size,
            )
        else:
            text = Qwen3_5TextConfig(
                **common, intermediate_size=2 * hidden_size, **linear_attention
            )
        # multimodal RoPE over (time, height, width), interleaved as in the real config; its
        # sections cover the rotary frequencies: a quarter of head_dim 32 rotates, 4 pairs
        text.rope_parameters = {
            **(text.rope_parameters or {}),
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        vision = _tower(hidden_size, depth=1)
        composite = Qwen3_5MoeConfig if arch == "qwen3_5_moe_vl" else Qwen3_5Config
        return composite(
            text_config=text.to_dict(),
            vision_config=vision,
            **_VISION_TOKEN_IDS,
            tie_word_embeddings=True,
        )
    if arch == "gpt_oss":
        # gpt-oss has no dense MLP: `intermediate_size` is each expert's width. Layers alternate
        # sliding-window (128) and full attention as in the real model. Plain RoPE instead of
        # the real YaRN (factor 32 over 4096 positions), which would claim a 131072-token
        # context for a model whose tokenizer stops at 4096. No attention implementation is
        # set: transformers refuses SDPA for gpt-oss (it would drop the sinks) and loads it
        # with the eager kernel, which applies the sinks and runs on a CPU in fp32.
        return GptOssConfig(
            **common,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            intermediate_size=moe_intermediate_size,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")


def build_tiny_model(
    directory: Path,
    arch: Arch = "qwen3",
    *,
    hidden_size: int = 64,
    num_layers: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    num_experts: int | None = None,
    top_k: int | None = None,
    moe_intermediate_size: int | None = None,
) -> Path:
    """Write a tiny random-init causal LM and its tokenizer into `directory`; return it.

    `num_experts`, `top_k` and `moe_intermediate_size` shape the MoE archs (default
    `NUM_EXPERTS`, `TOP_K`, `MOE_INTERMEDIATE_SIZE`) and are refused for the dense ones.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    moe_options = (num_experts, top_k, moe_intermediate_size)
    if arch not in MOE_ARCHS and any(option is not None for option in moe_options):
        raise ValueError(
            f"num_experts, top_k and moe_intermediate_size apply to the MoE archs "
            f"({', '.join(sorted(MOE_ARCHS))}), not to {arch!r}"
        )
    num_experts = NUM_EXPERTS if num_experts is None else num_experts
    top_k = TOP_K if top_k is None else top_k
    moe_intermediate_size = (
        MOE_INTERMEDIATE_SIZE if moe_intermediate_size is None else moe_intermediate_size
    )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), not {top_k}")
    if moe_intermediate_size < 1:
        raise ValueError("moe_intermediate_size must be at least 1")
    if num_layers is None:
        num_layers = FAMILY_NUM_LAYERS.get(arch, 2)
    directory = Path(directory)
    tokenizer = build_tokenizer(vocab_size, vision=arch in VL_ARCHS)
    config = _config(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate_size,
    )
    # A private RNG scope: building a model must not disturb the caller's torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[arch](config)
        with torch.no_grad():
            finish_family_model(arch, model)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if arch in _QWEN_VL_ARCHS:
        # the Pillow processor: the same maths as the torchvision one, which needs torchvision
        Qwen2VLImageProcessorPil(
            patch_size=PATCH_SIZE,
            merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            min_pixels=MIN_IMAGE_PIXELS,
            max_pixels=MAX_IMAGE_PIXELS,
        ).save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.tiny_model",
        description="Build a tiny offline causal LM (or vision-language model) and tokenizer.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument(
        "--num-layers", type=int, help="decoder layers (default 2; deepseek_v4 3, nemotron_h 5)"
    )
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    moe = parser.add_argument_group(f"MoE archs ({', '.join(a for a in ARCHS if a in MOE_ARCHS)})")
    moe.add_argument("--num-experts", type=int, help=f"routed experts (default {NUM_EXPERTS})")
    moe.add_argument("--top-k", type=int, help=f"experts per token (default {TOP_K})")
    moe.add_argument(
        "--moe-intermediate-size",
        type=int,
        help=f"width of each expert (default {MOE_INTERMEDIATE_SIZE})",
    )
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    path = build_tiny_model(
        args.directory,
        args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        seed=args.seed,
        num_experts=args.num_experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
    )
    print(path)


if __name__ == "__main__":
    main()
