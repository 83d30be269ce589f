"""Time of one fused AdamW step (`SlotAdamW.step`) over N slots, as a worker cycle runs it.

Each slot is a row of `--values` fp32 values (331,776 is the rank-16 adapter of the
`engine_merge.py` model); gradients are fresh random values before each step. `--guard-all`
copies and checks every slot, as if no slot's step were sure to stay finite (the path hostile
hyper-parameters take), to show what the bound saves.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_step.py [--values 331776] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from protocol.api import AdamParams
from workers.engine import optimizer
from workers.engine.optimizer import SlotAdamW


def median_ms(opt: SlotAdamW, slots: int, repeats: int) -> float:
    spec = AdamParams(learning_rate=1e-4, weight_decay=0.01)
    times = []
    for _ in range(repeats + 1):
        opt.grads.normal_(std=1e-2)
        started = time.perf_counter()
        results = opt.step(list(range(slots)), [spec] * slots)
        times.append(time.perf_counter() - started)
        assert all(isinstance(r, dict) for r in results), results
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=331_776)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bounded = optimizer._bounded
    print(f"{'slots':>5} {'bounded ms':>10} {'all guarded ms':>14}")
    for slots in (1, 4, 16):
        opt = SlotAdamW(torch.randn(slots, args.values) * 1e-2, torch.zeros(slots, args.values))
        fast = median_ms(opt, slots, args.repeats)
        optimizer._bounded = lambda *rows: [False] * len(rows[0])  # type: ignore[assignment]
        try:
            slow = median_ms(opt, slots, args.repeats)
        finally:
            optimizer._bounded = bounded
        print(f"{slots:>5} {fast:>10.2f} {slow:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
