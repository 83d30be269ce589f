"""A light tenant's step latency alone and beside a tenant that floods the worker.

`twinkle-async up` runs with small passes (`--token-budget 256` by default) and two tenants.
The light tenant runs `forward_backward(cross_entropy)` + `optim_step` steps on 1 datum x 32
tokens, each awaited. The flooder, in its own process (its SDK client's threads do not share
this interpreter), keeps a backlog of `forward` calls on 2 datums x 128 tokens in flight: one
such call is larger than a pass, and forward calls never wait for an optim_step, so all of
them are ready at once and only the worker's scheduler decides who goes first.

It prints the light tenant's p50/p90 step latency alone and beside the flood, their ratio
(the issue's fairness target is p50 within 2x), and how many flood calls finished meanwhile.
Rounds alternate (alone, flood, alone, flood, ...) so both see the same background load.

    .venv/bin/python bench/fairness.py [--rounds 3] [--steps 16] [--in-flight 2]

The model is a random Qwen3 built offline (`workers.tiny_model`). On a 2-core machine the
flooder's client, the gateway and NATS share the cores with the worker, so part of the ratio is
CPU contention rather than the schedule; the share of the time the worker spent in passes and steps is printed as well.
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

import overhead  # the sibling benchmark's cluster: `up`, one SDK client, the worker's metrics
from tinker import types

ROOT = overhead.ROOT
FLOOD_KEY = "tml-bench-flood-0123456789"

FLOODER = """
import sys, time
from pathlib import Path
import tinker
from tinker import types

base_url, api_key, model, signals, in_flight_n = sys.argv[1:6]
tokens = [3 + i % 200 for i in range(129)]
batch = [
    types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 128},
    )
    for _ in range(2)
]
service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
flood = service.create_lora_training_client(base_model=model, rank=4, seed=2).result()
Path(signals, "ready").touch()
sent = 0
while not Path(signals, "quit").exists():
    while not Path(signals, "go").exists():
        if Path(signals, "quit").exists():
            break
        time.sleep(0.01)
    in_flight = []
    while Path(signals, "go").exists():
        while len(in_flight) < int(in_flight_n):
            in_flight.append(flood.forward(batch, "cross_entropy"))
        in_flight.pop(0).result()
        sent += 1
    for future in in_flight:
        future.result()
        sent += 1
    Path(signals, "sent").write_text(str(sent))
    Path(signals, "idle").touch()
service.close("success").result()
"""


def _wait_for(path: Path, proc: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} failed")
        time.sleep(0.02)


class Cluster(overhead.Cluster):
    """`twinkle-async up` with the light tenant (the cluster's own key) and a flooding one."""

    def __init__(self, tmp: Path, model: Path, args: argparse.Namespace) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        key_file = tmp / "keys.txt"
        key_file.write_text(f"{FLOOD_KEY} flood\n")
        extra = ["--key-file", str(key_file), "--token-budget", str(args.token_budget)]
        super().__init__(tmp, model, 4, args.threads, extra)
        self.base_url = self._base_url(tmp)

    @staticmethod
    def _base_url(tmp: Path) -> str:
        return str(json.loads((tmp / "ready.json").read_text())["base_url"])

    def light_steps(self, count: int) -> list[float]:
        """Steps as a training loop sends them: optim_step queued behind its forward_backward
        before either is awaited."""
        tokens = [3 + i % 200 for i in range(33)]
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32},
            )
        ]
        latencies = []
        for _ in range(count):
            started = time.perf_counter()
            fwd = self.client.forward_backward(batch, "cross_entropy")
            opt = self.client.optim_step(types.AdamParams(learning_rate=1e-3))
            fwd.result(timeout=120)
            opt.result(timeout=120)
            latencies.append(time.perf_counter() - started)
        return latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alone/flood pairs")
    parser.add_argument("--steps", type=int, default=16, help="light steps per round")
    parser.add_argument("--in-flight", type=int, default=2, help="the flood's backlog")
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--model", type=Path, help="an existing model directory to use instead")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-fairness-"))
    model = args.model
    if model is None:
        model = tmp / "model"
        subprocess.run([sys.executable, "-m", "workers.tiny_model", str(model)], check=True)
    cluster = Cluster(tmp, model, args)
    signals = tmp / "signals"
    signals.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, cluster.base_url, FLOOD_KEY, str(model), str(signals),
         str(args.in_flight)],
        env=env,
    )  # fmt: skip
    alone: list[float] = []
    crowded: list[float] = []
    engine = {"alone": 0.0, "flood": 0.0}  # the worker's seconds in passes and steps
    wall = {"alone": 0.0, "flood": 0.0}
    sent = 0
    try:
        _wait_for(signals / "ready", flooder, "the flooder", 120)
        cluster.light_steps(3)  # warm-up
        for _ in range(args.rounds):
            before, started = cluster.engine_s(), time.perf_counter()
            alone += cluster.light_steps(args.steps)
            engine["alone"] += cluster.engine_s() - before
            wall["alone"] += time.perf_counter() - started
            (signals / "idle").unlink(missing_ok=True)
            (signals / "go").touch()
            time.sleep(2.0)  # the flood's backlog builds up
            before, started = cluster.engine_s(), time.perf_counter()
            crowded += cluster.light_steps(args.steps)
            engine["flood"] += cluster.engine_s() - before
            wall["flood"] += time.perf_counter() - started
            (signals / "go").unlink()
            _wait_for(signals / "idle", flooder, "the flooder", 120)
            sent = int((signals / "sent").read_text())
    finally:
        (signals / "go").unlink(missing_ok=True)
        (signals / "quit").touch()
        flooder.wait(timeout=120)
        cluster.close()
    print(f"light tenant, 1x32 steps; flood {args.in_flight} x forward(2x128) in flight;"
          f" token budget {args.token_budget}; {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print(f"{'':>14} {'p50 ms':>8} {'p90 ms':>8} {'worker busy':>12}")
    for name, values in (("alone", alone), ("beside flood", crowded)):
        key = "alone" if name == "alone" else "flood"
        print(
            f"{name:>14} {statistics.median(values) * 1e3:8.1f} {_p(values, 0.9) * 1e3:8.1f}"
            f" {engine[key] / wall[key]:12.0%}"
        )
    ratio = statistics.median(crowded) / statistics.median(alone)
    print(f"p50 ratio (beside flood / alone): {ratio:.2f}x  (target <= 2x)")
    print(f"flood forward calls finished: {sent}")


if __name__ == "__main__":
    main()
