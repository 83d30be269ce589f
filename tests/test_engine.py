"""The trainer's model and residency on a tiny random Qwen3 (fp32, CPU): shared-pass isolation,
losses against an independent PEFT reference, per-slot AdamW against torch.optim.AdamW, gradient
accumulation, checkpoints (bit-exact round trip, PEFT loading), and request validation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from protocol.api import AdamParams, LoraConfig
from protocol.errors import NotFound, UserError
from protocol.jobs import StepAdam
from protocol.rules import check_adam
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import DatumArrays, FwdBwdRequest
from tests.engine_helpers import (
    PEFT_TIED_WARNING,
    TOLERANCE,
    VOCAB,
    Trainer,
    assert_same_outputs,
    bank_buffers,
    make_engine_fixture,  # noqa: F401  (the make_engine fixture)
    make_request,
    max_diff,
    perturb_b,
    train_round,
    trained_views,
    with_tenants,
)
from workers.engine import optimizer as optimizer_module

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# -- 1. shared pass isolation --------------------------------------------------------------


def test_shared_pass_gives_each_slot_its_solo_gradient(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=4, max_rank=16)
    rng = np.random.default_rng(1)
    for index, (model_id, rank) in enumerate((("t0", 4), ("t1", 8), ("t2", 8), ("t3", 16))):
        engine.create(model_id, LoraConfig(rank=rank, seed=index))
        perturb_b(engine, model_id, seed=100 + index)
    # Interleaved, with t0 twice: the engine packs rows tenant by tenant itself.
    batch = [
        ("t2", make_request("t2", [3, 7, 4], rng)),
        ("t0", make_request("t0", [5, 9], rng)),
        ("t3", make_request("t3", [12], rng)),
        ("t1", make_request("t1", [6], rng)),
        ("t0", make_request("t0", [2], rng)),
    ]
    shared = engine.forward_backward(batch)
    shared_grads = engine.bank.grads.clone()

    for model_id in ("t0", "t1", "t2", "t3"):
        engine.bank.grads.zero_()
        items = [(index, item) for index, item in enumerate(batch) if item[0] == model_id]
        solo = engine.forward_backward([item for _, item in items])
        for (index, _), solo_result in zip(items, solo, strict=True):
            assert_same_outputs(shared[index], solo_result)
        slot = engine.slot(model_id)
        solo_row = engine.bank.grads[slot]
        assert solo_row.abs().max() > 0
        assert max_diff(shared_grads[slot], solo_row) <= TOLERANCE
        for _, _, a, b in trained_views(engine, engine.bank.grads, model_id):
            assert a.abs().max() > 0 and b.abs().max() > 0

    # Rank padding receives exactly zero gradient.
    engine.bank.grads.copy_(shared_grads)
    for model_id in ("t0", "t1", "t2"):
        rank = engine.spec(model_id).rank
        for _, _, a, b in trained_views(engine, engine.bank.grads, model_id, full=True):
            assert torch.count_nonzero(a[rank:]) == 0 and torch.count_nonzero(b[:, rank:]) == 0


def test_forward_only_items_add_no_gradient(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=2, max_rank=8)
    engine.create("reader", LoraConfig(rank=8, seed=1))
    engine.create("trainer", LoraConfig(rank=8, seed=2))
    rng = np.random.default_rng(2)
    read = make_request("reader", [6, 4], rng, forward_only=True)
    train = make_request("trainer", [5], rng)
    shared = engine.forward_backward([("reader", read), ("trainer", train)])
    assert torch.count_nonzero(engine.bank.grads[engine.slot("reader")]) == 0
    assert torch.count_nonzero(engine.bank.grads[engine.slot("trainer")]) > 0
    read.forward_only = False
    engine.bank.grads.zero_()
    assert_same_outputs(shared[0], engine.forward_backward([("reader", read)])[0])


# -- 2. per-slot AdamW -----------------------------------------------------------------------


def test_slot_adamw_matches_torch_adamw(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=3, max_rank=8)
    engine.create("x", LoraConfig(rank=4, seed=1))
    engine.create("y", LoraConfig(rank=8, seed=2, train_mlp=False))
    engine.create("bystander", LoraConfig(rank=8, seed=3))
    adams = {
        "x": AdamParams(
            learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5
        ),
        "y": AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0),
    }
    references: dict[str, tuple[list[torch.Tensor], torch.optim.AdamW]] = {}
    for model_id, adam in adams.items():
        params = [
            view.clone().requires_grad_(True)
            for view in _slot_params(engine, engine.bank.weights, model_id)
        ]
        optimizer = torch.optim.AdamW(
            params,
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
        references[model_id] = (params, optimizer)

    generator = torch.Generator().manual_seed(7)
    bystander_slot = engine.slot("bystander")
    for view in _slot_params(engine, engine.bank.grads, "bystander"):
        view.copy_(torch.randn(view.shape, generator=generator))  # pending, not yet stepped
    bystander = [buffer[bystander_slot].clone() for buffer in bank_buffers(engine)]

    for _ in range(3):
        _same_gradients(engine, references, generator)
        metrics = engine.optim_step([("x", adams["x"]), ("y", adams["y"])])
        norm = torch.nn.utils.clip_grad_norm_(references["x"][0], adams["x"].grad_clip_norm)
        assert metrics[0]["unclipped_grad_l2:mean"] == pytest.approx(float(norm), rel=1e-5)
        unclipped = torch.linalg.vector_norm(
            torch.cat([g.grad.reshape(-1) for g in references["y"][0]])
        )
        assert metrics[1]["unclipped_grad_l2:mean"] == pytest.approx(float(unclipped), rel=1e-5)
        assert metrics[1]["learning_rate:mean"] == adams["y"].learning_rate
        for model_id, (params, optimizer) in references.items():
            optimizer.step()
            optimizer.zero_grad()
            for param, view in zip(
                params, _slot_params(engine, engine.bank.weights, model_id), strict=True
            ):
                assert max_diff(param.detach(), view) <= 1e-6
            assert torch.count_nonzero(engine.bank.grads[engine.slot(model_id)]) == 0
        # Other slots: bit-identical, pending gradients included.
        for before, buffer in zip(bystander, bank_buffers(engine), strict=True):
            assert torch.equal(before, buffer[bystander_slot])

    # Padding and untrained layers stayed exactly zero through decay and Adam.
    for _, _, a, b in trained_views(engine, engine.bank.weights, "x", full=True):
        assert torch.count_nonzero(a[4:]) == 0 and torch.count_nonzero(b[:, 4:]) == 0
    for _, group, a, b in trained_views(engine, engine.bank.weights, "y", full=True):
        if group == "mlp":
            assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0
    assert engine.optimizer.steps[engine.slot("x")] == 3


@pytest.mark.parametrize("fused", [True, False])
def test_coupled_weight_decay_matches_torch_adam(
    make_engine: Callable[..., Trainer], monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """A Twinkle client's `Adam`: the decay added to the gradient (torch's `Adam`), the
    gradient buffer left as it was until the step clears it, on the fused kernel and the
    foreach path alike; an AdamW slot in the same step is unaffected."""
    if not fused:
        monkeypatch.setattr(optimizer_module, "_FUSED_ADAM", None)
    engine = make_engine(max_slots=2, max_rank=8)
    engine.create("x", LoraConfig(rank=4, seed=1))
    engine.create("w", LoraConfig(rank=4, seed=2))
    generator = torch.Generator().manual_seed(3)
    for model_id in ("x", "w"):  # non-zero weights, so that the decay shows
        for view in _slot_params(engine, engine.bank.weights, model_id):
            view.copy_(torch.randn(view.shape, generator=generator))
    base = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    coupled = StepAdam(**msgspec.structs.asdict(base), coupled_weight_decay=True)
    references = {}
    for model_id, cls in (("x", torch.optim.Adam), ("w", torch.optim.AdamW)):
        params = [
            v.clone().requires_grad_(True)
            for v in _slot_params(engine, engine.bank.weights, model_id)
        ]
        references[model_id] = (
            params,
            cls(params, lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1),
        )
    for _ in range(3):
        _same_gradients(engine, references, generator)
        engine.optim_step([("x", coupled), ("w", base)])
        for model_id, (params, reference) in references.items():
            reference.step()
            for param, view in zip(
                params, _slot_params(engine, engine.bank.weights, model_id), strict=True
            ):
                assert max_diff(param.detach(), view) <= 1e-6, model_id


def _same_gradients(
    engine: Trainer, references: dict[str, Any], generator: torch.Generator
) -> None:
    """New random gradients in each slot's buffer and its reference parameters alike."""
    for model_id, (params, _) in references.items():
        for param, view in zip(
            params, _slot_params(engine, engine.bank.grads, model_id), strict=True
        ):
            gradient = torch.randn(view.shape, generator=generator)
            view.copy_(gradient)
            param.grad = gradient.clone()


