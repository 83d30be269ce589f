"""The per-model sequencer and the cycle planner: pure logic, no I/O."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    Job,
    OptimStepJob,
    SaveWeightsJob,
    TombstoneJob,
)
from workers.trainer.scheduler import FairShare, plan
from workers.trainer.sequencer import Pending, Sequencer


def fwd(model: str, seq: int, tokens: int = 10) -> Job:
    return ForwardBackwardJob(
        request_id=f"r-{model}-{seq}", model_id=model, tenant_id="t", seq_id=seq, n_tokens=tokens
    )


def opt(model: str, seq: int) -> Job:
    return OptimStepJob(request_id=f"r-{model}-{seq}", model_id=model, tenant_id="t", seq_id=seq)


def create(model: str) -> Job:
    return CreateModelJob(request_id=f"r-{model}-0", model_id=model, tenant_id="t", seq_id=0)


def offer(seq: Sequencer[str], job: Job, now: float = 0.0) -> bool:
    return seq.offer(Pending(job=job, handle=job.request_id, received_at=now))


def test_releases_in_seq_order_whatever_the_arrival_order() -> None:
    seq: Sequencer[str] = Sequencer()
    for job in (fwd("a", 3), fwd("a", 2), opt("a", 4), create("a"), fwd("a", 1)):
        assert offer(seq, job)
    assert [p.job.seq_id for p in seq.ready()["a"]] == [0, 1, 2, 3, 4]


def test_waits_for_a_gap_and_rejects_duplicates() -> None:
    seq: Sequencer[str] = Sequencer()
    offer(seq, create("a"))
    seq.applied(create("a"))
    offer(seq, fwd("a", 2))
    assert seq.ready() == {}
    assert not offer(seq, fwd("a", 2)), "a buffered op offered again is a duplicate"
    assert not offer(seq, create("a")), "an applied op offered again is a duplicate"
    offer(seq, fwd("a", 1))
    assert [p.job.seq_id for p in seq.ready()["a"]] == [1, 2]


def test_a_gap_that_never_fills_fails_loudly() -> None:
    seq: Sequencer[str] = Sequencer()
    offer(seq, create("a"), now=0.0)
    seq.applied(create("a"))
    offer(seq, fwd("a", 3), now=1.0)
    offer(seq, opt("a", 4), now=2.0)
    assert seq.stalled(now=50.0, gap_timeout_s=60.0) == {}
    stalled = seq.stalled(now=62.0, gap_timeout_s=60.0)
    assert [p.job.seq_id for p in stalled["a"]] == [3, 4]
    offer(seq, fwd("a", 5))
    assert [p.job.seq_id for p in seq.ready()["a"]] == [5]


def test_a_gap_of_some_seconds_is_reported_before_it_fails() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("a", "b"):
        offer(seq, create(model), now=0.0)
        seq.applied(create(model))
    offer(seq, fwd("a", 2), now=1.0)
    offer(seq, fwd("b", 2), now=3.0)
    assert seq.stalled(now=4.0, gap_timeout_s=60.0) == {}
    assert seq.gapped(now=4.0, after_s=5.0) == []
    assert seq.gapped(now=8.5, after_s=5.0) == ["a", "b"]  # the oldest gap first
    offer(seq, fwd("a", 1), now=9.0)
    seq.stalled(now=9.0, gap_timeout_s=60.0)
    assert seq.gapped(now=9.0, after_s=5.0) == ["b"]  # a's gap filled; nothing was removed
    assert [p.job.seq_id for p in seq.ready()["a"]] == [1, 2]


def test_plan_merges_models_into_one_pass_then_fuses_optim_steps() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("a", "b", "c"):
        offer(seq, create(model))
        seq.applied(create(model))
    for job in (fwd("a", 1), fwd("a", 2), opt("a", 3), fwd("b", 1), opt("b", 2), fwd("b", 3)):
        offer(seq, job)
    offer(seq, SaveWeightsJob(request_id="s", model_id="c", tenant_id="t", seq_id=1, name="x"))
    cycle = plan(seq.ready(), token_budget=1000)
    # the call's order is the engine's business (it groups rows by slot): compare as sets
    assert sorted((p.job.model_id, p.job.seq_id) for p in cycle.shared_pass) == [
        ("a", 1),
        ("a", 2),
        ("b", 1),
    ]
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.optim_steps] == [("a", 3), ("b", 2)]
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.others] == [("c", 1)]


def test_plan_respects_the_token_budget_but_always_takes_one() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("a", "b"):
        offer(seq, create(model))
        seq.applied(create(model))
    offer(seq, fwd("a", 1, tokens=500))
    offer(seq, opt("a", 2))
    offer(seq, fwd("b", 1, tokens=600))
    cycle = plan(seq.ready(), token_budget=100)
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.shared_pass] == [("a", 1)]
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.optim_steps] == [("a", 2)]


def tomb(model: str, seq: int) -> Job:
    return TombstoneJob(
        request_id=f"r-{model}-{seq}", model_id=model, tenant_id="t", seq_id=seq, error="refused"
    )


def test_tombstones_are_settled_where_they_stand_and_never_hold_a_model_up() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("a", "b"):
        offer(seq, create(model))
        seq.applied(create(model))
    for job in (fwd("a", 1), tomb("a", 2), fwd("a", 3), opt("a", 4), tomb("b", 1), fwd("b", 2)):
        offer(seq, job)
    offer(seq, SaveWeightsJob(request_id="s", model_id="b", tenant_id="t", seq_id=3, name="x"))
    cycle = plan(seq.ready(), token_budget=1000)
    assert sorted((p.job.model_id, p.job.seq_id) for p in cycle.shared_pass) == [
        ("a", 1),
        ("a", 3),
        ("b", 2),
    ]
    assert sorted((p.job.model_id, p.job.seq_id) for p in cycle.settled) == [("a", 2), ("b", 1)]
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.optim_steps] == [("a", 4)]
    assert cycle.others == [], "b's save waits for the pass that holds b's earlier work"
    for item in [*cycle.shared_pass, *cycle.settled, *cycle.optim_steps]:
        seq.applied(item.job)
    assert [(p.job.model_id, p.job.seq_id) for p in plan(seq.ready(), 1000).others] == [("b", 3)]


def test_a_tombstone_alone_settles_and_the_next_save_runs_in_the_same_cycle() -> None:
    seq: Sequencer[str] = Sequencer()
    offer(seq, create("a"))
    seq.applied(create("a"))
    offer(seq, tomb("a", 1))
    offer(seq, SaveWeightsJob(request_id="s", model_id="a", tenant_id="t", seq_id=2, name="x"))
    cycle = plan(seq.ready(), token_budget=1000)
    assert [p.job.seq_id for p in cycle.settled] == [1]
    assert [p.job.seq_id for p in cycle.others] == [2]


def test_buffered_tells_a_waiting_op_from_one_the_line_moved_past() -> None:
    seq: Sequencer[str] = Sequencer()
    offer(seq, create("a"))
    seq.applied(create("a"))
    offer(seq, fwd("a", 2))
    assert seq.buffered(fwd("a", 2)) and not seq.buffered(fwd("a", 1))


def fwd_of(model: str, tenant: str, seq: int, tokens: int) -> ForwardBackwardJob:
    return ForwardBackwardJob(
        request_id=f"r-{model}-{seq}",
        model_id=model,
        tenant_id=tenant,
        seq_id=seq,
        body=b"",
        n_tokens=tokens,
    )


def test_a_flooding_tenant_takes_one_op_per_round_and_the_light_one_goes_first() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("flood", "light"):
        offer(seq, create(model))
        seq.applied(create(model))
    for i in range(1, 21):  # twenty queued requests, offered before the light one arrives
        offer(seq, fwd_of("flood", "heavy", i, 100))
    offer(seq, fwd_of("light", "small", 1, 100))
    offer(seq, opt("light", 2))

    cycle = plan(seq.ready(), token_budget=300, served={"tenant:heavy": 5000.0})
    picked = [(p.job.model_id, p.job.seq_id) for p in cycle.shared_pass]
    assert picked[0] == ("light", 1), "the least-served tenant leads the call"
    assert picked == [("light", 1), ("flood", 1), ("flood", 2)]
    assert [p.job.model_id for p in cycle.optim_steps] == ["light"]


def test_an_optim_step_at_the_head_of_its_line_runs_before_the_shared_pass() -> None:
    """A light tenant's optim_step that arrived after its forward_backward was planned goes
    ahead of the flood's next pass: it needs nothing from that pass."""
    seq: Sequencer[str] = Sequencer()
    for model in ("flood", "light", "both"):
        offer(seq, create(model))
        seq.applied(create(model))
    for i in range(1, 6):
        offer(seq, fwd_of("flood", "heavy", i, 100))
    offer(seq, opt("light", 1))  # its forward_backward ran in an earlier cycle
    offer(seq, fwd_of("both", "small", 1, 10))
    offer(seq, opt("both", 2))

    cycle = plan(seq.ready(), token_budget=300, served={"tenant:heavy": 5000.0})
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.early_steps] == [("light", 1)]
    assert [(p.job.model_id, p.job.seq_id) for p in cycle.optim_steps] == [("both", 2)]
    assert ("both", 1) in [(p.job.model_id, p.job.seq_id) for p in cycle.shared_pass]
    assert all(p.job.model_id != "light" for p in cycle.shared_pass)


