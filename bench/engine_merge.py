"""Merged passes against one pass per tenant, on the multi-slot model alone (no gateway, no NATS).

For N = 1, 2, 4, 8, 16 tenants and two request sizes (1 datum × 32 tokens, 4 datums × 128
tokens), one run times, side by side:
- merged: the N tenants' forward_backward requests as one shared pass
  (`workers.trainer.operations.run_passes`), then one fused `optim_step` (what a worker cycle
  does);
- separate: N calls of one tenant each, then N single steps;
- same tokens: one tenant sending the same total tokens (N requests) in one call and one step.
It prints the median of `--repeats` for each (the ways take turns, so a drift of the machine's
speed weighs on all alike), merged ÷ separate as a throughput ratio (higher is
better: merging gains) and merged ÷ same-tokens as a time ratio (lower is better: the merge's
own cost). Each ratio is the median of the turns' own ratios (`paired`), the two ways of a turn
having run seconds apart. The same-tokens way steps one adapter where merged steps N, so its
ratio counts N - 1 adapters' AdamW too; "(pass only)" leaves the steps out. `--sweep` instead
prints training tokens/s of one tenant's pass by pass size, which is how the worker's default
token budget is chosen.

The model is a random Qwen3 built here (hidden 256, 4 layers, vocab 4096; `--vocab`), rank-16
adapters on every layer group, one torch thread, fp32.

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_merge.py [--repeats 5] [--token-budget N]
    (without --token-budget the pass size is measured first, as a worker measures it)
    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_merge.py --sweep
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from protocol.api import AdamParams, LoraConfig
from protocol.errors import TwinkleError
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from workers.engine.model import MultiSlotModel
from workers.engine.passes import tune_malloc
from workers.trainer.calibration import measure
from workers.trainer.operations import run_passes, run_steps
from workers.trainer.residency import Residency

SIZES = {"1x32": (1, 32), "4x128": (4, 128)}
ADAM = AdamParams(learning_rate=1e-4)


@dataclass
class Trainer:
    """A multi-slot model and its residency, called as the worker's operations call them
    (`workers.trainer.operations`): each request validated on the model, then one transaction
    of at most `max_slots` tenants, one shared pass or one fused step."""

    model: MultiSlotModel
    residency: Residency

    @classmethod
    def build(cls, base_model: str, **kwargs: Any) -> Trainer:
        """`MultiSlotModel(base_model, **kwargs)` and a residency of its slots."""
        model = MultiSlotModel(base_model, **kwargs)
        return cls(model, Residency(model))

    def forward_backward(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        calls = [(model_id, self.model.validate(req)) for model_id, req in batch]
        return run_passes(self.model, self.residency, calls)

    def optim_step(
        self, steps: list[tuple[str, AdamParams]]
    ) -> list[dict[str, float] | TwinkleError]:
        return run_steps(self.model, self.residency, steps)


def build_model(directory: Path, vocab: int, hidden: int, layers: int) -> Path:
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def request(model_id: str, datums: int, length: int, vocab: int, seed: int) -> FwdBwdRequest:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(datums):
        tokens = rng.integers(0, vocab, size=length + 1)
        items.append(
            DatumArrays(
                tokens=tokens[:-1].astype(np.int32),
                inputs={
                    "target_tokens": tokens[1:].astype(np.int64),
                    "weights": np.ones(length, dtype=np.float32),
                },
            )
        )
    return FwdBwdRequest(model_id, 0, "cross_entropy", False, {}, items)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def case(
    engine: Trainer, n: int, datums: int, length: int, vocab: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds of each way to run N tenants' requests, per turn: see the module docstring."""
    ids = [f"t{i}" for i in range(n)]
    batch = [(m, request(m, datums, length, vocab, i)) for i, m in enumerate(ids)]
    same = [("t0", req) for _, req in batch]

    def merged_pass() -> None:
        outputs = engine.forward_backward(batch)
        assert not any(isinstance(o, Exception) for o in outputs), outputs

    def merged() -> None:
        merged_pass()
        engine.optim_step([(m, ADAM) for m in ids])

    def separate() -> None:
        for item in batch:
            engine.forward_backward([item])
        for m in ids:
            engine.optim_step([(m, ADAM)])

    def same_pass() -> None:
        engine.forward_backward(same)

    def same_tokens() -> None:
        same_pass()
        engine.optim_step([("t0", ADAM)])

    modes = {
        "merged": merged,
        "separate": separate,
        "same": same_tokens,
        "merged_pass": merged_pass,
        "same_pass": same_pass,
    }
    return turns(modes, repeats)


