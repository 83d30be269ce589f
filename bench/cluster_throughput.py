"""Aggregate training throughput of `up` with N concurrent tenants, merging on and off.

Each client is its own tenant (its own API key, service client and LoRA training client) and
runs K steps of `forward_backward(cross_entropy)` + `optim_step`, each awaited; all clients run
at once, in one process, on asyncio. The cluster runs once with cross-tenant merging (one shared
pass and one fused step per cycle) and once with the worker's `--no-merge` (`TWINKLE_MERGE=0`:
every pass and step holds one model's work). For each batch shape and N it prints the aggregate
steps/s, the p50/p99 step latency, and the merged/unmerged throughput ratio.

    .venv/bin/python bench/cluster_throughput.py [--clients 1 4 16] [--steps 6] \
        [--shapes 1x32 4x128] [--threads 1]

`--lone`: instead, the tenants train one after another, each alone on the cluster for its K
steps, so every step is a lone tenant's: once with each call's future `.result()`-ed before the
next call is sent, once pipelined as tinker-cookbook's loops do (`forward_backward` and
`optim_step` submitted back to back, then both waited for).
Beside their tokens/s it prints the worker's own pass time for exactly these batches (its
`/metrics`: engine seconds of the shared passes and optimizer steps that ran them) and the
ratio of a step's wall time to that pass time, mean and p50 (and the mean to the pass and the
optimizer step together): what a lone tenant pays for the queue, the bus, the futures and HTTP
on top of its engine work. A second line gives each process's CPU time a step (this process is
the SDK client) and that extra beside what a step of 1.5x its pass leaves for it.

    .venv/bin/python bench/cluster_throughput.py --lone [--clients 16] [--steps 3] \
        [--shapes 4x128 1x32]

The model is a random Qwen3 built offline (`workers.tiny_model`: hidden 256, 4 layers, vocab
4096 by default) with rank-16 adapters; each client's first step is a warm-up, not counted.
"""

from __future__ import annotations

import argparse
import asyncio
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

import tinker
from tinker import types

Shape = tuple[int, int]  # (datums, tokens per datum)
ROOT = Path(__file__).resolve().parents[1]  # `up` runs this checkout's modules


def _batch(datums: int, length: int) -> list[types.Datum]:
    tokens = [3 + i % 200 for i in range(length + 1)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
        )
        for _ in range(datums)
    ]


class Cluster:
    """`twinkle-async up` with one API key per tenant, and a training client per tenant."""

    def __init__(self, tmp: Path, model: Path, args: argparse.Namespace, merge: bool) -> None:
        tenants = max(args.clients)
        keys = [f"tml-bench-tenant-{i:03d}-0123456789" for i in range(tenants)]
        tmp.mkdir(parents=True, exist_ok=True)
        key_file = tmp / "keys.txt"
        key_file.write_text("".join(f"{key} tenant-{i:03d}\n" for i, key in enumerate(keys)))
        ready = tmp / "ready.json"
        argv = [
            sys.executable, "-m", "twinkle_async", "up",
            "--base-model", str(model),
            "--port", "0",
            "--data-dir", str(tmp / "data"),
            "--key-file", str(key_file),
            "--ready-file", str(ready),
            "--threads", str(args.threads),
            "--max-slots", str(tenants),
            "--log-level", "WARNING",
        ]  # fmt: skip
        env = dict(os.environ, TWINKLE_MERGE="1" if merge else "0")
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT)
        while not ready.exists():
            if self.proc.poll() is not None:
                raise SystemExit("the cluster failed to start")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        base_url = info["base_url"]
        self.metrics_url = _worker_metrics_url(base_url, info["admin_key"])
        self.services = [tinker.ServiceClient(base_url=base_url, api_key=key) for key in keys]
        self.clients = [
            service.create_lora_training_client(base_model=str(model), rank=args.rank, seed=i)
            for i, service in enumerate(self.services)
        ]
        self.clients = [client.result() for client in self.clients]

    def close(self) -> None:
        try:
            for service in self.services:
                service.close("success").result()
        finally:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