@given(
    backlog=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    budget=st.integers(1, 40),
)
def test_rounds_give_every_model_an_op_before_any_gets_a_second(
    backlog: list[int], budget: int
) -> None:
    seq: Sequencer[str] = Sequencer()
    for index, count in enumerate(backlog):
        model = f"m{index}"
        offer(seq, create(model))
        seq.applied(create(model))
        for i in range(1, count + 1):
            offer(seq, fwd_of(model, model, i, 3))
    cycle = plan(seq.ready(), token_budget=budget)
    taken = {f"m{i}": 0 for i in range(len(backlog))}
    for item in cycle.shared_pass:
        taken[item.job.model_id] += 1
    assert sum(taken.values()) * 3 <= max(budget, 3)
    # a model got its n-th op only if every model with work left got n - 1
    left = [taken[m] for m, count in zip(taken, backlog, strict=True) if count > taken[m]]
    if left:
        assert max(taken.values()) <= min(left) + 1


def test_fair_share_starts_an_idle_tenant_at_the_clock_and_a_backlog_at_its_finish() -> None:
    share = FairShare()
    share.record([("a", "m1", 100), ("a", "m1", 100)])  # one call, two ops in a row
    assert share.finish == {"tenant:a": 200.0, "model:m1": 200.0} and share.clock == 100.0
    share.record([("a", "m1", 100)])
    assert share.clock == 200.0 and share.finish["tenant:a"] == 300.0
    share.record([("b", "m2", 50)])  # b was idle: it starts at the clock, not at 0
    assert share.finish["tenant:b"] == 250.0 and share.clock == 200.0
    share.record([("a", "m1", 100)])
    assert share.clock == 300.0
    assert "tenant:b" not in share.finish, "the clock passed b's finish: b is idle again"
    share.record([("b", "m2", 10), ("a", "m1", 100)])  # the clock: the furthest start
    assert share.clock == 400.0 and share.finish == {"tenant:a": 500.0, "model:m1": 500.0}


