"""protocol.images: image chunks read from their headers only. Real files made with Pillow give
their true size; what is not a whole png or jpeg (random bytes, a wrong format, a cut file, junk
after the end) is refused with a message naming it; a decompression bomb is refused from its
header; the vision-token count equals what the Qwen-VL image processor makes of the image. In a
forward_backward request decoded for a VL model an image chunk becomes its placeholder tokens,
checked against its expected_tokens and the request's image limit."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from protocol.errors import UserError
from protocol.images import (
    FORMATS,
    ImageHeader,
    VisionGeometry,
    check_pixels,
    normalise_format,
    read_header,
    vision_tokens,
)
from protocol.tensors import decode_forward_backward, encode_forward_backward
from tests.image_helpers import encoded, png_declaring, request_with
from workers.tiny_model import (
    IMAGE_PAD_ID,
    MAX_IMAGE_PIXELS,
    MERGE_SIZE,
    MIN_IMAGE_PIXELS,
    PATCH_SIZE,
)


@pytest.mark.parametrize(
    ("width", "height", "fmt", "mode", "options"),
    [
        (1, 1, "png", "RGB", {}),
        (96, 64, "png", "RGBA", {}),
        (640, 17, "png", "L", {}),
        (33, 500, "jpeg", "RGB", {}),
        (320, 240, "jpeg", "L", {"quality": 50}),
        (200, 120, "jpeg", "RGB", {"progressive": True}),
    ],
)
def test_real_files_give_their_size(
    width: int, height: int, fmt: str, mode: str, options: dict[str, object]
) -> None:
    data = encoded(width, height, fmt, mode, **options)
    assert read_header(data, fmt) == ImageHeader(fmt, width, height)


def test_format_names_are_read_loosely_and_others_refused() -> None:
    assert normalise_format("JPG") == normalise_format(" jpeg ") == "jpeg"
    assert normalise_format("PNG") == "png"
    for name in ("bmp", "tiff", "webp", "", "x" * 1000):
        with pytest.raises(UserError, match="is not supported: send one of png, jpeg") as err:
            normalise_format(name)
        assert len(str(err.value)) < 120  # a huge name is not echoed whole
    assert FORMATS == ("png", "jpeg")


@pytest.mark.parametrize(
    "data",
    [b"", b"hello world", bytes(range(256)) * 4, b"GIF89a" + b"\x00" * 20, b"\x89PN"],
    ids=["empty", "text", "noise", "gif", "png-prefix"],
)
def test_what_is_not_an_image_is_refused(data: bytes) -> None:
    with pytest.raises(UserError, match="is not a png or jpeg file"):
        read_header(data, "png")


def test_a_file_in_another_format_than_its_chunk_says_is_refused() -> None:
    with pytest.raises(UserError, match="is a jpeg file, not the png its format says"):
        read_header(encoded(8, 8, "jpeg"), "png")
    with pytest.raises(UserError, match="is a png file, not the jpeg its format says"):
        read_header(encoded(8, 8, "png"), "jpg")


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_files_and_junk_after_the_end_are_refused(fmt: str) -> None:
    data = encoded(48, 40, fmt)
    for cut in (len(data) - 1, len(data) // 2, 30, 12, 4):
        with pytest.raises(UserError, match="truncated|malformed|not a png or jpeg"):
            read_header(data[:cut], fmt)
    with pytest.raises(UserError, match="after its IEND|truncated"):
        read_header(data + b"\x00junk", fmt)


def test_a_chunk_length_past_the_end_is_refused_without_reading_it() -> None:
    bomb = bytearray(png_declaring(10, 10))
    bomb[33:37] = struct.pack(">I", 2**31)  # the IDAT chunk claims 2 GiB
    with pytest.raises(UserError, match="'IDAT' chunk runs past"):
        read_header(bytes(bomb), "png")


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = png_declaring(100_000, 100_000)
    assert len(bomb) < 120
    header = read_header(bomb, "png")
    assert header.pixels == 10**10
    with pytest.raises(UserError, match=r"100000 × 100000 = 10000000000 pixels, over the limit"):
        check_pixels(header, max_pixels=MAX_IMAGE_PIXELS)
    check_pixels(read_header(png_declaring(1024, 1024), "png"), max_pixels=MAX_IMAGE_PIXELS)


def test_zero_pixels_and_extreme_aspect_ratios_are_refused() -> None:
    with pytest.raises(UserError, match="no pixels"):
        read_header(png_declaring(0, 10), "png")
    with pytest.raises(UserError, match="aspect ratio of 201, over the limit of 200"):
        check_pixels(ImageHeader("png", 201, 1), max_pixels=10**6)


@pytest.mark.parametrize(
    ("width", "height"),
    [(1, 1), (16, 16), (96, 64), (33, 500), (640, 17), (1000, 999), (1200, 1100), (3000, 20)],
)
def test_vision_tokens_are_what_the_processor_makes(width: int, height: int) -> None:
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        min_pixels=MIN_IMAGE_PIXELS,
        max_pixels=MAX_IMAGE_PIXELS,
    )
    image = Image.open(io.BytesIO(encoded(width, height, "png")))
    grid = processor(images=[image], return_tensors="np")["image_grid_thw"]
    expected = int(np.prod(grid)) // MERGE_SIZE**2
    got = vision_tokens(
        width,
        height,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        min_pixels=MIN_IMAGE_PIXELS,
        max_pixels=MAX_IMAGE_PIXELS,
    )
    assert got == expected
    assert 4 <= got <= 1024  # within the processor's bounds


# -- a forward_backward request's image chunks ---------------------------------------------------

GEOMETRY = VisionGeometry(
    image_token_id=IMAGE_PAD_ID,
    patch_size=PATCH_SIZE,
    merge_size=MERGE_SIZE,
    min_pixels=MIN_IMAGE_PIXELS,
    max_pixels=MAX_IMAGE_PIXELS,
    max_image_pixels=4096 * 4096,
    max_images=3,
)


def test_an_image_chunk_becomes_its_placeholder_tokens_where_it_stands() -> None:
    png, jpeg = encoded(96, 64, "png"), encoded(64, 160, "jpeg")
    body = request_with(
        [("text", [7, 8]), ("image", (png, "png", 6)), ("text", [9])],
        [("image", (jpeg, "jpeg", None)), ("text", [10, 11])],
    )
    request = decode_forward_backward(body, vision=GEOMETRY)
    first, second = request.datums
    assert first.tokens.tolist() == [7, 8, *[IMAGE_PAD_ID] * 6, 9]
    [image] = first.images
    assert (image.start, image.n_tokens, image.data) == (2, 6, png)
    assert image.header == ImageHeader("png", 96, 64)
    # 64×160 resizes to 64×160 (multiples of 32): (2·5 patches of 32) → 4·10 / 4 = 10 tokens
    assert second.tokens.tolist() == [*[IMAGE_PAD_ID] * 10, 10, 11]
    assert [(i.start, i.n_tokens) for i in second.images] == [(0, 10)]
    # and back: the same chunks, each image with its count
    again = decode_forward_backward(encode_forward_backward(request), vision=GEOMETRY)
    for a, b in zip(again.datums, request.datums, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.images == b.images


def test_image_chunks_are_refused_by_a_text_model_and_checked_by_a_vl_one() -> None:
    png = encoded(96, 64, "png")
    body = request_with([("text", [7]), ("image", (png, "png", 6))])
    with pytest.raises(UserError, match="chunk 1 is an image chunk, which text models do not"):
        decode_forward_backward(body)
    wrong = request_with([("image", (png, "png", 7))])
    with pytest.raises(UserError, match="image is 6 tokens for this model, not the 7 its"):
        decode_forward_backward(wrong, vision=GEOMETRY)
    bomb = request_with([("image", (png_declaring(100_000, 100_000), "png", None))])
    with pytest.raises(UserError, match=r"datum 0: model_input chunk 0: .* over the limit"):
        decode_forward_backward(bomb, vision=GEOMETRY)
    cut = request_with([("image", (png[:-20], "png", None))])
    with pytest.raises(UserError, match="truncated"):
        decode_forward_backward(cut, vision=GEOMETRY)
    junk = request_with([("image", (b"not an image at all", "png", None))])
    with pytest.raises(UserError, match="not a png or jpeg file"):
        decode_forward_backward(junk, vision=GEOMETRY)
    many = request_with(*[[("image", (png, "png", 6))]] * 2, [("image", (png, "png", 6))] * 2)
    with pytest.raises(UserError, match="datum 2: model_input chunk 1: more than 3 images"):
        decode_forward_backward(many, vision=GEOMETRY)
