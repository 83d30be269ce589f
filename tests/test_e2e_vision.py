"""Images through the official SDK on a vision-language model (the tiny Qwen3.5 composite,
`make-tiny-model --arch qwen3_5_vl`), behind a real gateway, NATS and worker:
- `forward` with an `ImageChunk` gives the stock transformers composite's logprobs, also for
  the datum tinker-cookbook's Qwen3.5 renderer makes of a chat with an image (a jpeg chunk);
- a caption task (each synthetic image's colour named after it) trains: its loss falls;
- hostile images fail their request with an error that names what was wrong (a decompression
  bomb refused from its header, a truncated file, a wrong `expected_tokens`, data that does not
  decode), and the tenant's next request runs;
- an image counts toward its tenant's `max_tokens_per_request` and token rate by its vision
  tokens;
- sampling and `compute_logprobs` take prompts with images: the logprobs are the composite's,
  and a sample's logprobs are what `compute_logprobs` gives its tokens;
- two tenants in the same passes, one with images and one without, each train as alone;
- Qwen3-VL on a worker group of two ranks gives the stock composite's logprobs, in training
  and in sampling.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from PIL import Image
from tinker import types

from tests.conftest import ADMIN_KEY, Cluster, build_model, start_cluster, stop_cluster
from tests.image_helpers import composite_logprobs, encoded, png_declaring
from tests.sdk_helpers import sdk_service
from tests.wire import Wire
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

MAX_PIXELS = 512 * 512  # the cluster's --max-image-pixels
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_5_vl", "qwen3_5_vl")


@pytest.fixture(scope="module")
def vl_cluster(tmp_path_factory: pytest.TempPathFactory, vl_model: Path) -> Iterator[Cluster]:
    limits = {"TWINKLE_MAX_IMAGE_PIXELS": str(MAX_PIXELS), "TWINKLE_MAX_IMAGES_PER_REQUEST": "8"}
    running = start_cluster(
        tmp_path_factory.mktemp("vl") / "data",
        [vl_model],
        "--long-poll-s",
        "5",  # a rate-limited request's poll answers "paused" in 5 s
        env=limits,
    )
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def service(vl_cluster: Cluster) -> Iterator[tinker.ServiceClient]:
    """One client of the module's vision cluster for all its tests (the shared `client` too)."""
    with sdk_service(vl_cluster) as client:
        yield client


@pytest.fixture(scope="module")
def client(service: tinker.ServiceClient, vl_model: Path) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=str(vl_model), rank=8, seed=3).result()


def _png(colour: tuple[int, int, int], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + rng.integers(-20, 20, (64, 96, 3)), 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _corrupt(png: bytes) -> bytes:
    """`png` with a sound header and broken pixel data: only decoding finds it."""
    data = bytearray(png)
    start = data.index(b"IDAT") + 4
    data[start : start + 16] = bytes(16)
    return bytes(data)


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


def _forward_is_the_composites(client: tinker.TrainingClient, vl_model: Path) -> None:
    image = _png(COLOURS["red"])
    datum = _datum([7, 8], image, [40, 41, 42])
    out = client.forward([datum], "cross_entropy").result()
    got = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)

    ids = torch.tensor([7, 8, VISION_START_ID, *[IMAGE_PAD_ID] * 6, VISION_END_ID, 40, 41])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    want = composite_logprobs(vl_model, ids, image, targets).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_forward_with_an_image_gives_the_stock_models_logprobs(
    client: tinker.TrainingClient, vl_model: Path
) -> None:
    _forward_is_the_composites(client, vl_model)