def _slot_params(engine: Trainer, buffer: torch.Tensor, model_id: str) -> list[torch.Tensor]:
    return [view for _, _, a, b in trained_views(engine, buffer, model_id) for view in (a, b)]


# -- 3. gradient accumulation ------------------------------------------------------------------


def test_two_calls_accumulate_like_one_concatenated_call(
    make_engine: Callable[..., Trainer],
) -> None:
    engine = make_engine(max_slots=3, max_rank=8)
    for model_id in ("split", "whole"):
        engine.create(model_id, LoraConfig(rank=8, seed=5))  # same seed: identical adapters
        perturb_b(engine, model_id, seed=50)
    engine.create("other", LoraConfig(rank=4, seed=6))
    rng = np.random.default_rng(3)
    first = make_request("split", [4, 7, 3], rng)
    second = make_request("split", [6, 2], rng)
    engine.forward_backward([("split", first)])
    engine.forward_backward([("other", make_request("other", [5], rng)), ("split", second)])
    whole = FwdBwdRequest("whole", 1, "cross_entropy", False, {}, first.datums + second.datums)
    engine.forward_backward([("whole", whole)])

    split_row, whole_row = (engine.bank.grads[engine.slot(m)] for m in ("split", "whole"))
    assert whole_row.abs().max() > 0
    assert max_diff(split_row, whole_row) <= TOLERANCE
    # eps well above rounding noise, so Adam's near-sign update cannot amplify it.
    adam = AdamParams(learning_rate=1e-2, eps=1e-3, weight_decay=0.01)
    engine.optim_step([("split", adam), ("whole", adam)])
    weights = engine.bank.weights
    assert max_diff(weights[engine.slot("split")], weights[engine.slot("whole")]) <= 1e-6


