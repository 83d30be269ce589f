"""`python -m tests.group_idle MODEL [--no-keepalive]`: a worker group of 2 ranks whose
collectives time out after 3 s sits idle for 8 s, then creates an adapter; prints "created".
Without rank 0's keepalives rank 1 times out while it waits, and the group stops as one (rank 0
exits 70 before anything is created)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from protocol.api import LoraConfig
from workers.group.launch import start_group
from workers.settings import WorkerSettings


def main() -> None:
    model = Path(sys.argv[1])
    settings = WorkerSettings(
        base_model=str(model), devices=2, group_timeout_s=3.0, max_slots=2, max_rank=8
    )
    group = start_group(settings)
    if "--no-keepalive" in sys.argv:
        group.engine.keepalive_s = 1e9
    time.sleep(8.0)
    group.engine.create("m", LoraConfig(rank=4, seed=1))
    print("created", flush=True)
    group.stop()


if __name__ == "__main__":
    main()
