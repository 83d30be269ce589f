"""What rank 0 of a worker group tells the other ranks: the engine calls to repeat, as bytes.

Job: encode each state-changing engine call (`workers.group.mirror`) with its arguments as one
msgpack message (msgspec), arrays and tensors as raw little-endian bytes with their dtype and
shape, and decode it on the other ranks. No pickle: a message is data, never code.

Messages are `Call` structs tagged by their name. A forward_backward carries its requests whole
(datums, loss inputs, images, a custom loss's graph, its element budget) and the pass size, so
every rank packs the same passes; a load carries the checkpoint rank 0 read and checked, in one
device's layout; an adopt carries the state rank 0 read from a snapshot, likewise.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
import numpy as np
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.custom_loss import CustomLoss
from protocol.images import DatumImage
from protocol.sampling import SampleSpec
from protocol.tensors import DatumArrays, FwdBwdRequest
from workers.engine.lora import LayerGroup
from workers.trainer.checkpoints import AdapterCheckpoint
from workers.trainer.parking import HostRow, SlotState
from workers.trainer.slot_checkpoints import StoredAdapter


class Array(msgspec.Struct, array_like=True, frozen=True):
    """An array's bytes, dtype (numpy's name) and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack_array(array: np.ndarray) -> Array:
    array = np.ascontiguousarray(array)
    return Array(array.dtype.str, tuple(array.shape), array.tobytes())


def unpack_array(packed: Array) -> np.ndarray:
    flat = np.frombuffer(packed.data, dtype=np.dtype(packed.dtype))
    return flat.reshape(packed.shape).copy()


def pack_tensor(tensor: torch.Tensor) -> Array:
    return pack_array(tensor.detach().to("cpu").contiguous().numpy())


def unpack_tensor(packed: Array) -> torch.Tensor:
    return torch.from_numpy(unpack_array(packed))


class Datum(msgspec.Struct, array_like=True, frozen=True):
    tokens: Array
    inputs: dict[str, Array]
    images: list[DatumImage] = []  # a VL model's images, each rank decodes them alike


class Request(msgspec.Struct, array_like=True, frozen=True):
    """A `FwdBwdRequest`, whole."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float | str]
    datums: list[Datum]
    custom_loss: CustomLoss | None
    max_elements: int


def pack_request(request: FwdBwdRequest) -> Request:
    return Request(
        request.model_id,
        request.seq_id,
        request.loss_fn,
        request.forward_only,
        dict(request.loss_fn_config),
        [
            Datum(
                pack_array(d.tokens),
                {k: pack_array(v) for k, v in d.inputs.items()},
                list(d.images),
            )
            for d in request.datums
        ],
        request.custom_loss,
        request.max_elements,
    )


def unpack_request(packed: Request) -> FwdBwdRequest:
    return FwdBwdRequest(
        model_id=packed.model_id,
        seq_id=packed.seq_id,
        loss_fn=packed.loss_fn,
        forward_only=packed.forward_only,
        loss_fn_config=dict(packed.loss_fn_config),
        datums=[
            DatumArrays(
                unpack_array(d.tokens),
                {k: unpack_array(v) for k, v in d.inputs.items()},
                list(d.images),
            )
            for d in packed.datums
        ],
        custom_loss=packed.custom_loss,
        max_elements=packed.max_elements,
    )


class Stored(msgspec.Struct, array_like=True, frozen=True):
    """A checkpoint read and checked (`StoredAdapter`)."""

    base_model: str
    rank: int
    lora_alpha: float
    tensors: dict[str, Array]
    checkpoint_spec: LoraConfig | None
    moments: dict[str, Array] | None
    step: int
    meta: dict[str, Any]
    spec: LoraConfig
    groups: list[str]


def pack_stored(stored: StoredAdapter) -> Stored:
    checkpoint = stored.checkpoint
    return Stored(
        checkpoint.base_model,
        checkpoint.rank,
        checkpoint.lora_alpha,
        {k: pack_tensor(v) for k, v in checkpoint.tensors.items()},
        checkpoint.spec,
        None
        if checkpoint.moments is None
        else {k: pack_tensor(v) for k, v in checkpoint.moments.items()},
        checkpoint.step,
        dict(checkpoint.meta),
        stored.spec,
        sorted(stored.groups),
    )


def unpack_stored(packed: Stored) -> StoredAdapter:
    checkpoint = AdapterCheckpoint(
        base_model=packed.base_model,
        rank=packed.rank,
        lora_alpha=packed.lora_alpha,
        tensors={k: unpack_tensor(v) for k, v in packed.tensors.items()},
        spec=packed.checkpoint_spec,
        moments=None
        if packed.moments is None
        else {k: unpack_tensor(v) for k, v in packed.moments.items()},
        step=packed.step,
        meta=dict(packed.meta),
    )
    groups: frozenset[LayerGroup] = frozenset(packed.groups)  # type: ignore[arg-type]
    return StoredAdapter(checkpoint, packed.spec, groups)


class Row(msgspec.Struct, array_like=True, frozen=True):
    values: Array
    whole_row: bool


class State(msgspec.Struct, array_like=True, frozen=True):
    """A slot's state (`SlotState`), in one device's layout."""

    spec: LoraConfig
    lora_alpha: float
    step: int
    scales: dict[str, float]
    rows: dict[str, Row]


def pack_state(state: SlotState) -> State:
    return State(
        state.spec,
        state.lora_alpha,
        state.step,
        {str(group): scale for group, scale in state.scales.items()},
        {k: Row(pack_tensor(v.values), v.whole_row) for k, v in state.rows.items()},
    )


def unpack_state(packed: State) -> SlotState:
    scales = {cast(LayerGroup, group): scale for group, scale in packed.scales.items()}
    return SlotState(
        spec=packed.spec,
        lora_alpha=packed.lora_alpha,
        step=packed.step,
        scales=scales,
        rows={k: HostRow(unpack_tensor(v.values), v.whole_row) for k, v in packed.rows.items()},
    )


# -- the calls ---------------------------------------------------------------------------------


class Call(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """One engine call every rank runs."""


class Create(Call, frozen=True):
    model_id: str
    spec: LoraConfig


class Release(Call, frozen=True):
    model_id: str


class ForwardBackward(Call, frozen=True):
    pass_tokens: int
    items: list[tuple[str, Request]]


class OptimStep(Call, frozen=True):
    steps: list[tuple[str, AdamParams]]


class Save(Call, frozen=True):
    model_id: str
    kind: str


class Load(Call, frozen=True):
    model_id: str
    with_optimizer: bool
    stored: Stored


class Slot(Call, frozen=True):
    model_id: str


class Capture(Call, frozen=True):
    model_id: str


class Adopt(Call, frozen=True):
    model_id: str
    state: State


class SampleStep(Call, frozen=True):
    """One step of the torch sampler: requests dropped, requests joining (each with its seed
    fixed, its adapter's key and checkpoint directory), then the step."""

    cancels: list[int]
    submits: list[tuple[SampleSpec, str | None, str | None]]


class Keepalive(Call, frozen=True):
    """Nothing to run: rank 0 is alive and idle."""


class Stop(Call, frozen=True):
    """The group is shutting down: the other ranks leave."""


AnyCall = (
    Create
    | Release
    | ForwardBackward
    | OptimStep
    | Save
    | Load
    | Slot
    | Capture
    | Adopt
    | SampleStep
    | Keepalive
    | Stop
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyCall)


def encode(call: Call) -> bytes:
    return _ENCODER.encode(call)


def decode(data: bytes) -> AnyCall:
    return _DECODER.decode(data)
