"""`protocol.stability` and the stable_reinforce loss, without a cluster.

Spans are checked before they index anything (hostile values each get a one-line user error);
records resolve to the runs the spans cover, only for their owner; the worker's check catches a
tampered token or an advantage off the sampled positions; the loss equals an independent
float64 evaluation of its formula, value and gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol import stability
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.stability import Span
from protocol.tensors import decode_forward_backward
from workers.engine.losses import STABLE_REINFORCE, resolve_config

PROMPT = [5, 6, 7, 8]
SAMPLED = [40, 41, 42]
SAMPLED_LP = [-1.5, -0.25, -3.0]


def record(tenant: str = "alice", sequence: str = "req-1-sample-seq0") -> stability.StabilityRecord:
    return stability.new_record(
        sequence=sequence,
        tenant_id=tenant,
        sampling_session_id="s:sample:0",
        prompt_length=len(PROMPT),
        tokens=SAMPLED,
        logprobs=SAMPLED_LP,
        written_at=1.0,
    )


def body(
    spans: list[tuple[str, str, int, int]] | None,
    *,
    targets: list[int] | None = None,
    advantages: list[float] | None = None,
) -> bytes:
    """A stable_reinforce request of one datum: prompt + sampled tokens, shifted by one."""
    full = PROMPT + SAMPLED
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="stable_reinforce")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(full[:-1], "<i4").tobytes()
    n = len(full) - 1
    inputs = {
        "target_tokens": (np.asarray(targets or full[1:], "<i8"), pb.DTYPE_INT64),
        "advantages": (
            np.asarray(advantages or [0.0] * 3 + [1.0] * 3, "<f4"),
            pb.DTYPE_FLOAT32,
        ),
        "logprobs": (np.full(n, -9.0, "<f4"), pb.DTYPE_FLOAT32),
    }
    for name, (array, dtype) in inputs.items():
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = dtype
        tensor.shape.append(n)
        tensor.dense = array.tobytes()
    for kind, sequence, offset, length in spans or []:
        span = datum.loss_fn_input_spans.add()
        arm = span.prompt_tokens if kind == "prompt" else span.sampled_tokens
        arm.sequence_id, arm.offset, arm.length = sequence, offset, length
    return bytes(msg.SerializeToString())


GOOD = [("prompt", "req-1-sample-seq0", 1, 3), ("sampled", "req-1-sample-seq0", 0, 3)]


def test_spans_resolve_to_the_recorded_run_and_replace_the_sent_logprobs() -> None:
    raw = body(GOOD)
    spans = stability.datum_spans(raw)
    assert spans == [[Span("prompt", "req-1-sample-seq0", 1, 3), Span("sampled", *GOOD[1][1:])]]
    slices = stability.slices_for(spans, {"req-1-sample-seq0": record()}, "alice")
    carried = stability.decode_slices(stability.encode_slices(slices))
    request = decode_forward_backward(raw)
    stability.apply_slices(request, carried)
    np.testing.assert_array_equal(
        request.datums[0].inputs["logprobs"], np.asarray([0, 0, 0, *SAMPLED_LP], np.float32)
    )


@pytest.mark.parametrize(
    ("spans", "fragment"),
    [
        (None, "needs provenance on every datum"),
        ([("prompt", "req-1-sample-seq0", 1, 6)], "no sampled token"),
        ([("prompt", "req-1-sample-seq0", 1, 3), ("sampled", "req-1", 0, 2)], "cover 5 positions"),
        ([("prompt", "x", 1, 3), ("sampled", "x", 0, 2**40)], "must be in [0, 2**31)"),
        ([("prompt", "x", -1, 3), ("sampled", "x", 0, 3)], "must be in [0, 2**31)"),
        ([("prompt", "x:y", 1, 3), ("sampled", "x", 0, 3)], "not a sequence id"),
        ([("prompt", "", 1, 3), ("sampled", "x", 0, 3)], "not a sequence id"),
        ([("prompt", "x" * 500, 1, 3), ("sampled", "x", 0, 3)], "not a sequence id"),
        ([("sampled", "x", 0, 0)] * 40, "40 spans for 6 targets"),
    ],
)
def test_malformed_spans_are_refused_before_anything_is_read(
    spans: list[tuple[str, str, int, int]] | None, fragment: str
) -> None:
    with pytest.raises(UserError) as caught:
        stability.datum_spans(body(spans))
    assert fragment in caught.value.message and "\n" not in caught.value.message


def test_a_body_that_is_not_protobuf_is_a_user_error() -> None:
    with pytest.raises(UserError, match="not a valid ForwardBackwardRequest"):
        stability.datum_spans(b"\xff\xff\xff")


@pytest.mark.parametrize(
    ("records", "spans", "fragment"),
    [
        ({}, GOOD, "has no stability record"),
        ({"req-1-sample-seq0": record(tenant="mallory")}, GOOD, "has no stability record"),
        (
            {"req-1-sample-seq0": record()},
            [("prompt", "req-1-sample-seq0", 1, 3), ("sampled", "req-1-sample-seq0", 1, 3)],
            "outside the 3 sampled tokens",
        ),
        (
            {"req-1-sample-seq0": record()},
            [("prompt", "req-1-sample-seq0", 2, 3), ("sampled", "req-1-sample-seq0", 0, 3)],
            "outside the 4 prompt tokens",
        ),
    ],
)
def test_records_resolve_only_for_their_owner_and_within_their_sequence(
    records: dict[str, stability.StabilityRecord],
    spans: list[tuple[str, str, int, int]],
    fragment: str,
) -> None:
    with pytest.raises(UserError) as caught:
        stability.slices_for(stability.datum_spans(body(spans)), records, "alice")
    assert fragment in caught.value.message


@pytest.mark.parametrize(
    ("targets", "advantages", "fragment"),
    [
        ([6, 7, 8, 40, 41, 43], None, "differ from the tokens"),
        (None, [0.5, 0, 0, 1, 1, 1], "not a sampled token"),
    ],
)
def test_the_worker_refuses_a_tampered_token_or_an_advantage_off_the_sampled_positions(
    targets: list[int] | None, advantages: list[float] | None, fragment: str
) -> None:
    raw = body(GOOD, targets=targets, advantages=advantages)
    slices = stability.slices_for(
        stability.datum_spans(raw), {"req-1-sample-seq0": record()}, "alice"
    )
    with pytest.raises(UserError) as caught:
        stability.apply_slices(decode_forward_backward(raw), slices)
    assert fragment in caught.value.message


def test_the_loss_is_truncated_importance_sampling_in_value_and_gradient() -> None:
    rng = np.random.default_rng(3)
    n = 64
    q = rng.normal(-2.0, 1.0, n)
    lp = q + rng.normal(0.0, 1.5, n)  # ratios from e^-4 to e^4: many above the bound
    adv = rng.normal(0.0, 1.0, n) * (rng.random(n) < 0.8)
    settings = resolve_config(STABLE_REINFORCE, {})
    bound = settings["truncation"]
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor(q), "advantages": torch.tensor(adv)}
    loss = STABLE_REINFORCE.elementwise(lp_t, inputs, settings)
    loss.sum().backward()
    # The reference, written out independently: w = min(exp(lp - q), C) where A != 0.
    weight = np.where(adv != 0, np.minimum(np.exp(lp - q), bound), 0.0)
    np.testing.assert_allclose(loss.detach().numpy(), -weight * adv, rtol=1e-12, atol=1e-12)
    assert lp_t.grad is not None
    np.testing.assert_allclose(lp_t.grad.numpy(), -weight * adv, rtol=1e-12, atol=1e-12)
    assert np.sum(np.exp(lp - q)[adv != 0] > bound) > 5  # the bound was exercised
    # far off-policy tokens stay finite
    far = STABLE_REINFORCE.elementwise(
        torch.tensor([0.0, 0.0]),
        {"logprobs": torch.tensor([-1e4, -1e4]), "advantages": torch.tensor([1.0, 0.0])},
        settings,
    )
    assert torch.equal(far, torch.tensor([-bound, -0.0]))


def test_the_truncation_setting_is_checked() -> None:
    assert resolve_config(STABLE_REINFORCE, {"truncation": 5.0})["truncation"] == 5.0
    for bad in (float("nan"), "two"):
        with pytest.raises(UserError):
            resolve_config(STABLE_REINFORCE, {"truncation": bad})
    with pytest.raises(UserError, match="not a setting"):
        resolve_config(STABLE_REINFORCE, {"kl_coeff": 0.1})
