"""workers.engine.vision: the vision tower of a VL checkpoint loaded alone beside its text model
gives the composite model's logits for sequences with images (one image, two images of other
sizes with text between), its multimodal positions equal the model's own, and bad inputs (a
placeholder count that does not match the images) are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

from workers.engine.vision import VisionTower
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vl"), "qwen3_5_vl")


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
