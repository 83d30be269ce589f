"""Starting a worker group: `twinkle-async worker --devices N` runs rank 0 and starts the rest.

Rank 0 is the worker process itself, the group's only NATS client (leases, consumers,
outcomes, heartbeat: to the cluster the group is one worker). It starts ranks 1 .. N-1 as child
processes (`python -m workers.group.follower`), each told the engine to build and where the
group meets, joins the process group with them, and builds its model, residency and operations,
which it runs on every rank through `GroupOps` (`workers.group.mirror`).

One failure domain: a child that exits takes rank 0 down at once (a watcher thread), and the
children die with rank 0 (a parent-death signal, and rank 0's exit closes the group). The
supervisor (`up`, compose, systemd) then starts the whole group again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.group.runtime import GroupSpec, free_port, join, leave, ready
from workers.metrics import TrainerMetrics
from workers.settings import WorkerSettings

if TYPE_CHECKING:  # rank 0 imports the group's torch side only once it starts one
    from workers.group.mirror import GroupOps

log = logging.getLogger(__name__)

_CHILD_EXIT = 70  # rank 0's exit status when a rank of its group died


def engine_options(settings: WorkerSettings) -> dict[str, Any]:
    """What every rank needs to build the same engine (its device aside)."""
    return {
        "base_model": settings.base_model,
        "max_slots": settings.max_slots,
        "max_rank": settings.max_rank,
        "max_parked": settings.max_parked,
        "device": settings.device,
        "threads": settings.threads,
        "log_level": settings.log_level,
        "max_image_pixels": settings.max_image_pixels,
        "max_images": settings.max_images,
        "memory_limit": settings.memory_limit,
        # the other ranks read the checkpoints rank 0 writes (the same disk, or store)
        "data_dir": str(settings.data_dir),
        "artifact_store": settings.artifact_store,
        "artifact_cache_bytes": settings.artifact_cache_bytes,
    }


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent (rank 0) dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass
class Group:
    """Rank 0's view of its group: its operations, run on every rank, and the other ranks'
    processes."""

    ops: GroupOps | None
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    stopping: bool = False

    def watch(self) -> None:
        """Exit rank 0 as soon as another rank exits (unless the group is stopping)."""

        def run() -> None:
            while not self.stopping:
                for rank, child in enumerate(self.children, start=1):
                    code = child.poll()
                    if code is not None and not self.stopping:
                        log.critical(
                            "rank %d of the worker group exited (%s); the group stops", rank, code
                        )
                        os._exit(_CHILD_EXIT)
                time.sleep(0.2)

        threading.Thread(target=run, name="group-watch", daemon=True).start()

    def stop(self, timeout_s: float = 15.0) -> None:
        """A clean stop: the other ranks leave, then this one."""
        self.stopping = True
        if self.ops is not None:
            self.ops.stop_group()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        leave()


def start_group(settings: WorkerSettings, metrics: TrainerMetrics | None = None) -> Group:
    """Start ranks 1 .. N-1, join them, and build rank 0's model and operations (blocks until
    all joined)."""
    from workers.engine.model import MultiSlotModel
    from workers.group.mirror import Channel, GroupOps
    from workers.trainer.operations import EngineOps
    from workers.trainer.residency import Residency

    world = settings.devices
    port = free_port()
    engine = json.dumps(engine_options(settings))
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.group.follower",
                str(rank),
                str(world),
                str(port),
                str(settings.group_timeout_s),
                engine,
            ],
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads run yet at this point)
        )
        for rank in range(1, world)
    ]
    group = Group(ops=None, children=children)
    group.watch()
    spec = GroupSpec(rank=0, world=world, port=port, timeout_s=settings.group_timeout_s)
    collective = join(spec, spec.device(settings.device))
    model = MultiSlotModel(
        settings.base_model,
        max_slots=settings.max_slots,
        max_rank=settings.max_rank,
        device=str(spec.device(settings.device)),
        collective=collective,
        memory_limit=settings.memory_limit,
    )
    if model.vision is not None:
        model.vision.limit(settings.max_image_pixels, settings.max_images)
    residency = Residency(model, max_parked=settings.max_parked)
    group.ops = GroupOps(
        EngineOps(model, residency, settings, metrics),
        Channel(collective.host_group),
        keepalive_s=settings.group_timeout_s / 8,
    )
    ready(spec, collective)
    log.info("worker group of %d ranks on %s joined (port %d)", world, settings.device, port)
    return group
