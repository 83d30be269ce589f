"""The JSON `forward_backward`/`forward` bodies of the tinker SDKs before protobuf bodies (0.16.1
sends them), converted at the gateway's door (`protocol.json_tensors`): the same request as the
protobuf body SDK 0.38 sends, every field a client controls refused with its place when it
cannot be carried; and a damaged protobuf body's `model_id` and `seq_id` read before the damage
(`protocol.tensors.forward_backward_ref`)."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from protocol import api
from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError
from protocol.json_tensors import answer_json, forward_backward_from_json, is_json, wants_protobuf
from protocol.sampling import SampledSequence, SampleOutput, encode_sample_response
from protocol.tensors import (
    decode_forward_backward,
    encode_forward_backward_output,
    forward_backward_ref,
)


def _body(datums: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A JSON body as tinker 0.16.1 writes it (`exclude_unset`: a chunk's `type` left out)."""
    return {
        "forward_backward_input": {"data": datums, "loss_fn": "cross_entropy", **extra},
        "model_id": "m",
        "seq_id": 3,
    }


def _datum(tokens: list[int], targets: list[int], weights: list[float]) -> dict[str, Any]:
    return {
        "loss_fn_inputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [len(targets)]},
            "weights": {"data": weights, "dtype": "float32", "shape": [len(weights)]},
        },
        "model_input": {"chunks": [{"tokens": tokens}]},
    }


def _convert(body: dict[str, Any], forward_only: bool = False) -> bytes:
    return forward_backward_from_json(json.dumps(body).encode(), forward_only=forward_only)


def test_a_json_body_is_the_protobuf_body_of_the_same_call() -> None:
    body = _body(
        [_datum([1, 2, 3], [2, 3, 4], [1.0, 0.5, 0.25]), _datum([7], [8], [1.0])],
        loss_fn_config={"clip_low_threshold": 0.8},
    )
    converted = _convert(body)
    want = pb.ForwardBackwardRequest(
        model_id="m", seq_id=3, loss_fn="cross_entropy", loss_fn_config={"clip_low_threshold": 0.8}
    )
    for tokens, targets, weights in (([1, 2, 3], [2, 3, 4], [1.0, 0.5, 0.25]), ([7], [8], [1.0])):
        datum = want.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(
                dense=np.asarray(targets, "<i8").tobytes(),
                dtype=pb.DTYPE_INT64,
                shape=[len(targets)],
            )
        )
        datum.loss_fn_inputs["weights"].CopyFrom(
            pb.Tensor(
                dense=np.asarray(weights, "<f4").tobytes(),
                dtype=pb.DTYPE_FLOAT32,
                shape=[len(weights)],
            )
        )
    assert pb.ForwardBackwardRequest.FromString(converted) == want
    assert converted == _convert(body)  # the same bytes again: a retry is a retry
    request = decode_forward_backward(converted)
    assert not request.forward_only and [d.tokens.tolist() for d in request.datums] == [
        [1, 2, 3],
        [7],
    ]
    # a ForwardRequest is the same call, forward-only
    forward = {"forward_input": body["forward_backward_input"], "model_id": "m", "seq_id": 4}
    assert decode_forward_backward(_convert(forward, forward_only=True)).forward_only


def test_images_travel_as_their_bytes() -> None:
    png = b"\x89PNG not really"
    datum = _datum([1], [2], [1.0])
    datum["model_input"]["chunks"] = [
        {"tokens": [1]},
        {
            "type": "image",
            "data": base64.b64encode(png).decode(),
            "format": "png",
            "expected_tokens": 6,
        },
    ]
    [chunk_text, chunk_image] = (
        pb.ForwardBackwardRequest.FromString(_convert(_body([datum]))).data[0].model_input
    )
    assert chunk_text.WhichOneof("chunk") == "encoded_text"
    assert (
        chunk_image.image.data,
        chunk_image.image.format,
        chunk_image.image.expected_tokens,
    ) == (png, "png", 6)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(
                tokens=[2**31]
            ),
            "outside int32",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(
                tokens=[-(2**31) - 1]
            ),
            "outside int32",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][0].update(
                tokens=[2**70]
            ),
            "outside int32",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(
                shape=[5]
            ),
            "does not hold",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(
                shape=[-1, -1]
            ),
            "does not hold",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(
                data=[1e39, 1.0]
            ),
            "does not fit float32",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"][
                "target_tokens"
            ].update(data=[2**64, 1]),
            "does not fit int64",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"][
                "target_tokens"
            ].update(data=[1.5, 1]),
            "non-integer",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"].update(
                dtype="bfloat16"
            ),
            "not a valid forward_backward request",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"].append(
                {"type": "image", "data": "@@@", "format": "png"}
            ),
            "not base64",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"].append(
                {"location": "http://x/y.png", "format": "png"}
            ),
            "image_asset_pointer",
        ),
        (
            lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"].append(
                {"type": "image", "format": "png"}
            ),
            "needs its data",
        ),
        (lambda b: b.update(surprise=1), "not a valid forward_backward request"),
        (lambda b: b.update(seq_id=2**40), "out of range"),
        (lambda b: b.pop("forward_backward_input"), "has no forward_backward_input"),
    ],
)
def test_what_protobuf_cannot_carry_is_refused_naming_it(change: Any, fragment: str) -> None:
    body = _body([_datum([1, 2], [2, 3], [1.0, 1.0])])
    change(body)
    with pytest.raises(UserError) as refused:
        _convert(body)
    assert fragment in str(refused.value)


