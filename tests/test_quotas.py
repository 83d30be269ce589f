"""Quota arithmetic and key minting: the pure cores of `quotas.py` and `auth.py`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import QuotaExceeded
from protocol.records import QuotaRecord
from twinkle_async.auth import KEY_PREFIX, hash_key, mint_key
from twinkle_async.quotas import InFlight, check_cap, check_limit, check_room, effective, take
from twinkle_async.settings import Limits


def test_a_tenant_record_overrides_the_defaults_limit_by_limit() -> None:
    defaults = Limits(max_adapters=4, max_rank=32)
    record = QuotaRecord(tenant_id="t", max_rank=8, tokens_per_minute=1000)
    assert effective(defaults, record) == Limits(max_adapters=4, max_rank=8, tokens_per_minute=1000)
    assert effective(defaults, None) == defaults


def test_caps_name_the_limit_and_the_current_value() -> None:
    check_cap("max_adapters", 1, 1, 2)
    check_cap("max_adapters", 5, 1, None)
    with pytest.raises(QuotaExceeded, match=r"max_adapters exceeded: 2 in use.*limit is 2"):
        check_cap("max_adapters", 2, 1, 2)
    with pytest.raises(QuotaExceeded, match=r"max_rank exceeded: this request needs 64"):
        check_limit("max_rank", 64, 32)
    with pytest.raises(QuotaExceeded, match=r"100 used, the limit is 100"):
        check_room("max_checkpoint_bytes", 100, 100)


def test_the_bucket_bursts_then_queues_in_order() -> None:
    bucket, start = take(None, 50, per_minute=600, now=100.0, burst_s=10.0)  # 10 tok/s, cap 100
    assert start == 100.0 and bucket.level == 50
    bucket, start = take(bucket, 50, 600, 100.0, 10.0)
    assert start == 100.0 and bucket.level == 0
    bucket, start = take(bucket, 30, 600, 100.0, 10.0)
    assert start == pytest.approx(103.0)  # 30 tokens of debt at 10 tokens/s
    bucket, start = take(bucket, 10, 600, 101.0, 10.0)
    assert start == pytest.approx(104.0)  # behind the first request's debt
    bucket, start = take(bucket, 1, 600, 1000.0, 10.0)
    assert start == 1000.0 and bucket.level == pytest.approx(99.0)  # refilled to the cap


@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=30),
    st.integers(60, 100_000),
    st.floats(1.0, 120.0),
)
def test_over_time_the_bucket_never_admits_more_than_its_rate(
    sizes: list[int], per_minute: int, burst_s: float
) -> None:
    """Every request starts no earlier than the rate allows after the initial burst."""
    bucket = None
    admitted = 0
    for size in sizes:
        bucket, start = take(bucket, size, per_minute, 0.0, burst_s)
        admitted += size
        allowed = per_minute / 60.0 * (burst_s + start)
        assert admitted <= allowed + 1e-6


def test_in_flight_samples_expire_and_finish() -> None:
    flight = InFlight(ttl_s=10.0)
    flight.add("t", "a", 0.0)
    flight.add("t", "b", 5.0)
    assert flight.count("t", 6.0) == 2
    flight.done("t", "b")
    assert flight.count("t", 6.0) == 1
    assert flight.count("t", 11.0) == 0  # a client that never asked stops counting


def test_keys_are_minted_random_and_stored_only_hashed() -> None:
    key, key_id = mint_key()
    other, other_id = mint_key()
    assert key.startswith(KEY_PREFIX) and len(key) > 40 and key != other and key_id != other_id
    assert hash_key(key) != key and len(hash_key(key)) == 64 and key not in hash_key(key)
