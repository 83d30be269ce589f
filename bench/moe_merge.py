"""Merged passes against one pass per tenant on a Mixture-of-Experts model (the model alone).

The same side-by-side run as `bench/engine_merge.py` (N = 1, 2, 4, 8, 16 tenants; 1×32 and 4×128
tokens; merged call + fused step, N separate calls, one tenant with the same tokens), on a random
Qwen3-MoE: hidden 256, 4 layers, 16 experts top-4, moe_intermediate 128, vocab 4096, rank-16
adapters on every layer group (the experts' shared-outer LoRA included), one torch thread, fp32.

It then prints what the experts' LoRA costs, for the same tokens:
- N tenants' full adapters (the model's shared pass);
- one tenant whose adapter leaves the MLP alone (`train_mlp=False`: the experts run the stock
  transformers module);
- the base model with no adapter at all: the same packed rows through the model, the summed
  cross-entropy and its backward to the input embeddings (so every layer's backward runs).

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe_merge.py [--repeats 5] [--token-budget N]
        [--skip-merge] [--max-slots 17] [--adapters full|experts]

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
from workers.trainer.calibration import measure


def build_model(directory: Path, vocab: int) -> Path:
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=4,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
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
        model = build_model(Path(tmp), args.vocab)
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
            f"random Qwen3-MoE hidden 256, 4 layers, 16 experts top-4, moe_intermediate 128,"
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
