"""Every built-in loss in the trainer's model (fp32, CPU) against an independent reference: a PEFT model
carrying the same adapter, with each loss written out here from Tinker's documented formulas (per-token
logprobs, loss:sum, LoRA gradients); forward-only passes; a shared pass mixing loss functions;
request validation; and chunk invariance under the SDK's own result combiner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.sampling import MAX_LOGPROBS_K
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from tests.engine_helpers import LAYOUTS, PEFT_TIED_WARNING, TOLERANCE, VOCAB, Trainer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

RANK = 8
LORA_ALPHA = 32
LENGTHS = [7, 11, 5]

# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engine(random_qwen3: Path, request: pytest.FixtureRequest) -> Trainer:
    """One trainer for the module; each test creates its own model_ids and releases them.

    "split" runs each call as passes of at most 9 token positions, log-probs one token at a
    time: the numbers must not change.
    """
    return Trainer(
        str(random_qwen3),
        max_slots=4,
        max_rank=RANK,
        lora_alpha=LORA_ALPHA,
        **LAYOUTS[request.param],
    )


@pytest.fixture
def tenants(engine: Trainer) -> Iterator[Callable[..., None]]:
    created: list[str] = []

    def create(*model_ids: str, seed: int = 1) -> None:
        for index, model_id in enumerate(model_ids):
            engine.create(model_id, LoraConfig(rank=RANK, seed=seed + index))
            randomize_b(engine, model_id, seed=100 * seed + index)
            created.append(model_id)

    engine.bank.grads.zero_()
    yield create
    for model_id in created:
        engine.release(model_id)


@pytest.fixture(scope="module")
def reference(random_qwen3: Path) -> Any:
    """A PEFT LoRA model on the same base, every linear adapted; weights copied in per test."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(random_qwen3, dtype=torch.float32),
        PeftLoraConfig(
            r=RANK,
            lora_alpha=LORA_ALPHA,
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
    model.eval()
    return model


def slot_views(engine: Trainer, buffer: torch.Tensor, model_id: str) -> Iterator[Any]:
    yield from engine.bank.slot_views(buffer, engine.slot(model_id), RANK)


def randomize_b(engine: Trainer, model_id: str, seed: int) -> None:
    """Non-zero B so that A receives gradient too."""
    generator = torch.Generator().manual_seed(seed)
    for _, _, b in slot_views(engine, engine.bank.weights, model_id):
        b.copy_(torch.randn(b.shape, generator=generator) * 0.05)


def load_reference(reference: Any, engine: Trainer, model_id: str) -> dict[str, Any]:
    """Copy the slot's adapter into the PEFT model; return its LoRA layers by module path."""
    layers = {}
    for layout, a, b in slot_views(engine, engine.bank.weights, model_id):
        layer = reference.base_model.model.get_submodule(layout.path)
        layer.lora_A["default"].weight.data.copy_(a)
        layer.lora_B["default"].weight.data.copy_(b)
        layer.lora_A["default"].weight.grad = None
        layer.lora_B["default"].weight.grad = None
        layers[layout.path] = layer
    return layers


def reference_logprobs(reference: Any, datum: DatumArrays) -> torch.Tensor:
    """Learner logprobs of the datum's targets at every position (full-vocab log-softmax)."""
    input_ids = torch.as_tensor(datum.tokens, dtype=torch.long)[None]
    logits = reference(input_ids=input_ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.as_tensor(datum.inputs["target_tokens"])
    if targets.ndim == 1:
        return logprobs.gather(-1, targets[:, None])[:, 0]
    return logprobs.gather(-1, targets)


def max_diff(a: Any, b: Any) -> float:
    return float(torch.as_tensor(a).sub(torch.as_tensor(b)).abs().max())


def assert_close_loss(got: float, want: float) -> None:
    assert abs(got - want) <= TOLERANCE * max(1.0, abs(want)), (got, want)


# -- the reference formulas (Tinker's loss documentation), written independently ------

DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
}


def reference_elementwise(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    settings = {**DEFAULTS[loss_fn], **config}
    if loss_fn == "cross_entropy":
        return -inputs.get("weights", torch.ones_like(lp)) * lp
    q, adv = inputs["logprobs"], inputs["advantages"]
    low = inputs.get("clip_low_threshold", settings.get("clip_low_threshold"))
    high = inputs.get("clip_high_threshold", settings.get("clip_high_threshold"))
    if loss_fn == "importance_sampling":
        return -(torch.exp(lp - q) * adv) * inputs.get("weights", torch.ones_like(lp))
    if loss_fn == "ppo":
        ratio = torch.exp(lp - q)
        return -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if loss_fn == "cispo":
        ratio = torch.exp(lp - q)
        return -(torch.clamp(ratio, low, high).detach() * lp * adv)
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * settings["beta"] * (lp - q) ** 2)
    if loss_fn == "gspo":
        mask = inputs["sequence_ratio_mask"] != 0
        log_s = (lp.detach() - q)[mask].mean()
        rho = torch.exp(log_s + lp - lp.detach())
        return -torch.min(rho * adv, torch.clamp(rho, low, high) * adv)
    raise AssertionError(loss_fn)


# -- building requests ---------------------------------------------------------------------------


def make_datums(
    lengths: list[int], rng: np.random.Generator, k: int | None = None
) -> list[DatumArrays]:
    datums = []
    for length in lengths:
        shape = (length,) if k is None else (length, k)
        targets = rng.integers(0, VOCAB, shape).astype(np.int64)
        tokens = rng.integers(0, VOCAB, length).astype(np.int32)
        datums.append(DatumArrays(tokens, {"target_tokens": targets}))
    return datums


def add_inputs(
    loss_fn: str,
    datums: list[DatumArrays],
    learner: list[np.ndarray],
    rng: np.random.Generator,
    *,
    per_token_clip: bool = False,
    weights: bool = False,
) -> None:
    """The loss's inputs for each datum; sampler logprobs near the learner's, so ratios straddle
    the clip bounds. `learner` holds the current learner logprobs of each datum."""
    for index, (datum, lp) in enumerate(zip(datums, learner, strict=True)):
        shape = lp.shape
        if loss_fn == "cross_entropy" or weights:
            # Scaled like a per-datum mean, as clients normalise: gradients stay O(1).
            values = (rng.normal(size=shape) / shape[0]).astype(np.float32)
            values[..., 0] = 0.0
            datum.inputs["weights"] = values
        if loss_fn == "cross_entropy":
            continue
        noise = rng.normal(scale=0.3, size=shape).astype(np.float32)
        # r = e² ≈ 7.4 (beyond every upper bound, CISPO's 4.0 included) or e⁻² ≈ 0.14
        noise[2] = -2.0 if index % 2 == 0 else 2.0
        sampler = (lp + noise).astype(np.float32)
        advantages = (rng.normal(size=shape) / shape[0]).astype(np.float32)
        advantages[:2] = 0.0  # prompt positions
        sampler[:2] = 0.0  # padded as the cookbook does (DRO still penalises these)
        if loss_fn == "gspo":
            mask = np.ones(shape, dtype=np.float32)
            mask[:2] = 0.0
            if index == 0:
                sampler[2:] = lp[2:]  # on-policy: s = 1, inside even the tight default bounds
            datum.inputs["sequence_ratio_mask"] = mask
        datum.inputs["logprobs"] = sampler
        datum.inputs["advantages"] = advantages
        if per_token_clip:
            datum.inputs["clip_low_threshold"] = rng.uniform(0.7, 0.95, shape).astype(np.float32)
            datum.inputs["clip_high_threshold"] = rng.uniform(1.05, 1.3, shape).astype(np.float32)


def current_logprobs(engine: Trainer, model_id: str, datums: list[DatumArrays]) -> list[np.ndarray]:
    probe = [DatumArrays(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in datums]
    request = FwdBwdRequest(model_id, 0, "cross_entropy", True, {}, probe)
    [result] = engine.forward_backward([(model_id, request)])
    return [output["logprobs"] for output in result.loss_fn_outputs]


def rl_request(
    engine: Trainer,
    model_id: str,
    loss_fn: str,
    rng: np.random.Generator,
    *,
    lengths: list[int] = LENGTHS,
    config: dict[str, float | str] | None = None,
    forward_only: bool = False,
    k: int | None = None,
    **options: bool,
) -> FwdBwdRequest:
    datums = make_datums(lengths, rng, k)
    add_inputs(loss_fn, datums, current_logprobs(engine, model_id, datums), rng, **options)
    return FwdBwdRequest(model_id, 1, loss_fn, forward_only, dict(config or {}), datums)


def as_tensors(datum: DatumArrays) -> dict[str, torch.Tensor]:
    return {name: torch.as_tensor(array) for name, array in datum.inputs.items()}


# -- 1. each loss against the independent reference ---------------------------------------------

CASES = {
    "cross_entropy": ("cross_entropy", {}, {}),
    "cross_entropy-k": ("cross_entropy", {}, {"k": 3}),
    "importance_sampling": ("importance_sampling", {}, {}),
    "importance_sampling-k-weights": ("importance_sampling", {}, {"k": 2, "weights": True}),
    "ppo-defaults": ("ppo", {}, {}),
    "ppo-config": ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}),
    "ppo-per-token": ("ppo", {"clip_low_threshold": 0.5}, {"per_token_clip": True}),
    "cispo-defaults": ("cispo", {}, {}),
    "cispo-config": ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}),
    "cispo-per-token": ("cispo", {}, {"per_token_clip": True}),
    "dro-defaults": ("dro", {}, {}),
    "dro-beta": ("dro", {"beta": 0.3}, {}),
    "gspo-defaults": ("gspo", {}, {}),
    "gspo-config": ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}, {}),
}


