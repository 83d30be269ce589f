"""A vision-language checkpoint's frozen vision tower beside its text model: images as the
model's own tokens and positions.

Job: for a VL base model (its config has a `vision_config`: Qwen3.5, Qwen3.5-MoE, Qwen3-VL),
load the vision encoder alone (the checkpoint's `model.visual.*` tensors) next to the text model
the engine already loads, and give a sequence with images what the composite model computes
from it:
- `features`: each image's vision tokens `[n_i, hidden]`, `n_i = t·h·w / merge²` of its patch
  grid, computed without gradient (the tower is frozen; LoRA trains the text model only);
- `embed`: the text model's token embeddings, each image's placeholder tokens replaced by its
  features in order;
- `positions`: the multimodal RoPE positions `[3, T]` of one sequence: a text run advances all
  three by its length; an image of merged grid `(t, h, w)` starting at position p takes
  `(p + i, p + j, p + k)` over its grid and the next token starts at `p + max(h, w)`.

Invariant: the text model run on `embed(...)` with `positions(...)` gives the composite model's
logits for the same ids and images (≤ 1e-5 in fp32; `tests/test_vision.py`).

Other vision-language families (Kimi-K2.5's `vision_tower` + `mm_projector`, Inkling's
`vision_tower`) load as text models: their tower is not Qwen-VL's (no `model.visual`, no patch
grid positions), so `load` gives None for them and `no_images` says why an image is refused,
naming what their image path lacks here (their image processors need torchvision).

Place in the flow: loaded by the engine for a VL base model; the passes call it for the rows
that hold images.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from PIL import Image
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    PretrainedConfig,
)
from transformers.models.auto.image_processing_auto import (  # type: ignore[attr-defined]
    IMAGE_PROCESSOR_MAPPING_NAMES,  # each family's image processor classes, by backend
)
from transformers.utils.hub import cached_file
from transformers.utils.import_utils import is_torchvision_available

from protocol.errors import UserError
from protocol.images import DatumImage, VisionGeometry
from workers.engine.configs import load_config

# The checkpoint prefixes of the vision tower: transformers 5's layout, then the older one.
_PREFIXES = ("model.visual.", "visual.")
MAX_IMAGE_PIXELS = 4096 * 4096  # an image's declared pixels, refused beyond (from its header)
MAX_IMAGES = 16  # per request


class VisionTower:
    """A VL model's frozen vision encoder and the token ids that place its output."""

    def __init__(self, visual: nn.Module, config: PretrainedConfig, processor: Any) -> None:
        self.visual = visual.requires_grad_(False).eval()
        self.config = config
        self.processor = processor
        self.merge = int(config.vision_config.spatial_merge_size)
        self.image_token_id = int(config.image_token_id)
        size = processor.size
        self.geometry = VisionGeometry(
            image_token_id=self.image_token_id,
            patch_size=int(processor.patch_size),
            merge_size=int(processor.merge_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            max_image_pixels=MAX_IMAGE_PIXELS,
            max_images=MAX_IMAGES,
        )
        self.limit(MAX_IMAGE_PIXELS, MAX_IMAGES)

    def limit(self, max_image_pixels: int, max_images: int) -> None:
        """Refuse images of more than `max_image_pixels` declared pixels, and requests of more
        than `max_images` images (the worker's `--max-image-pixels`,
        `--max-images-per-request`)."""
        if max_image_pixels < 1 or max_images < 1:
            raise ValueError(f"image limits must be positive: {max_image_pixels}, {max_images}")
        self.geometry = replace(
            self.geometry, max_image_pixels=max_image_pixels, max_images=max_images
        )
        # Pillow's decompression-bomb guard (an error at twice its value) at our own limit
        Image.MAX_IMAGE_PIXELS = max_image_pixels

    @classmethod
    def load(
        cls,
        base_model: str,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        model: nn.Module | None = None,
    ) -> VisionTower | None:
        """The tower of `base_model` (a local checkpoint directory or a hub id, as the text
        model is loaded from), or None for a text model and for a family whose tower is not
        Qwen-VL's (`no_images` says why). `model`: the engine's model, whose tower is taken as
        it is when it is the composite (Qwen3-VL)."""
        config = load_config(base_model)
        if getattr(config, "vision_config", None) is None:
            return None
        held = getattr(getattr(model, "model", None), "visual", None)
        if isinstance(held, nn.Module):
            processor = AutoImageProcessor.from_pretrained(base_model)  # type: ignore[no-untyped-call]
            return cls(held, config, processor)
        with torch.device("meta"):  # only to learn the tower's class: no memory
            composite = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
        tower = getattr(getattr(composite, "model", None), "visual", None)
        del composite
        if not isinstance(tower, nn.Module):  # Kimi-K2.5's, Inkling's `vision_tower`: text only
            return None
        tower_class: Any = type(tower)  # a transformers model class: `_from_config`
        visual = tower_class._from_config(config.vision_config, dtype=dtype)
        tensors = visual.state_dict(keep_vars=True)  # the module's own parameters and buffers
        missing = set(tensors)
        with torch.no_grad():
            for name, tensor in _tower_tensors(base_model):
                if name not in tensors:
                    raise ValueError(f"{base_model}: unexpected vision tower tensor {name!r}")
                tensors[name].copy_(tensor)
                missing.discard(name)
        # buffers computed at construction (rotary frequencies) are not stored in checkpoints
        missing -= {name for name, _ in visual.named_buffers()}
        if missing:
            raise ValueError(f"{base_model}: vision tower tensors missing: {sorted(missing)[:5]}")
        processor = AutoImageProcessor.from_pretrained(base_model)  # type: ignore[no-untyped-call]
        return cls(visual.to(device), config, processor)

    def pixels(self, images: Sequence[DatumImage]) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's `pixel_values` and `image_grid_thw` of `images`, decoded here (their
        headers were checked when the request was decoded; Pillow's own bomb guard is set to
        the same limit when the tower loads). A file that fails to decode is a `UserError`."""
        decoded = []
        for index, image in enumerate(images):
            try:
                with Image.open(io.BytesIO(image.data)) as opened:
                    decoded.append(opened.convert("RGB"))
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                raise UserError(f"image {index} could not be decoded: {err}") from None
        out = self.processor(images=decoded, return_tensors="pt")
        grid = cast(torch.Tensor, out["image_grid_thw"])
        counts = (grid.prod(-1) // self.merge**2).tolist()
        if counts != [image.n_tokens for image in images]:  # the header's size was not the file's
            raise UserError(
                f"images decode to {counts} tokens, not the {[i.n_tokens for i in images]} "
                "their headers declare"
            )
        return cast(torch.Tensor, out["pixel_values"]), grid

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each image's vision tokens, in order (`pixel_values` and `grid_thw` as the image
        processor returns them for those images)."""
        return self._encode(pixel_values, grid_thw)[0]

    def _encode(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(each image's vision tokens, the deepstack features: one `[all images' tokens, H]`
        per deepstack layer, empty for a tower without them)."""
        dtype = next(self.visual.parameters()).dtype
        with torch.no_grad():
            out = self.visual(pixel_values.to(dtype), grid_thw=grid_thw)
        pooled = cast(torch.Tensor, out.pooler_output)
        sizes = (grid_thw.prod(-1) // self.merge**2).tolist()
        deepstack = list(getattr(out, "deepstack_features", None) or [])
        return list(torch.split(pooled, sizes)), deepstack

    def decoder_inputs(
        self,
        embeddings: nn.Module,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
    ) -> dict[str, Any]:
        """What the decoder takes for rows of ids `[rows, width]` whose placeholders stand for
        these images, in order: `inputs_embeds` (`embed`) and, for a tower with deepstack
        layers (Qwen3-VL), the placeholders' mask and the features the first decoder layers
        add there."""
        device = input_ids.device
        tokens, deepstack = self._encode(pixel_values.to(device), grid_thw.to(device))
        rows, width = input_ids.shape
        embeds = self.embed(embeddings, input_ids.reshape(-1), tokens).view(rows, width, -1)
        inputs: dict[str, Any] = {"inputs_embeds": embeds}
        if deepstack:
            inputs["visual_pos_masks"] = input_ids == self.image_token_id
            inputs["deepstack_visual_embeds"] = [f.to(embeds.dtype) for f in deepstack]
        return inputs

    def embed(
        self, embeddings: nn.Module, input_ids: torch.Tensor, features: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """`embeddings(input_ids)` `[T, H]` with the image placeholders replaced by `features`
        (all of them, in order: their count must match the placeholders')."""
        embedded = cast(torch.Tensor, embeddings(input_ids))
        mask = input_ids == self.image_token_id
        n_features = sum(f.shape[0] for f in features)
        if int(mask.sum()) != n_features:
            raise ValueError(
                f"{int(mask.sum())} image placeholder tokens for {n_features} image features"
            )
        if not n_features:
            return embedded
        values = torch.cat(list(features)).to(embedded.dtype)
        return embedded.masked_scatter(mask.unsqueeze(-1), values)

    def positions(self, input_ids: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The multimodal RoPE positions `[3, T]` of one sequence of ids `[T]` whose image
        placeholder runs are the images of patch grids `grids` `(t, h, w)`, in order."""
        ids = input_ids.tolist()
        out = torch.empty(3, len(ids), dtype=torch.long)
        position, index, image = 0, 0, 0
        while index < len(ids):
            if ids[index] != self.image_token_id:  # a text run, up to the next image
                stop = next(
                    (i for i in range(index, len(ids)) if ids[i] == self.image_token_id), len(ids)
                )
                out[:, index:stop] = torch.arange(position, position + stop - index)
                position, index = position + stop - index, stop
                continue
            if image >= len(grids):
                raise ValueError(f"more image placeholder runs than the {len(grids)} images")
            t, h, w = (int(grids[image][0]), *(int(v) // self.merge for v in grids[image][1:]))
            n = t * h * w
            if ids[index : index + n] != [self.image_token_id] * n:
                raise ValueError(f"image {image} has fewer than its {n} placeholder tokens")
            grid = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            ).reshape(3, -1)
            out[:, index : index + n] = grid + position
            position, index, image = position + max(h, w), index + n, image + 1
        if image != len(grids):
            raise ValueError(f"{len(grids)} images for {image} image placeholder runs")
        return out


def no_images(base_model: str, config: PretrainedConfig) -> str:
    """Why `base_model` takes no images here, for a model `VisionTower.load` gave None for: a
    text model, or a vision-language family whose image path this engine does not compute,
    with what that path lacks on this worker (an image processor that needs torchvision)."""
    if getattr(config, "vision_config", None) is None:
        return f"{base_model} is a text model and takes no images"
    family = str(config.model_type)
    backends = IMAGE_PROCESSOR_MAPPING_NAMES.get(family, {})
    missing = ""
    if backends and "pil" not in backends and not is_torchvision_available():
        processor = next(iter(backends.values()))
        missing = (
            f"its image processor ({processor}) needs torchvision, which is not installed, and "
        )
    return (
        f"{base_model} ({family}) takes text only here: {missing}the engine places image "
        "features for Qwen-VL's vision towers only; send the text without the image"
    )


def _checkpoint_file(base_model: str, name: str) -> str | None:
    """A file of the checkpoint, in its local directory or the hub cache (None: it has none)."""
    local = Path(base_model)
    if local.is_dir():
        return str(local / name) if (local / name).exists() else None
    found = cached_file(base_model, name, _raise_exceptions_for_missing_entries=False)
    return None if found is None else str(found)


def _tower_tensors(base_model: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name inside the tower, tensor) for each vision tower tensor of a safetensors
    checkpoint (a local directory or a hub id), read one at a time."""
    index = _checkpoint_file(base_model, "model.safetensors.index.json")
    if index is not None:
        names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    for name in names:
        file = _checkpoint_file(base_model, name)
        if file is None:
            raise ValueError(f"{base_model}: no {name} to read the vision tower from")
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
                if prefix is not None:
                    yield key[len(prefix) :], handle.get_tensor(key)
