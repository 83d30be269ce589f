"""Image chunks read from their headers only: format, declared size, and the vision tokens
they become.

Job: tell from an `ImageChunk`'s bytes what it is and how many pixels it declares without
decoding it, so that what is not an image, a truncated file, a format not taken and a
decompression bomb (a 100-byte PNG that declares 100000 × 100000 pixels) are refused before any
decoder sees them; and count the tokens a Qwen-VL style processor makes of it (`vision_tokens`),
which is what a request's token budget and its tenant's rate limit count.

Formats: png and jpeg, what the SDK's renderers send (`jpg` is taken for `jpeg`).

Invariants:
- Reading costs one pass over the chunk lengths (png) or the segment markers (jpeg), never a
  decompression; nothing here allocates more than the input.
- A file is whole when its structure ends where the data ends: png's chunks end with `IEND`,
  jpeg's data ends with its end-of-image marker. Anything else is truncated (or has junk after
  it), and refused.
- Every refusal is a `UserError` whose message names what was wrong and, for a limit, the limit.

Place in the flow: the gateway checks each image chunk of a request (`read_header`,
`check_pixels`) and counts `vision_tokens`; the worker decodes only what passed, under the same
pixel limit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from protocol.errors import UserError

FORMATS = ("png", "jpeg")
_ALIASES = {"jpg": "jpeg"}
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
# jpeg start-of-frame markers (baseline, progressive, lossless, arithmetic): C0-CF but for
# C4 (Huffman tables), C8 (reserved) and CC (arithmetic conditioning)
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length follows
MAX_ASPECT_RATIO = 200  # what the Qwen-VL processors refuse beyond


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header declares."""

    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def normalise_format(declared: str) -> str:
    """`declared` as one of `FORMATS`, or a `UserError` naming the formats taken."""
    name = declared.strip().lower()
    name = _ALIASES.get(name, name)
    if name not in FORMATS:
        raise UserError(
            f"image format {declared[:32]!r} is not supported: send one of {', '.join(FORMATS)}"
        )
    return name


def sniff(data: bytes) -> str | None:
    """The format `data` starts like, or None."""
    if data.startswith(_PNG_MAGIC):
        return "png"
    if data.startswith(_JPEG_MAGIC):
        return "jpeg"
    return None


def read_header(data: bytes, declared: str) -> ImageHeader:
    """The format and size `data` declares, checked against the format the chunk names and for
    truncation; a `UserError` for anything that is not a whole png or jpeg file."""
    fmt = normalise_format(declared)
    found = sniff(data)
    if found is None:
        raise UserError(f"the image data ({len(data)} bytes) is not a png or jpeg file")
    if found != fmt:
        raise UserError(f"the image data is a {found} file, not the {fmt} its format says")
    width, height = _png_size(data) if fmt == "png" else _jpeg_size(data)
    if width <= 0 or height <= 0:
        raise UserError(f"the {fmt} image declares {width} × {height} pixels: no pixels")
    return ImageHeader(fmt, width, height)


def check_pixels(header: ImageHeader, max_pixels: int) -> None:
    """A `UserError` when the image declares more pixels than `max_pixels`, or an aspect ratio
    the processors refuse; the check a decompression bomb fails before it is decoded."""
    if header.pixels > max_pixels:
        raise UserError(
            f"the {header.format} image declares {header.width} × {header.height} = "
            f"{header.pixels} pixels, over the limit of {max_pixels} pixels per image"
        )
    ratio = max(header.width, header.height) / min(header.width, header.height)
    if ratio > MAX_ASPECT_RATIO:
        raise UserError(
            f"the image is {header.width} × {header.height} pixels: an aspect ratio of "
            f"{ratio:.0f}, over the limit of {MAX_ASPECT_RATIO}"
        )


