"""`make demo`: a tiny model, a local cluster (`twinkle-async up`), and examples/sft.py against it.

Everything runs on this machine, offline: NATS on loopback, the gateway, one CPU worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    work = ROOT / ".demo"
    work.mkdir(exist_ok=True)
    model_dir = work / "tiny-qwen3"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    if not (model_dir / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "twinkle_async", "make-tiny-model", str(model_dir)],
            check=True,
            env=env,
        )
    ready = Path(tempfile.mkdtemp(prefix="twinkle-demo-")) / "ready.json"
    api_key = "tml-demo-key"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "twinkle_async",
            "up",
            "--base-model",
            str(model_dir),
            "--port",
            "0",
            "--data-dir",
            str(work / "data"),
            "--api-key",
            api_key,
            "--ready-file",
            str(ready),
            "--threads",
            "1",
            "--log-level",
            "WARNING",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if up.poll() is not None:
                print("the cluster failed to start", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print("the cluster did not become ready in 300 s", file=sys.stderr)
                return 1
            time.sleep(0.1)
        base_url = json.loads(ready.read_text())["base_url"]
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "sft.py"),
                "--base-url",
                base_url,
                "--api-key",
                api_key,
                "--base-model",
                str(model_dir),
            ],
            env=env,
        ).returncode
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    sys.exit(main())
