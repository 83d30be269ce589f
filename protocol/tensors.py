"""TensorData codecs: the SDK's protobuf ForwardBackwardRequest in, ForwardBackwardOutput out.

Decoded requests hold numpy arrays (dense, row-major, native byte order); the worker turns them
into torch tensors. On the wire every number is little-endian: tokens are int32, tensors carry
their dtype (float32, int64, int32 and bfloat16 are read; int32 widens to int64 and bfloat16 to
float32), an empty shape means 1-D, and sparse CSR tensors are densified with pad 0.

Anything malformed in a request is a `UserError` whose one-line message names the datum and the
field, so the client sees what to fix. The output encoder checks our own invariants (same field
names in every datum, metric keys `name:reduction`) with `ValueError`: breaking them is our bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # no stubs here

from protocol import tinker_wire_pb2 as pb
from protocol.custom_loss import CustomLoss
from protocol.errors import PayloadTooLarge, UserError
from protocol.images import DatumImage, ImageHeader, VisionGeometry, read_request_image
from protocol.sampling import MAX_LOGPROBS_K

# Wire dtype -> how its bytes read; the widened result is float32 or int64.
_WIRE_DTYPES: dict[pb.DType, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}
_DTYPE_NAMES = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_INT64: "int64",
    pb.DTYPE_INT32: "int32",
    pb.DTYPE_BFLOAT16: "bfloat16",
}
_TOKEN_DTYPE = np.dtype("<i4")
# What one request may declare, in tensor elements (every `loss_fn_inputs` cell, dense or sparse,
# plus the token ids). A dense tensor costs its bytes on the wire, but a sparse CSR tensor's dense
# size is not bounded by the body's (a few bytes can declare [1, 2**26]), so the whole request is
# held to a budget before anything is allocated. The default is one element per byte of the
# chunk size the gateway announces (4 MiB): four times what any dense request of that size holds.
DEFAULT_MAX_REQUEST_ELEMENTS = 4 * 1024 * 1024
MAX_DIMS = 8  # loss inputs are [N] or [N, K]; anything deeper is refused before numpy sees it
TARGET_TOKENS = "target_tokens"  # the loss input whose K (ids per position) a pass pads to
_OFFSET_DTYPE = np.dtype("<i8")


@dataclass
class DatumArrays:
    """One datum: its input token ids and its `loss_fn_inputs`, dense."""

    tokens: np.ndarray  # int32 [N]: the chunks concatenated, an image as its placeholder ids
    # int64 / float32, shape [N] or [N, K]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    images: list[DatumImage] = field(default_factory=list)  # in order, where they stand


@dataclass
class FwdBwdRequest:
    """A decoded `ForwardBackwardRequest` (one chunk of a forward_backward or forward call)."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float | str]  # v2 preferred, legacy numeric map merged under it
    datums: list[DatumArrays]
    custom_loss: CustomLoss | None = None  # loss_fn "custom": the graph the job carries
    max_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS  # the request's element budget

    @property
    def n_tokens(self) -> int:
        return sum(int(d.tokens.shape[0]) for d in self.datums)


@dataclass
class FwdBwdOutput:
    """A decoded `ForwardBackwardOutput`: per-datum arrays in request order, and metrics."""

    loss_fn_outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"


# -- single tensors -----------------------------------------------------------------------------


def _widen(raw: np.ndarray, dtype: pb.DType) -> np.ndarray:
    """Wire values -> float32 / int64 in native order (always a fresh, writable copy)."""
    if dtype == pb.DTYPE_BFLOAT16:
        # bfloat16 is the upper half of a float32.
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == pb.DTYPE_FLOAT32:
        return raw.astype(np.float32)
    return raw.astype(np.int64)


def _read(data: bytes, dtype: pb.DType, where: str, what: str) -> np.ndarray:
    """Read a little-endian buffer of a wire dtype, checking that its length fits the dtype."""
    wire = _WIRE_DTYPES[dtype]
    if len(data) % wire.itemsize:
        raise UserError(
            f"{where}: {what} has {len(data)} bytes, not a multiple of {wire.itemsize}"
            f" ({_DTYPE_NAMES[dtype]})"
        )
    return _widen(np.frombuffer(data, dtype=wire), dtype)


