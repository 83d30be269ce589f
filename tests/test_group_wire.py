"""The worker group's messages (`workers.group.wire`): every call rank 0 sends comes back equal on
the other ranks: a cycle's jobs byte for byte (bodies, images, a custom loss's graph), a slot
state whole, a sampler step's requests; no pickle is involved (a message is msgpack data)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.custom_loss import CustomLoss, LossInput, LossNode
from protocol.images import DatumImage, ImageHeader
from protocol.jobs import (
    CreateModelJob,
    ForwardBackwardJob,
    LoadWeightsJob,
    OptimStepJob,
    decode_job,
    encode_job,
)
from protocol.sampling import SampleSpec, TargetIds
from workers.group import wire
from workers.trainer.parking import HostRow, SlotState

IMAGE = DatumImage(ImageHeader("png", 64, 96), b"\x89PNG image bytes", 2, 6)

LOSS = CustomLoss(
    loss_id="l-1",
    name="mine",
    inputs=[LossInput("logprobs", 1), LossInput("weights", 2)],
    nodes=[LossNode("call_function", "neg", "torch.neg", ["logprobs"], {"dim": 0})],
    metrics=["m"],
)


def test_a_cycles_jobs_come_back_byte_for_byte() -> None:
    jobs = [
        ForwardBackwardJob(
            request_id="r-1",
            model_id="m-1",
            tenant_id="t",
            seq_id=4,
            body=bytes(range(256)) * 3,
            n_tokens=7,
            max_elements=99,
            provenance=b"\x00\x01",
            custom_loss=LOSS,
        ),
        OptimStepJob(
            request_id="r-2",
            model_id="m-1",
            tenant_id="t",
            seq_id=5,
            adam=AdamParams(learning_rate=1e-3, grad_clip_norm=1.0),
        ),
        CreateModelJob(request_id="r-3", model_id="m-2", tenant_id="t", seq_id=0),
        LoadWeightsJob(request_id="r-4", model_id="m-3", tenant_id="t", seq_id=0),
    ]
    sent = [encode_job(job) for job in jobs]
    call = wire.decode(wire.encode(wire.Jobs("shared_pass", sent, 512, {"m-9": "failed"})))
    assert isinstance(call, wire.Jobs)
    assert (call.kind, call.pass_tokens, call.failed) == ("shared_pass", 512, {"m-9": "failed"})
    assert call.jobs == sent
    assert [decode_job(data) for data in call.jobs] == jobs


@pytest.mark.parametrize(
    "call",
    [
        wire.Release("m"),
        wire.Capture("m"),
        wire.Calibrate(),
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


def test_a_state_comes_back_bit_for_bit() -> None:
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
