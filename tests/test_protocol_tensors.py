"""protocol.tensors against the official tinker SDK's own code paths: forward_backward bodies the
SDK encodes decode to the same arrays, and the outputs we encode decode with the SDK's proto
conversion.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import tinker_public_pb2 as sdk_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from protocol import tinker_wire_pb2 as pb
from protocol.errors import PayloadTooLarge, UserError
from protocol.tensors import (
    DatumArrays,
    FwdBwdRequest,
    decode_forward_backward,
    decode_forward_backward_output,
    encode_forward_backward,
    encode_forward_backward_output,
    numpy_to_tensor,
    scan_forward_backward,
    tensor_to_numpy,
)

# -- forward_backward request: SDK encoder -> our decoder ----------------------------------------


def _sdk_body(
    data: list[types.Datum],
    loss_fn: Any = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    forward_only: bool = False,
) -> bytes:
    """The exact bytes `AsyncTrainingResource.forward_backward` posts (before optional zstd)."""
    fwd_bwd_input = types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=fwd_bwd_input,
        model_id="sess-1:train:0",
        seq_id=7,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    body: bytes = message.SerializeToString()
    return body


def _sparse_2d(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    dense = torch.zeros(rows, cols, dtype=dtype)
    dense[0, 1] = 5
    dense[2, 0] = 7
    dense[3, cols - 1] = 9
    return dense


def test_sdk_request_decodes_to_the_same_arrays() -> None:
    n = 4
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 1.0, 1.0, 0.5]},
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[
                    types.EncodedTextChunk(tokens=[9, 8]),
                    types.EncodedTextChunk(tokens=[7, 70000]),
                ]
            ),
            loss_fn_inputs={
                "target_tokens": np.array([8, 7, 70000, 1], dtype=np.int64),
                "logprobs": np.array([-0.5, -1.5, -2.0, -0.25], dtype=np.float32),
                "advantages": np.array([1.0, -1.0, 0.5, 2.0], dtype=np.float64),
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={
                "target_tokens": torch.tensor([6, 7, 8, 9], dtype=torch.int32),
                "weights": torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.bfloat16),
                "sequence_ratio_mask": torch.ones(n),
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 1, 1, 1]),
            loss_fn_inputs={
                "target_tokens": _sparse_2d(n, 6, torch.int64),
                "weights": _sparse_2d(n, 6, torch.float32) / 10,
            },
        ),
    ]
    assert data[3].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # sent as CSR
    body = _sdk_body(
        data, "ppo", loss_fn_config={"clip_low_threshold": 0.8, "loss_id": "abc"}, forward_only=True
    )

    request = decode_forward_backward(body)

    assert (request.model_id, request.seq_id, request.loss_fn) == ("sess-1:train:0", 7, "ppo")
    assert request.forward_only is True
    assert request.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8), "loss_id": "abc"}
    assert request.n_tokens == 16
    for sent, got in zip(data, request.datums, strict=True):
        assert got.tokens.dtype == np.int32
        np.testing.assert_array_equal(got.tokens, sent.model_input.to_ints())
        assert sorted(got.inputs) == sorted(sent.loss_fn_inputs)
        for name, tensor in sent.loss_fn_inputs.items():
            expected = tensor.to_numpy()
            assert got.inputs[name].dtype == expected.dtype, name
            assert got.inputs[name].shape == expected.shape, name
            np.testing.assert_array_equal(got.inputs[name], expected)
            assert got.inputs[name].flags.writeable
    assert request.datums[3].inputs["target_tokens"][3, 5] == 9


def test_wire_dtypes_the_sdk_does_not_send() -> None:
    values = np.array([1.5, -2.0, 0.0, 3.25], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    int32 = np.array([1, -2, 2**31 - 1], dtype="<i4").tobytes()
    np.testing.assert_array_equal(
        tensor_to_numpy(pb.Tensor(dtype=pb.DTYPE_BFLOAT16, dense=bf16, shape=[2, 2])),
        values.reshape(2, 2),
    )
    widened = tensor_to_numpy(pb.Tensor(dtype=pb.DTYPE_INT32, dense=int32))
    assert widened.dtype == np.int64
    np.testing.assert_array_equal(widened, [1, -2, 2**31 - 1])
    round_trip = tensor_to_numpy(numpy_to_tensor(np.arange(6, dtype=np.int64).reshape(2, 3)))
    np.testing.assert_array_equal(round_trip, np.arange(6).reshape(2, 3))


def test_loss_fn_config_v2_wins_and_legacy_numbers_are_kept() -> None:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="ppo")
    message.loss_fn_config["beta"] = 0.5
    message.loss_fn_config["clip_low_threshold"] = 0.1
    message.loss_fn_config_v2["clip_low_threshold"].number = 0.8
    message.loss_fn_config_v2["name"].text = "x"
    request = decode_forward_backward(message.SerializeToString())
    assert request.loss_fn_config == {"beta": 0.5, "clip_low_threshold": 0.8, "name": "x"}


def test_our_request_encoder_round_trips_and_parses_as_the_sdk_proto() -> None:
    request = FwdBwdRequest(
        model_id="m",
        seq_id=3,
        loss_fn="cross_entropy",
        forward_only=False,
        loss_fn_config={"a": 1.0, "b": "t"},
        datums=[
            DatumArrays(
                tokens=np.array([1, 2, 3], dtype=np.int32),
                inputs={
                    "target_tokens": np.array([2, 3, 4], dtype=np.int64),
                    "weights": np.ones((3, 2), dtype=np.float32),
                },
            )
        ],
    )
    body = encode_forward_backward(request)
    again = decode_forward_backward(body)
    assert again.loss_fn_config == request.loss_fn_config
    np.testing.assert_array_equal(again.datums[0].tokens, [1, 2, 3])
    np.testing.assert_array_equal(again.datums[0].inputs["weights"], np.ones((3, 2)))
    assert sdk_pb.ForwardBackwardRequest.FromString(body).seq_id == 3


def _tensor(**kwargs: Any) -> pb.Tensor:
    return pb.Tensor(**kwargs)


def _body_with(datum: pb.Datum) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    message.data.add()  # datum 0 is fine; the broken one is datum 1
    message.data[0].model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00"
    message.data.append(datum)
    body: bytes = message.SerializeToString()
    return body


def _datum(tokens: bytes = b"\x01\x00\x00\x00", **inputs: pb.Tensor) -> pb.Datum:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = tokens
    for name, tensor in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return datum


def _csr(values: bytes, crow: list[int], col: list[int], shape: list[int]) -> pb.Tensor:
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape)
    tensor.sparse_csr.values = values
    tensor.sparse_csr.crow_indices = np.array(crow, dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array(col, dtype="<i8").tobytes()
    return tensor


_F2 = np.array([1.0, 2.0], dtype="<f4").tobytes()
_IMAGE = pb.Datum()
_IMAGE.model_input.add().image.data = b"\x89PNG"
_DMEL = pb.Datum()
_DMEL.model_input.add().dmel.dmel = b"\x00"

MALFORMED = {
    "image chunk": (_IMAGE, "image chunk"),
    "dmel chunk": (_DMEL, "dmel"),
    "token bytes": (_datum(tokens=b"\x01\x00\x00"), "3 token bytes"),
    "dense bytes": (_datum(weights=_tensor(dtype=pb.DTYPE_FLOAT32, dense=b"1234567")), "'weights'"),
    "shape": (_datum(weights=_tensor(dtype=pb.DTYPE_FLOAT32, dense=_F2, shape=[3])), "shape [3]"),
    "dtype": (_datum(weights=_tensor(dense=_F2)), "unsupported dtype"),
    "crow": (_datum(weights=_csr(_F2, [0, 1, 3], [0, 1], [2, 2])), "crow_indices"),
    "col range": (_datum(weights=_csr(_F2, [0, 1, 2], [0, 2], [2, 2])), "out of range"),
    "csr 1-D": (_datum(weights=_csr(_F2, [0, 2], [0, 1], [2])), "2-D shape"),
    "col count": (_datum(weights=_csr(_F2, [0, 1, 2], [0], [2, 2])), "col_indices"),
}


def test_declared_sizes_are_held_to_one_request_budget_before_anything_is_built() -> None:
    """Sparse shapes cost nothing on the wire; the budget counts what densifying would build,
    summed over the whole request, and both the scan and the decode refuse past it."""
    huge = _datum(weights=_csr(_F2, [0, 1, 2], [0, 1], [2, 10**12]))
    with pytest.raises(PayloadTooLarge, match="at most"):
        decode_forward_backward(_body_with(huge))
    # each tensor alone fits, together they do not
    sparse = _csr(_F2, [0, 1, 2], [0, 1], [2, 600])
    body = _body_with(_datum(weights=sparse, advantages=sparse))
    summary = scan_forward_backward(body)
    assert summary.n_elements == 2 * 1200 + 2 and summary.n_datums == 2
    with pytest.raises(PayloadTooLarge):
        decode_forward_backward(body, max_elements=2000)
    assert decode_forward_backward(body, max_elements=summary.n_elements).datums[1].inputs[
        "weights"
    ].shape == (2, 600)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_request_is_a_one_line_user_error(case: str) -> None:
    datum, fragment = MALFORMED[case]
    with pytest.raises(UserError) as caught:
        decode_forward_backward(_body_with(datum))
    message = str(caught.value)
    assert message.startswith("datum 1"), message
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x03\xff\xff\xff"])
def test_unparseable_request_is_a_user_error(body: bytes) -> None:
    with pytest.raises(UserError, match="not a valid ForwardBackwardRequest"):
        decode_forward_backward(body)


# -- forward_backward output: our encoder -> SDK decoder -----------------------------------------


def _outputs() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "logprobs": rng.standard_normal(n).astype(np.float32),
            "elementwise_loss": rng.standard_normal(n),  # float64 goes out as float32
            "top": rng.integers(0, 100, size=(n, k)),
        }
        for n, k in [(4, 2), (3, 2), (5, 3), (2, 2)]
    ]


def test_output_decodes_with_the_sdk() -> None:
    outputs = _outputs()
    metrics = {"loss:sum": 7.5, "tokens:mean": 3.5}
    body = encode_forward_backward_output(outputs, metrics, "CrossEntropyLossReturn")

    result = deserialize_forward_backward_output(body)

    assert result.loss_fn_output_type == "CrossEntropyLossReturn"
    assert result.metrics == metrics
    assert len(result.loss_fn_outputs) == len(outputs)
    for sent, got in zip(outputs, result.loss_fn_outputs, strict=True):
        assert sorted(got) == sorted(sent)
        for name, array in sent.items():
            expected = array.astype(np.float32 if array.dtype.kind == "f" else np.int64)
            assert got[name].shape == list(array.shape)
            np.testing.assert_array_equal(got[name].to_numpy(), expected)
    # Trailing shape [2] then [3] then [2] again: three records.
    assert len(pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs) == 3
    ours = decode_forward_backward_output(body)
    assert ours.metrics == metrics and ours.loss_fn_output_type == "CrossEntropyLossReturn"
    for sent, got_ours in zip(outputs, ours.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(got_ours["top"], sent["top"])


def test_chunk_metric_combining_accepts_our_metrics() -> None:
    outputs = _outputs()
    first = deserialize_forward_backward_output(
        encode_forward_backward_output(outputs[:3], {"loss:sum": 2.0, "acc:mean": 1.0})
    )
    second = deserialize_forward_backward_output(
        encode_forward_backward_output(outputs[3:], {"loss:sum": 3.0, "acc:mean": 0.0})
    )
    combined = combine_fwd_bwd_output_results([first, second])
    assert combined.metrics == {"loss:sum": 5.0, "acc:mean": pytest.approx(0.75)}
    assert len(combined.loss_fn_outputs) == 4


def test_malformed_output_is_a_user_error() -> None:
    message = pb.ForwardBackwardOutput.FromString(
        encode_forward_backward_output([{"a": np.zeros(2)}, {"a": np.zeros(3)}], {})
    )
    message.loss_fn_outputs[0].fields["a"].offsets = np.array([0, 12, 8], dtype="<i8").tobytes()
    with pytest.raises(UserError, match="record 0 field 'a': offsets"):
        decode_forward_backward_output(message.SerializeToString())


def test_empty_output_and_encoder_invariants() -> None:
    empty = deserialize_forward_backward_output(
        encode_forward_backward_output([], {"loss:sum": 0.0})
    )
    assert (empty.loss_fn_output_type, empty.loss_fn_outputs) == ("ArrayRecord", [])
    with pytest.raises(ValueError, match="exactly one ':'"):
        encode_forward_backward_output([], {"loss": 1.0})
    with pytest.raises(ValueError, match="datum 1 has fields"):
        encode_forward_backward_output([{"a": np.zeros(1)}, {"b": np.zeros(1)}], {})
