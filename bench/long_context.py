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
(a `recompute_tokens` no pass reaches). Then, per T, the time per token of recompute over keep, and per mode
the growth at the largest T over the smallest.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py [--tokens 1024 4096 16384]
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


def child(mode: str, tokens: int, model_dir: str, threads: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_merge import Trainer, request

    from protocol.api import AdamParams, LoraConfig
    from workers.engine.passes import tune_malloc

    tune_malloc()  # as the worker does
    torch.set_num_threads(threads)
    engine = Trainer.build(model_dir, max_slots=1, max_rank=16, pass_tokens=max(tokens, 512))
    engine.model.passes.recompute_tokens = 0 if mode == "recompute" else 2**62
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
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(tokens), str(model_dir), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["keep", "recompute"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, tokens, model_dir, threads = args.child
        child(mode, int(tokens), model_dir, int(threads))
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
        for mode in args.modes:
            first, last = args.tokens[0], args.tokens[-1]
            extra = (results[last, mode]["growth"] - results[first, mode]["growth"]) / MiB
            print(f"{mode}: growth at {last} over {first} tokens: {extra:.0f} MiB")


if __name__ == "__main__":
    main()
