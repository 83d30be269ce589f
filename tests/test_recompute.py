"""Recomputing decoder layers in the backward (`workers/engine/recompute.py`): a shared pass of
tenants of different ranks and adapter kinds gives the same losses, log-probs and gradients
(≤ 1e-6, fp32) with and without it, on dense, MoE (the routing replayed), recurrent (Gated
DeltaNet, Mamba2) and MLA models; the layers do run twice; forward-only passes never recompute."""

from __future__ import annotations

import pytest
import torch

from protocol.api import LoraConfig
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from tests.conftest import build_model
from tests.engine_helpers import Trainer, cross_entropy_request, max_diff, perturb_b

TOLERANCE = 1e-6
NEVER = 2**62  # a `recompute_tokens` no pass reaches
TENANTS = {
    "full": LoraConfig(rank=8, seed=1),
    "mlp": LoraConfig(rank=4, seed=2, train_attn=False, train_unembed=False),
    "attn": LoraConfig(rank=2, seed=3, train_mlp=False),
}


def _mlp_calls(engine: Trainer) -> list[int]:
    """A counter of the first decoder layer's MLP (or mixer) runs, forward and recomputed."""
    layer = engine.core.passes.decoder.layers[0]
    block = getattr(layer, "mlp", None) or getattr(layer, "mixer", None)
    calls = [0]
    block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _run(
    engine: Trainer, batch: list[tuple[str, FwdBwdRequest]], recompute_tokens: int | None
) -> tuple[list[FwdBwdOutput], torch.Tensor]:
    engine.core.passes.recompute_tokens = recompute_tokens
    engine.bank.grads.zero_()
    outputs = engine.forward_backward(batch)
    assert all(isinstance(out, FwdBwdOutput) for out in outputs), outputs
    return outputs, engine.bank.grads.clone()  # type: ignore[return-value]


@pytest.mark.parametrize(
    "arch", ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "nemotron_h"]
)
def test_recomputed_layers_give_the_same_outputs_and_gradients(
    arch: str, tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    model_dir = build_model(tmp_path_factory.mktemp(arch), arch)
    engine = Trainer(str(model_dir), max_slots=3, max_rank=8)
    assert engine.core.passes.recompute is not None
    for model_id, spec in TENANTS.items():
        engine.create(model_id, spec)
        perturb_b(engine, model_id, seed=len(model_id))
    vocab = engine.core.vocab_size
    batch = [
        (model_id, cross_entropy_request(model_id, [23, 9], vocab, seed, forward_only=False))
        for seed, model_id in enumerate(TENANTS)
    ]
    calls = _mlp_calls(engine)
    plain, plain_grads = _run(engine, batch, NEVER)
    once = calls[0]
    recomputed, recomputed_grads = _run(engine, batch, 0)
    assert calls[0] - once == 2 * once  # each pass's layer ran again in its backward
    for a, b in zip(plain, recomputed, strict=True):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=TOLERANCE)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
            assert max_diff(x["logprobs"], y["logprobs"]) <= TOLERANCE
    scale = max(1.0, float(plain_grads.abs().max()))
    assert float(plain_grads.abs().max()) > 0
    assert max_diff(plain_grads, recomputed_grads) <= TOLERANCE * scale, arch

    # a forward-only pass runs each layer once, whatever its size
    before = calls[0]
    forward = [
        (model_id, FwdBwdRequest(model_id, 1, "cross_entropy", True, {}, request.datums))
        for model_id, request in batch
    ]
    _run(engine, forward, 0)
    assert calls[0] - before == once


def test_a_datum_over_the_pass_budget_recomputes(
    tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None
) -> None:
    """By default a pass recomputes when it is over the pass token budget (a datum longer than
    the budget, in a pass of its own) and at least `RECOMPUTE_FLOOR` long; `recompute_tokens`
    sets the threshold outright."""
    model_dir = build_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
    engine = Trainer(str(model_dir), max_slots=1, max_rank=4, pass_tokens=8)
    engine.create("m", LoraConfig(rank=4, seed=1))
    calls = _mlp_calls(engine)
    request = cross_entropy_request("m", [16], engine.core.vocab_size, 0, forward_only=False)
    passes = engine.core.passes
    for floor, threshold, runs in ((16, None, 2), (17, None, 1), (0, 17, 1), (0, 16, 2)):
        passes.pass_tokens = 8 if floor else 64
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("workers.engine.passes.RECOMPUTE_FLOOR", floor)
            calls[0] = 0
            _run(engine, [("m", request)], threshold)
        assert calls[0] == runs, (floor, threshold)
    passes.pass_tokens = 64  # within the budget: kept, however long
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("workers.engine.passes.RECOMPUTE_FLOOR", 0)
        calls[0] = 0
        _run(engine, [("m", request)], None)
    assert calls[0] == 1
