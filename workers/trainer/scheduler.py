"""The cycle plan: which ready ops run together, and in whose favour. Pure, no I/O.

Each cycle takes ready forward/forward_backward ops across all models of the pool, up to a token
budget, as one shared call (the engine splits it into passes of at most its pass size); then
every optim_step that directly follows a model's work in this cycle as one fused step; then the
other ops (create, save, load, unload), which are barriers for their own model only. An
optim_step that heads its model's line (its forward_backward ran in an earlier cycle) does not
depend on this cycle's call, so those run as one fused step *before* it: a light tenant's step
that arrived just after its forward_backward was planned does not wait behind another tenant's
pass. Tombstones (calls the gateway refused) run nothing: they are settled wherever they
stand in a model's line, so they never hold it up.

Fairness: the call is filled in rounds, one op per model per round, models ordered by their
tenant's virtual start, then the model's own (least first; `FairShare`: start-time fair queueing
on tokens). So a tenant flooding the queue takes at most one op per round, a light tenant's op
(or a tenant's light model) leads the very next call, a share of a crowded cycle does not grow
with a backlog, and a tenant that trained alone waits at most a round when others arrive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocol.jobs import ForwardBackwardJob, OptimStepJob, TombstoneJob
from workers.trainer.sequencer import Pending

H = TypeVar("H")


@dataclass
class Cycle(Generic[H]):
    """One cycle: the lone optimizer steps, a shared pass, a fused optimizer step, then the
    rest, in that order."""

    early_steps: list[Pending[H]] = field(default_factory=list)  # heads of their line
    shared_pass: list[Pending[H]] = field(default_factory=list)
    optim_steps: list[Pending[H]] = field(default_factory=list)
    others: list[Pending[H]] = field(default_factory=list)
    settled: list[Pending[H]] = field(default_factory=list)  # tombstones: nothing to run
    # the earliest time a model held back by its tenant's rate limit may go on (None: none)
    wake_at: float | None = None

    def __bool__(self) -> bool:
        return bool(
            self.early_steps or self.shared_pass or self.optim_steps or self.others or self.settled
        )


def plan(
    ready: dict[str, list[Pending[H]]],
    token_budget: int,
    now: float = float("inf"),
    served: Mapping[str, float] | None = None,
) -> Cycle[H]:
    """Plan one cycle from each model's in-order ready run.

    A model's forward_backward prefix joins the call op by op, in rounds (see the module
    docstring), while the budget allows (a call always takes at least one op, however large).
    Its optim_step follows the call only when its whole prefix joined it; one with no
    prefix is an early step. A forward_backward whose tenant's rate
    limit holds it until `not_before` > `now` stops its model's run there; `wake_at` says when
    to plan again. `served`: the virtual finish tag of each tenant and model by `FairShare.key`
    (`FairShare.finish`; one not there was idle and goes first; none at all: first come, first
    served).
    """
    cycle: Cycle[H] = Cycle()
    share = served or {}

    def start(model_id: str) -> tuple[float, float]:
        tenant = FairShare.key("tenant", ready[model_id][0].job.tenant_id)
        return share.get(tenant, 0.0), share.get(FairShare.key("model", model_id), 0.0)

    order = sorted(ready, key=start)
    position = dict.fromkeys(order, 0)  # each model's next op
    ran_work = dict.fromkeys(order, False)  # whether a model has work in this cycle's call
    open_models = list(order)
    tokens = 0
    while open_models:
        still_open: list[str] = []
        for model_id in open_models:
            run, i = ready[model_id], position[model_id]
            while i < len(run) and isinstance(run[i].job, TombstoneJob):
                cycle.settled.append(run[i])
                i += 1
            position[model_id] = i
            if i == len(run):
                continue
            job = run[i].job
            if not isinstance(job, ForwardBackwardJob):
                continue  # the head of what is left: an optim_step or a barrier
            if job.not_before > now:
                wake = job.not_before
                cycle.wake_at = wake if cycle.wake_at is None else min(cycle.wake_at, wake)
                continue
            if cycle.shared_pass and tokens + job.n_tokens > token_budget:
                continue  # over budget: the rest of this model waits
            cycle.shared_pass.append(run[i])
            tokens += job.n_tokens
            ran_work[model_id] = True
            position[model_id] = i + 1
            still_open.append(model_id)
        open_models = still_open
    for model_id in order:
        run, i = ready[model_id], position[model_id]
        if i == len(run):
            continue
        head = run[i].job
        if isinstance(head, ForwardBackwardJob):
            continue  # over budget or rate-limited
        if isinstance(head, OptimStepJob):
            (cycle.optim_steps if ran_work[model_id] else cycle.early_steps).append(run[i])
        elif not ran_work[model_id]:
            cycle.others.append(run[i])
    return cycle


class FairShare:
    """Start-time fair queueing on tokens, per tenant and per model (keyed by `key`).

    Each key's finish tag is the virtual time up to which it has been served; the virtual clock
    is the latest start of the latest call. A key starts its next op at its finish tag, or at
    the clock if that is later (it was idle). So a key with a backlog starts after its own
    finish, a light key that comes back starts at the clock, ahead of the backlog, and an idle
    key banks nothing: a tenant that trained alone is not held back behind newcomers catching
    up on its history, only behind their first ops. Nor is a tenant that used room a light one
    left in shared calls: the clock keeps up with the furthest start served. The scheduler
    orders models by their tenant's tag, then their own; the service records each call's
    tokens.
    """

    def __init__(self) -> None:
        self.finish: dict[str, float] = {}  # only keys ahead of the clock (the others start at it)
        self.clock = 0.0

    @staticmethod
    def key(kind: str, name: str) -> str:
        return f"{kind}:{name}"

    def record(self, served: Iterable[tuple[str, str, int]]) -> None:
        """Serve the (tenant_id, model_id, tokens) of one call, in the call's order."""
        starts = [self.clock]
        for tenant_id, model_id, count in served:
            starts.append(self._serve(self.key("tenant", tenant_id), count))
            self._serve(self.key("model", model_id), count)
        self.clock = max(starts)
        # Keys the clock caught up with start at it anyway: idle tenants cost nothing.
        self.finish = {key: tag for key, tag in self.finish.items() if tag > self.clock}

    def _serve(self, key: str, count: int) -> float:
        """Move `key`'s finish tag on by `count` tokens; the start of that service."""
        start = max(self.clock, self.finish.get(key, self.clock))
        self.finish[key] = start + count
        return start
