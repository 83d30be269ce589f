"""The templates of the Twinkle Client's samplers (`POST /template`, from the gateway's sampler
routes only): a trajectory encoded into its prompt, and a sampled sequence decoded and appended
to its prompt's feature (`decoded`, `new_input_feature`), as twinkle's vLLM sampler does.

Body: `{"template": {"template_cls", "model_id", settings...}, "encode": [trajectory, ...]}`
answers `{"result": [{"feature": {...}, "prompt": [ids]}, ...]}`;
`{"template": {...}, "features": [{...}, ...], "finish": [{"feature": index, "tokens": [ids]},
...]}` answers
`{"result": [{"decoded": "...", "new_input_feature": {...}}, ...]}`.

A template holds no caller's state, so templates are kept by what names them (class, model,
settings), at most `MAX_TEMPLATES`, the least recently used dropped.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from workers.processor.checks import Fields, Refused
from workers.processor.objects import Context, TemplateSpec, Work, batch_json, failed, template_spec

MAX_TEMPLATES = 8
MAX_ITEMS = 64  # the gateway's inputs a call
MAX_ROWS = 64 * 128  # their samples (num_samples at most 128)
MAX_TOKENS = 1 << 20  # a prompt's ids plus its sampled ones


class Templates:
    """Templates by their spec (used from the service's thread pool)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cache: OrderedDict[TemplateSpec, Any] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, spec: TemplateSpec) -> Any:
        with self.lock:
            template = self.cache.get(spec)
            if template is not None:
                self.cache.move_to_end(spec)
                return template
        template = spec.make(self.ctx)
        with self.lock:
            self.cache[spec] = template
            while len(self.cache) > MAX_TEMPLATES:
                self.cache.popitem(last=False)
        return template


def _plain(feature: Any) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in feature.items()}


def _items(value: Any, name: str, most: int = MAX_ITEMS) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not 1 <= len(value) <= most:
        raise Refused(f"{name}: a list of 1..{most} objects")
    if not all(isinstance(item, dict) for item in value):
        raise Refused(f"{name}: a list of objects")
    return value


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_TOKENS:
        raise Refused(f"{name}: a list of at most {MAX_TOKENS} token ids")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise Refused(f"{name}: token ids are integers")
    return value


def template_work(templates: Templates, f: Fields, ctx: Context) -> Work:
    given = f.take("template")
    if not isinstance(given, dict):
        raise Refused("template: an object")
    spec_fields = Fields("template", given)
    spec = template_spec(spec_fields, ctx, "template_cls")
    spec_fields.done()
    encode = f.take("encode", None)
    finish = f.take("finish", None)
    if (encode is None) == (finish is None):
        raise Refused("one of encode or finish")
    if encode is not None:
        f.done()
        trajectories = _items(encode, "encode")

        def encoded() -> bytes:
            template = templates.get(spec)
            out = []
            for index, trajectory in enumerate(trajectories):
                try:
                    feature = _plain(template.encode(trajectory, add_generation_prompt=True))
                    prompt = template.get_vllm_input_ids(feature["input_ids"])
                except Exception as exc:
                    raise failed(f"encode[{index}]", exc) from None
                out.append({"feature": feature, "prompt": _plain({"p": prompt})["p"]})
            return b'{"result":' + batch_json(out) + b"}"

        return encoded
    features = _items(f.take("features", None), "features")
    f.done()
    for index, one in enumerate(features):
        _ids(one.get("input_ids"), f"features[{index}].input_ids")
    rows = _items(finish, "finish", MAX_ROWS)
    for index, row in enumerate(rows):
        at = row.get("feature")
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < len(features):
            raise Refused(f"finish[{index}].feature: an index into features")
        _ids(row.get("tokens"), f"finish[{index}].tokens")

    def finished() -> bytes:
        template = templates.get(spec)
        out = []
        for index, row in enumerate(rows):
            try:
                decoded = template.decode(row["tokens"])
                prompt = copy.deepcopy(features[row["feature"]])
                feature = _plain(template.concat_input_feature(prompt, row["tokens"]))
            except Exception as exc:
                raise failed(f"finish[{index}]", exc) from None
            out.append({"decoded": decoded, "new_input_feature": feature})
        return b'{"result":' + batch_json(out) + b"}"

    return finished