def _cycles_until_served(model: str, share: FairShare, seq: Sequencer[str], budget: int) -> int:
    for cycle_no in range(1, 200):
        cycle = plan(seq.ready(), token_budget=budget, served=share.finish)
        share.record([(p.job.tenant_id, p.job.model_id, p.job.n_tokens) for p in cycle.shared_pass])
        for item in cycle.shared_pass:
            seq.applied(item.job)
        if any(item.job.model_id == model for item in cycle.shared_pass):
            return cycle_no
    raise AssertionError(f"{model} was never served")


def test_a_tenant_that_trained_alone_waits_one_round_when_others_arrive() -> None:
    """Its history is not held against it: the newcomers go first once each, then it is served
    (a decaying count of tokens served lately made it wait until they had caught up)."""
    seq: Sequencer[str] = Sequencer()
    share = FairShare()
    models = ["old", "new1", "new2", "new3"]
    for model in models:
        offer(seq, create(model))
        seq.applied(create(model))
    for i in range(1, 201):
        offer(seq, fwd_of("old", "old", i, 100))
    for _ in range(50):  # the old tenant trains alone for 50 calls
        cycle = plan(seq.ready(), token_budget=100, served=share.finish)
        assert [p.job.model_id for p in cycle.shared_pass] == ["old"]
        share.record([("old", "old", 100)])
        seq.applied(cycle.shared_pass[0].job)
    for model in models[1:]:
        for i in range(1, 101):
            offer(seq, fwd_of(model, model, i, 100))
    assert _cycles_until_served("old", share, seq, budget=100) <= len(models)
    # and from then on, every tenant is served once per round
    for _ in range(3):
        assert _cycles_until_served("old", share, seq, budget=100) <= len(models)


def test_a_tenant_that_used_room_a_light_one_left_is_not_starved_when_a_third_arrives() -> None:
    """A flood that shared calls with a light tenant for a while got more tokens than the light
    one; that was room nobody else wanted, and it is not held against the flood when a third
    tenant arrives (a clock that lagged at the light tenant's start let the newcomer go first
    until it had caught up on all of it)."""
    seq: Sequencer[str] = Sequencer()
    share = FairShare()
    for model in ("light", "flood", "new"):
        offer(seq, create(model))
        seq.applied(create(model))
    for i in range(1, 401):
        offer(seq, fwd_of("light", "light", i, 32))
        offer(seq, fwd_of("flood", "flood", i, 256))
    for _ in range(100):  # light + flood fit one call of 300 tokens
        cycle = plan(seq.ready(), token_budget=300, served=share.finish)
        assert sorted(p.job.model_id for p in cycle.shared_pass) == ["flood", "light"]
        share.record([(p.job.tenant_id, p.job.model_id, p.job.n_tokens) for p in cycle.shared_pass])
        for item in cycle.shared_pass:
            seq.applied(item.job)
    for i in range(1, 101):
        offer(seq, fwd_of("new", "new", i, 256))  # now only two of the three fit a call
    for _ in range(5):
        assert _cycles_until_served("flood", share, seq, budget=300) <= 2
        assert _cycles_until_served("new", share, seq, budget=300) <= 2


def test_within_one_tenant_the_less_served_model_goes_first() -> None:
    seq: Sequencer[str] = Sequencer()
    for model in ("busy", "quiet"):
        offer(seq, create(model))
        seq.applied(create(model))
    offer(seq, fwd_of("busy", "same", 1, 200))
    offer(seq, fwd_of("quiet", "same", 1, 200))
    share = FairShare()
    share.record([("same", "busy", 4000)])
    share.record([("same", "busy", 4000)])
    cycle = plan(seq.ready(), token_budget=300, served=share.finish)
    assert [p.job.model_id for p in cycle.shared_pass] == ["quiet"]
