"""Slot parking in the trainer's residency (fp32, CPU): with more tenants than slots, the least recently
used tenant's slot goes to host memory and comes back bit-exactly when a call needs it.

Each test runs the same requests on an engine with 2 slots (parking all the time) and on one with
8 slots (never parking) and compares losses and whole slot rows: weights, pending gradients, both
Adam moments, step counts and scales.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from protocol.api import AdamParams, LoraConfig
from protocol.errors import NotFound, ServerError, UserError
from protocol.rules import check_adam
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from tests.engine_helpers import Trainer
from workers.engine.lora import LAYER_GROUPS
from workers.trainer.checkpoints import read_checkpoint
from workers.trainer.parking import Tenant
from workers.trainer.snapshots import read_state, write_state

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 256
TOLERANCE = 1e-6
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
# Ranks and layer groups differ, so parking copies differently shaped parts of the slot row.
SPECS = {
    "t0": LoraConfig(rank=2, seed=1),
    "t1": LoraConfig(rank=8, seed=2, train_unembed=False),
    "t2": LoraConfig(rank=4, seed=3, train_attn=False),
    "t3": LoraConfig(rank=1, seed=4, train_mlp=False, train_unembed=False),
    "t4": LoraConfig(rank=3, seed=5),
}
TENANTS = list(SPECS)


@pytest.fixture
def make_parking(random_qwen3: Path) -> Callable[..., Trainer]:
    """Trainers of `max_slots` slots holding the SPECS tenants (unless not `create`)."""

    def make(max_slots: int, max_parked: int | None = None, create: bool = True) -> Trainer:
        engine = Trainer(str(random_qwen3), max_slots=max_slots, max_rank=8, max_parked=max_parked)
        if create:
            for model_id, spec in SPECS.items():
                engine.create(model_id, spec)
        return engine

    return make


def make_request(model_id: str, seed: int, *, forward_only: bool = False) -> FwdBwdRequest:
    rng = np.random.default_rng(seed)
    datums = []
    for length in rng.integers(3, 9, size=2):
        inputs = {
            "target_tokens": rng.integers(0, VOCAB, length).astype(np.int64),
            "weights": (rng.normal(size=length) / length).astype(np.float32),
        }
        datums.append(DatumArrays(rng.integers(0, VOCAB, length).astype(np.int32), inputs))
    return FwdBwdRequest(model_id, 1, "cross_entropy", forward_only, {}, datums)


def slot_state(engine: Trainer, model_id: str) -> dict[str, Any]:
    """Everything the slot holds for `model_id`, whole rows (padding included), as copies."""
    slot = engine.slot(model_id)
    return {
        "weights": engine.bank.weights[slot].clone(),
        "grads": engine.bank.grads[slot].clone(),
        "exp_avg": engine.optimizer.exp_avg[slot].clone(),
        "exp_avg_sq": engine.optimizer.exp_avg_sq[slot].clone(),
        "step": engine.optimizer.steps[slot],
        "scales": {group: engine.bank.scales[group][slot] for group in LAYER_GROUPS},
        "spec": engine.spec(model_id),
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any], tolerance: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor)
            if tolerance == 0.0:  # bit for bit: NaN and the sign of zero included
                assert torch.equal(value.view(torch.int32), other.view(torch.int32)), key
            else:
                assert float((value - other).abs().max()) <= tolerance, key
        else:
            assert value == other, key


def assert_same_results(
    a: list[FwdBwdOutput], b: list[FwdBwdOutput], tolerance: float = 0.0
) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        assert left.loss_fn_output_type == right.loss_fn_output_type
        assert left.metrics.keys() == right.metrics.keys()
        for name, value in left.metrics.items():
            assert abs(value - right.metrics[name]) <= tolerance, name
        for out_left, out_right in zip(left.loss_fn_outputs, right.loss_fn_outputs, strict=True):
            for name, array in out_left.items():
                assert np.abs(array - out_right[name]).max(initial=0.0) <= tolerance, name


# -- training under slot pressure ------------------------------------------------------------------


def test_interleaved_training_matches_an_engine_that_never_parks(
    make_parking: Callable[..., Trainer],
) -> None:
    tight, roomy = make_parking(max_slots=2), make_parking(max_slots=8)
    for round_ in range(3):
        for index, model_id in enumerate(TENANTS):
            request = make_request(model_id, seed=100 * round_ + index)
            assert_same_results(
                tight.forward_backward([(model_id, request)]),
                roomy.forward_backward([(model_id, request)]),
            )
            assert tight.optim_step([(model_id, ADAM)]) == roomy.optim_step([(model_id, ADAM)])
            assert tight.residency.slots_used() == 2 and tight.residency.adapters_total() == len(
                TENANTS
            )
            assert all(tight.has(other) for other in TENANTS)
    assert len(tight.parked) == 3 and len(roomy.parked) == 0
    for model_id in TENANTS:
        assert_same_state(slot_state(tight, model_id), slot_state(roomy, model_id))
        assert tight.optimizer.steps[tight.slot(model_id)] == 3


def test_pending_gradients_survive_a_park(make_parking: Callable[..., Trainer]) -> None:
    tight, roomy = make_parking(max_slots=2), make_parking(max_slots=8)
    for engine in (tight, roomy):  # one step first, so moments and B are non-zero too
        for index, model_id in enumerate(TENANTS):
            engine.forward_backward([(model_id, make_request(model_id, seed=index))])
        engine.optim_step([(model_id, ADAM) for model_id in TENANTS])

    # Gradients accumulate over two calls per tenant, with every tenant parked in between.
    for round_ in range(2):
        for index, model_id in enumerate(TENANTS):
            request = make_request(model_id, seed=10 + 10 * round_ + index)
            assert_same_results(
                tight.forward_backward([(model_id, request)]),
                roomy.forward_backward([(model_id, request)]),
            )
    assert "t0" in tight.parked
    before = slot_state(roomy, "t0")
    assert torch.count_nonzero(before["grads"]) > 0
    assert_same_state(slot_state(tight, "t0"), before)  # restored with its pending gradient

    for model_id in reversed(TENANTS):
        assert tight.optim_step([(model_id, ADAM)]) == roomy.optim_step([(model_id, ADAM)])
    for model_id in TENANTS:
        state = slot_state(tight, model_id)
        assert torch.count_nonzero(state["grads"]) == 0
        assert_same_state(state, slot_state(roomy, model_id))


def test_a_call_over_more_tenants_than_slots_runs_in_groups(
    make_parking: Callable[..., Trainer],
) -> None:
    tight, roomy = make_parking(max_slots=2), make_parking(max_slots=8)
    # Every tenant, one twice and one forward-only item, in an order that mixes the groups.
    batch = [
        (model_id, make_request(model_id, seed=index)) for index, model_id in enumerate(TENANTS)
    ]
    batch.insert(1, ("t3", make_request("t3", seed=7, forward_only=True)))
    batch.append(("t0", make_request("t0", seed=8)))
    for _ in range(2):
        assert_same_results(tight.forward_backward(batch), roomy.forward_backward(batch), TOLERANCE)
        steps = [(model_id, ADAM) for model_id in reversed(TENANTS)]
        for tight_metrics, roomy_metrics in zip(
            tight.optim_step(steps), roomy.optim_step(steps), strict=True
        ):
            assert tight_metrics.keys() == roomy_metrics.keys()
            for name, value in tight_metrics.items():
                # relative: a pass of 2 tenants and one of 8 compute the LoRA terms differently
                # (`workers.engine.lora_kernels`), equal to rounding
                assert abs(value - roomy_metrics[name]) <= TOLERANCE * max(1.0, abs(value))
    assert tight.residency.slots_used() == 2 and tight.residency.adapters_total() == len(TENANTS)
    for model_id in TENANTS:
        assert_same_state(slot_state(tight, model_id), slot_state(roomy, model_id), TOLERANCE)

    with pytest.raises(ServerError, match="twice"):
        tight.optim_step([("t0", ADAM), ("t4", ADAM), ("t0", ADAM)])
    with pytest.raises(NotFound):
        tight.forward_backward([("t1", batch[2][1]), ("nobody", batch[2][1])])


def test_save_and_load_of_parked_tenants(
    make_parking: Callable[..., Trainer], tmp_path: Path
) -> None:
    tight, roomy = make_parking(max_slots=2), make_parking(max_slots=8)
    for engine in (tight, roomy):
        for index, model_id in enumerate(TENANTS):
            engine.forward_backward([(model_id, make_request(model_id, seed=index))])
            engine.optim_step([(model_id, ADAM)])
    assert "t0" in tight.parked
    for engine, name in ((tight, "tight"), (roomy, "roomy")):
        engine.save("t0", tmp_path / name, kind="weights", meta={})
    saved = read_checkpoint(tmp_path / "tight", with_optimizer=True)
    reference = read_checkpoint(tmp_path / "roomy", with_optimizer=True)
    assert saved.step == reference.step == 1 and saved.spec == reference.spec
    for tensors, expected in (
        (saved.tensors, reference.tensors),
        (saved.moments, reference.moments),
    ):
        assert tensors is not None and expected is not None and tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[key], expected[key]) for key in tensors)

    # Loading over a parked tenant replaces its state (pending gradients dropped).
    tight.forward_backward([("t1", make_request("t1", seed=50))])
    for model_id in ("t2", "t3"):
        tight.slot(model_id)
    assert "t1" in tight.parked
    assert tight.load("t1", tmp_path / "tight", with_optimizer=True) == SPECS["t0"]
    # And a new tenant with every slot held parks the least recently used one.
    tight.load("copy", tmp_path / "tight", with_optimizer=True)
    assert tight.residency.adapters_total() == len(TENANTS) + 1 and list(tight.parked)[-1] == "t3"
    for model_id in ("t1", "copy"):
        assert_same_state(slot_state(tight, model_id), slot_state(roomy, "t0"))
    # Training on from the loaded copy matches training on from the original.
    request = make_request("t0", seed=60)
    assert_same_results(
        tight.forward_backward([("copy", request)]), roomy.forward_backward([("t0", request)])
    )
    assert tight.optim_step([("copy", ADAM)]) == roomy.optim_step([("t0", ADAM)])
    assert_same_state(slot_state(tight, "copy"), slot_state(roomy, "t0"))


def test_max_parked_drops_the_oldest_parked_tenant(
    make_parking: Callable[..., Trainer], caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_parking(max_slots=2, max_parked=2, create=False)
    with caplog.at_level(logging.WARNING, logger="workers.trainer.parking"):
        for model_id in TENANTS:  # t0, t1 parked as t2, t3 arrive; t4 parks t2 and drops t0
            engine.create(model_id, SPECS[model_id])
    assert not engine.has("t0") and all(engine.has(model_id) for model_id in TENANTS[1:])
    assert engine.residency.adapters_total() == 4 and len(engine.parked) == 2
    assert any("t0" in record.getMessage() for record in caplog.records)
    with pytest.raises(NotFound):
        engine.forward_backward([("t0", make_request("t0", seed=0))])
    with pytest.raises(NotFound):
        engine.optim_step([("t0", ADAM)])
    # Restoring t1 parks t3 (least recently used resident); nothing is dropped.
    engine.forward_backward([("t1", make_request("t1", seed=1))])
    assert list(engine.parked) == ["t2", "t3"]
    assert engine.has("t1") and engine.residency.adapters_total() == 4

    with pytest.raises(ValueError, match="max_parked"):
        make_parking(max_slots=2, max_parked=-1, create=False)


def test_parked_tenants_answer_every_entry_point(
    make_parking: Callable[..., Trainer], tmp_path: Path
) -> None:
    engine = make_parking(max_slots=2)
    assert "t0" in engine.parked
    # spec, validate and has do not restore.
    assert engine.spec("t0") == SPECS["t0"]
    engine.validate("t0", make_request("t0", seed=0))
    check_adam(ADAM)  # what optim_step checks first
    assert "t0" in engine.parked and engine.has("t0")
    with pytest.raises(UserError, match="already has an adapter"):
        engine.create("t0", SPECS["t0"])
    engine.release("t0")
    assert not engine.has("t0") and engine.residency.adapters_total() == len(TENANTS) - 1
    with pytest.raises(NotFound):
        engine.spec("t0")

    # A snapshot's slot goes before any tenant is parked; with none left a snapshot parks one.
    engine.release("t4")
    engine.save("t1", tmp_path / "sampler", kind="sampler_weights", meta={})  # restores t1
    engine.release("t3")
    assert engine.residency.slots_used() == 1 and list(engine.parked) == ["t2"]
    engine.residency.load_snapshot("s", tmp_path / "sampler")
    engine.slot("t2")
    assert (
        not engine.residency.has_snapshot("s")
        and len(engine.parked) == 0
        and engine.residency.slots_used() == 2
    )
    engine.residency.load_snapshot("s", tmp_path / "sampler")
    assert (
        engine.residency.has_snapshot("s")
        and len(engine.parked) == 1
        and engine.residency.slots_used() == 1
    )
    assert engine.has("t1") and engine.has("t2")


def test_a_row_with_values_outside_the_adapter_is_parked_whole(
    make_parking: Callable[..., Trainer],
) -> None:
    engine = make_parking(max_slots=2, create=False)
    engine.create("a", LoraConfig(rank=2, seed=1, train_mlp=False))
    slot = engine.slot("a")
    engine.bank.grads[slot, -1] = float("nan")  # lm_head B padding: never written normally
    engine.optimizer.exp_avg[slot, 0] = 3.0
    before = slot_state(engine, "a")
    engine.create("b", LoraConfig(rank=2, seed=2))
    engine.create("c", LoraConfig(rank=2, seed=3))
    assert "a" in engine.parked
    assert_same_state(slot_state(engine, "a"), before)


def test_an_adapter_with_no_layer_on_its_model_parks_and_snapshots_as_nothing(
    tmp_path: Path,
) -> None:
    """An MLP-only adapter on a model whose MLP the bank does not wrap (GPT-2's are `Conv1D`)
    owns nothing in the bank. `create` refuses one now, but a state from before (a snapshot, a
    checkpoint) still arrives: parking and snapshots store nothing for it, where `torch.cat` of
    no tensors used to raise, and stopped its worker on every replay of its optim_step."""
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0
    )
    config.eos_token_id = 0
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    engine = Trainer(str(tmp_path / "gpt2"), max_slots=1, max_rank=8)
    assert "mlp" not in engine.bank.groups_present()
    spec = LoraConfig(rank=2, seed=1, train_attn=False, train_unembed=False)
    tenant = Tenant(slot=0, spec=spec, lora_alpha=32.0)

    state = engine.parked.copy(tenant)
    assert state.rows == {}
    written = write_state(tmp_path / "state", 3, state, {"model_id": "m"})
    assert read_state(written).rows == {}
    engine.parked.park("m", tenant)
    parked = engine.parked.pop("m")
    assert parked is not None and parked.rows == {}
    assert engine.parked.restore(parked, 0) == tenant