def test_a_cookbook_rendered_image_conversation_is_scored_as_the_composite(
    client: tinker.TrainingClient, vl_model: Path
) -> None:
    """What tinker-cookbook's Qwen3.5 renderer makes of a chat with an image (a jpeg chunk, its
    `expected_tokens` from the model's image processor) runs as it is: the forward logprobs
    are the stock composite's over the same tokens."""
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from transformers import AutoImageProcessor, AutoTokenizer

    renderer = renderers.get_renderer(
        "qwen3_5_disable_thinking",
        AutoTokenizer.from_pretrained(vl_model),
        image_processor=AutoImageProcessor.from_pretrained(vl_model),
    )
    picture = Image.open(io.BytesIO(_png(COLOURS["green"], seed=9)))
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image", "image": picture}, {"type": "text", "text": "colour?"}],
        },
        {"role": "assistant", "content": "green"},
    ]
    datum = conversation_to_datum(
        conversation,
        renderer,
        max_length=None,
        train_on_what=renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    )
    [image] = [c for c in datum.model_input.chunks if isinstance(c, types.ImageChunk)]
    assert image.format == "jpeg" and image.expected_tokens
    ids = [
        token
        for chunk in datum.model_input.chunks
        for token in (
            [IMAGE_PAD_ID] * image.expected_tokens
            if isinstance(chunk, types.ImageChunk)
            else chunk.tokens
        )
    ]
    out = client.forward([datum], "cross_entropy").result()
    got = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    want = composite_logprobs(vl_model, torch.tensor(ids), image.data, targets).numpy()
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
        (_corrupt(encoded(96, 64, "png")), 6, "could not be decoded"),
        (encoded(520, 520, "png"), 6, "270400 pixels, over the limit of 262144 pixels per image"),
    ],
    ids=[
        "bomb",
        "truncated",
        "wrong-expected-tokens",
        "not-an-image",
        "corrupt-data",
        "over-max-image-pixels",
    ],
)
def test_a_hostile_image_fails_its_request_alone(
    client: tinker.TrainingClient, image: bytes, expected: int, message: str
) -> None:
    bad = _datum([7], image, [40, 41], expected=expected)
    with pytest.raises(Exception, match=message):
        client.forward([bad], "cross_entropy").result()
    good = _datum([7], _png(COLOURS["blue"]), [40, 41])
    assert client.forward([good], "cross_entropy").result().loss_fn_outputs


def test_more_images_than_the_clusters_limit_fail_the_request(
    client: tinker.TrainingClient,
) -> None:
    batch = [_datum([7], _png(COLOURS["red"], seed), [40]) for seed in range(9)]
    with pytest.raises(Exception, match="datum 8: model_input chunk 1: more than 8 images"):
        client.forward(batch, "cross_entropy").result()
    assert client.forward(batch[:8], "cross_entropy").result().loss_fn_outputs


def _image_prompt(image: bytes, suffix: list[int]) -> types.ModelInput:
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[7, 8, VISION_START_ID]),
            types.ImageChunk(data=image, format="png", expected_tokens=6),
            types.EncodedTextChunk(tokens=[VISION_END_ID, *suffix]),
        ]
    )


def _sampling_is_the_composites(sampling: tinker.SamplingClient, vl_model: Path) -> None:
    """compute_logprobs of a prompt with an image gives the composite's, and a greedy
    sample's logprobs are what compute_logprobs gives its tokens."""
    image = _png(COLOURS["green"], seed=5)
    prompt = _image_prompt(image, [40, 41])
    ids = [7, 8, VISION_START_ID, *[IMAGE_PAD_ID] * 6, VISION_END_ID, 40, 41]
    assert prompt.length == len(ids)
    got = sampling.compute_logprobs(prompt).result()
    assert got[0] is None and len(got) == len(ids)
    want = composite_logprobs(vl_model, torch.tensor(ids[:-1]), image, torch.tensor(ids[1:]))
    np.testing.assert_allclose(np.asarray(got[1:], dtype=np.float64), want.numpy(), atol=1e-4)

    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    result = sampling.sample(prompt, num_samples=2, sampling_params=params).result()
    first, second = result.sequences
    assert len(first.tokens) == 4 and first.tokens == second.tokens  # greedy
    scored = sampling.compute_logprobs(_image_prompt(image, [40, 41, *first.tokens])).result()
    assert first.logprobs is not None
    np.testing.assert_allclose(first.logprobs, scored[-4:], atol=1e-4)


def test_sampling_and_compute_logprobs_take_images(
    service: tinker.ServiceClient, vl_model: Path
) -> None:
    sampling = service.create_sampling_client(base_model=str(vl_model)).result()
    _sampling_is_the_composites(sampling, vl_model)
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    bomb = _image_prompt(png_declaring(100_000, 100_000), [40])
    with pytest.raises(Exception, match="over the limit of"):
        sampling.sample(bomb, num_samples=1, sampling_params=params).result()


def _tenant(cluster: Cluster, name: str, limits: dict[str, int] | None = None) -> str:
    """A new tenant's API key, with `limits` as its quota overrides."""
    with httpx.Client(
        base_url=cluster.base_url, headers={"X-Admin-Key": ADMIN_KEY}, timeout=30.0
    ) as admin:
        for method, path, body in [
            ("POST", "tenants", {"name": name}),
            *([("PUT", f"quotas/{name}", limits)] if limits else []),
            ("POST", "keys", {"tenant": name, "label": "vision tests"}),
        ]:
            response = admin.request(method, f"/admin/v1/{path}", json=body)
            assert response.status_code == 200, response.text
    return str(response.json()["key"])


