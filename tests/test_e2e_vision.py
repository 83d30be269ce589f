"""Images through the official SDK on a vision-language model (the tiny Qwen3.5 composite,
`make-tiny-model --arch qwen3_5_vl`), behind a real gateway, NATS and worker:
- `forward` with an `ImageChunk` gives the stock transformers composite's logprobs;
- a caption task (each synthetic image's colour named after it) trains: its loss falls;
- hostile images fail their request with an error that names what was wrong (a decompression
  bomb refused from its header, a truncated file, a wrong `expected_tokens`), and the tenant's
  next request runs.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from PIL import Image
from tinker import types

from tests.conftest import Cluster, build_model, start_cluster, stop_cluster
from tests.image_helpers import composite_logprobs, encoded, png_declaring
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_5_vl", "qwen3_5_vl")


@pytest.fixture(scope="module")
def vl_cluster(tmp_path_factory: pytest.TempPathFactory, vl_model: Path) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("vl") / "data", [vl_model])
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def client(vl_cluster: Cluster, vl_model: Path) -> Iterator[tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=vl_cluster.base_url, api_key=vl_cluster.api_key)
    training = service.create_lora_training_client(
        base_model=str(vl_model), rank=8, seed=3
    ).result()
    yield training
    service.close("success").result()


def _png(colour: tuple[int, int, int], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.integers(-20, 20, (64, 96, 3)), 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _datum(prefix: list[int], image: bytes, suffix: list[int], expected: int = 6) -> types.Datum:
    """`prefix`, <vision_start>, the image, <vision_end>, `suffix`: next-token targets over
    the whole sequence, weighted on the suffix only (the caption)."""
    chunks: list[types.ModelInputChunk] = [
        types.EncodedTextChunk(tokens=[*prefix, VISION_START_ID]),
        types.ImageChunk(data=image, format="png", expected_tokens=expected),
        types.EncodedTextChunk(tokens=[VISION_END_ID, *suffix[:-1]]),
    ]
    model_input = types.ModelInput(chunks=chunks)
    n = model_input.length
    head = n - len(suffix)
    targets = [0] * head + suffix
    weights = [0.0] * head + [1.0] * len(suffix)
    return types.Datum(
        model_input=model_input,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_forward_with_an_image_gives_the_stock_models_logprobs(
    client: tinker.TrainingClient, vl_model: Path
) -> None:
    image = _png(COLOURS["red"])
    datum = _datum([7, 8], image, [40, 41, 42])
    out = client.forward([datum], "cross_entropy").result()
    got = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)

    ids = torch.tensor([7, 8, VISION_START_ID, *[IMAGE_PAD_ID] * 6, VISION_END_ID, 40, 41])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    want = composite_logprobs(vl_model, ids, image, targets).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_caption_task_with_images_trains(client: tinker.TrainingClient) -> None:
    names = {"red": [50, 51], "green": [60, 61], "blue": [70, 71]}
    batch = [
        _datum([9], _png(rgb, seed), names[colour])
        for seed in range(2)
        for colour, rgb in COLOURS.items()
    ]
    losses = []
    for _ in range(8):
        out = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("image", "expected", "message"),
    [
        (png_declaring(100_000, 100_000), 6, "100000 × 100000 = 10000000000 pixels, over the"),
        (encoded(96, 64, "png")[:-30], 6, "truncated"),
        (encoded(96, 64, "png"), 7, "is 6 tokens for this model, not the 7"),
        (b"\x00" * 64, 6, "is not a png or jpeg file"),
    ],
    ids=["bomb", "truncated", "wrong-expected-tokens", "not-an-image"],
)
def test_a_hostile_image_fails_its_request_alone(
    client: tinker.TrainingClient, image: bytes, expected: int, message: str
) -> None:
    bad = _datum([7], image, [40, 41], expected=expected)
    with pytest.raises(Exception, match=message):
        client.forward([bad], "cross_entropy").result()
    good = _datum([7], _png(COLOURS["blue"]), [40, 41])
    assert client.forward([good], "cross_entropy").result().loss_fn_outputs
