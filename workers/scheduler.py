"""The cycle plan: which ready ops run together. Pure, no I/O.

Each cycle takes every ready forward/forward_backward across all models of the pool, up to a
token budget, as ONE shared pass; then every optim_step that directly follows a model's work in
this cycle (or heads its line) as one fused step; then the other ops (create, save, load,
unload), which are barriers for their own model only. Tombstones (calls the gateway refused)
run nothing: they are settled wherever they stand in a model's line, so they never hold it up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocol.jobs import ForwardBackwardJob, OptimStepJob, TombstoneJob
from workers.sequencer import Pending

H = TypeVar("H")


@dataclass
class Cycle(Generic[H]):
    """One cycle: a shared pass, a fused optimizer step, then the rest, in that order."""

    shared_pass: list[Pending[H]] = field(default_factory=list)
    optim_steps: list[Pending[H]] = field(default_factory=list)
    others: list[Pending[H]] = field(default_factory=list)
    settled: list[Pending[H]] = field(default_factory=list)  # tombstones: nothing to run
    # the earliest time a model held back by its tenant's rate limit may go on (None: none)
    wake_at: float | None = None

    def __bool__(self) -> bool:
        return bool(self.shared_pass or self.optim_steps or self.others or self.settled)


def plan(
    ready: dict[str, list[Pending[H]]], token_budget: int, now: float = float("inf")
) -> Cycle[H]:
    """Plan one cycle from each model's in-order ready run.

    A model's forward_backward prefix joins the pass while the budget allows (a pass always takes
    at least one op, however large). Its optim_step joins only when its whole prefix did. A
    forward_backward whose tenant's rate limit holds it until `not_before` > `now` stops its
    model's run there; `wake_at` says when to plan again.
    """
    cycle: Cycle[H] = Cycle()
    tokens = 0
    for run in ready.values():
        i = 0
        ran_work = False  # whether this model has work in the pass before `run[i]`
        while i < len(run):
            job = run[i].job
            if isinstance(job, TombstoneJob):
                cycle.settled.append(run[i])
            elif isinstance(job, ForwardBackwardJob):
                if job.not_before > now:
                    wake = job.not_before
                    cycle.wake_at = wake if cycle.wake_at is None else min(cycle.wake_at, wake)
                    break
                if cycle.shared_pass and tokens + job.n_tokens > token_budget:
                    break
                cycle.shared_pass.append(run[i])
                tokens += job.n_tokens
                ran_work = True
            else:
                break
            i += 1
        if i == len(run):
            continue
        head = run[i].job
        if isinstance(head, ForwardBackwardJob):
            continue  # over budget or rate-limited: the rest of this model waits
        if isinstance(head, OptimStepJob):
            cycle.optim_steps.append(run[i])
        elif not ran_work:
            cycle.others.append(run[i])
    return cycle
