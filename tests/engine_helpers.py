"""A tenant-level handle on the real trainer pieces, for tests that drive the engine directly.

`Trainer` puts a `MultiSlotModel` (`workers.engine.model`) and a `Residency`
(`workers.trainer.residency`) together the way the worker's operations do
(`workers.trainer.operations`): each request validated once on the model, the calls split into
transactions once, slots taken from the residency, the pass and the step run on the model. Tests
name tenants by model_id, as clients do, and read the bank, the optimizer and the parked
adapters where the real objects keep them.

Beside it, what the engine, fault-isolation, MoE and vision tests share: the `make_engine`
fixture (a `Trainer` on the tiny random Qwen3 in both pass layouts), requests, slot views and
bit-exact comparisons, faults injected into the model's passes, and a MoE adapter's export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch

from protocol.api import AdamParams, LoraConfig
from protocol.errors import TwinkleError
from protocol.jobs import AdapterLayout, ExportMergedJob, merged_export_dir
from protocol.paths import TinkerPath, checkpoint_dir
from protocol.rules import check_adam
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest
from workers.engine.collective import Collective
from workers.engine.model import MultiSlotModel
from workers.engine.passes import Checked, PassResults
from workers.sampler.torch_sampler import TorchSampler
from workers.trainer.operations import run_passes, run_steps, transactions
from workers.trainer.parking import SlotState
from workers.trainer.residency import Residency
from workers.trainer.transfer import export_merged


class Trainer:
    """A model and its residency, called by model_id; see the module docstring."""

    def __init__(
        self,
        base_model: str,
        *,
        max_slots: int | None = 8,
        max_rank: int = 32,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        lora_alpha: float = 32.0,
        max_parked: int | None = None,
        pass_tokens: int = 16384,
        logits_chunk_elements: int | None = None,
        collective: Collective | None = None,
        memory_limit: int | None = None,
    ) -> None:
        self.core = MultiSlotModel(
            base_model,
            max_slots=max_slots,
            max_rank=max_rank,
            device=device,
            dtype=dtype,
            pass_tokens=pass_tokens,
            logits_chunk_elements=logits_chunk_elements,
            collective=collective,
            memory_limit=memory_limit,
        )
        self.residency = Residency(self.core, lora_alpha=lora_alpha, max_parked=max_parked)
        # where the real objects keep what tests look at
        self.slots = self.residency
        self.parked = self.residency.parked
        self.bank = self.core.bank
        self.optimizer = self.core.optimizer
        self.passes = self.core.passes
        self.model = self.core.model  # the transformers model
        self.vision = self.core.vision
        self.collective = self.core.collective
        self.base_model = base_model
        self.vocab_size = self.core.vocab_size
        self.max_context = self.core.max_context
        self.max_slots = self.core.max_slots
        self.max_rank = self.core.max_rank
        self.device = self.core.device
        self.dtype = self.core.dtype
        self.lora_alpha = self.residency.lora_alpha

    @property
    def pass_tokens(self) -> int:
        return self.core.pass_tokens

    @pass_tokens.setter
    def pass_tokens(self, value: int) -> None:
        self.core.pass_tokens = value

    def sampler(self, **kwargs: Any) -> TorchSampler:
        """A torch sampler on this model, its snapshots in this residency's slots."""
        return TorchSampler(self.core, self.residency, **kwargs)

    # -- tenants -------------------------------------------------------------------------------

    def create(self, model_id: str, spec: LoraConfig) -> None:
        self.residency.create(model_id, spec)

    def has(self, model_id: str) -> bool:
        return self.residency.has(model_id)

    def spec(self, model_id: str) -> LoraConfig:
        return self.residency.spec(model_id)

    def slot(self, model_id: str) -> int:
        return self.residency.slot(model_id)

    def release(self, model_id: str) -> None:
        self.residency.release(model_id)

    def save(
        self,
        model_id: str,
        directory: Path,
        *,
        kind: Literal["weights", "sampler_weights"],
        meta: dict[str, Any],
    ) -> int:
        return self.residency.save(model_id, directory, kind=kind, meta=meta)

    def load(self, model_id: str, directory: Path, *, with_optimizer: bool) -> LoraConfig:
        return self.residency.load(model_id, directory, with_optimizer=with_optimizer)

    def capture(self, model_id: str) -> SlotState:
        return self.residency.capture(model_id)

    def adopt(self, model_id: str, state: SlotState) -> None:
        self.residency.adopt(model_id, state)

    # -- requests, as the operations run them ------------------------------------------------

    def validate(self, model_id: str, req: FwdBwdRequest) -> Checked:
        self.residency.spec(model_id)  # NotFound for a model without an adapter here
        return self.core.validate(req)

    def forward_backward(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        """Validate every item (the first bad one raises), then run them as the operations
        do: transactions of at most `max_slots` tenants, each one shared pass."""
        calls = [(model_id, self.validate(model_id, req)) for model_id, req in batch]
        model_ids = [model_id for model_id, _ in batch]
        results: dict[int, FwdBwdOutput | TwinkleError] = {}
        for group in self.residency.sub_calls(model_ids):
            outputs = run_passes(self.core, self.residency, [calls[i] for i in group])
            results.update(zip(group, outputs, strict=True))
        return [results[i] for i in range(len(batch))]

    def optim_step(
        self, steps: list[tuple[str, AdamParams]]
    ) -> list[dict[str, float] | TwinkleError]:
        for model_id, adam in steps:
            self.residency.spec(model_id)
            check_adam(adam)
        model_ids = [model_id for model_id, _ in steps]
        results: dict[int, dict[str, float] | TwinkleError] = {}
        for group in self.residency.sub_calls(model_ids):
            outputs = run_steps(self.core, self.residency, [steps[i] for i in group])
            results.update(zip(group, outputs, strict=True))
        return [results[i] for i in range(len(steps))]

    def isolated(self, batch: list[tuple[str, FwdBwdRequest]]) -> list[FwdBwdOutput | TwinkleError]:
        """`forward_backward` with the operations' fault isolation: a transaction that raises is
        re-run in halves until the items that make it fail are alone."""
        calls = [(model_id, self.validate(model_id, req)) for model_id, req in batch]
        return transactions(
            self.residency,
            lambda group: run_passes(self.core, self.residency, group),
            calls,
            [model_id for model_id, _ in batch],
        )


# -- a trainer per test, on the tiny random Qwen3 ------------------------------------------------

VOCAB = 256
TOLERANCE = 1e-5
# PEFT warns whenever an adapter touches a tied lm_head; that is exactly the layout tests compare.
PEFT_TIED_WARNING = "ignore:Model has `tie_word_embeddings=True`:UserWarning"

# Each test that takes `make_engine` runs twice: each call as one pass with whole logits chunks,
# and split into passes of at most 9 token positions (a call's datums spread over several passes,
# short ones sharing packed rows) with log-probs computed one token at a time.
LAYOUTS: dict[str, dict[str, int]] = {
    "one-pass": {},
    "split": {"pass_tokens": 9, "logits_chunk_elements": 1},
}


@pytest.fixture(name="make_engine", params=list(LAYOUTS))
def make_engine_fixture(
    random_qwen3: Path, request: pytest.FixtureRequest
) -> Callable[..., Trainer]:
    """`make_engine`: trainers on the tiny random Qwen3 in this run's layout, keywords as
    `Trainer` takes them. A module that imports this function has the fixture."""

    def make(**kwargs: Any) -> Trainer:
        return Trainer(str(random_qwen3), **{**LAYOUTS[request.param], **kwargs})

    return make


def make_request(
    model_id: str,
    lengths: list[int],
    rng: np.random.Generator,
    *,
    k: int | None = None,
    weights: bool = True,
    forward_only: bool = False,
) -> FwdBwdRequest:
    """A cross_entropy request of one datum per length: random tokens and targets (K of them a
    position when `k`), signed weights (some exactly 0) unless `weights` is False."""
    datums = []
    for length in lengths:
        target_shape = (length,) if k is None else (length, k)
        inputs = {"target_tokens": rng.integers(0, VOCAB, target_shape).astype(np.int64)}
        if weights:
            # Signed, as the SDK's custom-loss path sends them, scaled like a per-datum mean;
            # some exactly 0.
            values = (rng.normal(size=target_shape) / length).astype(np.float32)
            values[..., 0] = 0.0
            inputs["weights"] = values
        datums.append(DatumArrays(rng.integers(0, VOCAB, length).astype(np.int32), inputs))
    return FwdBwdRequest(model_id, 1, "cross_entropy", forward_only, {}, datums)


def trained_views(
    engine: Trainer, buffer: torch.Tensor, model_id: str, *, full: bool = False
) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(path, group, A, B) views of one model's slot in `buffer`, trained layers only.

    `full` yields every layer at r_max, rank padding and untrained layers included.
    """
    spec = engine.spec(model_id)
    trained = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    rank = engine.max_rank if full else spec.rank
    for layout, a, b in engine.bank.slot_views(buffer, engine.slot(model_id), rank):
        if full or trained[layout.group]:
            yield layout.path, layout.group, a, b


def perturb_b(engine: Trainer, model_id: str, seed: int) -> None:
    """Random non-zero B (at the true rank, trained layers only) so A receives gradient too."""
    generator = torch.Generator().manual_seed(seed)
    for _, _, _, b in trained_views(engine, engine.bank.weights, model_id):
        b.copy_(torch.randn(b.shape, generator=generator) * 0.05)


def max_diff(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    return float(torch.as_tensor(a).sub(torch.as_tensor(b)).abs().max())


def assert_same_outputs(shared: FwdBwdOutput, solo: FwdBwdOutput) -> None:
    """The same outputs up to `TOLERANCE` (a shared pass against a solo one)."""
    assert shared.loss_fn_output_type == solo.loss_fn_output_type
    assert abs(shared.metrics["loss:sum"] - solo.metrics["loss:sum"]) <= TOLERANCE * max(
        1.0, abs(solo.metrics["loss:sum"])
    )
    for got, want in zip(shared.loss_fn_outputs, solo.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert got[key].shape == want[key].shape and got[key].dtype == np.float32
            assert max_diff(got[key], want[key]) <= TOLERANCE


def bank_buffers(engine: Trainer) -> list[torch.Tensor]:
    """Every [S, P] buffer a slot has a row in."""
    return [
        engine.bank.weights,
        engine.bank.grads,
        engine.optimizer.exp_avg,
        engine.optimizer.exp_avg_sq,
    ]


# -- three tenants, faults and bit-exact comparisons ---------------------------------------------

SPECS = {
    "a": LoraConfig(rank=4, seed=1),
    "b": LoraConfig(rank=8, seed=2, train_mlp=False),
    "c": LoraConfig(rank=2, seed=3, train_attn=False),
}


def with_tenants(engine: Trainer) -> Trainer:
    """`engine` holding the SPECS tenants with non-zero B matrices (so A gets gradient)."""
    for index, (model_id, spec) in enumerate(SPECS.items()):
        engine.create(model_id, spec)
        perturb_b(engine, model_id, seed=10 + index)
    return engine


def slot_state(engine: Trainer, model_id: str) -> dict[str, torch.Tensor | int]:
    """Copies of everything a tenant's slot holds: whole rows, padding included."""
    slot = engine.slot(model_id)
    return {
        "weights": engine.bank.weights[slot].clone(),
        "grads": engine.bank.grads[slot].clone(),
        "exp_avg": engine.optimizer.exp_avg[slot].clone(),
        "exp_avg_sq": engine.optimizer.exp_avg_sq[slot].clone(),
        "step": engine.optimizer.steps[slot],
    }


def assert_same_bits(a: dict[str, torch.Tensor | int], b: dict[str, torch.Tensor | int]) -> None:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor)
            assert torch.equal(value.view(torch.int32), other.view(torch.int32)), key
        else:
            assert value == other, key