@pytest.mark.filterwarnings(PEFT_TIED_WARNING)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_matches_reference(
    engine: Trainer, tenants: Callable[..., None], reference: Any, case: str
) -> None:
    loss_fn, config, options = CASES[case]
    tenants("m", seed=3)
    rng = np.random.default_rng(sorted(CASES).index(case))
    request = rl_request(engine, "m", loss_fn, rng, config=config, **options)
    [result] = engine.forward_backward([("m", request)])
    layers = load_reference(reference, engine, "m")

    total = torch.zeros(())
    clipped = 0
    for datum, output in zip(request.datums, result.loss_fn_outputs, strict=True):
        lp = reference_logprobs(reference, datum)
        inputs = as_tensors(datum)
        elementwise = reference_elementwise(loss_fn, lp, inputs, config)
        total = total + elementwise.sum()
        assert (
            output["logprobs"].shape == tuple(lp.shape) and output["logprobs"].dtype == np.float32
        )
        assert max_diff(output["logprobs"], lp.detach()) <= TOLERANCE
        assert max_diff(output["elementwise_loss"], elementwise.detach()) <= TOLERANCE
        if loss_fn in ("ppo", "cispo", "gspo"):
            clipped += count_clipped(loss_fn, lp.detach(), inputs, config)
    total.backward()
    assert result.metrics == pytest.approx({"loss:sum": float(total.detach())}, abs=TOLERANCE)
    if loss_fn in ("ppo", "cispo", "gspo"):
        assert clipped > 0  # the clipped branch is exercised
    for layout, a, b in slot_views(engine, engine.bank.grads, "m"):
        layer = layers[layout.path]
        assert a.abs().max() > 0
        assert max_diff(a, layer.lora_A["default"].weight.grad) <= TOLERANCE, layout.path
        assert max_diff(b, layer.lora_B["default"].weight.grad) <= TOLERANCE, layout.path


