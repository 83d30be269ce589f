"""Tiny configs of the Tinker families beyond Qwen and gpt-oss, for `workers.tiny_model`.

`workers.tiny_model` is the entry point: it trains the tokenizer, asks `family_config` for the
config of one of these archs, initialises the model from a seed, lets `finish_family_model`
fill what the classes leave to a checkpoint, and saves both. Every model here is built from
transformers' own config and model classes, so its module tree is the real family's: the
names below are the ones LoRA targeting matches (`workers/engine/lora.py`).

- `llama`: `LlamaForCausalLM`, dense GQA (one KV head for all the query heads), embeddings
  tied as in Llama-3.2-1B/3B;
- `deepseek_v3`: `DeepseekV3ForCausalLM`, multi-head latent attention (`q_a_proj`, `q_b_proj`,
  `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), layer 0 a dense GLU MLP
  (`first_k_dense_replace` 1, as Kimi-K2), the others MoE: fused experts
  `mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, router `mlp.gate`, one shared
  expert `mlp.shared_experts.{gate,up,down}_proj`;
- `glm_moe_dsa`: `GlmMoeDsaForCausalLM`, the same MLA and MoE plus the DSA indexer
  (`self_attn.indexer.{wq_b,wk,weights_proj}`, no gradient: its top-k is a selection);
  layer 0 dense;
- `deepseek_v4`: `DeepseekV4ForCausalLM` from `DeepseekV4Config` with explicit `layer_types`
  (one sliding-window layer, one compressed sparse (CSA, with its indexer) and one heavily
  compressed (HCA), compression rates 2 and 4 so that a few tokens already compress),
  single-KV MQA (`q_a_proj`, `q_b_proj`, `kv_proj`), the grouped low-rank output
  (`o_a_proj`, `o_b_proj`), attention sinks, hyper-connections (`attn_hc`, `ffn_hc`, 2
  streams), every layer MoE with one shared expert, the first hash-routed (`mlp.gate.tid2eid`,
  filled here with a seeded table of distinct experts per token; the class leaves it zero,
  which would send every token to expert 0 twice). DeepSeek-V4.1 is built the same way;
- `nemotron_h`: `NemotronHForCausalLM` over the block pattern `M*EME` (Mamba2, attention,
  MoE; `num_layers` cuts or extends it), every block `model.layers.N.mixer`: Mamba2
  `in_proj [2·d_inner + 2·groups·state + heads, H]` and `out_proj` (4 heads × 32, 2 groups,
  state 16: the torch fallback runs them), attention `q/k/v/o_proj`, relu² non-gated experts
  `mixer.experts.up_proj [E, I, H]`, `down_proj [E, H, I]` and a shared expert
  `mixer.shared_experts.{up,down}_proj` twice as wide;
- `kimi_k25`: the Kimi-K2.5 composite (`Kimi_K25ForConditionalGeneration`): a one-block vision
  tower (14-pixel patches, 2×2 merge) and projector before a `deepseek_v3` text model, under
  `model.language_model`. transformers has no causal-LM class for it: the worker loads the
  composite with `AutoModelForImageTextToText`, as it loads Qwen3-VL. No image processor is
  written: transformers' `Kimi_K25ImageProcessor` needs torchvision;
- `inkling_mm_model`: Inkling (`InklingForConditionalGeneration`), text model under
  `model.language_model`: layer 0 sliding-window (2 KV heads), the last global (1 KV head),
  each with `q/k/v/o_proj`, the relative-position projection `r_proj` and short convolutions;
  layer 0 a dense MLP (`gate_proj`, `up_proj`, `down_proj`), the others MoE with fused experts
  and two shared experts as a 3-D bank `mlp.shared_experts.{gate,up,down}_proj [2, I, H]`, the
  router scoring them beside the routed ones. Its towers are tiny: audio 8 mel bins; vision
  2-pixel patches of 2 frames and 3 layers, because the tower plans its channels with scipy
  (not installed) unless it has as many layers as scale steps, and its temporal stage (1536
  channels here) widens with the patch: 6144 for 4-pixel patches. Loaded with
  `AutoModelForImageTextToText` (no causal-LM class for the composite); no image processor
  (`InklingImageProcessor` needs torchvision). The tokenizer has no audio tokens:
  `<|video_pad|>` and `<|vision_end|>` stand in for Inkling's audio placeholder and audio start.

Invariants: sizes stay tiny (hidden 64 by default, heads of 32 where the family has heads, MLA
ranks 48 and 32, the caller's experts: 8 of width 48 by default); routers are drawn from the
same normal as the weights (never zero); only the caller's seed decides the weights, so the same
arguments give the same files.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    InklingConfig,
    InklingForConditionalGeneration,
    InklingTextConfig,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

FAMILY_ARCHS = (
    "llama",
    "deepseek_v3",
    "glm_moe_dsa",
    "deepseek_v4",
    "nemotron_h",
    "kimi_k25",
    "inkling_mm_model",
)
FAMILY_MOE_ARCHS = frozenset(FAMILY_ARCHS) - {"llama"}
FAMILY_VL_ARCHS = frozenset({"kimi_k25", "inkling_mm_model"})
# Enough layers that each family shows every kind of block it has: DeepSeek-V4 one of each
# attention kind, Nemotron-H Mamba2, attention and MoE; the others a dense layer and a MoE one.
FAMILY_NUM_LAYERS = {"deepseek_v4": 3, "nemotron_h": 5}

FAMILY_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
    "deepseek_v4": DeepseekV4ForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "kimi_k25": Kimi_K25ForConditionalGeneration,
    "inkling_mm_model": InklingForConditionalGeneration,
}

HEAD_DIM = 32
# MLA: the query and KV ranks differ from each other and from the hidden size, so a weight read
# in the wrong layout fails on its shape; 16 rotary plus 16 non-rotary dims make a 32-wide head.
MLA: dict[str, Any] = dict(
    q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32
)


def _nemotron_blocks(num_layers: int) -> list[str]:
    """The block of each layer, from the checkpoints' pattern letters: Mamba2 (`M`, which
    transformers calls linear attention), attention (`*`) and MoE (`E`). `M*E` first, so that
    three layers already hold every kind, then Mamba2 and MoE alternate as in the real
    patterns (`M*EME` for 5 layers)."""
    blocks = {"M": "linear_attention", "*": "full_attention", "E": "moe"}
    return [blocks[letter] for letter in ("M*E" + "ME" * num_layers)[:num_layers]]


def family_config(
    arch: str,
    *,
    shared: dict[str, Any],
    vision_token_ids: dict[str, int],
    num_layers: int,
    num_experts: int,
    top_k: int,
    moe_intermediate_size: int,
) -> PretrainedConfig:
    """The tiny config of `arch`, one of `FAMILY_ARCHS`.

    `shared` holds what every tiny model has (vocab_size, hidden_size, initializer_range,
    max_position_embeddings, eos and pad ids); `vision_token_ids` the ids of
    `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>` and `<|vision_end|>` for the composites.
    """
    hidden_size = shared["hidden_size"]
    heads = hidden_size // HEAD_DIM  # the caller checks that it divides
    dense_width = 2 * hidden_size
    text: dict[str, Any] = dict(
        **shared, num_hidden_layers=num_layers, bos_token_id=None, tie_word_embeddings=False
    )
    deepseek_moe: dict[str, Any] = dict(
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        n_shared_experts=1,
        # one group: group-limited routing would cap top_k at a group's experts
        n_group=1,
        topk_group=1,
    )
    if arch == "llama":
        return LlamaConfig(
            **{**text, "tie_word_embeddings": True},
            num_attention_heads=heads,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            intermediate_size=dense_width,
        )
    if arch in ("deepseek_v3", "kimi_k25"):
        deepseek_v3 = DeepseekV3Config(
            **text,
            **MLA,
            **deepseek_moe,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=dense_width,
            first_k_dense_replace=1,
        )
        # the real configs' routing; vLLM's class keeps the router's score-correction bias
        # (which transformers' always has) only for this method
        deepseek_v3.topk_method = "noaux_tc"
        if arch == "deepseek_v3":
            return deepseek_v3
        return Kimi_K25Config(
            text_config=deepseek_v3.to_dict(),
            vision_config=dict(
                patch_size=14,
                merge_kernel_size=[2, 2],
                pos_emb_height=8,
                pos_emb_width=8,
                pos_emb_time=2,
                num_attention_heads=2,
                num_hidden_layers=1,
                hidden_size=32,
                intermediate_size=64,
                initializer_range=shared["initializer_range"],
            ),
            projection_hidden_size=32,  # the projector normalises the tower's output
            image_token_id=vision_token_ids["image_token_id"],
            video_token_id=vision_token_ids["video_token_id"],
            vision_start_token_id=vision_token_ids["vision_start_token_id"],
            vision_end_token_id=vision_token_ids["vision_end_token_id"],
            tie_word_embeddings=False,
        )
    if arch == "glm_moe_dsa":
        return GlmMoeDsaConfig(
            **text,
            **MLA,
            **deepseek_moe,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=dense_width,
            first_k_dense_replace=1,
            # the indexer keeps 4 keys per query, so a short input is already sparse
            index_topk=4,
            index_n_heads=2,
            index_head_dim=32,
        )
    if arch == "deepseek_v4":
        kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
        return DeepseekV4Config(
            **text,
            num_attention_heads=heads,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            partial_rotary_factor=0.5,
            q_lora_rank=MLA["q_lora_rank"],
            o_groups=2,
            o_lora_rank=16,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            n_shared_experts=1,
            layer_types=[kinds[i % 3] for i in range(num_layers)],
            mlp_layer_types=["hash_moe"] + ["moe"] * (num_layers - 1),
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            sliding_window=8,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            hc_mult=2,
        )
    if arch == "nemotron_h":
        return NemotronHConfig(
            **{**text, "num_hidden_layers": None},  # the pattern gives the depth
            layers_block_type=_nemotron_blocks(num_layers),
            num_attention_heads=heads,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            intermediate_size=dense_width,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=16,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            moe_shared_expert_intermediate_size=2 * moe_intermediate_size,
        )
    if arch == "inkling_mm_model":
        # Sliding-window layers but the last of every six (here: of the model); the first layer
        # dense when there is more than one.
        period = min(6, num_layers)
        inkling_text = InklingTextConfig(
            **{k: v for k, v in text.items() if k != "tie_word_embeddings"},
            num_attention_heads=heads,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            swa_num_attention_heads=heads,
            swa_num_key_value_heads=2,
            swa_head_dim=HEAD_DIM,
            sliding_window_size=8,
            d_rel=8,
            rel_extent=16,
            local_layer_ids=[i for i in range(num_layers) if (i + 1) % period],
            mlp_layer_types=[
                "dense" if i < min(1, num_layers - 1) else "sparse" for i in range(num_layers)
            ],
            intermediate_size=dense_width,
            moe_intermediate_size=moe_intermediate_size,
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=2,
            # not 1, so that logits computed without the model's muP division are wrong
            logits_mup_width_multiplier=2.0,
        )
        return InklingConfig(
            text_config=inkling_text.to_dict(),
            vision_config=dict(
                patch_size=2,
                temporal_patch_size=2,
                num_hidden_layers=3,
                hidden_size=32,
                num_attention_heads=2,
                initializer_range=shared["initializer_range"],
            ),
            audio_config=dict(
                n_mel_bins=8, mel_vocab_size=16, initializer_range=shared["initializer_range"]
            ),
            image_token_id=vision_token_ids["image_token_id"],
            image_bos_token_id=vision_token_ids["vision_start_token_id"],
            audio_token_id=vision_token_ids["video_token_id"],
            audio_bos_token_id=vision_token_ids["vision_end_token_id"],
        )
    raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(FAMILY_ARCHS)}")


def finish_family_model(arch: str, model: PreTrainedModel) -> None:
    """Fill what the model class leaves to a checkpoint, from the torch RNG the caller seeded:
    DeepSeek-V4's hash routers get a table of `top_k` distinct experts per token id."""
    if arch != "deepseek_v4":
        return
    for name, buffer in model.named_buffers():
        if name.endswith("mlp.gate.tid2eid"):
            vocab_size, top_k = buffer.shape
            num_experts = model.config.n_routed_experts
            table = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(vocab_size)])
            buffer.copy_(table)
