"""The worker group's messages (`workers.group.wire`): every call rank 0 sends comes back equal on
the other ranks, arrays with their dtype, shape and bytes, images, a custom loss's graph, a checkpoint
and a slot state whole; no pickle is involved (a message is msgpack data)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.custom_loss import CustomLoss, LossInput, LossNode
from protocol.images import DatumImage, ImageHeader
from protocol.sampling import SampleSpec, TargetIds
from protocol.tensors import DatumArrays, FwdBwdRequest
from workers.group import wire
from workers.trainer.checkpoints import AdapterCheckpoint
from workers.trainer.parking import HostRow, SlotState
from workers.trainer.slot_checkpoints import StoredAdapter

IMAGE = DatumImage(ImageHeader("png", 64, 96), b"\x89PNG image bytes", 2, 6)


def _request() -> FwdBwdRequest:
    rng = np.random.default_rng(0)
    datum = DatumArrays(
        rng.integers(0, 100, 7).astype(np.int32),
        {
            "target_tokens": rng.integers(0, 100, (7, 3)).astype(np.int64),
            "weights": rng.normal(size=(7, 3)).astype(np.float32),
        },
        [IMAGE, DatumImage(ImageHeader("jpeg", 32, 32), b"\xff\xd8\xff", 0, 1)],
    )
    loss = CustomLoss(
        loss_id="l-1",
        name="mine",
        inputs=[LossInput("logprobs", 1), LossInput("weights", 2)],
        nodes=[LossNode("call_function", "neg", "torch.neg", ["logprobs"], {"dim": 0})],
        metrics=["m"],
    )
    return FwdBwdRequest(
        "m-1", 4, "custom", False, {"eps": 0.2, "loss_id": "l-1"}, [datum], loss, 99
    )


def _same_request(got: FwdBwdRequest, want: FwdBwdRequest) -> None:
    for field in ("model_id", "seq_id", "loss_fn", "forward_only", "loss_fn_config", "custom_loss"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.max_elements == want.max_elements
    for a, b in zip(got.datums, want.datums, strict=True):
        assert a.tokens.dtype == b.tokens.dtype and np.array_equal(a.tokens, b.tokens)
        assert a.inputs.keys() == b.inputs.keys()
        for key in a.inputs:
            assert a.inputs[key].dtype == b.inputs[key].dtype
            assert np.array_equal(a.inputs[key], b.inputs[key])
        assert a.images == b.images


def test_a_forward_backward_comes_back_whole() -> None:
    request = _request()
    call = wire.decode(
        wire.encode(wire.ForwardBackward(512, [("m-1", wire.pack_request(request))]))
    )
    assert isinstance(call, wire.ForwardBackward) and call.pass_tokens == 512
    [(model_id, packed)] = call.items
    assert model_id == "m-1"
    _same_request(wire.unpack_request(packed), request)


@pytest.mark.parametrize(
    "call",
    [
        wire.Create("m", LoraConfig(rank=8, seed=3, train_attn=False)),
        wire.Release("m"),
        wire.OptimStep(
            [("a", AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)), ("b", AdamParams())]
        ),
        wire.Save("m", "sampler_weights"),
        wire.Slot("m"),
        wire.Capture("m"),
        wire.SampleStep(
            [3],
            [
                (
                    SampleSpec(prompt=(1, 2, 3), num_samples=2, seed=7, stop_token_ids=(9,)),
                    "k",
                    "/d",
                ),
                (
                    SampleSpec(prompt=(4,), target_prompt_logprobs=TargetIds(1, 2, (5, -1))),
                    None,
                    None,
                ),
                (SampleSpec(prompt=(7, 8, *[5] * 6), images=(IMAGE,)), None, None),
            ],
        ),
        wire.Keepalive(),
        wire.Stop(),
    ],
)
def test_each_call_comes_back_equal(call: wire.Call) -> None:
    assert wire.decode(wire.encode(call)) == call


def test_a_checkpoint_and_a_state_come_back_bit_for_bit() -> None:
    tensors = {"k.lora_A.weight": torch.randn(4, 3, 5), "k.lora_B.weight": torch.randn(6, 4)}
    checkpoint = AdapterCheckpoint(
        base_model="b",
        rank=4,
        lora_alpha=32.0,
        tensors=tensors,
        spec=LoraConfig(rank=4),
        moments={k + ".exp_avg": v * 2 for k, v in tensors.items()},
        step=7,
        meta={"seq_id": 3, "saved_at": 1.5},
    )
    stored = StoredAdapter(checkpoint, LoraConfig(rank=4), frozenset({"attn", "mlp"}))
    call = wire.decode(wire.encode(wire.Load("m", True, wire.pack_stored(stored))))
    assert isinstance(call, wire.Load) and call.with_optimizer
    back = wire.unpack_stored(call.stored)
    assert (back.spec, back.groups, back.checkpoint.step) == (stored.spec, stored.groups, 7)
    assert back.checkpoint.meta == checkpoint.meta
    for key, value in {**tensors, **(checkpoint.moments or {})}.items():
        source = back.checkpoint.tensors | (back.checkpoint.moments or {})
        assert torch.equal(source[key], value)

    state = SlotState(
        spec=LoraConfig(rank=4),
        lora_alpha=32.0,
        step=2,
        scales={"attn": 8.0, "mlp": 0.0, "unembed": 8.0},
        rows={"weights": HostRow(torch.randn(11), False), "grads": HostRow(torch.randn(40), True)},
    )
    adopted = wire.decode(wire.encode(wire.Adopt("m", wire.pack_state(state))))
    assert isinstance(adopted, wire.Adopt)
    again = wire.unpack_state(adopted.state)
    assert (again.spec, again.lora_alpha, again.step, again.scales) == (
        state.spec,
        state.lora_alpha,
        state.step,
        state.scales,
    )
    for name, row in state.rows.items():
        assert again.rows[name].whole_row == row.whole_row
        assert torch.equal(again.rows[name].values, row.values)


def test_anything_else_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.decode(msgspec.msgpack.encode(["NoSuchCall", "m"]))
    with pytest.raises(msgspec.DecodeError):
        wire.decode(b"\x80\x04not msgpack")
