"""Memory per rank of a worker group whose MoE experts are split over its ranks.

Measured: a random Qwen3-MoE on the CPU (hidden 256, 4 layers, 16 experts top-4,
moe_intermediate 512, vocab 4096; its experts split) and a random dense Qwen3 (hidden 512,
4 layers, intermediate 1536, vocab 4096; its decoder linears split), 8 slots of max rank 16, as
groups of N = 1, 2 and 4 ranks (gloo, loopback). Each rank reports the bytes of its frozen base
model, of its adapter bank (weights, gradients, Adam's two moments, fp32) and its resident set.

Planned: the bytes per rank of Qwen3-235B-A22B and Qwen3.5-397B-A17B over 8 GPUs, counted from
their `config.json` (tests/data/moe_configs, shipped; nothing downloaded): the base model in
bf16 (routed experts split 8 ways, everything else whole on every rank), one adapter slot
(`bench/moe_memory.py`'s count, its per-expert factors split 8 ways) and the slots that fit in
a 141 GB GPU after the base model, keeping 10 % for the passes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sharded_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported

from moe_memory import (  # type: ignore[import-not-found]  # noqa: E402
    CONFIGS,
    _attention_per_rank,
    _is_moe_layer,
    _layer_types,
    load,
    slot_bytes,
    text_config,
)

GPUS = 8
GPU_BYTES = 141 * 10**9
RANK = 32
BIG = ("Qwen3-235B-A22B", "Qwen3.5-397B-A17B")
MiB, GB = 2**20, 10**9


# -- measured on the CPU ---------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build the multi-slot model, report its bytes as one JSON line on stdout."""
    import torch

    from workers.engine.collective import Collective
    from workers.engine.model import MultiSlotModel
    from workers.group.runtime import GroupSpec, join, leave

    torch.set_num_threads(1)
    collective: Collective = Collective()
    if args.world > 1:
        collective = join(GroupSpec(args.rank, args.world, port=args.port), torch.device("cpu"))
    engine = MultiSlotModel(str(args.model), max_slots=8, max_rank=16, collective=collective)
    bank = engine.bank.weights
    base = sum(
        p.numel() * p.element_size()
        for name, p in engine.model.named_parameters()
        if "lora_" not in name
    )
    status = Path("/proc/self/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    report = {
        "rank": args.rank,
        "base": base,
        "bank": 4 * bank.numel() * bank.element_size(),  # weights, grads, exp_avg, exp_avg_sq
        "rss": rss_kib * 1024,
    }
    print(json.dumps(report), flush=True)
    if args.world > 1:
        leave()


def build_model(directory: Path, kind: str) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if kind == "dense":
        dense = Qwen3Config(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            tie_word_embeddings=True,
        )
        Qwen3ForCausalLM(dense).save_pretrained(directory)
        return directory
    config = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=512,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def measure(model: Path, world: int) -> list[dict[str, int]]:
    from workers.group.runtime import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--model",
                str(model),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for rank in range(world)
    ]
    reports = []
    for rank in ranks:
        out, _ = rank.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if rank.returncode or not lines:
            raise RuntimeError(f"a rank failed (exit {rank.returncode})")
        reports.append(json.loads(lines[-1]))
    return sorted(reports, key=lambda r: r["rank"])


# -- planned from config.json ----------------------------------------------------------------