# -- 4. cross_entropy against an independent reference ----------------------------------------


@pytest.mark.filterwarnings(PEFT_TIED_WARNING)
@pytest.mark.parametrize("k", [None, 3], ids=["per-token", "k-targets"])
def test_cross_entropy_matches_peft_reference(
    make_engine: Callable[..., Trainer], random_qwen3: Path, k: int | None
) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    engine = make_engine(max_slots=2, max_rank=8)
    engine.create("m", LoraConfig(rank=8, seed=3))
    perturb_b(engine, "m", seed=30)
    request = make_request("m", [5, 8, 3], np.random.default_rng(4), k=k)
    [result] = engine.forward_backward([("m", request)])

    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(random_qwen3, dtype=torch.float32),
        PeftLoraConfig(
            r=8,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "lm_head",
            ],
        ),
    )
    reference.eval()
    peft_layers = {}
    for path, _, a, b in trained_views(engine, engine.bank.weights, "m"):
        layer = reference.base_model.model.get_submodule(path)
        layer.lora_A["default"].weight.data.copy_(a)
        layer.lora_B["default"].weight.data.copy_(b)
        peft_layers[path] = layer

    total = torch.zeros(())
    for datum, output in zip(request.datums, result.loss_fn_outputs, strict=True):
        logits = reference(input_ids=torch.as_tensor(datum.tokens, dtype=torch.long)[None]).logits[
            0
        ]
        targets = torch.as_tensor(datum.inputs["target_tokens"])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if k is None:
            logprobs = logprobs.gather(-1, targets[:, None])[:, 0]
        else:
            logprobs = logprobs.gather(-1, targets)
        elementwise = -torch.as_tensor(datum.inputs["weights"]) * logprobs
        total = total + elementwise.sum()
        assert output["logprobs"].shape == tuple(targets.shape)
        assert max_diff(output["logprobs"], logprobs.detach()) <= TOLERANCE
        assert max_diff(output["elementwise_loss"], elementwise.detach()) <= TOLERANCE
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(float(total.detach()), abs=TOLERANCE)
    assert result.loss_fn_output_type == "CrossEntropyLossReturn"
    for path, _, a, b in trained_views(engine, engine.bank.grads, "m"):
        layer = peft_layers[path]
        assert max_diff(a, layer.lora_A["default"].weight.grad) <= TOLERANCE
        assert max_diff(b, layer.lora_B["default"].weight.grad) <= TOLERANCE


