"""Bounded property-based fuzzing of `retrieve_futures`, `cancel_future` and
`join_sampling_session` against a real cluster, with the harness and targets of
`tests/fuzz_harness.py`: valid bodies with one hostile field (or none), and any JSON at all.
Every answer must come within 10 s, never be a 5xx, carry a JSON error body with a known
category, and never accept another tenant's id; each test fails on the first answer that
does not.

A poll's `timeout` is fuzzed only with values that must be refused or answered at once: any
other number asks the gateway to hold the poll (up to 30 s), which is the endpoint working.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz_harness import (
    DELETE,
    Fuzzer,
    JsonRoute,
    Raw,
    fuzz_settings,
    fuzzer,
    set_field,
    target,
)
from tests.hostile_inputs import HOSTILE_IDS, hostile, json_junk

pytestmark = pytest.mark.e2e
__all__ = ["fuzzer", "target"]  # the fixtures, from tests.fuzz_harness

# fmt: off
ROUTES = [
    JsonRoute(
        "retrieve_futures",
        lambda t: {"target": {"type": "sampling_session", "sampling_session_id": t.sampler,
                              "cloned_sampler_id": 0},
                   "prev_cursor": 0, "timeout": 0, "retrieved_request_ids": [t.request]},
        {"target": "dict", "target.sampling_session_id": "sampler",
         "target.cloned_sampler_id": "int", "target.type": "str", "prev_cursor": "int",
         "retrieved_request_ids": "list", "retrieved_request_ids.0": "request"},
    ),
    JsonRoute(
        "cancel_future",
        lambda t: {"request_id": t.request},
        {"request_id": "request"},
    ),
    JsonRoute(
        "join_sampling_session",
        lambda t: {"sampling_session_id": t.sampler, "type": "join_sampling_session"},
        {"sampling_session_id": "sampler", "type": "str"},
    ),
]
# fmt: on
REFUSED_TIMEOUTS = [-1, -1e-9, 601, 1e300, Raw("1e400"), Raw("NaN"), "1", [], {}, True]


@given(data=st.data())
@fuzz_settings(400)
def test_fuzz_sampling_routes_one_hostile_field(fuzzer: Fuzzer, data: st.DataObject) -> None:
    t = fuzzer.target
    route = data.draw(st.sampled_from(ROUTES), label="route")
    body = copy.deepcopy(route.body(t))
    dotted = data.draw(st.sampled_from(sorted(route.fields)), label="field")
    value = data.draw(
        st.just(DELETE) | hostile(route.fields[dotted], t) | st.sampled_from(HOSTILE_IDS),
        label="value",
    )
    set_field(body, dotted, value)
    # An acknowledged id only drops entries from the caller's own session's log (the session's
    # owner is checked first), so naming another tenant's request there touches nothing of
    # theirs and is answered like any id the log no longer holds.
    acknowledgement = dotted == "retrieved_request_ids.0"
    fuzzer.post_json(route.route, body, t.names_other(value) and not acknowledgement)


@given(data=st.data())
@fuzz_settings(100)
def test_fuzz_poll_timeouts(fuzzer: Fuzzer, data: st.DataObject) -> None:
    body = copy.deepcopy(ROUTES[0].body(fuzzer.target))
    body["timeout"] = data.draw(st.sampled_from(REFUSED_TIMEOUTS), label="timeout")
    resp = fuzzer.post_json("retrieve_futures", body)
    assert resp is not None and resp.status_code == 400, resp.text if resp else None


@given(data=st.data())
@fuzz_settings(150)
def test_fuzz_sampling_routes_random_bodies(fuzzer: Fuzzer, data: st.DataObject) -> None:
    """Any JSON at all, or an object with the route's keys holding any JSON (a poll's timeout
    is kept at 0: see the module docstring)."""
    route = data.draw(st.sampled_from(ROUTES), label="route")
    keys = sorted({f.split(".")[0] for f in route.fields})
    body: Any = data.draw(
        json_junk() | st.fixed_dictionaries({}, optional={k: json_junk() for k in keys}),
        label="body",
    )
    if route.route == "retrieve_futures" and isinstance(body, dict):
        body["timeout"] = 0
    fuzzer.post_json(route.route, body)
