"""Long datums on one engine: peak memory and time of one training step, layers recomputed or not.

One tenant (rank 16, every layer group) trains one datum of T tokens, `forward_backward` then
`optim_step`, as the worker's operations run them (`bench/engine_merge.py`'s `Trainer`), on a
random Qwen3 of hidden 512, 8 layers and a 4096-token vocabulary (about 24 M parameters, the
context raised to 256 Ki), fp32 on the CPU. Each (T, mode) runs in a fresh process:
- growth: the peak resident set during the step (VmHWM, reset just before it) minus the
  resident set before it, after a one-datum warm-up step;
- time: the step's wall time, and its time per token.
Modes: "recompute" runs every training pass with its decoder layers recomputed in the backward
(`workers/engine/recompute.py`, `recompute_tokens=0`), "keep" keeps every layer's activations
(a `recompute_tokens` no pass reaches), "split2" (any "splitN") recomputes on a worker group of
N ranks on loopback (gloo, one process and `--threads` threads each), the datum's positions
split over them (`workers/engine/context_parallel.py`): its growth is the largest rank's. Then,
per T, the time per token of recompute over keep, and per mode the growth at the largest T over
the smallest, and a split mode's growth over recompute's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py [--tokens 1024 4096 16384]
        [--modes keep recompute split2]

`--plan` prints the memory plan instead (`workers/engine/memory.py`, no model is run): the
bytes a trained token costs and the longest datum, for the real configs of Qwen3-8B,
Qwen3-30B-A3B, Qwen3.5-35B-A3B and DeepSeek-V3.1 (`tests/data/lineup`; bf16 activations, the
base model's share and the planned rank-32 slots resident), on 80 GB and 141 GB devices, one
device and a group of 8 splitting the datum.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
CONTEXT = 256 * 1024


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(mode: str, tokens: int, model_dir: str, threads: int, group: str = "") -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_merge import Trainer, request

    from protocol.api import AdamParams, LoraConfig
    from workers.engine.collective import Collective
    from workers.engine.passes import tune_malloc
    from workers.group.runtime import GroupSpec, join, leave

    tune_malloc()  # as the worker does
    torch.set_num_threads(threads)
    collective = Collective()
    if group:  # "rank world port": a rank of a group on loopback
        rank, world, port = (int(v) for v in group.split())
        collective = join(GroupSpec(rank=rank, world=world, port=port), torch.device("cpu"))
    engine = Trainer.build(
        model_dir, max_slots=1, max_rank=16, pass_tokens=max(tokens, 512), collective=collective
    )
    engine.model.passes.recompute_tokens = 2**62 if mode == "keep" else 0
    engine.model.passes.context.tokens = 0 if group else None
    engine.residency.create("t", LoraConfig(rank=16, seed=0))
    adam = [("t", AdamParams(learning_rate=1e-4))]
    engine.forward_backward([("t", request("t", 1, 64, 4096, 1))])  # allocator warm-up
    engine.optim_step(adam)
    batch = [("t", request("t", 1, tokens, 4096, 0))]
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    [out] = engine.forward_backward(batch)
    engine.optim_step(adam)
    seconds = time.perf_counter() - started
    growth = _status("VmHWM") - before
    loss = float(out.metrics["loss:sum"])  # type: ignore[union-attr]
    print(json.dumps({"growth": growth, "seconds": seconds, "loss": loss}))
    if group:
        leave()


def build(directory: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_merge import build_model

    build_model(directory, vocab=4096, hidden=512, layers=8)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = CONTEXT
    config_path.write_text(json.dumps(config))
    return directory


def run(mode: str, tokens: int, model_dir: Path, threads: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", mode, str(tokens), str(model_dir)]
    if not mode.startswith("split"):
        out = subprocess.run(
            [*command, str(threads), ""], check=True, capture_output=True, text=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    from workers.group.runtime import free_port

    world, port = int(mode.removeprefix("split")), free_port()
    ranks = [
        subprocess.Popen(
            [*command, str(threads), f"{rank} {world} {port}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for rank in ranks:
        stdout, _ = rank.communicate(timeout=7200)
        if rank.returncode:
            raise RuntimeError(f"a rank of {mode} failed ({rank.returncode})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    # the fullest rank's growth, the slowest rank's time (the step ends when every rank's does)
    return {
        "growth": max(r["growth"] for r in results),
        "seconds": max(r["seconds"] for r in results),
        "loss": results[0]["loss"],
    }


def plan() -> None:
    """The memory plan of the real configs (see the module docstring)."""
    from workers.engine.lora_counts import build_on_meta, count_per_rank
    from workers.engine.memory import PLAN_SHARE, plan_slots, plan_tokens, slot_bytes

    sys.path.insert(0, str(Path(__file__).parent))
    from moe_memory import load_fields

    from workers.engine.lora_counts import config_from_fields

    models = (
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3.5-35B-A3B",
        "deepseek-ai/DeepSeek-V3.1",
    )
    configs = {}
    for model_id in models:
        config = config_from_fields(load_fields(model_id))
        config.get_text_config().max_position_embeddings = 2**30  # the plan alone decides
        configs[model_id.split("/")[1]] = config
    # bytes a base weight: DeepSeek-V3.1's checkpoint is fp8; the others bf16
    weight_bytes = {"DeepSeek-V3.1": 1}
    print(
        "activations bf16; per rank: the base model's share, then its adapter slots (planned as"
        f" the worker plans them, rank 32), then {PLAN_SHARE:.0%} of what is left for a pass;"
        " 'fits': the longest datum the plan trains ('-': the base model does not fit);"
        " '1 slot': the same with one slot (`--max-slots 1`)"
    )
    print(
        f"{'model':>16} {'device':>7} {'ranks':>5} {'split':>5} {'slots':>5} {'KiB/token':>9}"
        f" {'fits':>8} {'32Ki':>5} {'128Ki':>5} {'256Ki':>5} {'1 slot':>8}"
    )
    for name, config in configs.items():
        model = build_on_meta(config)
        params = sum(p.numel() for p in model.parameters())
        slot_numel = 32 * sum(count_per_rank(model).per_group.values())
        for device_gb in (80, 141):
            for ranks in (1, 8):
                split = ranks  # every one of them splits (`workers/engine/context_parallel.py`)
                left = device_gb * 10**9 - params * weight_bytes.get(name, 2) // ranks
                if left <= 0:
                    print(f"{name:>16} {device_gb:>5}GB {ranks:>5} {split:>5} {'-':>5}")
                    continue
                slots = plan_slots(left, slot_numel // ranks).max_slots
                free = max(0, left - slots * slot_bytes(slot_numel // ranks))
                row = plan_tokens(
                    config, dtype_bytes=2, free_bytes=free, max_context=2**30, ranks=split
                )
                lone = plan_tokens(
                    config,
                    dtype_bytes=2,
                    free_bytes=max(0, left - slot_bytes(slot_numel // ranks)),
                    max_context=2**30,
                    ranks=split,
                )
                marks = " ".join(
                    f"{'yes' if row.train_tokens >= t else 'no':>5}" for t in (2**15, 2**17, 2**18)
                )
                print(
                    f"{name:>16} {device_gb:>5}GB {ranks:>5} {split:>5} {slots:>5}"
                    f" {row.train_bytes_per_token / 2**10:>9.1f} {row.train_tokens:>8} {marks}"
                    f" {lone.train_tokens:>8}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["keep", "recompute"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plan", action="store_true", help="the memory plan of real configs")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, tokens, model_dir, threads, group = args.child
        child(mode, int(tokens), model_dir, int(threads), group)
        return
    if args.plan:
        plan()
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "mid")
        print(
            "random Qwen3 hidden 512, 8 layers, vocab 4096, fp32, CPU, "
            f"{args.threads} thread(s); one datum, forward_backward + optim_step, rank 16"
        )
        print(f"{'tokens':>7} {'mode':>10} {'growth MiB':>11} {'step s':>8} {'ms/token':>9} loss")
        results: dict[tuple[int, str], dict[str, float]] = {}
        for tokens in args.tokens:
            for mode in args.modes:
                result = results[tokens, mode] = run(mode, tokens, model_dir, args.threads)
                print(
                    f"{tokens:>7} {mode:>10} {result['growth'] / MiB:>11.0f}"
                    f" {result['seconds']:>8.2f} {1000 * result['seconds'] / tokens:>9.3f}"
                    f" {result['loss']:.6f}",
                    flush=True,
                )
        if {"keep", "recompute"} <= set(args.modes):
            print("time per token, recompute / keep:")
            for tokens in args.tokens:
                ratio = results[tokens, "recompute"]["seconds"] / results[tokens, "keep"]["seconds"]
                print(f"{tokens:>7} {ratio:.2f}x")
        first, last = args.tokens[0], args.tokens[-1]
        extra = {
            mode: (results[last, mode]["growth"] - results[first, mode]["growth"]) / MiB
            for mode in args.modes
        }
        for mode in args.modes:
            print(f"{mode}: growth at {last} over {first} tokens: {extra[mode]:.0f} MiB")
        for mode in args.modes:
            if mode.startswith("split") and "recompute" in extra:
                print(
                    f"{mode}: a rank's growth over one device's (recompute), at {last}"
                    f" over {first}: {extra[mode] / extra['recompute']:.2f}x;"
                    f" at {last}: {results[last, mode]['growth'] / results[last, 'recompute']['growth']:.2f}x"
                )


if __name__ == "__main__":
    main()
