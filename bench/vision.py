"""A shared pass with images against the same text tokens without, on the model alone.

Four tenants on the tiny random Qwen3.5 vision-language composite (`make-tiny-model --arch
qwen3_5_vl`: hidden 64, 2 layers, a one-block vision tower; rank-16 adapters). Each sends
`--datums` datums of 24 text tokens, an image of `--size` × `--size` pixels (png) and 8 more
text tokens; the text-only requests have the same lengths with text in the image's place. One
shared pass of all four (`workers.trainer.operations.run_passes`), median of `--repeats` (the
two take turns). It prints training tokens/s of each (image tokens counted as tokens), their
ratio, and the part of the image pass spent decoding and encoding the images
(`VisionTower.pixels` and `features`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/vision.py [--repeats 5] [--size 128] [--datums 4]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from engine_merge import Trainer, interleaved  # type: ignore[import-not-found]
from PIL import Image

from protocol.api import LoraConfig
from protocol.images import DatumImage, read_header
from protocol.tensors import DatumArrays, FwdBwdRequest
from workers.engine.model import MultiSlotModel
from workers.engine.passes import tune_malloc
from workers.tiny_model import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, build_tiny_model

TENANTS = 4


def _png(rng: np.random.Generator, size: int) -> bytes:
    out = io.BytesIO()
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def requests(
    engine: MultiSlotModel, datums: int, size: int, images: bool
) -> list[tuple[str, FwdBwdRequest]]:
    assert engine.vision is not None
    rng = np.random.default_rng(0)
    batch = []
    for tenant in range(TENANTS):
        rows = []
        for _ in range(datums):
            data = _png(rng, size)
            header = read_header(data, "png")
            n = engine.vision.geometry.tokens(header)
            text = rng.integers(10, engine.vocab_size, 24 + n + 8).astype(np.int32)
            text[text == IMAGE_PAD_ID] = IMAGE_PAD_ID + 1
            found = []
            if images:
                text[23], text[24 + n] = VISION_START_ID, VISION_END_ID
                text[24 : 24 + n] = IMAGE_PAD_ID
                found = [DatumImage(header, data, 24, n)]
            targets = rng.integers(10, engine.vocab_size, text.shape[0]).astype(np.int64)
            rows.append(DatumArrays(text, {"target_tokens": targets}, found))
        model_id = f"t{tenant}"
        batch.append((model_id, FwdBwdRequest(model_id, 0, "cross_entropy", False, {}, rows)))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--datums", type=int, default=4, help="datums per tenant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tune_malloc()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Trainer.build(
            str(build_tiny_model(Path(tmp), "qwen3_5_vl")), max_slots=5, max_rank=16
        )
        for tenant in range(TENANTS):
            engine.residency.create(f"t{tenant}", LoraConfig(rank=16, seed=tenant))
        with_images = requests(engine.model, args.datums, args.size, images=True)
        text_only = requests(engine.model, args.datums, args.size, images=False)
        tokens = sum(request.n_tokens for _, request in with_images)
        image_tokens = sum(i.n_tokens for _, r in with_images for d in r.datums for i in d.images)
        t = interleaved(
            {
                "images": lambda: engine.forward_backward(with_images),
                "text": lambda: engine.forward_backward(text_only),
            },
            args.repeats,
        )
        vision = engine.model.vision
        assert vision is not None
        pictures = [i for _, r in with_images for d in r.datums for i in d.images]
        started = time.perf_counter()
        for _ in range(args.repeats):
            pixels, grids = vision.pixels(pictures)
            vision.features(pixels, grids)
        tower_s = (time.perf_counter() - started) / args.repeats
    print(
        f"tiny Qwen3.5 VL (hidden 64, 2 layers), {TENANTS} tenants × {args.datums} datums, "
        f"{args.size}×{args.size} png each, {tokens} tokens a pass ({image_tokens} of images), "
        f"{torch.get_num_threads()} thread, median of {args.repeats}"
    )
    print(f"with images: {tokens / t['images']:8.0f} tokens/s ({t['images']:.3f} s)")
    print(f"text only:   {tokens / t['text']:8.0f} tokens/s ({t['text']:.3f} s)")
    print(f"images ÷ text time: {t['images'] / t['text']:.2f}×")
    share = tower_s / t["images"]
    print(f"decoding and encoding the images: {tower_s:.3f} s ({share:.0%} of the pass)")


if __name__ == "__main__":
    main()
