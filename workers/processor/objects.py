"""Twinkle's own Dataset, Template, preprocessors and DataLoader, reached only through the tables
here: the classes a client may create (`CREATE`), the methods it may call on each (`CALLS`), the
templates (`TEMPLATES`) and preprocessors (`PREPROCESSORS`) it may name.

Each entry checks its fields at once (a `Refused` names the bad one) and returns the blocking
work as a function, which the service runs in its thread pool under the object's lock.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import HubOperation
from twinkle.preprocessor import (
    AlpacaProcessor,
    CompetitionMathGRPOProcessor,
    CompetitionMathProcessor,
    CountdownProcessor,
    GSM8KProcessor,
    SelfCognitionProcessor,
)
from twinkle.template import Qwen3_5Template, Template

from workers.processor import checks
from workers.processor.checks import Fields, Models, Refused, shown
from workers.processor.registry import Entry

log = logging.getLogger(__name__)

Work = Callable[[], Any]  # blocking; returns the call's result, or `bytes` of JSON ready to send

MAX_LENGTH = 131072
MAX_BATCH = 1024
MAX_MAP_BATCH = 10000
SEED = 42  # twinkle's default seed: a shuffled loader gives the same order after a restart
TRUNCATION = ("raise", "left", "right", "delete")  # not "split": it multiplies rows unbounded
TEXT = (str, type(None))

TEMPLATES: dict[str, Any] = {"Template": Template, "Qwen3_5Template": Qwen3_5Template}
# name -> (class, the init_args it takes and their JSON types)
PREPROCESSORS: dict[str, tuple[Any, dict[str, tuple[type, ...]]]] = {
    "SelfCognitionProcessor": (SelfCognitionProcessor, {"model_name": TEXT, "model_author": TEXT}),
    "AlpacaProcessor": (AlpacaProcessor, {}),
    "CompetitionMathProcessor": (CompetitionMathProcessor, {}),
    "CompetitionMathGRPOProcessor": (CompetitionMathGRPOProcessor, {}),
    "CountdownProcessor": (CountdownProcessor, {}),
    "GSM8KProcessor": (GSM8KProcessor, {"system": TEXT, "add_assistant": (bool,)}),
}


@dataclass(frozen=True)
class Context:
    """What the checks and the work need from the service's configuration."""

    data_root: str  # a real path
    models: Models
    max_rows: int
    max_file_bytes: int
    max_answer_bytes: int


def failed(what: str, exc: Exception) -> Refused:
    """A twinkle step that failed on the caller's own data or choices: a 400 saying so."""
    log.warning("%s failed", what, exc_info=exc)
    message = " ".join(str(exc).split())
    if len(message) > 300:
        message = message[:297] + "..."
    return Refused(f"{what} failed: {type(exc).__name__}: {message}")


def _check_rows(what: str, dataset: Any, ctx: Context) -> None:
    rows = len(dataset)
    if rows > ctx.max_rows:
        raise Refused(f"{what}: {rows} rows, over this server's {ctx.max_rows}", 413)


def create_dataset(f: Fields, ctx: Context) -> Work:
    """`Dataset(dataset_meta=DatasetMeta(file, data_slice=...))` over a file of the data root."""
    meta = checks.dataset_meta_fields(f.take("dataset_meta"))
    f.ignore("remote_group")
    f.done()
    dataset_id = meta.take("dataset_id")
    path = checks.data_file(dataset_id, ctx.data_root, ctx.max_file_bytes)
    picked = checks.data_slice(meta.take("data_slice", None), ctx.max_rows)
    subset = meta.string("subset_name", checks.MAX_ID, "default")
    split = meta.string("split", checks.MAX_ID, "train")
    if meta.take("data", None) is not None:
        raise Refused("dataset_meta.data: not taken; name a file of the data directory instead")
    meta.done()

    def work() -> Any:
        desc = DatasetMeta(dataset_id=path, subset_name=subset, split=split, data_slice=picked)
        try:
            dataset = Dataset(dataset_meta=desc)
        except Exception as exc:
            raise failed(f"dataset_meta.dataset_id: reading {shown(dataset_id)}", exc) from None
        _check_rows("dataset_meta", dataset, ctx)
        return dataset

    return work


def dataloader_options(f: Fields) -> dict[str, Any]:
    """`DataLoader(dataset=pid, batch_size=...)`'s other fields, as twinkle's DataLoader takes
    them (its extra keywords go to torch's DataLoader)."""
    options: dict[str, Any] = {"batch_size": f.integer("batch_size", 1, MAX_BATCH)}
    min_batch = f.integer("min_batch_size", 1, MAX_BATCH, None)
    if min_batch is not None:
        options["min_batch_size"] = min_batch
    if f.boolean("shuffle", False):
        options["shuffle"] = True
        options["generator"] = torch.Generator().manual_seed(SEED)
    options["drop_last"] = f.boolean("drop_last", False)
    f.ignore("remote_group")
    f.done()
    return options


def create_dataloader(parent: Entry, options: dict[str, Any]) -> Work:
    return lambda: DataLoader(dataset=parent.obj, **options)


@dataclass(frozen=True)
class TemplateSpec:
    """A template as a caller names it: its class, its served model and its settings."""

    name: str
    model: str
    kwargs: tuple[tuple[str, Any], ...]

    def make(self, ctx: Context) -> Any:
        """The template (blocking: it reads the model's tokenizer)."""
        path = model_dir(self.model, ctx.models.paths[self.model])
        try:
            return TEMPLATES[self.name](model_id=path, **dict(self.kwargs))
        except Exception as exc:
            raise failed(f"template_func: {self.name} for {self.model}", exc) from None