def _indices(data: bytes, where: str, what: str) -> np.ndarray:
    if len(data) % 8:
        raise UserError(f"{where}: {what} has {len(data)} bytes, not a multiple of 8 (int64)")
    return np.frombuffer(data, dtype=_OFFSET_DTYPE).astype(np.int64)


def _densify_csr(msg: pb.Tensor, shape: list[int], pad: float, where: str) -> np.ndarray:
    if len(shape) != 2:
        raise UserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    nrows, ncols = shape
    csr = msg.sparse_csr
    values = _read(csr.values, msg.dtype, where, "sparse values")
    crow = _indices(csr.crow_indices, where, "crow_indices")
    col = _indices(csr.col_indices, where, "col_indices")
    nnz = values.shape[0]
    if crow.shape[0] != nrows + 1 or crow[0] != 0 or crow[-1] != nnz:
        raise UserError(
            f"{where}: crow_indices must have {nrows + 1} entries from 0 to nnz={nnz},"
            f" got {crow.shape[0]} ending at {int(crow[-1]) if crow.size else None}"
        )
    row_counts = np.diff(crow)
    if (row_counts < 0).any():
        raise UserError(f"{where}: crow_indices must not decrease")
    if col.shape[0] != nnz:
        raise UserError(f"{where}: col_indices has {col.shape[0]} entries, expected nnz={nnz}")
    if nnz and (col.min() < 0 or col.max() >= ncols):
        raise UserError(f"{where}: col_indices out of range for {ncols} columns")
    dense = np.full((nrows, ncols), pad, dtype=values.dtype)
    dense[np.repeat(np.arange(nrows), row_counts), col] = values
    return dense


