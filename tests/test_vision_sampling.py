"""Images in prompts: `sample_spec` reads a prompt's image chunks from their headers and places
their vision tokens; the gateway's scan of a forward_backward body counts an image's vision
tokens (`check_images`); and the trainer's torch sampler samples from a prompt with an image as
the stock transformers composite scores it (prompt logprobs, every generated token's logprob and
greedy choice), batched beside a text prompt with its own result, while an image that does not
decode fails only its own request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from protocol import api
from protocol.errors import UserError
from protocol.images import VisionGeometry
from protocol.sampling import SampleSpec, sample_spec
from protocol.tensors import check_images, scan_forward_backward
from tests.engine_helpers import Trainer
from tests.image_helpers import composite_log_softmax, encoded, png_declaring, request_with
from workers.sampler.torch_sampler import TorchSampler
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")

GEOMETRY = VisionGeometry(
    image_token_id=IMAGE_PAD_ID,
    patch_size=16,
    merge_size=2,
    min_pixels=4 * 32 * 32,
    max_pixels=1024 * 32 * 32,
    max_image_pixels=512 * 512,
    max_images=2,
)
PNG = encoded(64, 96, "png")  # 2 × 3 merged patches: 6 tokens
PNG_TOKENS = 6


def _prompt(*chunks: api.ModelInputChunk) -> api.SampleRequest:
    return api.SampleRequest(
        prompt=api.ModelInput(chunks=list(chunks)),
        sampling_params=api.SamplingParams(max_tokens=4, temperature=0.0, stop=[]),
    )


def _text(*ids: int) -> api.EncodedTextChunk:
    return api.EncodedTextChunk(tokens=list(ids))


def _image(data: bytes = PNG, expected: int | None = None) -> api.ImageChunk:
    return api.ImageChunk(data=data, format="png", expected_tokens=expected)


def _spec(body: api.SampleRequest, vision: VisionGeometry | None = GEOMETRY) -> SampleSpec:
    return sample_spec(body, max_context=4096, vocab_size=256, vision=vision)


def test_a_prompts_image_stands_as_its_vision_tokens_where_it_is_sent() -> None:
    spec = _spec(_prompt(_text(7, VISION_START_ID), _image(expected=PNG_TOKENS), _text(4, 9)))
    assert spec.prompt == (7, VISION_START_ID, *[IMAGE_PAD_ID] * PNG_TOKENS, VISION_END_ID, 9)
    [image] = spec.images
    assert (image.start, image.n_tokens, image.data) == (2, PNG_TOKENS, PNG)


@pytest.mark.parametrize(
    ("body", "vision", "message"),
    [
        (_prompt(_text(7), _image()), None, "prompt chunk 1 is an image, and this model takes"),
        (_prompt(_image(expected=5)), GEOMETRY, "is 6 tokens for this model, not the 5 its"),
        (_prompt(_image(png_declaring(100_000, 100_000))), GEOMETRY, "over the limit of 262144"),
        (_prompt(_image(PNG[:-20])), GEOMETRY, "truncated"),
        (_prompt(_image(b"not an image at all")), GEOMETRY, "is not a png or jpeg file"),
        (_prompt(*[_image()] * 3), GEOMETRY, "prompt chunk 2: more than 2 images in one request"),
        (_prompt(_text(7, IMAGE_PAD_ID)), GEOMETRY, "token id 5 is the image placeholder"),
        (
            _prompt(api.ImageAssetPointerChunk(location="s3://x/y.png", format="png")),
            GEOMETRY,
            "'image_asset_pointer': image assets are not stored here; send the image inline",
        ),
        (
            _prompt(api.ImageChunk(data=PNG, format="gif")),
            GEOMETRY,
            "image format 'gif' is not supported",
        ),
    ],
    ids=[
        "text-model",
        "expected-tokens",
        "bomb",
        "truncated",
        "not-an-image",
        "too-many",
        "stray-placeholder",
        "asset-pointer",
        "format",
    ],
)
def test_a_bad_prompt_image_is_refused_naming_what_is_wrong(
    body: api.SampleRequest, vision: VisionGeometry | None, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        _spec(body, vision)


def test_the_gateways_scan_counts_an_images_vision_tokens_and_refuses_bad_ones() -> None:
    body = request_with([("text", [7, VISION_START_ID]), ("image", (PNG, "png", None))])
    summary = scan_forward_backward(body)
    assert summary.n_tokens == 2  # the scan alone reads no image
    checked = check_images(summary, GEOMETRY, "vl")
    assert checked.n_tokens == 2 + PNG_TOKENS
    assert checked.n_elements == summary.n_elements + PNG_TOKENS
    with pytest.raises(UserError, match="chunk 1 is an image chunk, and 'text' is a text model"):
        check_images(summary, None, "text")
    text_only = scan_forward_backward(request_with([("text", [7, 8])]))
    assert check_images(text_only, None, "text") == text_only
    bomb = request_with([("image", (png_declaring(100_000, 100_000), "png", None))])
    with pytest.raises(UserError, match="datum 0: model_input chunk 0: the png image declares"):
        check_images(scan_forward_backward(bomb), GEOMETRY, "vl")
    three = request_with([("image", (PNG, "png", None))] * 3)
    with pytest.raises(UserError, match="chunk 2: more than 2 images in one request"):
        check_images(scan_forward_backward(three), GEOMETRY, "vl")


# -- the torch sampler ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_5_vl", "qwen3_vl"])
def vl_model(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The Qwen3.5 composite, and Qwen3-VL (deepstack features, and the composite itself as
    the engine's model)."""
    return build_tiny_model(tmp_path_factory.mktemp("vl-sample"), request.param)