def template_spec(f: Fields, ctx: Context, name_field: str = "template_func") -> TemplateSpec:
    name = f.choice(name_field, tuple(TEMPLATES))
    model = ctx.models.name_of(f.take("model_id"))
    kwargs = {
        "max_length": f.integer("max_length", 1, MAX_LENGTH, 8192),
        "truncation_strategy": f.choice("truncation_strategy", TRUNCATION, "raise"),
        "use_chat_template": f.boolean("use_chat_template", True),
        "enable_thinking": f.boolean("enable_thinking", True),
        "default_system": f.string("default_system", checks.MAX_STRING, None),
    }
    return TemplateSpec(name, model, tuple(kwargs.items()))


def set_template(entry: Entry, f: Fields, ctx: Context) -> Work:
    spec = template_spec(f, ctx)
    f.done()

    def work() -> None:
        entry.obj.set_template(spec.make(ctx))

    return work


def model_dir(name: str, path: str) -> str:
    """A served model's files: its directory, or its snapshot in the local Hugging Face cache."""
    if os.path.isdir(path):
        return path
    try:
        return str(HubOperation.download_model(f"hf://{path}", local_files_only=True))
    except Exception:
        log.exception("the files of model %s (%s) are not here", name, path)
        raise Refused(f"model_id: the files of {name} are not on this server", 500) from None


def dataset_map(entry: Entry, f: Fields, ctx: Context) -> Work:
    name = f.choice("preprocess_func", tuple(PREPROCESSORS))
    cls, allowed = PREPROCESSORS[name]
    args = checks.init_args(f.take("init_args", None), allowed)
    if f.take("dataset_meta", None) is not None:
        raise Refused("dataset_meta: only null is taken (an object holds one dataset)")
    kwargs = _map_options(f)

    def work() -> None:
        try:
            entry.obj.map(cls(**args), **kwargs)
        except Exception as exc:
            raise failed(f"map: {name}", exc) from None
        _check_rows("map", entry.obj, ctx)

    return work


def _map_options(f: Fields) -> dict[str, Any]:
    """`datasets.map` options: rows kept in memory (no cache files), one process."""
    kwargs: dict[str, Any] = {"keep_in_memory": True}
    batch_size = f.integer("batch_size", 1, MAX_MAP_BATCH, None)
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    f.ignore("batched", "load_from_cache_file", "num_proc")
    f.done()
    return kwargs


def encode(entry: Entry, f: Fields, ctx: Context) -> Work:
    add_generation_prompt = f.boolean("add_generation_prompt", False)
    kwargs = _map_options(f)

    def work() -> None:
        if entry.obj.template is None:
            raise Refused("encode: no template; call set_template first")
        try:
            entry.obj.encode(add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:
            raise failed("encode", exc) from None
        _check_rows("encode", entry.obj, ctx)

    return work


def length(entry: Entry, f: Fields, ctx: Context) -> Work:
    f.done()
    return lambda: int(len(entry.obj))


def start(entry: Entry, f: Fields, ctx: Context) -> Work:
    """`__iter__`: a new pass over the loader, kept with the object; answers 'ok' as twinkle's
    server does."""
    f.done()

    def work() -> str:
        entry.iterator = iter(entry.obj)
        return "ok"

    return work


def advance(entry: Entry, f: Fields, ctx: Context) -> Work:
    """`__next__`: the next batch as JSON rows; 410 once the pass is over."""
    f.done()

    def work() -> bytes:
        if entry.iterator is None:
            entry.iterator = iter(entry.obj)
        try:
            batch = next(entry.iterator)
        except StopIteration:
            raise Refused("Iterator exhausted", 410) from None
        payload = batch_json(batch)
        if len(payload) > ctx.max_answer_bytes:
            raise Refused(
                f"__next__: the batch is {len(payload)} bytes of JSON, over this server's "
                f"{ctx.max_answer_bytes}; use a smaller batch_size",
                413,
            )
        return b'{"result":' + payload + b"}"

    return work


def batch_json(batch: Any) -> bytes:
    try:
        text = json.dumps(batch, ensure_ascii=False, allow_nan=False, default=_plain)
    except ValueError:
        raise Refused(
            "__next__: the batch holds NaN or infinite numbers, which JSON cannot carry"
        ) from None
    return text.encode()


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray | torch.Tensor):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise Refused(f"__next__: a row holds a {type(value).__name__}, which JSON cannot carry")


def skip(entry: Entry, f: Fields, ctx: Context) -> Work:
    """`skip_consumed_samples` (and `resume_from_checkpoint`, which twinkle makes the same)."""
    consumed = f.integer("consumed_train_samples", 0, 1 << 62)
    f.done()

    def work() -> None:
        entry.obj.skip_consumed_samples(consumed)
        entry.iterator = None

    return work


def state(entry: Entry, f: Fields, ctx: Context) -> Work:
    f.done()
    return lambda: entry.obj.get_state()


Call = Callable[[Entry, Fields, Context], Work]
CREATE = {"Dataset": "dataset", "DataLoader": "dataloader"}  # class_type -> processor_type
CALLS: dict[str, dict[str, Call]] = {
    "Dataset": {
        "set_template": set_template,
        "map": dataset_map,
        "encode": encode,
        "__len__": length,
    },
    "DataLoader": {
        "__iter__": start,
        "__next__": advance,
        "__len__": length,
        "skip_consumed_samples": skip,
        "resume_from_checkpoint": skip,
        "get_state": state,
    },
}
