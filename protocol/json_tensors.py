"""The JSON bodies of the tinker SDKs that send `forward_backward` and `forward` as JSON (0.16 to
the last before protobuf), as the protobuf `ForwardBackwardRequest` the rest of the service reads.

Job: one conversion at the gateway's door, so that one decoder (`protocol.tensors`) serves every
SDK: a JSON `ForwardBackwardRequest` (`{"forward_backward_input": {"data": [...], "loss_fn": ...,
"loss_fn_config": {...}}, "model_id": ..., "seq_id": ...}`) or `ForwardRequest` (`forward_input`,
a forward-only pass) becomes the protobuf body SDK 0.38 would have sent for the same call:
- a datum's `model_input.chunks`: `encoded_text` tokens as int32, `image` chunks (base64 in JSON)
  as bytes with their format and expected tokens; an `image_asset_pointer` (a URL the server
  would fetch) is refused;
- its `loss_fn_inputs`: `{data, dtype, shape}` tensors as dense little-endian bytes of their
  dtype (`int64`, `float32`), their shape as given (1-D of `len(data)` when absent).

Invariants: the same JSON body gives the same protobuf bytes (a retry is a retry); nothing but
the body's own fields is read; a value protobuf cannot carry (a token id outside int32, a number
outside float32 where it becomes one) is refused naming its place, never wrapped. The body's size
is bounded by the gateway before this runs.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import msgspec
import numpy as np

from protocol import tinker_wire_pb2 as pb
from protocol.errors import UserError

_DTYPES: dict[str, tuple[np.dtype[Any], pb.DType]] = {
    "int64": (np.dtype("<i8"), pb.DTYPE_INT64),
    "float32": (np.dtype("<f4"), pb.DTYPE_FLOAT32),
}
_INT32 = np.iinfo(np.int32)


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None


class _Chunk(msgspec.Struct, forbid_unknown_fields=True):
    """One chunk; the SDKs leave out `type` where it is the default, so the fields tell."""

    type: Literal["encoded_text", "image", "image_asset_pointer"] | None = None
    tokens: list[int] | None = None
    data: str | None = None
    format: Literal["png", "jpeg"] | None = None
    expected_tokens: int | None = None
    location: str | None = None

    def kind(self) -> str:
        if self.type is not None:
            return self.type
        if self.tokens is not None:
            return "encoded_text"
        return "image_asset_pointer" if self.location is not None else "image"


class _ModelInput(msgspec.Struct, forbid_unknown_fields=True):
    chunks: list[_Chunk]


class _Datum(msgspec.Struct, forbid_unknown_fields=True):
    model_input: _ModelInput
    loss_fn_inputs: dict[str, _Tensor] = {}


class _Input(msgspec.Struct, forbid_unknown_fields=True):
    data: list[_Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    model_id: str
    forward_backward_input: _Input | None = None
    forward_input: _Input | None = None
    seq_id: int | None = None


_DECODER = msgspec.json.Decoder(_Request)


def is_json(content_type: str, body: bytes) -> bool:
    """Whether a `forward_backward`/`forward` body is JSON (its Content-Type says so, or it
    opens as an object: a protobuf body never starts with `{`, field 15 of a wire type the
    request does not have)."""
    return "json" in content_type.lower() or body[:1] == b"{"


def forward_backward_from_json(body: bytes, *, forward_only: bool) -> bytes:
    """The protobuf `ForwardBackwardRequest` of a JSON `ForwardBackwardRequest` (or, with
    `forward_only`, a `ForwardRequest`); a `UserError` naming the first field it cannot carry."""
    what = "forward" if forward_only else "forward_backward"
    try:
        request = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise UserError(f"{what} body is not a valid {what} request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise UserError(f"{what} body is not valid JSON: {exc}") from None
    except RecursionError:
        raise UserError(f"{what} body is nested too deeply") from None
    given = request.forward_input if forward_only else request.forward_backward_input
    field = "forward_input" if forward_only else "forward_backward_input"
    if given is None:
        raise UserError(f"{what} body has no {field}")
    seq_id = request.seq_id if request.seq_id is not None else 0
    if not _INT32.min <= seq_id <= _INT32.max:
        raise UserError(f"seq_id {seq_id} is out of range")
    msg = pb.ForwardBackwardRequest(
        model_id=request.model_id,
        seq_id=seq_id,
        loss_fn=given.loss_fn,
        forward_only=forward_only,
        loss_fn_config=given.loss_fn_config or {},
    )
    for index, datum in enumerate(given.data):
        out = msg.data.add()
        for position, chunk in enumerate(datum.model_input.chunks):
            where = f"data[{index}].model_input.chunks[{position}]"
            kind = chunk.kind()
            if kind == "encoded_text":
                if chunk.tokens is None:
                    raise UserError(f"{where}: an encoded_text chunk needs its tokens")
                out.model_input.add().encoded_text.tokens = _int32_bytes(chunk.tokens, where)
            elif kind == "image":
                if chunk.data is None or chunk.format is None:
                    raise UserError(f"{where}: an image chunk needs its data and format")
                image = out.model_input.add().image
                image.data = _base64(chunk.data, where)
                image.format = chunk.format
                if chunk.expected_tokens is not None:
                    if not 0 <= chunk.expected_tokens <= _INT32.max:
                        raise UserError(f"{where}.expected_tokens is out of range")
                    image.expected_tokens = chunk.expected_tokens
            else:
                raise UserError(
                    f"{where}: image_asset_pointer chunks are not supported here; send the image"
                    " itself (an image chunk)"
                )
        for name in sorted(datum.loss_fn_inputs):
            out.loss_fn_inputs[name].CopyFrom(
                _tensor(datum.loss_fn_inputs[name], f"data[{index}].loss_fn_inputs[{name!r}]")
            )
    return bytes(msg.SerializeToString(deterministic=True))


def _int32_bytes(values: list[int], where: str) -> bytes:
    try:
        array = np.asarray(values, dtype=np.int64) if values else np.zeros(0, np.int64)
    except OverflowError:
        raise UserError(f"{where}.tokens: a token id is outside int32") from None
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        raise UserError(f"{where}.tokens: a token id is outside int32")
    return array.astype("<i4").tobytes()


def _base64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}.data is not base64") from None


def _tensor(tensor: _Tensor, where: str) -> pb.Tensor:
    dtype, wire = _DTYPES[tensor.dtype]
    shape = tensor.shape if tensor.shape is not None else [len(tensor.data)]
    if any(size < 0 for size in shape) or int(np.prod(shape, dtype=object)) != len(tensor.data):
        raise UserError(f"{where}: shape {shape} does not hold its {len(tensor.data)} values")
    try:
        with np.errstate(over="raise", invalid="raise"):
            values = np.asarray(tensor.data, dtype=np.float64 if dtype.kind == "f" else np.int64)
            if dtype.kind == "i" and any(isinstance(v, float) for v in tensor.data):
                raise UserError(f"{where}: an int64 tensor holds a non-integer value")
            array = values.astype(dtype)
    except (OverflowError, FloatingPointError):
        raise UserError(f"{where}: a value does not fit {tensor.dtype}") from None
    if dtype.kind == "f" and not np.array_equal(np.isfinite(array), np.isfinite(values)):
        raise UserError(f"{where}: a value does not fit {tensor.dtype}")
    return pb.Tensor(dense=array.tobytes(), dtype=wire, shape=shape)


# -- answers: what a finished call returns to an SDK that reads JSON ------------------------------


def wants_protobuf(accept: str) -> bool:
    """Whether the client reads protobuf answers (SDK 0.38 asks for them in `Accept`)."""
    return "application/x-protobuf" in accept.lower()


def answer_json(request_type: str, payload: bytes) -> bytes:
    """A protobuf answer (a `ForwardBackwardOutput`, or a `SampleResponse` for a sample) as the
    JSON an older SDK reads."""
    if request_type == "sample":
        return _sample_json(payload)
    return _forward_backward_json(payload)


def _forward_backward_json(payload: bytes) -> bytes:
    from protocol.tensors import decode_forward_backward_output

    output = decode_forward_backward_output(payload)
    outputs = [
        {name: _tensor_json(array) for name, array in datum.items()}
        for datum in output.loss_fn_outputs
    ]
    return msgspec.json.encode(
        {
            "loss_fn_output_type": output.loss_fn_output_type,
            "loss_fn_outputs": outputs,
            "metrics": output.metrics,
        }
    )


def _tensor_json(array: np.ndarray) -> dict[str, Any]:
    integer = array.dtype.kind in "iu"
    return {
        "data": array.reshape(-1).astype(np.int64 if integer else np.float64).tolist(),
        "dtype": "int64" if integer else "float32",
        "shape": list(array.shape),
    }


def _sample_json(payload: bytes) -> bytes:
    msg = pb.SampleResponse.FromString(payload)
    sequences = [
        {
            "stop_reason": "stop" if seq.stop_reason == pb.STOP_REASON_STOP else "length",
            "tokens": np.frombuffer(seq.tokens, dtype="<i4").tolist(),
            "logprobs": _floats(seq.logprobs),
        }
        for seq in msg.sequences
    ]
    answer: dict[str, Any] = {"type": "sample", "sequences": sequences}
    if msg.HasField("prompt_logprobs"):
        answer["prompt_logprobs"] = _floats(msg.prompt_logprobs)
    if msg.HasField("topk_prompt_logprobs"):
        topk = msg.topk_prompt_logprobs
        ids = np.frombuffer(topk.token_ids, dtype="<i4").reshape(topk.length, topk.k)
        lps = np.frombuffer(topk.logprobs, dtype="<f4").reshape(topk.length, topk.k)
        answer["topk_prompt_logprobs"] = [
            None
            if i == 0
            else [(int(t), float(lp)) for t, lp in zip(ids[i], lps[i], strict=True) if t or lp]
            for i in range(topk.length)
        ]
    return msgspec.json.encode(answer)


def _floats(data: bytes) -> list[float | None]:
    """float32 values, NaN (not computed) as null."""
    return [None if v != v else float(v) for v in np.frombuffer(data, dtype="<f4").tolist()]
