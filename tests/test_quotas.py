"""Quota arithmetic and key minting: the pure cores of `quotas.py` and `auth.py`.

The in-flight samples' KV shell, shared by two gateways, is tested in `test_in_flight_samples.py`.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import records
from protocol.errors import QuotaExceeded, RateLimited
from protocol.records import InFlightSamples, QuotaRecord
from protocol.rules import MAX_ID_CHARS
from twinkle_async.auth import KEY_PREFIX, hash_key, mint_key
from twinkle_async.futures import new_request_id
from twinkle_async.quotas import (
    MAX_IN_FLIGHT,
    admit_sample,
    check_cap,
    check_limit,
    check_room,
    effective,
    live_samples,
    release_sample,
    take,
)
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


def _admitted(
    record: InFlightSamples | None,
    request_id: str,
    limit: int,
    now: float,
    ttl_s: float,
    cap: int = MAX_IN_FLIGHT,
) -> InFlightSamples:
    admitted = admit_sample(record, request_id, limit, now, ttl_s, cap)
    assert admitted is not None
    return admitted


def test_in_flight_samples_expire_and_finish() -> None:
    record = _admitted(None, "a", 3, 0.0, 10.0)
    record = _admitted(record, "b", 3, 5.0, 10.0)
    assert set(live_samples(record, 6.0, 10.0)) == {"a", "b"}
    released = release_sample(record, "b")
    assert released is not None and set(live_samples(released, 6.0, 10.0)) == {"a"}
    assert live_samples(released, 11.0, 10.0) == {}  # a client that never asked stops counting


def test_a_full_tenant_is_refused_but_a_retried_submit_is_admitted_again() -> None:
    record = _admitted(_admitted(None, "a", 2, 0.0, 10.0), "b", 2, 1.0, 10.0)
    today = "quota max_concurrent_samples: 2 sample requests in flight; retry when one finishes"
    with pytest.raises(RateLimited, match=f"^{today}$"):
        admit_sample(record, "c", 2, 2.0, 10.0)
    assert admit_sample(record, "a", 2, 2.0, 10.0) is None  # in already: nothing to write
    # an expired entry frees its slot, and the write drops it
    later = _admitted(record, "c", 2, 10.5, 10.0)
    assert later.started == {"b": 1.0, "c": 10.5}


def test_a_release_writes_only_when_the_request_is_in() -> None:
    record = _admitted(None, "a", 2, 0.0, 10.0)
    assert release_sample(None, "a") is None
    assert release_sample(record, "zzz") is None
    assert release_sample(record, "a") == InFlightSamples(started={})
    assert record.started == {"a": 0.0}  # the input is left as it was


def test_the_record_is_capped_whatever_the_limit() -> None:
    record = None
    for i in range(3):
        record = _admitted(record, f"r{i}", 1_000_000, 0.0, 10.0, 3)
    with pytest.raises(RateLimited, match=r"3 sample requests .* the most this cluster keeps"):
        admit_sample(record, "r3", 1_000_000, 0.0, 10.0, 3)


def test_a_full_record_fits_one_message_of_a_stock_nats_server() -> None:
    """The cap in entries bounds the KV value: longest request ids, a stock 1 MiB max_payload."""
    longest = {"x" * (MAX_ID_CHARS - 6) + f"{i:06d}": 1.7e9 + i for i in range(MAX_IN_FLIGHT)}
    assert len(records.encode(InFlightSamples(started=longest))) < 1024 * 1024 * 0.6
    ours = {new_request_id("sample"): 1.7e9 for _ in range(MAX_IN_FLIGHT)}
    assert len(records.encode(InFlightSamples(started=ours))) < 256 * 1024


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 15), st.floats(0.0, 5.0)), min_size=1, max_size=60
    ),
    st.integers(0, 6),
    st.integers(1, 8),
)
def test_never_more_in_flight_than_the_limit_or_the_cap(
    ops: list[tuple[bool, int, float]], limit: int, cap: int
) -> None:
    """Admits and releases in any order, the clock moving on: every admit that succeeds leaves
    at most `min(limit, cap)` live requests, and one refused only when that many are live."""
    record: InFlightSamples | None = None
    now = 0.0
    for is_admit, n, step_s in ops:
        now += step_s
        request_id = f"r{n}"
        if not is_admit:
            record = release_sample(record, request_id) or record
            continue
        live = live_samples(record, now, 10.0)
        try:
            admitted = admit_sample(record, request_id, limit, now, 10.0, cap)
        except RateLimited:
            assert request_id not in live and len(live) >= min(limit, cap)
            continue
        if admitted is None:
            assert request_id in live
        else:
            record = admitted
            assert request_id in record.started and len(record.started) <= min(limit, cap)


def test_keys_are_minted_random_and_stored_only_hashed() -> None:
    key, key_id = mint_key()
    other, other_id = mint_key()
    assert key.startswith(KEY_PREFIX) and len(key) > 40 and key != other and key_id != other_id
    assert hash_key(key) != key and len(hash_key(key)) == 64 and key not in hash_key(key)