def test_weights_default_to_one(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=1, max_rank=4)
    engine.create("m", LoraConfig(rank=4, seed=1))
    request = make_request("m", [6], np.random.default_rng(5), weights=False)
    [result] = engine.forward_backward([("m", request)])
    output = result.loss_fn_outputs[0]
    assert max_diff(output["elementwise_loss"], -output["logprobs"]) == 0.0
    assert result.metrics["loss:sum"] == pytest.approx(-float(output["logprobs"].sum()), rel=1e-6)


# -- 5. checkpoints and layer flags ------------------------------------------------------------


def test_weights_checkpoint_round_trip_is_exact(
    make_engine: Callable[..., Trainer], tmp_path: Path
) -> None:
    engine = make_engine(max_slots=3, max_rank=8)
    engine.create("a", LoraConfig(rank=4, seed=11, train_unembed=False))
    rng = np.random.default_rng(6)
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.05, grad_clip_norm=10.0)
    for _ in range(2):
        engine.forward_backward([("a", make_request("a", [5, 3], rng))])
        engine.optim_step([("a", adam)])
    written = engine.save("a", tmp_path / "ckpt", kind="weights", meta={"seq_id": 7})
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert files == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "meta.json",
    }
    assert written == sum(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())

    spec = engine.load("b", tmp_path / "ckpt", with_optimizer=True)
    assert spec == engine.spec("a")
    for buffer in bank_buffers(engine):
        assert torch.equal(buffer[engine.slot("a")], buffer[engine.slot("b")])
    assert engine.optimizer.steps[engine.slot("b")] == 2

    request = make_request("a", [4, 6], rng)
    for _ in range(2):
        [loss_a] = engine.forward_backward([("a", request)])
        [loss_b] = engine.forward_backward([("b", request)])
        assert loss_a.metrics == loss_b.metrics
        engine.optim_step([("a", adam), ("b", adam)])
    assert torch.equal(engine.bank.weights[engine.slot("a")], engine.bank.weights[engine.slot("b")])

    # Without the optimizer: same weights, fresh moments; pending gradients dropped.
    engine.forward_backward([("b", request)])
    engine.load("b", tmp_path / "ckpt", with_optimizer=False)
    slot_b = engine.slot("b")
    assert engine.optimizer.steps[slot_b] == 0
    for buffer in (engine.bank.grads, engine.optimizer.exp_avg, engine.optimizer.exp_avg_sq):
        assert torch.count_nonzero(buffer[slot_b]) == 0