def interleaved(modes: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each mode, the modes taking turns (in a rotating order) so that a
    drift of the machine's speed during the run weighs on all of them alike."""
    return {name: statistics.median(values) for name, values in turns(modes, repeats).items()}


def paired(times: dict[str, list[float]], top: str, bottom: str) -> float:
    """The median over the turns of `top`'s seconds ÷ `bottom`'s in the same turn. The two ran
    within seconds of each other, at the machine's speed of the moment, so a drift of that
    speed (a shared VM's) cancels in each ratio instead of adding to the spread."""
    return statistics.median(a / b for a, b in zip(times[top], times[bottom], strict=True))


def turns(modes: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each mode's seconds, once per turn, the modes taking turns in a rotating order."""
    for fn in modes.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in modes}
    names = list(modes)
    for turn in range(repeats):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            started = time.perf_counter()
            modes[name]()
            times[name].append(time.perf_counter() - started)
    return times


def compare(engine: Trainer, vocab: int, repeats: int) -> None:
    print(
        f"{'size':>6} {'N':>3} {'merged s':>9} {'separate s':>10} {'same-tok s':>10}"
        f" {'merged/separate thrpt':>22} {'merged/same-tok time':>21} {'(pass only)':>12}"
    )
    for name, (datums, length) in SIZES.items():
        for n in (1, 2, 4, 8, 16):
            times = case(engine, n, datums, length, vocab, repeats)
            t = {mode: statistics.median(values) for mode, values in times.items()}
            print(
                f"{name:>6} {n:>3} {t['merged']:>9.4f} {t['separate']:>10.4f} {t['same']:>10.4f}"
                f" {paired(times, 'separate', 'merged'):>21.2f}x"
                f" {paired(times, 'merged', 'same'):>20.2f}x"
                f" {paired(times, 'merged_pass', 'same_pass'):>11.2f}x",
                flush=True,
            )


def sweep(engine: Trainer, vocab: int, repeats: int) -> None:
    """Training tokens/s of one pass of one tenant by pass size (rows of 128 tokens)."""
    print(f"{'tokens':>7} {'pass s':>8} {'tokens/s':>9}")
    for rows in (1, 2, 4, 8, 16, 32, 64):
        batch = [("t0", request("t0", rows, 128, vocab, rows))]
        seconds = timed(lambda b=batch: engine.forward_backward(b), repeats)
        print(f"{rows * 128:>7} {seconds:>8.4f} {rows * 128 / seconds:>9.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--lora-kind", choices=["loop", "gather"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tune_malloc()  # as the worker does
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.vocab, args.hidden, args.layers)
        engine = Trainer.build(str(model), max_slots=16, max_rank=16)
        engine.model.bank.set_kind(args.lora_kind)
        if args.token_budget is None:
            # as a worker does at start-up (`workers.trainer.calibration`)
            found = measure(engine.model)
            engine.model.pass_tokens = found.pass_tokens
            curve = ", ".join(f"{size}: {rate:.0f}" for size, rate in found.curve)
            print(f"measured pass size {found.pass_tokens} tokens (tokens/s by size: {curve})")
        else:
            engine.model.pass_tokens = args.token_budget
        for i in range(16):
            engine.residency.create(f"t{i}", LoraConfig(rank=16, seed=i))
        print(
            f"random Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab},"
            f" rank 16, {torch.get_num_threads()} thread, median of {args.repeats} turns"
            " (a ratio: of each turn's own)",
            flush=True,
        )
        if args.sweep:
            sweep(engine, args.vocab, args.repeats)
        else:
            compare(engine, args.vocab, args.repeats)


if __name__ == "__main__":
    main()
