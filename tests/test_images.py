"""protocol.images: image chunks read from their headers only. Real files made with Pillow give
their true size; what is not a whole png or jpeg (random bytes, a wrong format, a cut file, junk
after the end) is refused with a message naming it; a decompression bomb is refused from its
header; the vision-token count equals what the Qwen-VL image processor makes of the image."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from protocol.errors import UserError
from protocol.images import (
    FORMATS,
    ImageHeader,
    check_pixels,
    normalise_format,
    read_header,
    vision_tokens,
)
from workers.tiny_model import MAX_IMAGE_PIXELS, MERGE_SIZE, MIN_IMAGE_PIXELS, PATCH_SIZE


def encoded(width: int, height: int, fmt: str, mode: str = "RGB", **options: object) -> bytes:
    rng = np.random.default_rng(width * 7919 + height)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)
    out = io.BytesIO()
    image.save(out, format=fmt.upper(), **options)
    return out.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A whole, tiny png whose header declares `width` × `height` pixels (a bomb when large)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
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
