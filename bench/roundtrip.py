"""Round-trip time of one forward_backward + optim_step through the official SDK.

Starts a local cluster (`twinkle-async up`) on a tiny model built offline, then times N rounds
of `forward_backward(cross_entropy)` + `optim_step` on a small batch, each awaited before the
next (no pipelining), and prints the median and p90 in milliseconds.

    .venv/bin/python bench/roundtrip.py [--rounds 50] [--datums 4] [--length 32]
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
from pathlib import Path

import tinker
from tinker import types


def start(tmp: Path, model: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ready = tmp / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "twinkle_async",
            "up",
            "--base-model",
            str(model),
            "--port",
            "0",
            "--data-dir",
            str(tmp / "data"),
            "--api-key",
            "tml-bench",
            "--ready-file",
            str(ready),
            "--threads",
            "1",
            "--log-level",
            "WARNING",
        ],
    )
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit("cluster failed to start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", TINKER_TELEMETRY="0")
    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "workers.tiny_model", str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    proc, info = start(tmp, model)
    try:
        service = tinker.ServiceClient(base_url=info["base_url"], api_key=info["api_key"])
        client = service.create_lora_training_client(base_model=str(model), rank=8, seed=0).result()
        tokens = list(range(3, 3 + args.length + 1))
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.length},
            )
            for _ in range(args.datums)
        ]
        times = []
        for i in range(args.rounds + 3):
            started = time.perf_counter()
            fwd = client.forward_backward(batch, "cross_entropy")
            opt = client.optim_step(types.AdamParams(learning_rate=1e-3))
            fwd.result()
            opt.result()
            if i >= 3:  # warm-up rounds excluded
                times.append((time.perf_counter() - started) * 1e3)
        times.sort()
        p90 = times[int(0.9 * (len(times) - 1))]
        print(
            f"forward_backward+optim_step round trip, {args.datums}x{args.length} tokens, {args.rounds} rounds: "
            f"median {statistics.median(times):.1f} ms, p90 {p90:.1f} ms, min {times[0]:.1f} ms"
        )
        service.close("success").result()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