@pytest.fixture(scope="module")
def sampler(vl_model: Path) -> TorchSampler:
    return Trainer(str(vl_model), max_slots=2, max_rank=8).sampler()


def _image_prompt(sampler: TorchSampler, image: bytes = PNG) -> SampleSpec:
    body = api.SampleRequest(
        prompt=api.ModelInput(
            chunks=[_text(7, 8, VISION_START_ID), _image(image), _text(VISION_END_ID, 10, 11)]
        ),
        sampling_params=api.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
        prompt_logprobs=True,
    )
    model = sampler.model
    return sample_spec(
        body,
        max_context=model.max_context,
        vocab_size=model.vocab_size,
        vision=model.geometry,
    )


def test_sampling_from_a_prompt_with_an_image_follows_the_composite(
    sampler: TorchSampler, vl_model: Path
) -> None:
    spec = _image_prompt(sampler)
    [out] = sampler.sample([(spec, None)])
    [sequence] = out.sequences
    assert len(sequence.tokens) == 6
    want = composite_log_softmax(vl_model, torch.tensor([*spec.prompt, *sequence.tokens]), PNG)
    n = len(spec.prompt)
    prompt_want = want[torch.arange(n - 1), torch.tensor(spec.prompt[1:])]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = torch.tensor([lp for lp in out.prompt_logprobs[1:] if lp is not None])
    torch.testing.assert_close(got, prompt_want, atol=1e-4, rtol=0)
    # every generated token is the composite's greedy choice, with its raw logprob: the
    # multimodal positions go on past the prompt as the composite's do
    rows = want[n - 1 : n - 1 + len(sequence.tokens)]
    assert sequence.tokens == rows.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(sequence.logprobs),
        rows[torch.arange(len(sequence.tokens)), torch.tensor(sequence.tokens)],
        atol=1e-4,
        rtol=0,
    )


def test_an_image_prompt_batched_beside_text_prompts_samples_as_alone(
    sampler: TorchSampler,
) -> None:
    image_spec = _image_prompt(sampler)
    long_text = SampleSpec(tuple(range(20, 60)), max_tokens=6, temperature=0.0, stop_at_eos=False)
    short_text = SampleSpec((30, 31), max_tokens=6, temperature=0.0, stop_at_eos=False)
    [alone] = sampler.sample([(image_spec, None)])
    [long_alone, short_alone] = sampler.sample([(long_text, None), (short_text, None)])
    together = sampler.sample([(long_text, None), (image_spec, None), (short_text, None)])
    for got, want in zip(together, [long_alone, alone, short_alone], strict=True):
        assert got.sequences[0].tokens == want.sequences[0].tokens
        torch.testing.assert_close(
            torch.tensor(got.sequences[0].logprobs),
            torch.tensor(want.sequences[0].logprobs),
            atol=1e-4,
            rtol=0,
        )


def test_an_image_that_does_not_decode_fails_its_own_request_only(
    sampler: TorchSampler,
) -> None:
    corrupt = bytearray(PNG)
    start = corrupt.index(b"IDAT") + 4
    corrupt[start : start + 16] = bytes(16)  # a sound header, its pixel data broken
    bad = _image_prompt(sampler, bytes(corrupt))
    good = _image_prompt(sampler)
    tickets = [sampler.submit(bad, None), sampler.submit(good, None)]
    answers: dict[int, object] = {}
    while sampler.busy:
        answers.update(sampler.step())
    assert isinstance(answers[tickets[0]], UserError)
    assert "could not be decoded" in str(answers[tickets[0]])
    [want] = sampler.sample([(good, None)])
    assert answers[tickets[1]].sequences[0].tokens == want.sequences[0].tokens  # type: ignore[attr-defined]


def test_the_vllm_sampler_refuses_images_naming_the_torch_sampler() -> None:
    from workers.sampler.backends import VllmBackend

    backend = VllmBackend(sampler=None, vocab_size=256, max_context=4096)
    body = _prompt(_text(7), _image())
    with pytest.raises(
        UserError, match="the vLLM sampler does not take images yet.*--sampler torch"
    ):
        sample_spec(
            body,
            max_context=backend.max_context,
            vocab_size=backend.vocab_size,
            vision=backend.vision,
            no_images=backend.no_images,
        )
