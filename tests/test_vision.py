"""workers.engine.vision: the vision tower of a VL checkpoint loaded alone beside its text model
gives the composite model's logits for sequences with images (one image, two images of other
sizes with text between), its multimodal positions equal the model's own, and bad inputs (a
placeholder count that does not match the images) are refused. In the engine's passes: a datum
with an image gets the composite's logprobs, a tenant with images beside one without gets its
solo gradient, and images are refused by a text model and stray placeholder ids by a VL one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError
from protocol.tensors import FwdBwdRequest, decode_forward_backward
from tests.engine_helpers import PEFT_TIED_WARNING, Trainer
from tests.image_helpers import composite_logprobs, encoded, request_with
from workers.engine.vision import VisionTower
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, Arch, build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Arch], Path]:
    """A tiny model of an arch, built once for the module."""
    models: dict[Arch, Path] = {}

    def build(arch: Arch) -> Path:
        if arch not in models:
            models[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return models[arch]

    return build


@pytest.fixture(scope="module")
def vl_model(built: Callable[[Arch], Path]) -> Path:
    return built("qwen3_5_vl")


# the engine tests run on the dense Qwen3.5 composite, the MoE one (routed and shared
# experts), Qwen3-VL (its tower's deepstack features enter the first decoder layers) and
# Qwen3-VL-MoE
COMPOSITES = pytest.mark.parametrize(
    "composite", ["qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_vl", "qwen3_vl_moe"]
)


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def case(vl_model: Path) -> Callable[[list[tuple[int, int]]], Case]:
    """(ids [T], pixel values, grids) of text, then each image of (width, height) between the
    vision start and end tokens, then text."""
    processor = AutoImageProcessor.from_pretrained(vl_model)

    def make(sizes: list[tuple[int, int]]) -> Case:
        images = [_image(i, w, h) for i, (w, h) in enumerate(sizes)]
        out = processor(images=images, return_tensors="pt")
        ids = [7, 8, 9]
        for grid in out["image_grid_thw"].tolist():
            n = grid[0] * grid[1] * grid[2] // 4
            ids += [VISION_START_ID, *[IMAGE_PAD_ID] * n, VISION_END_ID, 10, 11]
        return torch.tensor(ids), out["pixel_values"], out["image_grid_thw"]

    return make


@pytest.mark.parametrize(
    "sizes", [[(96, 64)], [(64, 160), (130, 70)]], ids=["one-image", "two-images"]
)
def test_text_model_and_tower_give_the_composites_logits(
    vl_model: Path, case: Callable[[list[tuple[int, int]]], Case], sizes: list[tuple[int, int]]
) -> None:
    ids, pixels, grids = case(sizes)
    composite = AutoModelForImageTextToText.from_pretrained(vl_model)
    text_model = AutoModelForCausalLM.from_pretrained(vl_model)
    tower = VisionTower.load(str(vl_model))
    assert tower is not None
    assert not any(p.requires_grad for p in tower.visual.parameters())  # frozen
    with torch.no_grad():
        want = composite(
            input_ids=ids[None],
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE_PAD_ID).long()[None],
        ).logits[0]
        positions = tower.positions(ids, grids.tolist())
        rope, _ = composite.model.get_rope_index(
            ids[None], (ids == IMAGE_PAD_ID).long()[None], image_grid_thw=grids
        )
        assert torch.equal(positions, rope[:, 0])
        features = tower.features(pixels, grids)
        assert [f.shape[0] for f in features] == (grids.prod(-1) // 4).tolist()
        embeds = tower.embed(text_model.get_input_embeddings(), ids, features)
        got = text_model(inputs_embeds=embeds[None], position_ids=positions[:, None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the image matters: other pixels, other logits after it
    other = tower.embed(text_model.get_input_embeddings(), ids, tower.features(pixels + 1, grids))
    with torch.no_grad():
        moved = text_model(inputs_embeds=other[None], position_ids=positions[:, None]).logits[0]
    assert (moved[-1] - got[-1]).abs().max() > 1e-4


def test_a_text_model_has_no_tower(tiny_model: Path) -> None:
    assert VisionTower.load(str(tiny_model)) is None


def test_placeholders_that_do_not_match_the_images_are_refused(
    vl_model: Path, case: Callable[[list[tuple[int, int]]], Case]
) -> None:
    ids, pixels, grids = case([(96, 64)])
    tower = VisionTower.load(str(vl_model))
    assert tower is not None
    embeddings = AutoModelForCausalLM.from_pretrained(vl_model).get_input_embeddings()
    features = tower.features(pixels, grids)
    short = ids[ids != IMAGE_PAD_ID]
    with pytest.raises(ValueError, match="0 image placeholder tokens for 6 image features"):
        tower.embed(embeddings, short, features)
    with pytest.raises(ValueError, match="1 images for 0 image placeholder runs"):
        tower.positions(short, grids.tolist())
    with pytest.raises(ValueError, match="more image placeholder runs than the 0 images"):
        tower.positions(ids, [])
    cut = torch.cat([ids[:5], ids[7:]])  # 4 of the image's 6 placeholders
    with pytest.raises(ValueError, match="fewer than its 6 placeholder tokens"):
        tower.positions(cut, grids.tolist())


# -- the engine's passes with images -------------------------------------------------------------


def _engine(model: Path) -> Trainer:
    return Trainer(str(model), max_slots=4, max_rank=8)


def _decoded(engine: Trainer, body: bytes, forward_only: bool = False) -> FwdBwdRequest:
    assert engine.vision is not None
    request = decode_forward_backward(body, vision=engine.vision.geometry)
    request.forward_only = forward_only
    return request


PNG = encoded(96, 64, "png")  # 6 vision tokens


def _image_body(engine: Trainer, after: list[int]) -> bytes:
    """Tenant "a"'s request of one datum: text, `PNG`, then `after`."""
    return request_with(
        [("text", [7, 8, VISION_START_ID]), ("image", (PNG, "png", 6)), ("text", after)],
        model_id="a",
        vocab=engine.vocab_size,
    )