@pytest.mark.filterwarnings(PEFT_TIED_WARNING)
def test_sampler_checkpoint_loads_in_peft_with_same_logits(
    make_engine: Callable[..., Trainer], random_qwen3: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    engine = make_engine(max_slots=2, max_rank=8)
    engine.create("m", LoraConfig(rank=6, seed=21))
    perturb_b(engine, "m", seed=210)
    directory = tmp_path / "sampler"
    engine.save("m", directory, kind="sampler_weights", meta={})
    assert {p.name for p in directory.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }

    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, 9).astype(np.int32)
    # the widest [N, K] targets a request may carry: K distinct ids per position
    targets = np.argsort(rng.random((9, VOCAB)), axis=1)[:, :MAX_LOGPROBS_K].astype(np.int64)
    request = FwdBwdRequest(
        "m", 1, "cross_entropy", True, {}, [DatumArrays(tokens, {"target_tokens": targets})]
    )
    [result] = engine.forward_backward([("m", request)])

    base = AutoModelForCausalLM.from_pretrained(random_qwen3, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, directory)
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0]
    assert (
        max_diff(
            result.loss_fn_outputs[0]["logprobs"],
            torch.log_softmax(logits, dim=-1).gather(1, torch.from_numpy(targets)),
        )
        <= TOLERANCE
    )
    assert torch.count_nonzero(engine.bank.grads) == 0  # a forward-only pass


def test_layer_flags_leave_untrained_layers_at_zero_gradient(
    make_engine: Callable[..., Trainer], tmp_path: Path
) -> None:
    engine = make_engine(max_slots=4, max_rank=8)
    flags = {
        "no_attn": LoraConfig(rank=4, seed=1, train_attn=False),
        "no_mlp": LoraConfig(rank=4, seed=2, train_mlp=False),
        "no_unembed": LoraConfig(rank=8, seed=3, train_unembed=False),
        "unembed_only": LoraConfig(rank=8, seed=4, train_attn=False, train_mlp=False),
    }
    rng = np.random.default_rng(8)
    for index, (model_id, spec) in enumerate(flags.items()):
        engine.create(model_id, spec)
        perturb_b(engine, model_id, seed=80 + index)
    engine.forward_backward([(model_id, make_request(model_id, [5, 3], rng)) for model_id in flags])

    for model_id, spec in flags.items():
        trained = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        for path, group, a, b in trained_views(engine, engine.bank.grads, model_id, full=True):
            if trained[group]:
                assert a.abs().max() > 0 and b.abs().max() > 0, (model_id, path)
            else:
                assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0, (model_id, path)

    engine.save("no_mlp", tmp_path / "no_mlp", kind="sampler_weights", meta={})
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "no_mlp" / "adapter_model.safetensors").keys()
    assert keys and not any(".mlp." in key for key in keys)
    assert any("lm_head" in key for key in keys) and any("self_attn" in key for key in keys)


# -- 6. validation and slot errors -------------------------------------------------------------


def test_validate_rejects_bad_requests(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=1, max_rank=4)
    engine.create("m", LoraConfig(rank=4, seed=1))
    rng = np.random.default_rng(9)

    def rejected(request: FwdBwdRequest, *fragments: str) -> None:
        with pytest.raises(UserError) as caught:
            engine.validate("m", request)
        for fragment in fragments:
            assert fragment in caught.value.message

    request = make_request("m", [4], rng)
    request.loss_fn = "ppo_typo"
    rejected(request, "unknown loss_fn 'ppo_typo'", "supported: cross_entropy")

    request = make_request("m", [4, 5], rng)
    request.datums[1].tokens[2] = VOCAB
    rejected(request, "datums[1].model_input", str(VOCAB))

    request = make_request("m", [4, 5], rng)
    request.datums[0].inputs["target_tokens"] = request.datums[0].inputs["target_tokens"][:3]
    rejected(request, "datums[0].loss_fn_inputs.target_tokens", "length 3 != 4")

    request = make_request("m", [4], rng)
    del request.datums[0].inputs["target_tokens"]
    rejected(request, "datums[0].loss_fn_inputs.target_tokens", "missing")

    request = make_request("m", [4], rng)
    request.datums[0].inputs["target_tokens"][1] = -1
    rejected(request, "datums[0].loss_fn_inputs.target_tokens", "-1")

    request = make_request("m", [4], rng)
    request.datums[0].inputs["weights"] = request.datums[0].inputs["weights"].astype(np.int64)
    rejected(request, "datums[0].loss_fn_inputs.weights", "dtype")

    request = make_request("m", [4], rng)
    request.datums[0] = DatumArrays(
        np.zeros(0, dtype=np.int32), {"target_tokens": np.zeros(0, dtype=np.int64)}
    )
    rejected(request, "datums[0].model_input", "empty")

    request = make_request("m", [4], rng)
    request.datums[0] = DatumArrays(
        np.zeros(engine.max_context + 1, dtype=np.int32),
        {"target_tokens": np.zeros(engine.max_context + 1, dtype=np.int64)},
    )
    rejected(request, "datums[0].model_input", "context")

    with pytest.raises(NotFound):
        engine.validate("ghost", make_request("ghost", [3], rng))
    with pytest.raises(UserError, match="adam_params.eps"):
        check_adam(AdamParams(eps=0.0))
    engine.forward_backward([("m", make_request("m", [3], rng))])
    before = [buffer.clone() for buffer in bank_buffers(engine)]
    with pytest.raises(UserError, match="adam_params.beta1"):
        engine.optim_step([("m", AdamParams(beta1=1.0))])
    for old, buffer in zip(before, bank_buffers(engine), strict=True):
        assert torch.equal(old, buffer)  # a rejected step changes nothing
    engine.validate("m", make_request("m", [3, 2], rng, k=2))  # a good request passes


