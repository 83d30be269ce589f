"""Merged passes against one pass per tenant on a Mixture-of-Experts model (the model alone).

The same side-by-side run as `bench/engine_merge.py` (N = 1, 2, 4, 8, 16 tenants; 1×32 and 4×128
tokens; merged call + fused step, N separate calls, one tenant with the same tokens), on a random
MoE model of `--arch`, rank-16 adapters on every layer group (the experts' shared-outer LoRA
included), one torch thread, fp32. Every arch has hidden 256, 16 routed experts top-4 of width
128, vocab 4096 and four MoE layers (`--num-layers` changes the depth):
- `qwen3_moe` (default): Qwen3-MoE, 4 layers, all MoE, 8 query / 4 KV heads of 32;
- `deepseek_v3`: DeepSeek-V3 as `workers.tiny_families` builds it, 5 layers: multi-head latent
  attention (8 heads, the tiny query/KV ranks 48 and 32), layer 0 a dense GLU MLP
  (`first_k_dense_replace` 1), the others MoE with one shared expert of width 128;
- `nemotron_h`: Nemotron-H, 9 blocks `M*EMEMEME` (Mamba2, one attention block, four MoE blocks
  of relu² non-gated experts and a shared expert of width 256). Its rows are padded, not packed
  (a recurrent mixer).

It then prints what the experts' LoRA costs, for the same tokens:
- N tenants' full adapters (the model's shared pass);
- one tenant whose adapter leaves the MLP alone (`train_mlp=False`: the experts run the stock
  transformers module);
- the base model with no adapter at all: the same packed rows through the model, the summed
  cross-entropy and its backward to the input embeddings (so every layer's backward runs).

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_merge.py [--repeats 5] [--token-budget N]
        [--skip-merge] [--max-slots 17] [--adapters full|experts]
        [--arch qwen3_moe|deepseek_v3|nemotron_h] [--num-layers N]

`--adapters experts` gives the tenants MLP-only adapters (`train_attn=False,
train_unembed=False`): the pass's LoRA is then the experts' alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from engine_merge import (  # type: ignore[import-not-found]
    Trainer,
    compare,
    paired,
    request,
    turns,
)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from protocol.api import LoraConfig
from protocol.tensors import FwdBwdRequest
from workers.engine.passes import tune_malloc
from workers.tiny_families import FAMILY_MODEL_CLASSES, family_config, finish_family_model
from workers.tiny_model import EOS_ID, PAD_ID
from workers.trainer.calibration import measure

HIDDEN, EXPERTS, TOP_K, MOE_WIDTH = 256, 16, 4, 128
# Decoder layers by arch, four MoE layers each: DeepSeek-V3's first layer is dense, and
# Nemotron-H's pattern `M*EMEMEME` puts a MoE block after every Mamba2 block but the first.
NUM_LAYERS = {"qwen3_moe": 4, "deepseek_v3": 5, "nemotron_h": 9}
ARCH_NAMES = {"qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3", "nemotron_h": "Nemotron-H"}


def build_model(directory: Path, arch: str, vocab: int, num_layers: int) -> Path:
    """Save a random model of `arch` in `directory`: Qwen3-MoE here, the other families from
    `workers.tiny_families` at the same widths (the family's own classes and module names)."""
    if arch != "qwen3_moe":
        config = family_config(
            arch,
            shared=dict(
                vocab_size=vocab,
                hidden_size=HIDDEN,
                max_position_embeddings=32768,
                initializer_range=0.1,  # as below: routers with some range
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            ),
            vision_token_ids={},  # text-only families
            num_layers=num_layers,
            num_experts=EXPERTS,
            top_k=TOP_K,
            moe_intermediate_size=MOE_WIDTH,
        )
        torch.manual_seed(0)
        model = FAMILY_MODEL_CLASSES[arch](config)
        with torch.no_grad():
            finish_family_model(arch, model)
        model.save_pretrained(directory)
        return directory
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=MOE_WIDTH,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        initializer_range=0.1,  # a router with some range: tokens spread over the experts
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def no_adapter_pass(engine: Trainer, batch: list[tuple[str, FwdBwdRequest]]) -> None:
    """The base model's forward and backward over the same rows, with no adapter."""
    tokens = torch.tensor(np.stack([d.tokens for _, req in batch for d in req.datums]))
    targets = torch.tensor(
        np.stack([d.inputs["target_tokens"] for _, req in batch for d in req.datums])
    )
    embeddings = engine.model.model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    logits = engine.model.model(inputs_embeds=embeddings).logits
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
    )
    loss.backward()  # type: ignore[no-untyped-call]