def _forward(engine: Trainer, body: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tenant "a"'s forward-only logprobs of `body`'s datum, with its ids and targets."""
    request = _decoded(engine, body, forward_only=True)
    [out] = engine.forward_backward([("a", request)])
    assert not isinstance(out, Exception), out
    datum = request.datums[0]
    return (
        torch.from_numpy(out.loss_fn_outputs[0]["logprobs"]),
        torch.from_numpy(datum.tokens.astype(np.int64)),
        torch.from_numpy(datum.inputs["target_tokens"]),
    )


@COMPOSITES
def test_the_engines_logprobs_with_an_image_are_the_composites(
    composite: Arch, built: Callable[[Arch], Path]
) -> None:
    """A fresh adapter adds nothing, so a forward pass's logprobs of a datum with an image are
    the stock composite model's for those ids and that image."""
    vl_model = built(composite)
    engine = _engine(vl_model)
    engine.create("a", LoraConfig(rank=4, seed=1))
    body = _image_body(engine, [VISION_END_ID, 9])
    got, ids, targets = _forward(engine, body)
    want = composite_logprobs(vl_model, ids, PNG, targets)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@COMPOSITES
def test_a_tenant_with_images_beside_one_without_gets_its_solo_gradient(
    composite: Arch, built: Callable[[Arch], Path]
) -> None:
    vl_model = built(composite)
    with_image = request_with(
        [("text", [7, VISION_START_ID]), ("image", (encoded(64, 160, "jpeg"), "jpeg", 10))],
        [("text", [11, 12, 13, VISION_START_ID]), ("image", (encoded(96, 64, "png"), "png", 6))],
        model_id="a",
        vocab=512,
    )
    text_only = request_with([("text", [20, 21, 22, 23, 24])], model_id="b", vocab=512)
    merged, solo = _engine(vl_model), _engine(vl_model)
    for engine in (merged, solo):
        engine.create("a", LoraConfig(rank=4, seed=1))
        engine.create("b", LoraConfig(rank=8, seed=2))
    a, b = _decoded(merged, with_image), _decoded(merged, text_only)
    results = merged.forward_backward([("a", a), ("b", b)])
    alone = solo.forward_backward([("a", a)]) + solo.forward_backward([("b", b)])
    for together, apart in zip(results, alone, strict=True):
        assert not isinstance(together, Exception) and not isinstance(apart, Exception)
        for x, y in zip(together.loss_fn_outputs, apart.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for model_id in ("a", "b"):
        got = merged.bank.grads[merged.slot(model_id)]
        want = solo.bank.grads[solo.slot(model_id)]
        scale = float(want.abs().max())
        assert scale > 0  # the adapter learns from its datums
        # ≤ 1e-5 of the gradient's magnitude (float32 sums in another order)
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, scale)


@pytest.mark.parametrize("composite", ["qwen3_vl", "qwen3_5_moe_vl"])
def test_layers_recomputed_with_images_give_the_same_results(
    composite: Arch, built: Callable[[Arch], Path]
) -> None:
    """Decoder layers recomputed in the backward (`workers/engine/recompute.py`) with images in
    the pass (the tower runs once, outside the layers; its embeddings and the multimodal
    positions, and Qwen3-VL's deepstack features added inside the first layers, reach the
    recomputation as they reached the forward): logprobs, losses and both tenants' gradients
    equal those of the pass that keeps its activations (≤ 1e-6)."""
    vl_model = built(composite)
    with_image = request_with(
        [("text", [7, VISION_START_ID]), ("image", (encoded(64, 160, "jpeg"), "jpeg", 10))],
        [("text", [11, 12, 13, VISION_START_ID]), ("image", (PNG, "png", 6)), ("text", [9])],
        model_id="a",
        vocab=512,
    )
    text_only = request_with([("text", [20, 21, 22, 23, 24])], model_id="b", vocab=512)
    engine = _engine(vl_model)
    engine.create("a", LoraConfig(rank=4, seed=1))
    engine.create("b", LoraConfig(rank=8, seed=2))
    a, b = _decoded(engine, with_image), _decoded(engine, text_only)
    runs = []
    for recompute_tokens in (2**62, 0):
        engine.core.passes.recompute_tokens = recompute_tokens
        engine.bank.grads.zero_()
        calls = [0]
        layer = engine.core.passes.decoder.layers[0]
        hook = layer.mlp.register_forward_pre_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        outputs = engine.forward_backward([("a", a), ("b", b)])
        hook.remove()
        assert all(not isinstance(out, Exception) for out in outputs), outputs
        runs.append((outputs, engine.bank.grads.clone(), calls[0]))
    (kept, kept_grads, kept_calls), (again, again_grads, again_calls) = runs
    assert again_calls == 2 * kept_calls  # the first layer did run again
    for x, y in zip(kept, again, strict=True):
        assert abs(x.metrics["loss:sum"] - y.metrics["loss:sum"]) <= 1e-6 * max(
            1.0, abs(x.metrics["loss:sum"])
        )
        for u, v in zip(x.loss_fn_outputs, y.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(u["logprobs"], v["logprobs"], atol=1e-6)
    scale = float(kept_grads.abs().max())
    assert scale > 0
    assert float((kept_grads - again_grads).abs().max()) <= 1e-6 * max(1.0, scale)


def test_images_are_refused_where_they_cannot_run(vl_model: Path, tiny_model: Path) -> None:
    engine = _engine(vl_model)
    engine.create("a", LoraConfig(rank=4, seed=1))
    stray = _decoded(engine, request_with([("text", [7, IMAGE_PAD_ID, 8])], model_id="a"))
    with pytest.raises(UserError, match=r"token 1 is the image placeholder id 5 outside an image"):
        engine.validate("a", stray)
    text = Trainer(str(tiny_model), max_slots=2, max_rank=8)
    text.create("t", LoraConfig(rank=4, seed=1))
    imaged = _decoded(
        engine, request_with([("image", (encoded(96, 64, "png"), "png", 6))], model_id="t")
    )
    with pytest.raises(UserError, match="is a text model and takes no images"):
        text.validate("t", imaged)


def test_a_vl_model_named_by_its_hub_id_loads_its_tower_from_the_hub_cache(
    vl_model: Path, tmp_path: Path
) -> None:
    """As the text model is: a hub id resolves in the hub cache (offline here)."""
    snapshot = tmp_path / "hub" / "models--tiny--vl" / "snapshots" / "0123abcd"
    shutil.copytree(vl_model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    script = (
        "from workers.engine.vision import VisionTower\n"
        "tower = VisionTower.load('tiny/vl')\n"
        "print(type(tower.visual).__name__, tower.geometry.patch_size)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["Qwen3_5VisionModel", "16"]


@pytest.mark.filterwarnings(PEFT_TIED_WARNING)
def test_a_qwen3_vl_adapter_loads_in_peft_on_the_stock_composite(
    built: Callable[[Arch], Path], tmp_path: Path
) -> None:
    """Qwen3-VL has no text-only class: the engine trains the composite's language model, and
    its sampler checkpoint names the composite's modules, so PEFT loads it on the stock
    composite and gives the engine's logprobs for a sequence with an image."""
    from peft import PeftModel

    qwen3_vl_model = built("qwen3_vl")
    engine = _engine(qwen3_vl_model)
    engine.create("a", LoraConfig(rank=4, seed=1))
    body = _image_body(engine, [VISION_END_ID, 9, 10])
    engine.forward_backward([("a", _decoded(engine, body))])
    engine.optim_step([("a", AdamParams(learning_rate=0.05))])
    engine.save("a", tmp_path / "sampler", kind="sampler_weights", meta={})
    got, ids, targets = _forward(engine, body)
    stock = AutoModelForImageTextToText.from_pretrained(qwen3_vl_model)
    peft = PeftModel.from_pretrained(stock, tmp_path / "sampler").eval()
    want = composite_logprobs(qwen3_vl_model, ids, PNG, targets, composite=peft)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    base = composite_logprobs(qwen3_vl_model, ids, PNG, targets)
    assert float((got - base).abs().max()) > 1e-3  # the trained adapter changed them