def test_slot_lifecycle_errors(make_engine: Callable[..., Trainer]) -> None:
    engine = make_engine(max_slots=2, max_rank=8)
    with pytest.raises(UserError, match="rank"):
        engine.create("m", LoraConfig(rank=0))
    with pytest.raises(UserError, match="rank"):
        engine.create("m", LoraConfig(rank=9))
    with pytest.raises(UserError, match="train_attn"):
        engine.create(
            "m", LoraConfig(train_attn=False, train_mlp=False, train_unembed=False, rank=4)
        )
    engine.create("a", LoraConfig(rank=4, seed=1))
    engine.create("b", LoraConfig(rank=4, seed=2))
    engine.create("c", LoraConfig(rank=4))  # every slot held: parks the least recently used ("a")
    assert (
        engine.residency.slots_used() == 2
        and engine.residency.adapters_total() == 3
        and "a" in engine.parked
    )
    slot_a = engine.slot("a")  # restored on demand, parking "b"
    engine.forward_backward([("a", make_request("a", [3], np.random.default_rng(10)))])
    engine.release("a")
    assert not engine.has("a")
    for buffer in bank_buffers(engine):
        assert torch.count_nonzero(buffer[slot_a]) == 0
    engine.create("d", LoraConfig(rank=4, seed=3))
    assert engine.slot("d") == slot_a