def resized(
    width: int, height: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(width, height) the Qwen-VL processors resize an image to: both multiples of `factor`
    (patch size × merge size), the aspect ratio kept as nearly as may be, the area within
    `[min_pixels, max_pixels]` (transformers' `smart_resize`)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


def vision_tokens(
    width: int,
    height: int,
    *,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
) -> int:
    """The tokens an image of `width` × `height` pixels becomes in the model's sequence: its
    resized grid of `patch_size` patches, `merge_size`² of them merged into one token."""
    w, h = resized(
        width,
        height,
        factor=patch_size * merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    return (w // patch_size) * (h // patch_size) // (merge_size * merge_size)


def _png_size(data: bytes) -> tuple[int, int]:
    """IHDR's width and height, after walking the chunks to `IEND` at the data's end."""
    if len(data) < 33 or data[12:16] != b"IHDR":  # magic, IHDR's length, type, 13 bytes, CRC
        raise UserError("the png image is truncated or malformed: no IHDR header")
    width, height = struct.unpack(">II", data[16:24])
    offset = len(_PNG_MAGIC)
    while True:
        if offset + 8 > len(data):
            raise UserError(f"the png image is truncated at byte {len(data)} (no IEND chunk)")
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        offset += 12 + length  # length, type, data, CRC
        if offset > len(data):
            raise UserError(
                f"the png image is truncated: its {kind!r} chunk runs past its {len(data)} bytes"
            )
        if kind == b"IEND":
            break
    if offset != len(data):
        raise UserError(f"the png image has {len(data) - offset} bytes after its IEND chunk")
    return int(width), int(height)


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """The first start-of-frame segment's width and height, in a file that ends with EOI."""
    if not data.endswith(b"\xff\xd9"):
        raise UserError("the jpeg image is truncated: it does not end with an end-of-image marker")
    offset = 2
    while offset + 4 <= len(data):
        if data[offset] != 0xFF:
            raise UserError(f"the jpeg image is malformed: no segment marker at byte {offset}")
        marker = data[offset + 1]
        if marker == 0xFF:  # fill byte
            offset += 1
            continue
        if marker in _JPEG_STANDALONE:
            offset += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, or the scan before any frame header
            break
        (length,) = struct.unpack(">H", data[offset + 2 : offset + 4])
        if length < 2 or offset + 2 + length > len(data):
            raise UserError(f"the jpeg image is truncated in its segment at byte {offset}")
        if marker in _JPEG_SOF:
            if length < 7:
                raise UserError("the jpeg image is malformed: a frame header too short")
            height, width = struct.unpack(">HH", data[offset + 5 : offset + 9])
            return int(width), int(height)
        offset += 2 + length
    raise UserError("the jpeg image is malformed: no frame header before its image data")


@dataclass(frozen=True)
class VisionGeometry:
    """How a vision-language model turns images into tokens, and the limits on them: what a
    request's image chunks are decoded with (`protocol.tensors.decode_forward_backward`)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int  # the processor resizes each image to within these
    max_pixels: int
    max_image_pixels: int  # refused beyond, from the header, before any decoding
    max_images: int  # per request

    def tokens(self, header: ImageHeader) -> int:
        """The placeholder tokens an image of `header`'s size stands for."""
        return vision_tokens(
            header.width,
            header.height,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )


@dataclass(frozen=True)
class DatumImage:
    """One image of a datum: its bytes, what its header declares, and where its placeholder
    tokens stand in the datum's token ids."""

    header: ImageHeader
    data: bytes
    start: int
    n_tokens: int


def read_image(
    data: bytes, declared: str, geometry: VisionGeometry, expected_tokens: int | None, where: str
) -> tuple[ImageHeader, int]:
    """An image chunk's header and its token count, checked: a whole png or jpeg, within the
    pixel limit, and (when the client gave one) the token count it expects."""
    try:
        header = read_header(data, declared)
        check_pixels(header, geometry.max_image_pixels)
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    n_tokens = geometry.tokens(header)
    if expected_tokens is not None and expected_tokens != n_tokens:
        raise UserError(
            f"{where}: the {header.width} × {header.height} image is {n_tokens} tokens for this "
            f"model, not the {expected_tokens} its expected_tokens says"
        )
    return header, n_tokens


def read_request_image(
    data: bytes,
    declared: str,
    geometry: VisionGeometry,
    expected_tokens: int | None,
    where: str,
    seen: int,
) -> tuple[ImageHeader, int]:
    """`read_image` for a request's image number `seen` (from 0), after the per-request image
    limit."""
    if seen >= geometry.max_images:
        raise UserError(
            f"{where}: more than {geometry.max_images} images in one request (the limit per"
            " request)"
        )
    return read_image(data, declared, geometry, expected_tokens, where)