def tensor_to_numpy(msg: pb.Tensor, *, where: str = "tensor", pad: float = 0) -> np.ndarray:
    """A wire `Tensor` as a dense float32 or int64 array; CSR cells not listed hold `pad`.

    `where` prefixes every error message (e.g. "datum 3 loss_fn_inputs['weights']").
    """
    if msg.dtype not in _WIRE_DTYPES:
        raise UserError(f"{where}: unsupported dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if len(shape) > MAX_DIMS:
        raise UserError(f"{where}: {len(shape)} dimensions; at most {MAX_DIMS}")
    if any(s < 0 for s in shape):
        raise UserError(f"{where}: negative dimension in shape {shape}")
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _densify_csr(msg, shape, pad, where)
    flat = _read(msg.dense, msg.dtype, where, "dense data")
    if not shape:
        return flat
    if math.prod(shape) != flat.shape[0]:
        raise UserError(
            f"{where}: shape {shape} needs {math.prod(shape)} values, got {flat.shape[0]}"
        )
    return flat.reshape(shape)


def _wire_dtype_of(array: np.ndarray) -> tuple[pb.DType, np.dtype[Any]]:
    """Floats go out as float32, integers and booleans as int64."""
    if array.dtype.kind == "f":
        return pb.DTYPE_FLOAT32, np.dtype("<f4")
    if array.dtype.kind in "iub":
        return pb.DTYPE_INT64, np.dtype("<i8")
    raise ValueError(f"cannot send an array of dtype {array.dtype}")


def numpy_to_tensor(array: np.ndarray) -> pb.Tensor:
    """A dense wire `Tensor` (float32 or int64) with the array's full shape."""
    dtype, wire = _wire_dtype_of(array)
    return pb.Tensor(dtype=dtype, shape=list(array.shape), dense=array.astype(wire).tobytes())


# -- forward_backward request -------------------------------------------------------------------


_UNSUPPORTED_CHUNKS = {"image": "an image chunk", "dmel": "a dmel (audio) chunk"}


@dataclass(frozen=True)
class ImageRef:
    """An image chunk as the gateway's scan finds it: where it stands and what it holds, not
    yet read (`check_images` reads its header)."""

    where: str  # "datum i: model_input chunk j"
    data: bytes
    format: str
    expected_tokens: int | None
    override_dimensions: bool


def _image_ref(chunk: pb.Chunk, where: str) -> ImageRef:
    image = chunk.image
    return ImageRef(
        where=where,
        data=image.data,
        format=image.format,
        expected_tokens=int(image.expected_tokens) if image.HasField("expected_tokens") else None,
        override_dimensions=image.HasField("override_dimensions"),
    )


def _read_image_ref(ref: ImageRef, vision: VisionGeometry, seen: int) -> tuple[ImageHeader, int]:
    """The header and token count of the request's image number `seen` (from 0), checked:
    the per-request image limit, the header, the pixel limit and `expected_tokens`."""
    if ref.override_dimensions and seen < vision.max_images:  # past the limit: that error
        raise UserError(f"{ref.where}: override_dimensions is not supported")
    return read_request_image(ref.data, ref.format, vision, ref.expected_tokens, ref.where, seen)


def _datum_tokens(
    msg: pb.Datum, index: int, vision: VisionGeometry | None = None, seen_images: int = 0
) -> tuple[np.ndarray, list[DatumImage]]:
    """A datum's token ids and its images. Without `vision` (a text model) an image chunk is
    refused; with it, an image stands as its placeholder tokens. `seen_images`: the images of
    the request's datums before this one (the per-request limit counts them all)."""
    parts: list[np.ndarray] = []
    images: list[DatumImage] = []
    position = 0
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "image" and vision is not None:
            ref = _image_ref(chunk, f"datum {index}: model_input chunk {j}")
            header, n_tokens = _read_image_ref(ref, vision, seen_images + len(images))
            images.append(DatumImage(header, ref.data, position, n_tokens))
            parts.append(np.full(n_tokens, vision.image_token_id, dtype=np.int32))
            position += n_tokens
            continue
        if kind != "encoded_text":
            what = _UNSUPPORTED_CHUNKS.get(kind or "", "an empty chunk")
            raise UserError(
                f"datum {index}: model_input chunk {j} is {what}, which text models do not support"
            )
        if len(chunk.encoded_text.tokens) % _TOKEN_DTYPE.itemsize:
            raise UserError(
                f"datum {index}: model_input chunk {j} has {len(chunk.encoded_text.tokens)} token"
                " bytes, not a multiple of 4 (int32)"
            )
        text = np.frombuffer(chunk.encoded_text.tokens, dtype=_TOKEN_DTYPE).astype(np.int32)
        parts.append(text)
        position += int(text.shape[0])
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return tokens, images


@dataclass(frozen=True)
class FwdBwdSummary:
    """What the gateway routes a `forward_backward` body on, read without building a tensor.

    `n_elements` is what densifying the request would allocate, from the declared shapes:
    every `loss_fn_inputs` cell plus every token id.
    """

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    n_datums: int
    n_tokens: int
    n_elements: int
    loss_id: str = ""  # loss_fn_config_v2["loss_id"] (text), which names a custom loss
    # the first datum whose target_tokens declares [N, K] with K outside 1..MAX_LOGPROBS_K:
    # (datum index, declared shape); refused by `check_target_width`
    wide_targets: tuple[int, tuple[int, ...]] | None = None
    # the image chunks, unread; `n_tokens` and `n_elements` count their placeholder tokens
    # once `check_images` has read their headers
    images: tuple[ImageRef, ...] = ()
    # (datum index, text tokens) of the longest datum (the first of the longest)
    longest: tuple[int, int] = (0, 0)


def datum_too_long(index: int, tokens: int, limit: int) -> str:
    """Why a datum longer than the workers' memory plan is refused (gateway and worker alike)."""
    return (
        f"datums[{index}].model_input: {tokens} tokens exceed the {limit} tokens of the longest"
        " datum this base model's workers can train (their memory plan, reported with their"
        " heartbeat and by get_server_capabilities)"
    )


def check_datum_lengths(summary: FwdBwdSummary, limit: int | None) -> None:
    """Refuse a body whose longest datum is over `limit` tokens (None: no plan known yet)."""
    index, tokens = summary.longest
    if limit is not None and tokens > limit:
        raise UserError(datum_too_long(index, tokens, limit))


def _parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    try:
        msg: pb.ForwardBackwardRequest = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as exc:
        raise UserError(
            f"forward_backward body is not a valid ForwardBackwardRequest: {exc}"
        ) from None
    return msg


def _declared_elements(tensor: pb.Tensor) -> int:
    """The cells a tensor declares: its shape's product, or its dense values when 1-D unshaped.

    A zero dimension counts as one, so `[0, 2**62]` cannot slip an absurd shape past the budget.
    """
    shape = [int(s) for s in tensor.shape]
    if shape:
        return math.prod(max(s, 1) for s in shape)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return 0  # refused when decoded: a sparse tensor needs a 2-D shape
    itemsize = _WIRE_DTYPES[tensor.dtype].itemsize if tensor.dtype in _WIRE_DTYPES else 1
    return len(tensor.dense) // itemsize


def _summarise(msg: pb.ForwardBackwardRequest) -> FwdBwdSummary:
    tokens = 0
    elements = 0
    wide_targets: tuple[int, tuple[int, ...]] | None = None
    images: list[ImageRef] = []
    longest = (0, 0)
    for index, datum in enumerate(msg.data):
        before = tokens
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind == "encoded_text":
                tokens += len(chunk.encoded_text.tokens) // _TOKEN_DTYPE.itemsize
            elif kind == "image":
                images.append(_image_ref(chunk, f"datum {index}: model_input chunk {j}"))
        for tensor in datum.loss_fn_inputs.values():
            elements += _declared_elements(tensor)
        if tokens - before > longest[1]:
            longest = (index, tokens - before)
        targets = datum.loss_fn_inputs.get(TARGET_TOKENS)
        if wide_targets is None and targets is not None and len(targets.shape) == 2:
            if not 1 <= targets.shape[1] <= MAX_LOGPROBS_K:
                wide_targets = (index, tuple(int(s) for s in targets.shape))
    return FwdBwdSummary(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        forward_only=bool(msg.forward_only),
        n_datums=len(msg.data),
        n_tokens=tokens,
        n_elements=elements + tokens,
        loss_id=_text_setting(msg, "loss_id"),
        wide_targets=wide_targets,
        images=tuple(images),
        longest=longest,
    )


def check_images(
    summary: FwdBwdSummary, vision: VisionGeometry | None, base_model: str
) -> FwdBwdSummary:
    """`summary` with its images' placeholder tokens counted in `n_tokens` and `n_elements`,
    after reading each image's header: a `UserError` for an image sent to a text model
    (`vision` None), one over the model's limits, one that is not a whole png or jpeg, or a
    wrong `expected_tokens`. Nothing is decoded."""
    if not summary.images:
        return summary
    if vision is None:
        raise UserError(
            f"{summary.images[0].where} is an image chunk, and {base_model!r} is a text model:"
            " it takes text only"
        )
    n_tokens = sum(_read_image_ref(ref, vision, seen)[1] for seen, ref in enumerate(summary.images))
    return replace(
        summary, n_tokens=summary.n_tokens + n_tokens, n_elements=summary.n_elements + n_tokens
    )


def _text_setting(msg: pb.ForwardBackwardRequest, key: str) -> str:
    if key not in msg.loss_fn_config_v2:
        return ""
    value = msg.loss_fn_config_v2[key]
    return str(value.text) if value.WhichOneof("value") == "text" else ""


def check_budget(summary: FwdBwdSummary, max_elements: int) -> None:
    """Refuse a request that declares more elements than one request may allocate."""
    if summary.n_elements > max_elements:
        raise PayloadTooLarge(
            f"forward_backward declares {summary.n_elements} tensor elements"
            f" ({summary.n_tokens} tokens across {summary.n_datums} datums, plus loss_fn_inputs);"
            f" one request may hold at most {max_elements}: send fewer datums per request"
        )


def check_target_width(summary: FwdBwdSummary) -> None:
    """Refuse [N, K] `target_tokens` with K outside 1..`MAX_LOGPROBS_K` (top-K distillation).

    A pass pads the targets of every datum it holds, every tenant's, to the widest K among them
    and gathers [chunk, K] log-probs, so one datum's K is the memory of everyone it shares a
    pass with; the element budget does not bound it (sparse CSR with no entries declares any K
    in a few bytes). The cap is the sampler's widest top-k, where top-K targets come from.
    """
    if summary.wide_targets is None:
        return
    index, shape = summary.wide_targets
    raise UserError(
        f"datums[{index}].loss_fn_inputs.{TARGET_TOKENS} ({summary.loss_fn}): shape"
        f" {list(shape)} has K = {shape[1]} target ids per position; K must be in"
        f" 1..{MAX_LOGPROBS_K}"
    )


def forward_backward_ref(body: bytes) -> tuple[str, int] | None:
    """(`model_id`, `seq_id`) of a `ForwardBackwardRequest` body that does not parse, read
    from its top-level fields up to the first damaged one (None: not both before it), so that
    its refusal still spends its seq. Fields 1 (a string) and 2 (a varint) are what every SDK
    writes first."""
    found: dict[int, str | int] = {}
    at = 0
    whole = False  # read to the end: a seq_id never met is proto3's omitted 0
    try:
        while len(found) < 2:
            if at == len(body):
                whole = True
                break
            key, at = _varint(body, at)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, at = _varint(body, at)
                if number == 2:
                    found[2] = value - (1 << 64) if value >= 1 << 63 else value
            elif wire == 2:
                length, at = _varint(body, at)
                if at + length > len(body):
                    break
                if number == 1:
                    found[1] = body[at : at + length].decode()
                at += length
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
            else:
                break
    except (IndexError, UnicodeDecodeError):
        pass
    model_id, seq_id = found.get(1), found.get(2, 0 if whole else None)
    if not isinstance(model_id, str) or not isinstance(seq_id, int):
        return None
    return model_id, seq_id


def _varint(body: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def scan_forward_backward(body: bytes) -> FwdBwdSummary:
    """The routing fields and declared sizes of a `ForwardBackwardRequest` body (no tensors)."""
    return _summarise(_parse_forward_backward(body))


def decode_forward_backward(
    body: bytes,
    max_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS,
    custom_loss: CustomLoss | None = None,
    vision: VisionGeometry | None = None,
) -> FwdBwdRequest:
    """Decode the SDK's protobuf `ForwardBackwardRequest` (already decompressed).

    The declared sizes are checked against `max_elements` before any tensor is densified;
    `custom_loss` is the graph a `custom` request's job carries. `vision`: the model's image
    geometry, for a vision-language model (image chunks are refused without it).
    """
    msg = _parse_forward_backward(body)
    check_budget(_summarise(msg), max_elements)
    datums: list[DatumArrays] = []
    n_images = 0
    for i, datum in enumerate(msg.data):
        inputs = {
            name: tensor_to_numpy(
                datum.loss_fn_inputs[name], where=f"datum {i} loss_fn_inputs[{name!r}]"
            )
            for name in sorted(datum.loss_fn_inputs)
        }
        tokens, images = _datum_tokens(datum, i, vision, n_images)
        n_images += len(images)
        datums.append(DatumArrays(tokens=tokens, inputs=inputs, images=images))
    # The SDK writes numbers to both maps and text only to v2; v2 wins where both have a key.
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind == "number":
            config[key] = float(value.number)
        elif kind == "text":
            config[key] = value.text
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        forward_only=bool(msg.forward_only),
        loss_fn_config=config,
        datums=datums,
        custom_loss=custom_loss,
        max_elements=max_elements,
    )


def encode_forward_backward(request: FwdBwdRequest) -> bytes:
    """The inverse of `decode_forward_backward`, for tests and tools that speak without the SDK."""
    msg = pb.ForwardBackwardRequest(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=request.loss_fn,
        forward_only=request.forward_only,
    )
    for key, value in request.loss_fn_config.items():
        if isinstance(value, str):
            msg.loss_fn_config_v2[key].text = value
        else:
            msg.loss_fn_config[key] = float(value)
            msg.loss_fn_config_v2[key].number = float(value)
    for datum in request.datums:
        out = msg.data.add()
        start = 0
        for image in datum.images:  # the text around each image, the image as its chunk
            if image.start > start:
                text = datum.tokens[start : image.start].astype(_TOKEN_DTYPE).tobytes()
                out.model_input.add().encoded_text.tokens = text
            chunk = out.model_input.add().image
            chunk.data, chunk.format = image.data, image.header.format
            chunk.expected_tokens = image.n_tokens
            start = image.start + image.n_tokens
        if start < datum.tokens.shape[0] or not datum.images:
            rest = datum.tokens[start:].astype(_TOKEN_DTYPE).tobytes()
            out.model_input.add().encoded_text.tokens = rest
        for name, array in datum.inputs.items():
            out.loss_fn_inputs[name].CopyFrom(numpy_to_tensor(array))
    body: bytes = msg.SerializeToString()
    return body


# -- forward_backward output --------------------------------------------------------------------


def _signature(datum: dict[str, np.ndarray]) -> tuple[tuple[str, pb.DType, tuple[int, ...]], ...]:
    """Per field: name, wire dtype, trailing shape. Datums in one ArrayRecord share it."""
    return tuple(
        (name, _wire_dtype_of(array)[0], tuple(array.shape[1:]))
        for name, array in sorted(datum.items())
    )


def _check_metric_keys(metrics: dict[str, float]) -> None:
    # The SDK splits every key on ':' into exactly (name, reduction); anything else fails the
    # whole result client-side.
    for key in metrics:
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} must be 'name:reduction' with exactly one ':'")


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]],
    metrics: dict[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """Encode per-datum outputs and metrics as the protobuf `ForwardBackwardOutput`.

    Consecutive datums whose fields agree in dtype and trailing shape share one `ArrayRecord`;
    a change (ragged `[N, K]` outputs) starts the next record, which the SDK concatenates.
    """
    _check_metric_keys(metrics)
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type)
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        names = sorted(outputs[0])
        for index, datum in enumerate(outputs):
            if sorted(datum) != names:
                raise ValueError(f"datum {index} has fields {sorted(datum)}, datum 0 has {names}")
    groups: list[list[dict[str, np.ndarray]]] = []
    previous: object = None
    for datum in outputs:
        signature = _signature(datum)
        if signature != previous:
            groups.append([])
            previous = signature
        groups[-1].append(datum)
    for group in groups:
        record = msg.loss_fn_outputs.add(type_tag=loss_fn_output_type, num_datums=len(group))
        for name in sorted(group[0]):
            dtype, wire = _wire_dtype_of(group[0][name])
            blobs = [np.ascontiguousarray(d[name], dtype=wire).tobytes() for d in group]
            offsets = np.cumsum([0, *(len(b) for b in blobs)], dtype=np.int64).astype(_OFFSET_DTYPE)
            batched = record.fields[name]
            batched.data = b"".join(blobs)
            batched.offsets = offsets.tobytes()
            batched.dtype = dtype
            batched.trailing_shape.extend(int(s) for s in group[0][name].shape[1:])
    body: bytes = msg.SerializeToString()
    return body


