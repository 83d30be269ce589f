"""The shard lease plan: pure decisions over leases and live workers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.records import LeaseRecord
from workers.trainer.leases import plan

N = 16


def leases_of(owners: dict[int, str], expires_at: float = 100.0) -> dict[int, LeaseRecord]:
    return {
        shard: LeaseRecord(
            pool="p", shard=shard, worker_id=who, expires_at=expires_at, claimed_at=0
        )
        for shard, who in owners.items()
    }


def test_a_lone_worker_takes_every_shard() -> None:
    assert plan(N, "a", {}, {"a"}, now=0.0).claim == tuple(range(N))


def test_a_newcomer_gets_half_handed_over() -> None:
    leases = leases_of(dict.fromkeys(range(N), "a"))
    first = plan(N, "a", leases, {"a", "b"}, now=0.0)
    assert first.release == tuple(range(8, N)) and first.claim == ()
    for shard in first.release:
        del leases[shard]
    assert plan(N, "b", leases, {"a", "b"}, now=0.0).claim == tuple(range(8, N))


def test_a_dead_workers_shards_are_taken_at_once_and_not_handed_back() -> None:
    owners = {shard: ("a" if shard < 8 else "b") for shard in range(N)}
    leases = leases_of(owners)
    for shard in range(8, N):
        leases[shard].expires_at = 5.0  # b stopped renewing
    # b's heartbeat still looks fresh: it must count as dead all the same
    decided = plan(N, "a", leases, {"a", "b"}, now=10.0)
    assert decided.claim == tuple(range(8, N)) and decided.release == ()


@given(st.integers(1, 6), st.integers(1, 64))
def test_rounds_settle_every_shard_with_one_owner_and_an_even_spread(
    n_workers: int, n_shards: int
) -> None:
    """Workers taking turns converge: every shard owned, nobody more than one above the share."""
    workers = [f"w{i}" for i in range(n_workers)]
    leases: dict[int, LeaseRecord] = {}
    for _ in range(6):
        for me in workers:
            decided = plan(n_shards, me, leases, set(workers), now=0.0)
            for shard in decided.release:
                del leases[shard]
            for shard in decided.claim:
                leases[shard] = LeaseRecord("p", shard, me, expires_at=100.0, claimed_at=0.0)
    assert set(leases) == set(range(n_shards))
    share = -(-n_shards // n_workers)
    counts = [sum(lease.worker_id == w for lease in leases.values()) for w in workers]
    assert max(counts) <= share + 1


# -- how a logged op is replayed when a model is taken over --------------------------------------


def test_replay_modes_follow_the_stored_outcome() -> None:
    from protocol.api import AdamParams
    from protocol.jobs import ForwardBackwardJob, OptimStepJob, SaveWeightsJob
    from workers.trainer.recovery import replay_mode

    train = ForwardBackwardJob(request_id="r", model_id="m", tenant_id="t", seq_id=3)
    forward = ForwardBackwardJob(
        request_id="r", model_id="m", tenant_id="t", seq_id=3, forward_only=True
    )
    step = OptimStepJob(request_id="r", model_id="m", tenant_id="t", seq_id=4, adam=AdamParams())
    save = SaveWeightsJob(request_id="r", model_id="m", tenant_id="t", seq_id=5, name="x")
    for job in (train, forward, step, save):
        assert replay_mode(job, None) == "publish"  # never finished: run and answer
        assert replay_mode(job, "pending") == "publish"
        assert replay_mode(job, "error") == "skip"  # a failed request changed nothing
    assert replay_mode(train, "done") == "quiet"  # rebuild the state, answer nothing
    assert replay_mode(step, "done") == "quiet"
    assert replay_mode(forward, "done") == "skip"  # changed nothing
    assert replay_mode(save, "done") == "skip"  # its files exist
