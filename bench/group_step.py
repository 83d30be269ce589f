"""A worker group's step against one device's: tokens/s, and the share of the step its
collectives take, for a dense model (frozen linears gathered) and a MoE model (experts split).

Each group of N ranks (gloo on the CPU, loopback; NCCL with `--device cuda`, rank r on cuda:r)
builds the engine and runs the same call: 4 tenants of rank 16, 2 datums of 128 tokens each,
one shared forward_backward and one fused optim_step, timed over `--repeats` (median, after a
warm-up). Every collective the engine makes is timed, and the bytes of what it hands rank 0
(the reduced or gathered tensors) counted: `MB/rank`.

Models (random, fp32 on the CPU, bf16 on GPUs):
- dense: Qwen3, hidden 512, 4 layers, intermediate 1536, vocab 4096;
- moe: Qwen3-MoE, hidden 256, 4 layers, 16 experts top-4, moe_intermediate 512, vocab 4096.

    OMP_NUM_THREADS=1 .venv/bin/python bench/group_step.py [--devices 1 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_merge import Trainer, request  # type: ignore[import-not-found]  # noqa: E402

TENANTS, DATUMS, LENGTH, VOCAB = 4, 2, 128, 4096


def build(kind: str, directory: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if kind == "dense":
        config: Any = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            tie_word_embeddings=True,
        )
        Qwen3ForCausalLM(config).save_pretrained(directory)
    else:
        config = Qwen3MoeConfig(
            vocab_size=VOCAB,
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
            initializer_range=0.1,
        )
        Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from protocol.api import AdamParams, LoraConfig
    from workers.engine.collective import Collective, ProcessGroupCollective
    from workers.group.runtime import GroupSpec, join, leave

    torch.set_num_threads(1)
    spent = {"s": 0.0, "bytes": 0}
    device = torch.device("cpu")
    collective: Collective = Collective()
    if args.world > 1:
        spec = GroupSpec(args.rank, args.world, port=args.port)
        device = spec.device(args.device)
        collective = join(spec, device)
        _time_collectives(collective, spent, device)
    else:
        device = torch.device("cuda", 0) if args.device == "cuda" else device
    engine = Trainer.build(
        str(args.model), max_slots=TENANTS, max_rank=16, device=str(device), collective=collective
    )
    engine.model.pass_tokens = TENANTS * DATUMS * LENGTH
    for i in range(TENANTS):
        engine.residency.create(f"t{i}", LoraConfig(rank=16, seed=i))
    batch = [(f"t{i}", request(f"t{i}", DATUMS, LENGTH, VOCAB, i)) for i in range(TENANTS)]
    steps = [(f"t{i}", AdamParams(learning_rate=1e-4)) for i in range(TENANTS)]

    def step() -> None:
        engine.forward_backward(batch)
        engine.optim_step(steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    times, shares, moved = [], [], []
    for _ in range(args.repeats):
        spent["s"], spent["bytes"] = 0.0, 0
        started = time.perf_counter()
        step()
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        shares.append(spent["s"] / elapsed)
        moved.append(spent["bytes"])
    if args.rank == 0:
        seconds = statistics.median(times)
        print(
            json.dumps(
                {
                    "step_s": seconds,
                    "tokens_per_s": TENANTS * DATUMS * LENGTH / seconds,
                    "collective_share": statistics.median(shares),
                    "bytes": statistics.median(moved),
                }
            ),
            flush=True,
        )
    if isinstance(collective, ProcessGroupCollective):
        dist.barrier()
        leave()


def _time_collectives(collective: Any, spent: dict[str, Any], device: Any) -> None:
    """Time every collective the engine calls (synchronised on GPUs) and count its bytes."""
    import torch

    for name in ("all_reduce_sum", "all_reduce_max", "all_gather_into", "all_gather_rows"):
        original = getattr(collective, name)

        def timed(*tensors: Any, _original: Any = original) -> Any:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            result = _original(*tensors)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            spent["s"] += time.perf_counter() - started
            first = tensors[0]  # what a rank ends up with: the reduced or gathered tensor
            spent["bytes"] += first.numel() * first.element_size()
            return result

        setattr(collective, name, timed)


def run(model: Path, world: int, device: str, repeats: int) -> dict[str, float]:
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
                "--device",
                device,
                "--repeats",
                str(repeats),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [rank.communicate(timeout=1200)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"a rank failed: {[rank.returncode for rank in ranks]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("{"))
    result: dict[str, float] = json.loads(line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    print(
        f"{TENANTS} tenants x {DATUMS} x {LENGTH} tokens, rank 16, {args.device},"
        f" median of {args.repeats}"
    )
    print(
        f"{'model':<7}{'N':>3}{'step s':>9}{'tokens/s':>10}{'vs N=1':>8}"
        f"{'collectives':>13}{'MB/rank':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            model = build(kind, Path(tmp) / kind)
            base = None
            for world in args.devices:
                got = run(model, world, args.device, args.repeats)
                base = base or got["tokens_per_s"]
                print(
                    f"{kind:<7}{world:>3}{got['step_s']:>9.3f}{got['tokens_per_s']:>10.0f}"
                    f"{got['tokens_per_s'] / base:>7.2f}x{got['collective_share'] * 100:>12.0f}%"
                    f"{got['bytes'] / 2**20:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
