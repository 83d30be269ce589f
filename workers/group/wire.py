"""What rank 0 of a worker group tells the other ranks: the calls to repeat, as bytes.

Job: encode each engine-thread call of rank 0 (`workers.group.mirror`) as one msgpack message
(msgspec), tensors as raw little-endian bytes with their dtype and shape, and decode it on the
other ranks. No pickle: a message is data, never code.

Messages are `Call` structs tagged by their name. The trainer's jobs travel encoded as the bus
carries them (`Jobs`), with the pass size, so every rank decodes and validates them with the
same code and packs the same passes; an adopt carries the state rank 0 read from a snapshot, in
one device's layout; a sampler step carries its requests with their seeds fixed.
"""

from __future__ import annotations

from typing import cast

import msgspec
import numpy as np
import torch

from protocol.api import LoraConfig
from protocol.sampling import SampleSpec
from workers.engine.lora import LayerGroup
from workers.trainer.parking import HostRow, SlotState


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


class Jobs(Call, frozen=True):
    """The jobs of one engine-thread call of the trainer's operations (`kind`: `shared_pass`,
    `optim_steps` or `other`), each encoded as the bus carries it (`protocol.jobs.encode_job`);
    the pass size and the failed models, as rank 0 has them now."""

    kind: str
    jobs: list[bytes]
    pass_tokens: int
    failed: dict[str, str]


class Release(Call, frozen=True):
    model_id: str


class Calibrate(Call, frozen=True):
    """Measure the pass size (`workers.trainer.calibration.measure`), every rank in step."""


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


AnyCall = Jobs | Release | Calibrate | Capture | Adopt | SampleStep | Keepalive | Stop

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(AnyCall)


def encode(call: Call) -> bytes:
    return _ENCODER.encode(call)


def decode(data: bytes) -> AnyCall:
    return _DECODER.decode(data)
