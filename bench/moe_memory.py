"""Bytes of one adapter slot on real MoE models, counted from their `config.json`.

A slot holds, per adapter parameter, four fp32 values: the weight, its gradient and Adam's two
moments (16 bytes). The parameters are those of Tinker's "shared-outer" MoE LoRA, per unit of
rank r:
- mlp: per MoE layer 3·(H + E·I) for the routed experts (gate and up: A [r, H] shared, B
  [E, I, r]; down: A [E, r, I], B [H, r] shared), plus ordinary LoRA (in + out) on the three
  linears of a shared expert, or of a dense MLP layer;
- attn: ordinary LoRA on every attention projection (q, k, v, o of full and sliding attention;
  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj of Qwen3.5's linear attention);
- unembed: ordinary LoRA on lm_head, H + vocab.
The router (`mlp.gate`, `mlp.router`), Qwen3.5's `shared_expert_gate` and the embedding are not
trained. The MLP counts reproduce Tinker's published per-rank figures; the bench checks them for
the shipped configs (tests/data/moe_configs) before printing.

Only reads JSON: no torch needed.

    .venv/bin/python bench/moe_memory.py [CONFIG_JSON_OR_DIR ...]   # default: the shipped three
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "moe_configs"
MODELS = ("Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b")
# Tinker's per-rank MLP counts (tinker-cookbook `get_lora_param_count`), which the count of the
# shipped configs must reproduce exactly.
TINKER_MLP_PER_RANK = {
    "Qwen3-30B-A3B": 14_450_688,  # 48·3·(2048 + 128·768)
    "Qwen3.5-35B-A3B": 16_281_600,  # 40·(3·(2048 + 256·512) + 3·(2048 + 512))
    "gpt-oss-20b": 6_842_880,  # 24·3·(2880 + 32·2880)
}
RANKS = (8, 32)
BUFFERS_PER_PARAM = 4  # weight, gradient, Adam's first and second moments
BYTES_PER_VALUE = 4  # fp32
GiB = 2**30


@dataclass(frozen=True)
class PerRank:
    """Adapter parameters per unit of LoRA rank, by layer group (the engine's group names)."""

    attn: int
    mlp: int
    unembed: int

    @property
    def total(self) -> int:
        return self.attn + self.mlp + self.unembed


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` of a multimodal checkpoint, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _layer_types(text: dict[str, Any]) -> list[str]:
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None and "full_attention_interval" in text:
        interval = int(text["full_attention_interval"])
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
    types = types or ["full_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"{len(types)} layer_types for {layers} layers")
    return [str(kind) for kind in types]


def _attention_per_rank(text: dict[str, Any], kind: str) -> int:
    """Σ (in + out) over one layer's attention projections."""
    hidden = int(text["hidden_size"])
    if kind == "linear_attention":  # Qwen3.5's gated DeltaNet
        key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
        value_heads = int(text["linear_num_value_heads"])
        value_dim = value_heads * int(text["linear_value_head_dim"])
        qkv, z, b, a = 2 * key_dim + value_dim, value_dim, value_heads, value_heads
        return sum(hidden + out for out in (qkv, z, b, a)) + (value_dim + hidden)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_dim = int(text.get("num_key_value_heads") or heads) * head_dim
    # Qwen3.5's gated attention: q_proj also emits the output gate, doubling its rows.
    q_out = heads * head_dim * (2 if text.get("attn_output_gate") else 1)
    return (hidden + q_out) + 2 * (hidden + kv_dim) + (heads * head_dim + hidden)


def _is_moe_layer(text: dict[str, Any], layer: int) -> bool:
    # Qwen3-MoE's rule; configs without these fields (gpt-oss, Qwen3.5) are sparse everywhere.
    step = int(text.get("decoder_sparse_step") or 1)
    return layer not in (text.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def lora_params_per_rank(config: dict[str, Any]) -> PerRank:
    """Parameters of one slot's adapter per unit of rank, from a checkpoint's `config.json`."""
    text = text_config(config)
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    if experts < 1:
        raise ValueError("not a MoE config: no num_experts / num_local_experts")
    # gpt-oss has no dense MLP: its `intermediate_size` is the experts' width.
    expert_width = int(text.get("moe_intermediate_size") or text["intermediate_size"])
    shared_width = int(text.get("shared_expert_intermediate_size") or 0)
    attn = mlp = 0
    for layer, kind in enumerate(_layer_types(text)):
        attn += _attention_per_rank(text, kind)
        if _is_moe_layer(text, layer):
            mlp += 3 * (hidden + experts * expert_width)
            if shared_width:
                mlp += 3 * (hidden + shared_width)
        else:
            mlp += 3 * (hidden + int(text["intermediate_size"]))
    return PerRank(attn=attn, mlp=mlp, unembed=hidden + vocab)


def slot_bytes(params: int) -> int:
    """Bytes one slot holds for `params` adapter parameters: fp32 weights, grads, Adam m and v."""
    return params * BUFFERS_PER_PARAM * BYTES_PER_VALUE


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """(name, config) of a `config.json` or of the directory that holds one."""
    file = path / "config.json" if path.is_dir() else path
    name = file.parent.name
    return name, json.loads(file.read_text())


def check_tinker_counts(counts: dict[str, PerRank]) -> None:
    """Fail loudly if a shipped model's MLP count disagrees with Tinker's published one."""
    for name, expected in TINKER_MLP_PER_RANK.items():
        if name in counts and counts[name].mlp != expected:
            raise AssertionError(
                f"{name}: {counts[name].mlp:,} MLP params per rank, Tinker has {expected:,}"
            )


def table(counts: dict[str, PerRank]) -> str:
    header = f"{'model':<17}{'per rank: mlp':>15}{'all groups':>13}"
    for rank in RANKS:
        header += f"{f'r={rank}: params':>16}{'bytes/slot':>17}{'GiB':>7}"
    lines = [header, "-" * len(header)]
    for name, per_rank in counts.items():
        line = f"{name:<17}{per_rank.mlp:>15,}{per_rank.total:>13,}"
        for rank in RANKS:
            params = per_rank.total * rank
            line += f"{params:>16,}{slot_bytes(params):>17,}{slot_bytes(params) / GiB:>7.2f}"
        lines.append(line)
    lines.append(
        "slot = adapter on every group (attn, mlp, unembed); bytes = params · 4 fp32 buffers "
        "(weights, grads, Adam m, v) · 4 B"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "configs", nargs="*", type=Path, default=[CONFIGS / name for name in MODELS]
    )
    args = parser.parse_args(argv)
    counts = {name: lora_params_per_rank(config) for name, config in map(load, args.configs)}
    check_tinker_counts(counts)
    print(table(counts))


if __name__ == "__main__":
    main()