def expert_cost(engine: Trainer, vocab: int, repeats: int) -> None:
    print(
        f"{'size':>6} {'N':>3} {'N adapters s':>13} {'no expert LoRA s':>17}"
        f" {'no adapter s':>13} {'vs no expert LoRA':>18} {'vs no adapter':>14}"
    )
    for name, (datums, length) in {"1x32": (1, 32), "4x128": (4, 128)}.items():
        for n in (1, 4, 16):
            batch = [(f"t{i}", request(f"t{i}", datums, length, vocab, i)) for i in range(n)]
            attention_only = [("base", req) for _, req in batch]
            times = turns(
                {
                    "adapters": lambda b=batch: engine.forward_backward(b),
                    "attention": lambda b=attention_only: engine.forward_backward(b),
                    "none": lambda b=batch: no_adapter_pass(engine, b),
                },
                repeats,
            )
            t = {mode: statistics.median(values) for mode, values in times.items()}
            print(
                f"{name:>6} {n:>3} {t['adapters']:>13.4f} {t['attention']:>17.4f}"
                f" {t['none']:>13.4f} {paired(times, 'adapters', 'attention'):>17.2f}x"
                f" {paired(times, 'adapters', 'none'):>13.2f}x",
                flush=True,
            )


def blocks(engine: Trainer) -> str:
    """How many of the model's layers are MoE layers, read from the built model's experts."""
    config = engine.model.model.config
    moe = sum(1 for name, _ in engine.model.model.named_modules() if name.endswith(".experts"))
    pattern = getattr(config, "layers_block_type", None)
    kinds = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}
    shown = f", pattern {''.join(kinds.get(b, '?') for b in pattern)}" if pattern else ""
    return f"{moe} MoE{shown}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arch", choices=tuple(NUM_LAYERS), default="qwen3_moe")
    parser.add_argument(
        "--num-layers", type=int, default=None, help="decoder layers (default: four MoE layers)"
    )
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--skip-merge", action="store_true", help="only the expert LoRA cost")
    parser.add_argument(
        "--adapters",
        choices=("full", "experts"),
        default="full",
        help="the tenants' adapters: every layer group, or the experts (MLP) alone",
    )
    parser.add_argument(
        "--max-slots", type=int, default=17, help="the adapter bank's slots (a worker's: 64)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    tune_malloc()  # as the worker does
    with tempfile.TemporaryDirectory() as tmp:
        layers = args.num_layers or NUM_LAYERS[args.arch]
        model = build_model(Path(tmp), args.arch, args.vocab, layers)
        engine = Trainer.build(str(model), max_slots=args.max_slots, max_rank=16)
        if args.token_budget is None:
            found = measure(engine.model)
            engine.model.pass_tokens = found.pass_tokens
            curve = ", ".join(f"{size}: {rate:.0f}" for size, rate in found.curve)
            print(f"measured pass size {found.pass_tokens} tokens (tokens/s by size: {curve})")
        else:
            engine.model.pass_tokens = args.token_budget
        experts_only = args.adapters == "experts"
        for i in range(16):
            engine.residency.create(
                f"t{i}",
                LoraConfig(
                    rank=16, seed=i, train_attn=not experts_only, train_unembed=not experts_only
                ),
            )
        engine.residency.create("base", LoraConfig(rank=16, seed=99, train_mlp=False))
        print(
            f"random {ARCH_NAMES[args.arch]} hidden {HIDDEN}, {layers} layers"
            f" ({blocks(engine)}), {EXPERTS} experts top-{TOP_K}, moe_intermediate {MOE_WIDTH},"
            f" vocab {args.vocab}, rank 16 ({args.adapters} adapters),"
            f" {torch.get_num_threads()} thread,"
            f" median of {args.repeats} turns (a ratio: of each turn's own)",
            flush=True,
        )
        if not args.skip_merge:
            compare(engine, args.vocab, args.repeats)
        expert_cost(engine, args.vocab, args.repeats)


if __name__ == "__main__":
    main()