def test_json_is_told_from_protobuf() -> None:
    assert is_json("application/json", b"")
    assert is_json("", b'{"model_id": "m"}')
    protobuf = pb.ForwardBackwardRequest(model_id="m", seq_id=1).SerializeToString()
    assert not is_json("application/x-protobuf", protobuf)
    with pytest.raises(UserError, match="not valid JSON"):
        forward_backward_from_json(b"{nope", forward_only=False)
    with pytest.raises(UserError, match="nested too deeply|not a valid"):
        forward_backward_from_json(b'{"model_id": ' + b"[" * 100_000, forward_only=False)


def test_a_damaged_protobuf_body_still_names_its_seq() -> None:
    message = pb.ForwardBackwardRequest(model_id="abc", seq_id=7, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00"
    body = message.SerializeToString()
    assert forward_backward_ref(body) == ("abc", 7)
    assert forward_backward_ref(body[:-2] + b"\xff\xff\xff") == ("abc", 7)  # damaged after
    assert forward_backward_ref(body[:4]) is None  # cut inside model_id
    assert forward_backward_ref(pb.ForwardBackwardRequest(model_id="z").SerializeToString()) == (
        "z",
        0,
    )
    assert forward_backward_ref(b"\x0a\x01z\x22\xff") is None  # damaged before any seq_id
    assert forward_backward_ref(b"\x0a\x02\xff\xfe\x10\x01") is None  # model_id not UTF-8


def test_a_json_prompt_whose_chunks_leave_out_their_type_decodes() -> None:
    """tinker 0.16.1 leaves out a chunk's default `type`: the chunk's fields tell it."""
    body = {
        "prompt": {"chunks": [{"tokens": [1, 2]}, {"type": "encoded_text", "tokens": [3]}]},
        "sampling_params": {"max_tokens": 4},
        "sampling_session_id": "s",
    }
    request = api.decode(json.dumps(body).encode(), api.SampleRequest)
    assert [chunk.tokens for chunk in request.prompt.chunks] == [[1, 2], [3]]  # type: ignore[union-attr]
    body["prompt"] = {"chunks": [{"format": "png"}]}  # an image without its data
    with pytest.raises(UserError, match="invalid SampleRequest body"):
        api.decode(json.dumps(body).encode(), api.SampleRequest)


def test_answers_read_as_json_by_older_sdks() -> None:
    """A finished forward_backward or sample answers JSON to a client that does not ask for
    protobuf: the same arrays, metrics, tokens and logprobs (NaN, not computed, as null)."""
    assert wants_protobuf("application/x-protobuf, application/json")
    assert not wants_protobuf("application/json") and not wants_protobuf("")
    outputs = [
        {"logprobs": np.array([-1.5, -0.25], np.float32)},
        {"logprobs": np.array([-2.0], np.float32)},
    ]
    payload = encode_forward_backward_output(outputs, {"loss:sum": 3.75})
    answer = json.loads(answer_json("forward_backward", payload))
    assert answer["metrics"] == {"loss:sum": 3.75}
    assert answer["loss_fn_outputs"][0]["logprobs"] == {
        "data": [-1.5, -0.25],
        "dtype": "float32",
        "shape": [2],
    }
    sampled = SampleOutput(
        [SampledSequence(tokens=[5, 6], logprobs=[-0.5, -1.0], stop_reason="length")],
        prompt_logprobs=[None, -0.75],
    )
    answer = json.loads(answer_json("sample", encode_sample_response(sampled)))
    assert answer["sequences"] == [
        {"stop_reason": "length", "tokens": [5, 6], "logprobs": [-0.5, -1.0]}
    ]
    assert answer["prompt_logprobs"] == [None, -0.75] and answer["type"] == "sample"
