"""What the stack adds to a training round trip: the same loop in-process and through `up`.

One round is `forward_backward(cross_entropy)` then `optim_step`, each awaited before the next.
The loop runs N rounds twice per batch shape:

- in-process, on the multi-slot model and its residency directly, as the worker's operations
  call them (one torch thread, no transport);
- through the official SDK → gateway → NATS → worker of a local `twinkle-async up`.

Both use the same random Qwen3 built offline (`workers.tiny_model`, by default hidden 256,
4 layers, vocab 4096) and rank-16 adapters. For each shape it prints p50/p90 per path and the
added latency per round trip (the p50 difference). It also reads the worker's own engine time
(its `/metrics`: pass and optimizer-step seconds) around each cluster round, and prints p50/p90
of the round trip less that: the stack's share measured within each round, which background
load on the machine moves far less than the difference between two paths.

    .venv/bin/python bench/overhead.py [--rounds 40] [--shapes 4x32 4x128] [--threads 1]

Timings on a shared machine are noisy: the in-process rounds are interleaved in blocks with
the cluster's so that both see the same background load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# This checkout's modules, here and in `up`'s children, whatever the working directory and
# whichever copy of the project the environment has installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import tinker  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

from protocol.api import AdamParams, LoraConfig  # noqa: E402
from protocol.tensors import DatumArrays, FwdBwdRequest  # noqa: E402
from workers.engine.model import MultiSlotModel  # noqa: E402
from workers.tiny_model import build_tiny_model  # noqa: E402
from workers.trainer.operations import run_passes, run_steps  # noqa: E402
from workers.trainer.residency import Residency  # noqa: E402

WARMUP = 3


def _tokens(length: int) -> list[int]:
    return [3 + i % 200 for i in range(length + 1)]


def _percentiles(times_ms: list[float]) -> tuple[float, float]:
    ordered = sorted(times_ms)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


class InProcess:
    """The model alone, as the worker's engine thread drives it (`workers.trainer.operations`):
    the request validated, one shared pass, one fused step."""

    def __init__(self, model: Path, rank: int, max_slots: int, max_rank: int) -> None:
        self.model = MultiSlotModel(str(model), max_slots=max_slots, max_rank=max_rank)
        self.residency = Residency(self.model)
        self.residency.create("bench", LoraConfig(rank=rank))

    def round_ms(self, datums: int, length: int) -> float:
        tokens = _tokens(length)
        request = FwdBwdRequest(
            model_id="bench",
            seq_id=0,
            loss_fn="cross_entropy",
            forward_only=False,
            loss_fn_config={},
            datums=[
                DatumArrays(
                    tokens=np.asarray(tokens[:-1], dtype=np.int32),
                    inputs={
                        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                        "weights": np.ones(length, dtype=np.float32),
                    },
                )
                for _ in range(datums)
            ],
        )
        started = time.perf_counter()
        run_passes(self.model, self.residency, [("bench", self.model.validate(request))])
        run_steps(self.model, self.residency, [("bench", AdamParams(learning_rate=1e-3))])
        return (time.perf_counter() - started) * 1e3


class Cluster:
    """`twinkle-async up` on the model, and one SDK training client."""

    def __init__(
        self, tmp: Path, model: Path, rank: int, threads: int, engine_args: list[str]
    ) -> None:
        ready = tmp / "ready.json"
        argv = [
            sys.executable, "-m", "twinkle_async", "up",
            "--base-model", str(model),
            "--port", "0",
            "--data-dir", str(tmp / "data"),
            "--api-key", "tml-bench",
            "--ready-file", str(ready),
            "--threads", str(threads),
            "--log-level", "WARNING",
            *engine_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=ROOT)
        while not ready.exists():
            if self.proc.poll() is not None:
                raise SystemExit("the cluster failed to start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.metrics_url = self._worker_metrics_url(info["base_url"], info["admin_key"])
        self.service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
        self.client = self.service.create_lora_training_client(
            base_model=str(model), rank=rank, seed=0
        ).result()

    def round_ms(self, datums: int, length: int) -> float:
        tokens = _tokens(length)
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
            )
            for _ in range(datums)
        ]
        started = time.perf_counter()
        self.client.forward_backward(batch, "cross_entropy").result()
        self.client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        return (time.perf_counter() - started) * 1e3

    @staticmethod
    def _worker_metrics_url(base_url: str, admin_key: str) -> str:
        request = urllib.request.Request(
            f"{base_url}/admin/v1/workers", headers={"X-Admin-Key": admin_key}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            [worker] = json.load(response)["workers"]
        return str(worker["metrics_url"])

    def engine_s(self) -> float:
        """Seconds the worker has spent in passes and optimizer steps so far."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        names = ("twinkle_worker_pass_seconds_sum", "twinkle_worker_optim_step_seconds_sum")
        return sum(
            float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in names
        )

    def close(self) -> None:
        try:
            self.service.close("success").result()
        finally:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--shapes", nargs="+", default=["4x32", "4x128"], help="DATUMSxTOKENS")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both paths")
    parser.add_argument(
        "--worker-threads", type=int, help="the worker's torch threads (default: --threads)"
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-slots", type=int, default=8, help="adapter slots, both paths")
    parser.add_argument("--max-rank", type=int, default=32, help="largest rank, both paths")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model", type=Path, help="an existing model directory to use instead")
    parser.add_argument("--block", type=int, default=5, help="rounds per path before switching")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-overhead-"))
    model = args.model or build_tiny_model(
        tmp / "model",
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
    )
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    local = InProcess(model, args.rank, args.max_slots, args.max_rank)
    worker_threads = args.threads if args.worker_threads is None else args.worker_threads
    engine_args = ["--max-slots", str(args.max_slots), "--max-rank", str(args.max_rank)]
    cluster = Cluster(tmp, model, args.rank, worker_threads, engine_args)
    try:
        for datums, length in shapes:
            times: dict[str, list[float]] = {"in-process": [], "cluster": []}
            for _ in range(WARMUP):
                local.round_ms(datums, length)
                cluster.round_ms(datums, length)
            stack_ms: list[float] = []  # each cluster round less the worker's engine time in it
            while len(times["cluster"]) < args.rounds:
                block = min(args.block, args.rounds - len(times["cluster"]))
                times["in-process"] += [local.round_ms(datums, length) for _ in range(block)]
                for _ in range(block):
                    before_s = cluster.engine_s()
                    times["cluster"].append(cluster.round_ms(datums, length))
                    engine_ms = (cluster.engine_s() - before_s) * 1e3
                    stack_ms.append(times["cluster"][-1] - engine_ms)
            p50 = {}
            for path, measured in times.items():
                p50[path], p90 = _percentiles(measured)
                print(
                    f"{datums}x{length} {path:>10}: p50 {p50[path]:7.1f} ms  p90 {p90:7.1f} ms"
                    f"  ({len(measured)} rounds)"
                )
            added = p50["cluster"] - p50["in-process"]
            print(f"{datums}x{length}      added: {added:7.1f} ms per round trip (p50)")
            stack_p50, stack_p90 = _percentiles(stack_ms)
            print(
                f"{datums}x{length}      stack: p50 {stack_p50:7.1f} ms  p90 {stack_p90:7.1f} ms"
                " (each cluster round less the worker's own engine time in it)",
                flush=True,
            )
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
