"""`python -m workers.group.follower RANK WORLD PORT TIMEOUT_S ENGINE`: rank 1 .. N-1 of a
worker group,
started by rank 0 (`workers.group.launch`).

Builds the same model as rank 0 (ENGINE: its options as JSON) on its own device with its share
of the experts, and the same operations, which write no files; joins the group of WORLD ranks
at rank 0's PORT on loopback (a collective waiting longer than TIMEOUT_S fails), then runs rank
0's calls until told to stop (`workers.group.mirror.follow`). It has no NATS connection.
It exits with rank 0, and with a status other than 0 if the group broke.
"""

from __future__ import annotations

import json
import logging
import signal
import sys


def main() -> int:
    # A supervisor stops rank 0's whole process group: this rank leaves when rank 0 says so,
    # after rank 0 has handed its shards over, or dies with it (its parent-death signal).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, world, port, timeout_s, engine_json = sys.argv[1:6]
    options = json.loads(engine_json)
    logging.basicConfig(
        level=str(options.get("log_level", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import dataclasses
    from pathlib import Path

    import torch

    from workers.engine.model import MultiSlotModel
    from workers.engine.passes import tune_malloc
    from workers.group.mirror import Channel, GroupBroken, follow
    from workers.group.runtime import GroupSpec, join, leave, ready
    from workers.settings import WorkerSettings
    from workers.trainer.operations import EngineOps
    from workers.trainer.residency import Residency

    log = logging.getLogger("workers.group.follower")
    if options.get("threads"):
        torch.set_num_threads(int(options["threads"]))
    tune_malloc()
    spec = GroupSpec(rank=int(rank), world=int(world), port=int(port), timeout_s=float(timeout_s))
    device = spec.device(options["device"])
    collective = join(spec, device)
    try:
        model = MultiSlotModel(
            options["base_model"],
            max_slots=options["max_slots"],
            max_rank=options["max_rank"],
            device=str(device),
            collective=collective,
            memory_limit=options["memory_limit"],
        )
        if model.vision is not None:  # it decodes what rank 0 took, under the same limits
            model.vision.limit(int(options["max_image_pixels"]), int(options["max_images"]))
        settings = WorkerSettings(
            base_model=options["base_model"],
            data_dir=Path(options["data_dir"]),
            artifact_store=options["artifact_store"],
            artifact_cache_bytes=int(options["artifact_cache_bytes"]),
        )
        ops = EngineOps(
            model, Residency(model, max_parked=options["max_parked"]), settings, writes=False
        )
        if ops.store is not None:  # a cache of its own: ranks download side by side
            ops.store = dataclasses.replace(
                settings, data_dir=settings.data_dir / f"rank-{rank}"
            ).open_store()
        ready(spec, collective)
        log.info("rank %d of %d ready on %s", spec.rank, spec.world, device)
        follow(ops, Channel(collective.host_group))
    except GroupBroken as broken:
        log.error("rank %d leaves the group: %s", spec.rank, broken)
        return 1
    finally:
        leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