# -- Qwen3.5: hybrid linear/full attention ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    directory = tmp_path_factory.mktemp("tiny-qwen3_5")
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.filterwarnings(PEFT_TIED_WARNING)
def test_qwen3_5_linear_attention_is_adapted_and_isolated(
    tiny_qwen3_5: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    engine = Trainer(str(tiny_qwen3_5), max_slots=2, max_rank=8)
    groups = {layout.path: layout.group for layout in engine.bank.layouts}
    # Tinker's adapter: one pair per q, k, v slice of the fused projection, none on the
    # per-head scalars `in_proj_a`/`in_proj_b`; a PEFT file holds the slices as one block LoRA
    for part in ("q", "k", "v"):  # kept beside it under Tinker's names (in_proj_q, …)
        assert groups[f"model.layers.0.linear_attn.in_proj_{part}"] == "attn"
    assert "model.layers.0.linear_attn.in_proj_qkv" not in groups
    assert not any(path.endswith(("in_proj_a", "in_proj_b")) for path in groups)
    assert groups["model.layers.0.linear_attn.out_proj"] == "attn"
    assert groups["model.layers.1.self_attn.q_proj"] == "attn"
    assert groups["model.layers.0.mlp.down_proj"] == "mlp"

    engine.create("full", LoraConfig(rank=8, seed=1))
    engine.create("mlp_only", LoraConfig(rank=4, seed=2, train_attn=False, train_unembed=False))
    for index, model_id in enumerate(("full", "mlp_only")):
        perturb_b(engine, model_id, seed=90 + index)
    rng = np.random.default_rng(11)
    batch = [
        ("full", make_request("full", [7, 4], rng)),
        ("mlp_only", make_request("mlp_only", [9], rng)),
    ]
    shared = engine.forward_backward(batch)
    shared_grads = engine.bank.grads.clone()
    for index, item in enumerate(batch):
        engine.bank.grads.zero_()
        [solo] = engine.forward_backward([item])
        assert_same_outputs(shared[index], solo)
        slot = engine.slot(item[0])
        assert max_diff(shared_grads[slot], engine.bank.grads[slot]) <= TOLERANCE
    for path, group, a, b in trained_views(engine, shared_grads, "mlp_only", full=True):
        if group != "mlp":
            assert torch.count_nonzero(a) == 0 and torch.count_nonzero(b) == 0, path

    engine.save("full", tmp_path / "full", kind="sampler_weights", meta={})
    tokens = rng.integers(0, VOCAB, 6).astype(np.int32)
    targets = np.argsort(rng.random((6, VOCAB)), axis=1)[:, :MAX_LOGPROBS_K].astype(np.int64)
    request = FwdBwdRequest(
        "full", 1, "cross_entropy", True, {}, [DatumArrays(tokens, {"target_tokens": targets})]
    )
    [result] = engine.forward_backward([("full", request)])
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32), tmp_path / "full"
    )
    with torch.no_grad():
        logits = peft_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0]
    assert (
        max_diff(
            result.loss_fn_outputs[0]["logprobs"],
            torch.log_softmax(logits, dim=-1).gather(1, torch.from_numpy(targets)),
        )
        <= TOLERANCE
    )


def test_load_rejects_incompatible_checkpoints(
    make_engine: Callable[..., Trainer], tmp_path: Path
) -> None:
    wide = make_engine(max_slots=1, max_rank=8)
    wide.create("m", LoraConfig(rank=8, seed=1))
    wide.save("m", tmp_path / "rank8", kind="weights", meta={})
    wide.save("m", tmp_path / "sampler", kind="sampler_weights", meta={})

    narrow = make_engine(max_slots=1, max_rank=4)
    with pytest.raises(UserError, match="rank 8"):
        narrow.load("n", tmp_path / "rank8", with_optimizer=True)
    with pytest.raises(UserError, match="not found"):
        narrow.load("n", tmp_path / "missing", with_optimizer=False)
    with pytest.raises(UserError, match="optimizer"):
        wide.load("other", tmp_path / "sampler", with_optimizer=True)
    assert not narrow.has("n") and not wide.has("other")
    # An adapter-only checkpoint loads without its optimizer; its spec comes from the files.
    wide.release("m")
    spec = wide.load("m", tmp_path / "sampler", with_optimizer=False)
    assert (spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed) == (8, True, True, True)


def test_discarded_gradients_leave_the_weights_and_the_other_slots_alone(
    make_engine: Callable[..., Trainer],
) -> None:
    """A Twinkle client's `zero_grad` before its step: the slot's accumulated gradient is
    cleared, nothing else; its next step applies only what was accumulated after."""
    engine = with_tenants(make_engine(max_slots=3, max_rank=8))
    train_round(engine, seed=1)
    a, b = engine.slot("a"), engine.slot("b")
    kept = engine.bank.grads[b].clone()
    weights = engine.bank.weights.clone()
    assert engine.bank.grads[a].abs().sum() > 0
    engine.core.discard_gradients([a])
    assert engine.bank.grads[a].abs().sum() == 0
    assert torch.equal(engine.bank.grads[b], kept)
    assert torch.equal(engine.bank.weights, weights)
    # after the discard, a round accumulates exactly what a fresh round does
    train_round(engine, seed=2)
    after = engine.bank.grads[a].clone()
    engine.core.discard_gradients([a])
    train_round(engine, seed=2)
    assert torch.equal(engine.bank.grads[a], after)