def test_an_image_counts_toward_max_tokens_per_request_by_its_vision_tokens(
    vl_cluster: Cluster, vl_model: Path
) -> None:
    key = _tenant(vl_cluster, "capped-vl", {"max_tokens_per_request": 9})
    capped = tinker.ServiceClient(base_url=vl_cluster.base_url, api_key=key)
    try:
        training = capped.create_lora_training_client(base_model=str(vl_model), rank=4).result()
        image = _png(COLOURS["red"])
        over = _datum([7, 8], image, [40, 41])  # 3 + 6 + 2 = 11 tokens
        with pytest.raises(Exception, match="max_tokens_per_request"):
            training.forward([over], "cross_entropy").result()
        within = _datum([], image, [40])  # 1 + 6 + 1 = 8 tokens
        assert training.forward([within], "cross_entropy").result().loss_fn_outputs
    finally:
        capped.close("success").result()


def test_an_image_counts_toward_the_token_rate_by_its_vision_tokens(
    vl_cluster: Cluster, vl_model: Path
) -> None:
    # 16 tokens a minute, a minute's worth of burst: the first request's 16 tokens (12 of them
    # its images') take it all, so the second's wait a minute, past the cluster's 5 s long
    # poll. Counted by their text tokens alone (4 a request), neither would wait.
    key = _tenant(vl_cluster, "slow-vl", {"tokens_per_minute": 16})
    wire = Wire(vl_cluster.base_url, key)
    try:
        model_id = wire.create_model(wire.session(), str(vl_model), rank=4)
        data = [_datum([], _png(COLOURS["red"], seed), [40]) for seed in (1, 2)]  # 2 x (1 + 6 + 1)
        ids = [
            wire.forward_backward(wire.fwdbwd_body(model_id, seq, data, forward_only=True)).json()[
                "request_id"
            ]
            for seq in (1, 2)
        ]
        assert wire.fwdbwd_output(wire.result(ids[0])).loss_fn_outputs
        polled = wire.post("retrieve_future", {"request_id": ids[1]})
        assert "json" in polled.headers["content-type"], "the second request ran unpaused"
        queued = polled.json()
        assert queued["type"] == "try_again", queued
        assert queued["queue_state"] == "paused_rate_limit", queued
        assert "tokens per minute" in queued["queue_state_reason"]
    finally:
        wire.close()


def _text_datum(seed: int) -> types.Datum:
    ids = np.random.default_rng(seed).integers(10, 100, 12).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 11},
    )


def test_a_tenant_with_images_and_one_without_each_train_as_alone(
    vl_cluster: Cluster, vl_model: Path
) -> None:
    """Two steps each; their second forward_backward's logprobs equal the solo runs'."""
    image_batch = [_datum([9], _png(rgb, 1), [50, 51]) for rgb in COLOURS.values()]
    text_batch = [_text_datum(seed) for seed in range(3)]
    adam = types.AdamParams(learning_rate=1e-2)

    def run(service: tinker.ServiceClient, batches: list[list[types.Datum]]) -> list[np.ndarray]:
        clients = [
            service.create_lora_training_client(base_model=str(vl_model), rank=4, seed=11).result()
            for _ in batches
        ]
        outs = []
        for _ in range(2):
            futures = [
                c.forward_backward(b, "cross_entropy")
                for c, b in zip(clients, batches, strict=True)
            ]
            outs = [f.result() for f in futures]
            for step in [c.optim_step(adam) for c in clients]:
                step.result()
        return [
            np.concatenate([np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs])
            for out in outs
        ]

    service = tinker.ServiceClient(
        base_url=vl_cluster.base_url, api_key=_tenant(vl_cluster, "pair-vl")
    )
    try:
        [image_alone] = run(service, [image_batch])
        [text_alone] = run(service, [text_batch])
        image_together, text_together = run(service, [image_batch, text_batch])
    finally:
        service.close("success").result()
    np.testing.assert_allclose(image_together, image_alone, atol=1e-5)
    np.testing.assert_allclose(text_together, text_alone, atol=1e-5)


@pytest.mark.timeout(300)
def test_qwen3_vl_on_a_worker_group_takes_images(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`up --devices 2` on Qwen3-VL (the composite is the engine's model, and its tower's
    deepstack features enter the first decoder layers): every rank decodes and encodes the
    images rank 0 took, and the logprobs are the stock composite's."""
    vl_model = build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3_vl", "qwen3_vl")
    running = start_cluster(
        tmp_path_factory.mktemp("vl-group") / "data", [vl_model], "--devices", "2"
    )
    try:
        service = tinker.ServiceClient(base_url=running.base_url, api_key=running.api_key)
        training = service.create_lora_training_client(base_model=str(vl_model), rank=4).result()
        _forward_is_the_composites(training, vl_model)
        sampling = service.create_sampling_client(base_model=str(vl_model)).result()
        _sampling_is_the_composites(sampling, vl_model)
        service.close("success").result()
    finally:
        stop_cluster(running)
