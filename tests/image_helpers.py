"""Images for tests: real png and jpeg files made with Pillow, a tiny png that declares any size
(a decompression bomb when large), forward_backward bodies whose datums hold image chunks, and
the stock transformers composite's logprobs of a sequence with one image."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from protocol import tinker_wire_pb2 as pb
from protocol.tensors import numpy_to_tensor
from workers.tiny_model import IMAGE_PAD_ID


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


def request_with(*datums: list[tuple[str, object]], model_id: str = "m", vocab: int = 1) -> bytes:
    """A ForwardBackwardRequest whose datums are chunks ("text", [ids]) or ("image", (data,
    format, expected_tokens or None)), with target tokens (seeded, below `vocab`) and weights
    of the SDK's length."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    rng = np.random.default_rng(len(datums))
    for chunks in datums:
        datum = msg.data.add()
        length = 0
        for kind, value in chunks:
            if kind == "text":
                ids = np.asarray(value, dtype="<i4")
                datum.model_input.add().encoded_text.tokens = ids.tobytes()
                length += ids.shape[0]
            else:
                data, fmt, expected = value  # type: ignore[misc]
                image = datum.model_input.add().image
                image.data, image.format = data, fmt
                if expected is not None:
                    image.expected_tokens = expected
                    length += expected
        targets = rng.integers(0, vocab, length, dtype=np.int64)
        datum.loss_fn_inputs["target_tokens"].CopyFrom(numpy_to_tensor(targets))
        datum.loss_fn_inputs["weights"].CopyFrom(numpy_to_tensor(np.ones(length, np.float32)))
    body: bytes = msg.SerializeToString()
    return body


def composite_log_softmax(
    model: Path, ids: torch.Tensor, image: bytes, composite: torch.nn.Module | None = None
) -> torch.Tensor:
    """The stock transformers composite's (or `composite`'s, that model with an adapter)
    log-softmax `[T, vocab]` over ids `[T]` holding one image's placeholders."""
    processor = AutoImageProcessor.from_pretrained(model)
    pixels = processor(images=[Image.open(io.BytesIO(image))], return_tensors="pt")
    if composite is None:
        composite = AutoModelForImageTextToText.from_pretrained(model)
    with torch.no_grad():
        logits = composite(
            input_ids=ids[None],
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == IMAGE_PAD_ID).long()[None],
        ).logits[0]
    return torch.log_softmax(logits.float(), -1)


def composite_logprobs(
    model: Path,
    ids: torch.Tensor,
    image: bytes,
    targets: torch.Tensor,
    composite: torch.nn.Module | None = None,
) -> torch.Tensor:
    """log p(targets[t] | ids[: t + 1]) of the stock transformers composite (or `composite`),
    for ids `[T]` holding one image's placeholders."""
    rows = composite_log_softmax(model, ids, image, composite)
    return rows[torch.arange(len(ids)), targets]
