"""A worker group's ranks: the process group they form and what each rank needs to know.

Job: join the `torch.distributed` process group of a group of N ranks (one per device) and give
the engine its `ProcessGroupCollective`. The ranks meet at rank 0's address (loopback for the
ranks that one `twinkle-async worker --devices N` starts on one machine) and a free port that
rank 0 chose; gloo carries host tensors, and the tensors of a pass on GPUs go through NCCL.

Collectives wait for the slowest rank. While the ranks join and build their engines (loading the
model) they wait up to `START_TIMEOUT_S`; once all are `ready`, up to `timeout_s`. A group
between requests waits on rank 0's next message (`workers.group.mirror`), which rank 0 sends at
least every eighth of `timeout_s`: an idle group never times out, and a group that stopped
answering (a rank died or hangs) does, after `timeout_s`, and the group stops as one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.engine.collective import ProcessGroupCollective

DEFAULT_TIMEOUT_S = 600.0  # a collective waiting longer than this fails its rank (and the group)
# Joining, and building each rank's engine (loading the model), may take longer than that.
START_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class GroupSpec:
    """Where the ranks of a group meet, and which one this is."""

    rank: int
    world: int
    address: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S

    def device(self, kind: str) -> torch.device:
        """This rank's device: `cuda:<rank>` on GPUs (one per rank), the CPU otherwise."""
        if kind.startswith("cuda"):
            return torch.device("cuda", self.rank)
        return torch.device(kind)


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def join(spec: GroupSpec, device: torch.device) -> ProcessGroupCollective:
    """Join the group's process group (blocks until every rank has); the engine's collective."""
    if spec.address in ("127.0.0.1", "localhost"):
        # gloo would otherwise pick the interface of the machine's host name
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.address}:{spec.port}",
        rank=spec.rank,
        world_size=spec.world,
        timeout=timedelta(seconds=max(spec.timeout_s, START_TIMEOUT_S)),
    )
    host = dist.new_group(backend="gloo") if backend != "gloo" else None
    return ProcessGroupCollective(device, host_group=host)


def ready(spec: GroupSpec, collective: ProcessGroupCollective) -> None:
    """Every rank has built its engine: from here on a collective waits at most `timeout_s`."""
    dist.barrier()
    timeout = timedelta(seconds=spec.timeout_s)
    groups = [None] if collective.host_group is None else [None, collective.host_group]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