def _worker_metrics_url(base_url: str, admin_key: str) -> str:
    request = urllib.request.Request(
        f"{base_url}/admin/v1/workers", headers={"X-Admin-Key": admin_key}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        [worker] = json.load(response)["workers"]
    return str(worker["metrics_url"])


def _engine_totals(metrics_url: str) -> dict[str, float]:
    """The worker's engine-time series so far: pass and optimizer-step seconds and counts."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    names = {
        f"twinkle_worker_{series}_{part}"
        for series in ("pass_seconds", "optim_step_seconds", "pass_tokens")
        for part in ("sum", "count")
    }
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            totals[name] = float(value)
    return totals


def _descendants(pid: int) -> list[int]:
    """`pid`'s children, theirs, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _role(pid: int) -> str:
    """Which part of the cluster a process is, from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [word.decode(errors="replace") for word in argv]
    if words and words[0].endswith("nats-server"):
        return "nats"
    if "workers" in words:
        return "worker"
    if "gateway" in words:
        return "gateway"
    return "up"


def _cpu_s(pids: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user and system) so far of each role's processes."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for pid, role in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def _lone(cluster: Cluster, shape: Shape, steps: int, pipelined: bool) -> None:
    """The tenants one after another, each alone for `steps` steps; prints one line.

    `pipelined`: each step submits `forward_backward` and `optim_step` back to back and then
    waits for both, as tinker-cookbook's `sl_loop` and `rl_loop` do; otherwise each call's
    future is waited for before the next call is sent (four HTTP calls in a row a step)."""
    batch = _batch(*shape)
    adam = types.AdamParams(learning_rate=1e-3)
    for client in cluster.clients:  # warm-up: each client's first step is not counted
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(adam).result()
    before = _engine_totals(cluster.metrics_url)
    pids = {pid: _role(pid) for pid in _descendants(cluster.proc.pid)}
    pids[os.getpid()] = "SDK client"
    cpu_before = _cpu_s(pids)
    step_s: list[float] = []
    started = time.perf_counter()
    for client in cluster.clients:
        for _ in range(steps):
            step_started = time.perf_counter()
            if pipelined:
                pass_future = client.forward_backward(batch, "cross_entropy")
                step_future = client.optim_step(adam)
                pass_future.result()
                step_future.result()
            else:
                client.forward_backward(batch, "cross_entropy").result()
                client.optim_step(adam).result()
            step_s.append(time.perf_counter() - step_started)
    wall_s = time.perf_counter() - started
    cpu = {role: spent - cpu_before.get(role, 0.0) for role, spent in _cpu_s(pids).items()}
    after = _engine_totals(cluster.metrics_url)
    delta = {name: after[name] - before[name] for name in after}
    passes = delta["twinkle_worker_pass_seconds_count"]
    if (
        passes != len(step_s)
        or delta["twinkle_worker_pass_tokens_sum"] != passes * shape[0] * shape[1]
    ):
        print(f"  (the worker ran {passes:.0f} passes for {len(step_s)} steps)")
    pass_s = delta["twinkle_worker_pass_seconds_sum"] / len(step_s)
    optim_s = delta["twinkle_worker_optim_step_seconds_sum"] / len(step_s)
    tokens = shape[0] * shape[1]
    mean_s, p50_s = wall_s / len(step_s), statistics.median(step_s)
    pattern = "pipelined" if pipelined else "awaited  "
    print(
        f"lone {pattern} {shape[0]}x{shape[1]:<4} {len(cluster.clients)} tenants x {steps} steps:"
        f" {tokens / mean_s:7.0f} tok/s, step mean {mean_s * 1e3:6.1f} ms p50 {p50_s * 1e3:6.1f} ms"
        f" max {max(step_s) * 1e3:6.1f} ms | worker pass {pass_s * 1e3:6.1f} ms"
        f" ({tokens / pass_s:5.0f} tok/s), optim {optim_s * 1e3:5.1f} ms"
        f" | step/pass mean {mean_s / pass_s:5.2f}x p50 {p50_s / pass_s:5.2f}x"
        f" | step/(pass+optim) mean {mean_s / (pass_s + optim_s):5.2f}x",
        flush=True,
    )
    # Where the rest goes: each process's CPU per step (the worker's includes the engine's).
    spent = ", ".join(
        f"{role} {seconds / len(step_s) * 1e3:.1f}" for role, seconds in sorted(cpu.items())
    )
    print(
        f"    CPU ms a step: {spent}; all {sum(cpu.values()) / len(step_s) * 1e3:.1f} on"
        f" {os.cpu_count()} cores | beside the engine: step - pass - optim"
        f" {(mean_s - pass_s - optim_s) * 1e3:.1f} ms, the 1.5x budget for it"
        f" {(0.5 * pass_s - optim_s) * 1e3:.1f} ms",
        flush=True,
    )


async def _step_s(client: tinker.TrainingClient, batch: list[types.Datum]) -> float:
    started = time.perf_counter()
    await client.forward_backward(batch, "cross_entropy")
    await client.optim_step(types.AdamParams(learning_rate=1e-3))
    return time.perf_counter() - started


async def _run(clients: list[tinker.TrainingClient], shape: Shape, steps: int) -> list[float]:
    """Every client's step latencies; returns them with the wall time of the timed steps last."""
    batch = _batch(*shape)
    await asyncio.gather(*(_step_s(client, batch) for client in clients))  # warm-up

    async def loop(client: tinker.TrainingClient) -> list[float]:
        return [await _step_s(client, batch) for _ in range(steps)]

    started = time.perf_counter()
    per_client = await asyncio.gather(*(loop(client) for client in clients))
    wall_s = time.perf_counter() - started
    return [latency for latencies in per_client for latency in latencies] + [wall_s]


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per client")
    parser.add_argument("--shapes", nargs="+", default=["1x32", "4x128"], help="DATUMSxTOKENS")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model", type=Path, help="an existing model directory to use instead")
    parser.add_argument(
        "--lone", action="store_true", help="tenants one after another (see the docstring)"
    )
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-throughput-"))
    model = args.model
    if model is None:
        model = tmp / "model"
        build = [sys.executable, "-m", "workers.tiny_model", str(model)]
        build += ["--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers)]
        build += ["--vocab-size", str(args.vocab_size)]
        subprocess.run(build, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    shapes: list[Shape] = [(int(d), int(n)) for d, n in (s.split("x") for s in args.shapes)]
    if args.lone:
        cluster = Cluster(tmp / "lone", model, args, merge=True)
        try:
            for shape in shapes:
                for pipelined in (False, True):
                    _lone(cluster, shape, args.steps, pipelined)
        finally:
            cluster.close()
        return
    rate: dict[tuple[bool, Shape, int], float] = {}
    for merge in (True, False):
        cluster = Cluster(tmp / ("merged" if merge else "unmerged"), model, args, merge)
        try:
            for shape in shapes:
                for n in args.clients:
                    *latencies, wall_s = asyncio.run(_run(cluster.clients[:n], shape, args.steps))
                    ordered = sorted(latencies)
                    rate[merge, shape, n] = len(latencies) / wall_s
                    print(
                        f"merge {'on ' if merge else 'off'} {shape[0]}x{shape[1]:<4} N={n:<3}"
                        f" {rate[merge, shape, n]:7.2f} steps/s"
                        f"  p50 {statistics.median(ordered) * 1e3:7.1f} ms"
                        f"  p99 {_percentile(ordered, 0.99) * 1e3:7.1f} ms",
                        flush=True,
                    )
        finally:
            cluster.close()
    for shape in shapes:
        for n in args.clients:
            ratio = rate[True, shape, n] / rate[False, shape, n]
            print(f"{shape[0]}x{shape[1]:<4} N={n:<3} merged/unmerged throughput: {ratio:5.2f}x")


if __name__ == "__main__":
    main()