def count_clipped(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> int:
    """Positions with a non-zero advantage whose ratio lies outside its clip bounds."""
    settings = {**DEFAULTS[loss_fn], **config}
    low = inputs.get("clip_low_threshold", torch.tensor(settings["clip_low_threshold"]))
    high = inputs.get("clip_high_threshold", torch.tensor(settings["clip_high_threshold"]))
    if loss_fn == "gspo":
        mask = inputs["sequence_ratio_mask"] != 0
        ratio = torch.exp((lp - inputs["logprobs"])[mask].mean()).expand_as(lp)
    else:
        ratio = torch.exp(lp - inputs["logprobs"])
    outside = (ratio < low) | (ratio > high)
    return int((outside & (inputs["advantages"] != 0)).sum())


def test_masked_far_off_policy_tokens_stay_finite(
    engine: Trainer, tenants: Callable[..., None]
) -> None:
    """q ≪ lp at A = 0 overflows exp(lp − q) in fp32; the masked term is still exactly 0."""
    tenants("m", seed=4)
    rng = np.random.default_rng(40)
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        request = rl_request(engine, "m", loss_fn, rng)
        request.datums[0].inputs["logprobs"][:2] = -500.0  # advantages are 0 there
        [result] = engine.forward_backward([("m", request)])
        assert np.isfinite(result.metrics["loss:sum"])
        assert np.all(result.loss_fn_outputs[0]["elementwise_loss"][:2] == 0.0)
        assert torch.isfinite(engine.bank.grads).all()


# -- 2. forward_only ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
)
def test_forward_only_matches_forward_backward_without_gradient(
    engine: Trainer, tenants: Callable[..., None], loss_fn: str
) -> None:
    tenants("m", seed=5)
    request = rl_request(engine, "m", loss_fn, np.random.default_rng(50), forward_only=True)
    [forward] = engine.forward_backward([("m", request)])
    assert torch.count_nonzero(engine.bank.grads) == 0
    request.forward_only = False
    [trained] = engine.forward_backward([("m", request)])
    assert torch.count_nonzero(engine.bank.grads[engine.slot("m")]) > 0
    assert forward.loss_fn_output_type == trained.loss_fn_output_type
    assert forward.metrics == pytest.approx(trained.metrics, abs=TOLERANCE)
    for got, want in zip(forward.loss_fn_outputs, trained.loss_fn_outputs, strict=True):
        assert max_diff(got["logprobs"], want["logprobs"]) <= TOLERANCE
        assert max_diff(got["elementwise_loss"], want["elementwise_loss"]) <= TOLERANCE