def decode_forward_backward_output(body: bytes) -> FwdBwdOutput:
    """Decode a `ForwardBackwardOutput` the way the SDK does (for tests and tools)."""
    try:
        msg = pb.ForwardBackwardOutput.FromString(body)
    except DecodeError as exc:
        raise UserError(f"body is not a valid ForwardBackwardOutput: {exc}") from None
    outputs: list[dict[str, np.ndarray]] = []
    for r, record in enumerate(msg.loss_fn_outputs):
        datums: list[dict[str, np.ndarray]] = [{} for _ in range(record.num_datums)]
        for name, batched in record.fields.items():
            where = f"record {r} field {name!r}"
            if batched.dtype not in _WIRE_DTYPES:
                raise UserError(f"{where}: unsupported dtype {batched.dtype}")
            itemsize = _WIRE_DTYPES[batched.dtype].itemsize
            flat = _read(batched.data, batched.dtype, where, "data")
            offsets = _indices(batched.offsets, where, "offsets")
            if (
                offsets.shape[0] != record.num_datums + 1
                or offsets[0] != 0
                or offsets[-1] != len(batched.data)
                or (np.diff(offsets) < 0).any()
                or (offsets % itemsize).any()
            ):
                raise UserError(
                    f"{where}: offsets must be {record.num_datums + 1} ascending byte offsets"
                    f" from 0 to {len(batched.data)}"
                )
            trailing = [int(s) for s in batched.trailing_shape]
            per_row = math.prod(trailing)
            for i in range(record.num_datums):
                values = flat[offsets[i] // itemsize : offsets[i + 1] // itemsize]
                if per_row == 0 or values.shape[0] % per_row:
                    raise UserError(f"{where}: datum {i} does not fit trailing shape {trailing}")
                datums[i][name] = values.reshape([values.shape[0] // per_row, *trailing])
        outputs.extend(datums)
    return FwdBwdOutput(
        loss_fn_outputs=outputs,
        metrics={k: float(v) for k, v in msg.metrics.items()},
        loss_fn_output_type=msg.loss_fn_output_type or "ArrayRecord",
    )
