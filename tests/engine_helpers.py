"""A tenant-level handle on the real trainer pieces, for tests that drive the engine directly.

`Trainer` puts a `MultiSlotModel` (`workers.engine.model`) and a `Residency`
(`workers.trainer.residency`) together the way the worker's operations do
(`workers.trainer.operations`): each request validated once on the model, the calls split into
transactions once, slots taken from the residency, the pass and the step run on the model. Tests
name tenants by model_id, as clients do, and read the bank, the optimizer and the parked
adapters where the real objects keep them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from protocol.api import AdamParams, LoraConfig
from protocol.errors import TwinkleError
from protocol.rules import check_adam
from protocol.tensors import FwdBwdOutput, FwdBwdRequest
from workers.engine.collective import Collective
from workers.engine.model import MultiSlotModel
from workers.engine.passes import Checked
from workers.sampler.torch_sampler import TorchSampler
from workers.trainer.operations import run_passes, run_steps, transactions
from workers.trainer.parking import SlotState
from workers.trainer.residency import Residency


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

    def isolated(
        self, batch: list[tuple[str, FwdBwdRequest]]
    ) -> list[FwdBwdOutput | TwinkleError]:
        """`forward_backward` with the operations' fault isolation: a transaction that raises is
        re-run in halves until the items that make it fail are alone."""
        calls = [(model_id, self.validate(model_id, req)) for model_id, req in batch]
        return transactions(
            self.residency,
            lambda group: run_passes(self.core, self.residency, group),
            calls,
            [model_id for model_id, _ in batch],
        )