def assert_same_output(got: object, want: object) -> None:
    """Bit-identical outputs."""
    assert isinstance(got, FwdBwdOutput) and isinstance(want, FwdBwdOutput)
    assert got.metrics == want.metrics and got.loss_fn_output_type == want.loss_fn_output_type
    for left, right in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            np.testing.assert_array_equal(left[key], right[key])


def requests(seed: int) -> list[tuple[str, FwdBwdRequest]]:
    """One training request for each SPECS tenant."""
    rng = np.random.default_rng(seed)
    lengths = {"a": [5, 3], "b": [4, 6], "c": [7]}
    return [(model_id, make_request(model_id, lengths[model_id], rng)) for model_id in SPECS]


def train_round(engine: Trainer, seed: int) -> None:
    results = engine.forward_backward(requests(seed))
    assert all(isinstance(result, FwdBwdOutput) for result in results)


def count_passes(engine: Trainer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of items of each pass the model runs from now on (`PassRunner.run`)."""
    passes: list[int] = []
    run = engine.passes.run

    def counted(items: Sequence[Checked], slots: Sequence[int]) -> PassResults:
        passes.append(len(items))
        return run(items, slots)

    monkeypatch.setattr(engine.passes, "run", counted)
    return passes


def explode_with(engine: Trainer, model_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every pass that holds a request of `model_id` raises, after its backward has
    moved gradients."""
    run = engine.passes.run

    def exploding(items: Sequence[Checked], slots: Sequence[int]) -> PassResults:
        results = run(items, slots)
        if any(item.request.model_id == model_id for item in items):
            raise RuntimeError("injected fault after the backward")
        return results

    monkeypatch.setattr(engine.passes, "run", exploding)


# -- a MoE adapter's export ---------------------------------------------------------------------


def export_layout(engine: Trainer, checkpoint: Path, root: Path, layout: AdapterLayout) -> Path:
    """`checkpoints export --layout` on the worker: the checkpoint's adapter in `layout`."""
    path = TinkerPath(run_id="run", kind="sampler_weights", name=checkpoint.name)
    stored = checkpoint_dir(root, path)
    stored.parent.mkdir(parents=True, exist_ok=True)
    if not stored.exists():
        stored.symlink_to(checkpoint, target_is_directory=True)
    export_id = f"export-{layout}"
    job = ExportMergedJob(
        request_id="req",
        model_id=export_id,
        tenant_id="t",
        seq_id=0,
        path=f"tinker://run/sampler_weights/{checkpoint.name}",
        export_id=export_id,
        layout=layout,
    )
    answer = export_merged(engine.core, engine.residency, root, job)
    target = merged_export_dir(root, export_id)
    assert {entry["name"] for entry in answer["files"]} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert answer["layout"] == layout
    return target


def cross_entropy_request(
    model_id: str, lengths: list[int], vocab: int, seed: int, *, forward_only: bool = True
) -> FwdBwdRequest:
    """A cross_entropy request of one datum per length, random tokens and targets below
    `vocab` (a model's own vocabulary, for the families whose tiny models differ)."""
    rng = np.random.default_rng(seed)
    datums = [
        DatumArrays(
            rng.integers(0, vocab, length).astype(np.int32),
            {"target_tokens": rng.integers(0, vocab, length).astype(np.int64)},
        )
        for length in lengths
    ]
    return FwdBwdRequest(model_id, 1, "cross_entropy", forward_only, {}, datums)