# -- 3. one shared pass over different loss functions --------------------------------------------


def assert_same_result(shared: FwdBwdOutput, solo: FwdBwdOutput) -> None:
    assert shared.loss_fn_output_type == solo.loss_fn_output_type
    assert_close_loss(shared.metrics["loss:sum"], solo.metrics["loss:sum"])
    for got, want in zip(shared.loss_fn_outputs, solo.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert got[key].shape == want[key].shape
            assert max_diff(got[key], want[key]) <= TOLERANCE


def test_shared_pass_mixing_losses_equals_solo_passes(
    engine: Trainer, tenants: Callable[..., None]
) -> None:
    tenants("sft", "rl", "dro", seed=6)
    rng = np.random.default_rng(60)
    batch = [
        (
            "rl",
            rl_request(
                engine, "rl", "ppo", rng, lengths=[6, 9], config={"clip_low_threshold": 0.9}
            ),
        ),
        ("sft", rl_request(engine, "sft", "cross_entropy", rng, lengths=[8, 4, 5])),
        ("dro", rl_request(engine, "dro", "dro", rng, lengths=[10], config={"beta": 0.2})),
        ("rl", rl_request(engine, "rl", "gspo", rng, lengths=[7])),  # a second loss, same tenant
        ("sft", rl_request(engine, "sft", "cispo", rng, lengths=[5], forward_only=True)),
    ]
    shared = engine.forward_backward(batch)
    shared_grads = engine.bank.grads.clone()
    for model_id in ("sft", "rl", "dro"):
        engine.bank.grads.zero_()
        items = [(index, item) for index, item in enumerate(batch) if item[0] == model_id]
        solo = engine.forward_backward([item for _, item in items])
        for (index, _), solo_result in zip(items, solo, strict=True):
            assert_same_result(shared[index], solo_result)
        slot = engine.slot(model_id)
        assert engine.bank.grads[slot].abs().max() > 0
        assert max_diff(shared_grads[slot], engine.bank.grads[slot]) <= TOLERANCE


# -- 4. validation -------------------------------------------------------------------------------


def _invalid(case: str, engine: Trainer, rng: np.random.Generator) -> FwdBwdRequest:
    loss_fn = case.split("/")[0]
    request = rl_request(engine, "m", loss_fn, rng, lengths=[4, 5])
    inputs = request.datums[1].inputs
    match case:
        case "ppo/missing-advantages":
            del inputs["advantages"]
        case "ppo/int-advantages":
            inputs["advantages"] = inputs["advantages"].astype(np.int64)
        case "cispo/float-target-tokens":
            inputs["target_tokens"] = inputs["target_tokens"].astype(np.float32)
        case "importance_sampling/short-logprobs":
            inputs["logprobs"] = inputs["logprobs"][:3]
        case "dro/weights":
            inputs["weights"] = np.ones(5, dtype=np.float32)
        case "gspo/unknown-input":
            inputs["old_logprobs"] = inputs["logprobs"].copy()
        case "gspo/empty-mask":
            inputs["sequence_ratio_mask"][:] = 0.0
        case "ppo/per-token-clip-order":
            inputs["clip_low_threshold"] = np.full(5, 1.5, dtype=np.float32)
        case "ppo/2d-advantages":
            inputs["advantages"] = np.zeros((5, 2), dtype=np.float32)
        case "dro/unknown-config":
            request.loss_fn_config = {"kl_coeff": 0.1}
        case "ppo/config-typo":
            request.loss_fn_config = {"clip_low": 0.9}
        case "ppo/config-text":
            request.loss_fn_config = {"clip_high_threshold": "1.2"}
        case "cispo/config-order":
            request.loss_fn_config = {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}
        case "cross_entropy/config":
            request.loss_fn_config = {"beta": 0.1}
        case "importance_sampling/k-above-cap":  # consistent [N, K] inputs, K one too many
            for name, array in inputs.items():
                inputs[name] = np.repeat(array[:, None], MAX_LOGPROBS_K + 1, axis=1)
        case "cross_entropy/k-zero":
            inputs["target_tokens"] = np.zeros((5, 0), dtype=np.int64)
            inputs.pop("weights", None)
    return request


INVALID = {
    "ppo/missing-advantages": ("ppo", "datums[1].loss_fn_inputs.advantages", "missing"),
    "ppo/int-advantages": ("ppo", "datums[1].loss_fn_inputs.advantages", "int64"),
    "cispo/float-target-tokens": ("cispo", "datums[1].loss_fn_inputs.target_tokens", "float32"),
    "importance_sampling/short-logprobs": (
        "importance_sampling",
        "datums[1].loss_fn_inputs.logprobs",
        "length 3 != 5",
    ),
    "dro/weights": ("dro", "datums[1].loss_fn_inputs.weights", "advantages = 0"),
    "gspo/unknown-input": ("gspo", "datums[1].loss_fn_inputs.old_logprobs", "not an input"),
    "gspo/empty-mask": ("gspo", "datums[1].loss_fn_inputs.sequence_ratio_mask", "non-zero"),
    "ppo/per-token-clip-order": ("ppo", "datums[1].loss_fn_inputs.clip_low_threshold", "above"),
    "ppo/2d-advantages": ("ppo", "datums[1].loss_fn_inputs.advantages", "one value per token"),
    "dro/unknown-config": ("dro", "loss_fn_config.kl_coeff", "accepted: beta"),
    "ppo/config-typo": ("ppo", "loss_fn_config.clip_low", "clip_low_threshold"),
    "ppo/config-text": ("ppo", "loss_fn_config.clip_high_threshold", "not a finite number"),
    "cispo/config-order": ("cispo", "loss_fn_config.clip_low_threshold", "above"),
    "cross_entropy/config": ("cross_entropy", "loss_fn_config.beta", "accepted: none"),
    "importance_sampling/k-above-cap": (
        "importance_sampling",
        "datums[1].loss_fn_inputs.target_tokens",
        f"K = {MAX_LOGPROBS_K + 1}",
    ),
    "cross_entropy/k-zero": ("cross_entropy", "datums[1].loss_fn_inputs.target_tokens", "K = 0"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_inputs_name_the_loss_and_the_key(
    engine: Trainer, tenants: Callable[..., None], case: str
) -> None:
    tenants("m", seed=7)
    request = _invalid(case, engine, np.random.default_rng(70))
    before = engine.bank.grads.clone()
    with pytest.raises(UserError) as caught:
        engine.forward_backward([("m", request)])
    message = caught.value.message
    loss_fn, key, detail = INVALID[case]
    assert f"({loss_fn})" in message and key in message and detail in message, message
    assert "\n" not in message
    assert torch.equal(before, engine.bank.grads)  # nothing ran


@pytest.mark.parametrize(
    ("loss_fn", "fragments"),
    [
        # A custom loss the gateway did not resolve (no create_custom_loss behind it).
        ("custom", ["loss_fn_config.loss_id", "ServiceClient.create_custom_loss"]),
        (
            "grpo",
            ["unknown loss_fn 'grpo'", "cross_entropy, importance_sampling, ppo, cispo, dro, gspo"],
        ),
    ],
)
def test_unsupported_and_unknown_losses_are_refused(
    engine: Trainer, tenants: Callable[..., None], loss_fn: str, fragments: list[str]
) -> None:
    tenants("m", seed=8)
    request = rl_request(engine, "m", "importance_sampling", np.random.default_rng(80))
    request.loss_fn = loss_fn
    with pytest.raises(UserError) as caught:
        engine.validate("m", request)
    for fragment in fragments:
        assert fragment in caught.value.message


# -- 5. chunk invariance under the SDK's combiner -----------------------------------------------


def to_sdk(result: FwdBwdOutput) -> Any:
    from tinker.types import ForwardBackwardOutput, TensorData

    return ForwardBackwardOutput(
        loss_fn_output_type=result.loss_fn_output_type,
        loss_fn_outputs=[
            {key: TensorData.from_numpy(value) for key, value in output.items()}
            for output in result.loss_fn_outputs
        ],
        metrics=dict(result.metrics),
    )


@pytest.mark.parametrize(
    "loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
)
def test_chunked_requests_combine_to_the_unchunked_result(
    engine: Trainer, tenants: Callable[..., None], loss_fn: str
) -> None:
    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results

    tenants("whole", "split", seed=9)  # different seeds: make them identical
    engine.bank.weights[engine.slot("split")] = engine.bank.weights[engine.slot("whole")]
    request = rl_request(
        engine, "whole", loss_fn, np.random.default_rng(90), lengths=[5, 8, 3, 6, 4]
    )
    [whole] = engine.forward_backward([("whole", request)])
    chunks = [request.datums[:2], request.datums[2:3], request.datums[3:]]
    results = []
    for chunk in chunks:
        part = FwdBwdRequest("split", 1, loss_fn, False, request.loss_fn_config, chunk)
        [result] = engine.forward_backward([("split", part)])
        results.append(to_sdk(result))

    combined = combine_fwd_bwd_output_results(results)
    expected = combine_fwd_bwd_output_results([to_sdk(whole)])  # the SDK reduces one chunk too
    assert combined.metrics.keys() == expected.metrics.keys() == {"loss:sum"}
    for key, value in expected.metrics.items():
        assert_close_loss(combined.metrics[key], value)
    assert combined.loss_fn_output_type == expected.loss_fn_output_type
    for got, want in zip(combined.loss_fn_outputs, expected.loss_fn_outputs, strict=True):
        assert got.keys() == want.keys()
        for key in got:
            assert max_diff(got[key].to_numpy(), want[key].to_numpy()) <= TOLERANCE
    grads = engine.bank.grads
    assert max_diff(grads[engine.slot("split")], grads[engine.slot("whole")]) <= TOLERANCE
