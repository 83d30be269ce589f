"""The vision-language composites whose tower is not Qwen-VL's (Kimi-K2.5: a vision tower and
an `mm_projector` before a DeepSeek-V3 text model; Inkling: a vision and an audio tower beside
its text model) in the engine: each loads whole, as the worker loads it, and trains its text
path. Two tenants of different ranks train in one shared pass, their losses fall, the adapters
sit on the language model and its output layer only, and no tower or projector weight moves.
Images are refused with a `UserError` that says what their image path lacks here (the family's
image processor needs torchvision), both where the worker decodes a request and where the
model validates one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.utils.import_utils import is_torchvision_available

from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError
from protocol.images import DatumImage, read_header
from protocol.tensors import DatumArrays, FwdBwdOutput, FwdBwdRequest, decode_forward_backward
from tests.engine_helpers import Trainer, count_passes
from tests.image_helpers import encoded, request_with
from workers.tiny_model import IMAGE_PAD_ID, Arch, build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FAMILIES = pytest.mark.parametrize("arch", ["kimi_k25", "inkling_mm_model"])
# what is not the text model: each family's towers and its projector
TOWERS = ("model.vision_tower.", "model.mm_projector.", "model.audio_tower.")
TEXT_PATH = ("model.language_model.", "lm_head")
# Two tenants of different ranks. Inkling keeps its shared experts as one 3-D bank, which the
# expert adapter cannot cover, so an adapter training its MLP is refused: its tenants train
# attention and the output layer.
SPECS = {
    "kimi_k25": {"a": LoraConfig(rank=4, seed=1), "b": LoraConfig(rank=8, seed=2)},
    "inkling_mm_model": {
        "a": LoraConfig(rank=4, seed=1, train_mlp=False),
        "b": LoraConfig(rank=8, seed=2, train_mlp=False),
    },
}
STEPS = 6


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Arch], Path]:
    """A tiny composite of an arch, built offline once for the module."""
    models: dict[Arch, Path] = {}

    def build(arch: Arch) -> Path:
        if arch not in models:
            models[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return models[arch]

    return build


def _request(model_id: str, seed: int, vocab_size: int) -> FwdBwdRequest:
    """A cross_entropy request of two text datums (lengths 12 and 7), the same each step."""
    rng = np.random.default_rng(seed)
    datums = []
    for length in (12, 7):
        tokens = rng.integers(0, vocab_size, length).astype(np.int32)
        targets = rng.integers(0, vocab_size, length).astype(np.int64)
        inputs = {"target_tokens": targets, "weights": np.ones(length, dtype=np.float32)}
        datums.append(DatumArrays(tokens, inputs))
    return FwdBwdRequest(model_id, 1, "cross_entropy", False, {}, datums)


def _towers(engine: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in engine.model.named_parameters()
        if name.startswith(TOWERS)
    }


@FAMILIES
def test_the_text_path_trains_and_the_towers_stay_frozen(
    arch: Arch, built: Callable[[Arch], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Trainer(str(built(arch)), max_slots=4, max_rank=8)
    assert type(engine.model).__name__.endswith("ForConditionalGeneration")  # the composite
    assert engine.vision is None  # not Qwen-VL's tower: text only
    towers = _towers(engine)
    assert any(name.startswith("model.vision_tower.") for name in towers)
    # LoRA sits on the text model's linears and the output layer, never a tower or projector
    paths = [layout.path for layout in engine.bank.layouts]
    assert any(".self_attn." in path for path in paths)
    assert [path for path in paths if not path.startswith(TEXT_PATH)] == []
    wrapped = [*engine.bank.layers, *engine.bank.expert_layers]
    assert [path for path in wrapped if path.startswith(TOWERS)] == []

    for model_id, spec in SPECS[arch].items():
        engine.create(model_id, spec)
    passes = count_passes(engine, monkeypatch)
    losses: dict[str, list[float]] = {model_id: [] for model_id in SPECS[arch]}
    for _ in range(STEPS):
        batch = [
            (model_id, _request(model_id, seed, engine.vocab_size))
            for seed, model_id in enumerate(SPECS[arch])
        ]
        for (model_id, _), out in zip(batch, engine.forward_backward(batch), strict=True):
            assert isinstance(out, FwdBwdOutput), out
            losses[model_id].append(out.metrics["loss:sum"])
        steps = engine.optim_step(
            [(model_id, AdamParams(learning_rate=2e-2)) for model_id in losses]
        )
        assert all(isinstance(step, dict) for step in steps), steps
    assert passes == [2] * STEPS  # both tenants in one shared pass each time
    for model_id, seen in losses.items():
        assert seen[-1] < 0.9 * seen[0], (model_id, seen)
    for name, before in towers.items():
        after = dict(engine.model.named_parameters())[name]
        assert after.grad is None and torch.equal(after, before), name


@FAMILIES
def test_an_image_is_refused_naming_what_its_path_lacks(
    arch: Arch, built: Callable[[Arch], Path]
) -> None:
    engine = Trainer(str(built(arch)), max_slots=2, max_rank=8)
    engine.create("a", LoraConfig(rank=4, seed=1, train_mlp=False))
    lacks = "needs torchvision, which is not installed" if not is_torchvision_available() else ""
    # where the worker decodes a request: no geometry, so an image chunk is refused
    assert engine.core.geometry is None
    body = request_with([("text", [7, 8]), ("image", (encoded(96, 64, "png"), "png", 6))])
    with pytest.raises(UserError, match="is an image chunk"):
        decode_forward_backward(body, vision=engine.core.geometry)
    # where the model validates one: the reason names the family and what it lacks
    png = encoded(64, 64, "png")
    tokens = np.array([7, *[IMAGE_PAD_ID] * 4, 8], dtype=np.int32)
    image = DatumImage(read_header(png, "png"), png, 1, 4)
    targets = {"target_tokens": np.zeros(6, dtype=np.int64)}
    imaged = FwdBwdRequest(
        "a", 1, "cross_entropy", False, {}, [DatumArrays(tokens, targets, [image])]
    )
    with pytest.raises(UserError, match=f"\\({arch}\\) takes text only here: .*{lacks}"):
        engine.validate("a", imaged)
    # the same ids as text are fine: without a tower the placeholder id is an ordinary token
    text = FwdBwdRequest("a", 1, "cross_entropy", False, {}, [DatumArrays(tokens, targets)])
    (out,) = engine.forward_backward([("a", text)])
    assert isinstance(out, FwdBwdOutput) and np.isfinite(out.metrics["loss:sum"])