def base_params(config: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts' parameters, the language model's other parameters, a vision tower's
    where the checkpoint has one: counted from its blocks)."""
    text = text_config(config)
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    width = int(text.get("moe_intermediate_size") or text["intermediate_size"])
    shared = int(text.get("shared_expert_intermediate_size") or 0)
    routed = other = 0
    other += vocab * hidden * (1 if text.get("tie_word_embeddings") else 2) + hidden
    for layer, kind in enumerate(_layer_types(text)):
        # each projection's in·out; `_attention_per_rank` sums in + out over the same ones
        other += _attention_weights(text, kind) + 2 * hidden
        if _is_moe_layer(text, layer):
            routed += 3 * experts * hidden * width
            other += experts * hidden  # the router
            if shared:
                other += 3 * hidden * shared + hidden  # the shared expert and its gate
        else:
            other += 3 * hidden * int(text["intermediate_size"])
    tower = 0
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        h, inner, depth = int(vision["hidden_size"]), int(vision["intermediate_size"]), 0
        depth = int(vision["depth"])
        merge = int(vision.get("spatial_merge_size", 2)) ** 2
        tower = depth * (4 * h * h + 2 * h * inner) + merge * h * (merge * h + hidden)
    return routed, other, tower


def _attention_weights(text: dict[str, Any], kind: str) -> int:
    hidden = int(text["hidden_size"])
    if kind == "linear_attention":
        key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
        heads = int(text["linear_num_value_heads"])
        value_dim = heads * int(text["linear_value_head_dim"])
        conv = int(text.get("linear_conv_kernel_dim", 4)) * (2 * key_dim + value_dim)
        projections = hidden * (2 * key_dim + 2 * value_dim + 2 * heads) + value_dim * hidden
        return projections + conv + 2 * heads + int(text["linear_value_head_dim"])  # + norm
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv = int(text.get("num_key_value_heads") or heads) * head_dim
    q_out = heads * head_dim * (2 if text.get("attn_output_gate") else 1)
    return hidden * (q_out + 2 * kv) + heads * head_dim * hidden + 2 * head_dim


def adapter_per_rank(config: dict[str, Any]) -> tuple[int, int]:
    """(per-expert factors, every other factor) of one adapter per unit of LoRA rank."""
    text = text_config(config)
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    width = int(text.get("moe_intermediate_size") or text["intermediate_size"])
    shared = int(text.get("shared_expert_intermediate_size") or 0)
    per_expert = other = 0
    for layer, kind in enumerate(_layer_types(text)):
        other += _attention_per_rank(text, kind)
        if _is_moe_layer(text, layer):
            per_expert += 3 * experts * width
            other += 3 * hidden + (3 * (hidden + shared) if shared else 0)
        else:
            other += 3 * (hidden + int(text["intermediate_size"]))
    return per_expert, other + hidden + vocab


def planned() -> str:
    header = (
        f"{'model':<19}{'base GB':>9}{f'base/rank GB (N={GPUS})':>23}"
        f"{f'slot r={RANK} GB':>14}{'slot/rank GB':>14}{'slots/GPU':>11}"
    )
    lines = [header, "-" * len(header)]
    for name in BIG:
        _, config = load(CONFIGS / name)
        routed, text, tower = base_params(config)
        other = text + tower
        per_expert, whole = adapter_per_rank(config)
        base_rank = (routed / GPUS + other) * 2
        slot = slot_bytes((per_expert + whole) * RANK)
        slot_rank = slot_bytes(int((per_expert / GPUS + whole) * RANK))
        slots = int((GPU_BYTES * 0.9 - base_rank) // slot_rank)
        lines.append(
            f"{name:<19}{(routed + other) * 2 / GB:>9.0f}{base_rank / GB:>23.1f}"
            f"{slot / GB:>14.2f}{slot_rank / GB:>14.2f}{slots:>11}"
        )
    lines.append(
        f"bf16 base, fp32 adapter (weights, grads, Adam m, v); {GPU_BYTES / GB:.0f} GB per GPU,"
        " 10 % kept for the passes"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'model':<7}{'N':>3}{'rank':>6}{'base MiB':>10}{'bank MiB':>10}{'RSS MiB':>9}")
        for kind in ("moe", "dense"):
            model = build_model(Path(tmp) / kind, kind)
            for world in (1, 2, 4):
                for report in measure(model, world):
                    print(
                        f"{kind:<7}{world:>3}{report['rank']:>6}{report['base'] / MiB:>10.1f}"
                        f"{report['bank'] / MiB:>10.1f}{report['rss'] / MiB:>9.0f}",
                        flush=True,
                    )
    print()
    print(planned())


if __name__ == "__main__":
    main()
