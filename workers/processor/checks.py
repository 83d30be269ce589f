"""What a caller may send the processor service, checked before any twinkle code runs: the body's
fields one by one (`Fields`), a dataset file under the data root (`data_file`), a `data_slice`,
a served model (`Models`) and a preprocessor's `init_args`. Standard library only.

A refusal is a `Refused` carrying the HTTP status and a one-line detail that names the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_STRING = 4096  # an init_args string, a template's default_system
MAX_ID = 1024  # a dataset id, a model id
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
HUB_NOTE = "hub datasets are not reachable from this server (offline)"
_MISSING: Any = object()
_GLOB = re.compile(r"[*?\[\]{}]")


class Refused(Exception):
    """A request the service will not run: its HTTP status and what was wrong."""

    def __init__(self, detail: str, status: int = 400) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


def shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def listed(names: Iterable[str]) -> str:
    return ", ".join(names) or "none"


class Fields:
    """A JSON object's fields, taken one at a time; `done` refuses whatever was not taken."""

    def __init__(self, where: str, body: Mapping[str, Any]) -> None:
        self.where = where
        self.body = dict(body)
        self.known: list[str] = []

    def _name(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def take(self, name: str, default: Any = _MISSING) -> Any:
        self.known.append(name)
        if name in self.body:
            return self.body.pop(name)
        if default is _MISSING:
            raise Refused(f"{self._name(name)}: missing")
        return default

    def integer(self, name: str, low: int, high: int, default: Any = _MISSING) -> Any:
        value = self.take(name, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Refused(
                f"{self._name(name)}: expected an integer from {low} to {high}, got {shown(value)}"
            )
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.take(name, default)
        if not isinstance(value, bool):
            raise Refused(f"{self._name(name)}: expected true or false, got {shown(value)}")
        return value

    def string(self, name: str, max_len: int, default: Any = _MISSING) -> Any:
        value = self.take(name, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or not value or len(value) > max_len:
            raise Refused(
                f"{self._name(name)}: expected a string of 1 to {max_len} characters, "
                f"got {shown(value)}"
            )
        return value

    def choice(self, name: str, allowed: Sequence[str], default: Any = _MISSING) -> Any:
        value = self.take(name, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or value not in allowed:
            raise Refused(f"{self._name(name)}: {shown(value)} is not one of {listed(allowed)}")
        return value

    def ignore(self, *names: str) -> None:
        """Fields twinkle's client may send that this service decides itself."""
        for name in names:
            self.take(name, None)

    def done(self) -> None:
        if self.body:
            extra = listed(shown(name) for name in sorted(self.body, key=str))
            where = f"{self.where}: " if self.where else ""
            raise Refused(f"{where}unexpected field(s) {extra}; allowed: {listed(self.known)}")


def json_object(raw: bytes, where: str = "body") -> dict[str, Any]:
    """A request body that must be one JSON object."""
    import json

    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise Refused(f"{where}: not valid JSON") from None
    if not isinstance(value, dict):
        raise Refused(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def dataset_meta_fields(value: Any) -> Fields:
    """`dataset_meta` as twinkle's client sends it: a JSON string tagged `DatasetMeta` (an
    object is taken too)."""
    if isinstance(value, str):
        if len(value) > 1 << 20:
            raise Refused("dataset_meta: over 1 MiB")
        value = json_object(value.encode(), "dataset_meta")
    if not isinstance(value, dict):
        raise Refused(f"dataset_meta: expected a DatasetMeta, got {shown(value)}")
    fields = Fields("dataset_meta", value)
    tag = fields.take("_TWINKLE_TYPE_", "DatasetMeta")
    if tag != "DatasetMeta":
        raise Refused(f"dataset_meta._TWINKLE_TYPE_: expected 'DatasetMeta', got {shown(tag)}")
    return fields


def data_slice(value: Any, max_rows: int) -> range | list[int] | None:
    """A `data_slice` (twinkle's client sends a range or a list tagged `_slice_type_`): indices
    from 0, at most `max_rows` of them. Twinkle wraps an index past the end of the file."""
    if value is None:
        return None
    if isinstance(value, dict):
        fields = Fields("dataset_meta.data_slice", value)
        kind = fields.choice("_slice_type_", ("range", "list"))
        if kind == "range":
            bound = 1 << 62
            start = fields.integer("start", 0, bound)
            stop = fields.integer("stop", 0, bound)
            step = fields.integer("step", 1, bound, 1)
            fields.done()
            picked: range | list[int] = range(start, stop, step)
        else:
            values = fields.take("values")
            fields.done()
            picked = _indices(values, max_rows)
    else:
        picked = _indices(value, max_rows)
    if len(picked) > max_rows:
        raise Refused(
            f"dataset_meta.data_slice: {len(picked)} rows, over this server's {max_rows}", 413
        )
    return picked


def _indices(values: Any, max_rows: int) -> list[int]:
    if not isinstance(values, list):
        raise Refused(f"dataset_meta.data_slice: expected a range or a list, got {shown(values)}")
    if len(values) > max_rows:
        raise Refused(
            f"dataset_meta.data_slice: {len(values)} rows, over this server's {max_rows}", 413
        )
    for index in values:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 62:
            raise Refused(f"dataset_meta.data_slice: {shown(index)} is not a row index from 0")
    return list(values)


def data_file(dataset_id: Any, root: str, max_bytes: int) -> str:
    """The real path of `dataset_id`, a data file under `root` (itself a real path)."""
    if not isinstance(dataset_id, str) or not dataset_id or len(dataset_id) > MAX_ID:
        raise Refused(f"dataset_meta.dataset_id: expected a file name, got {shown(dataset_id)}")
    name = shown(dataset_id)
    if "://" in dataset_id:
        raise Refused(f"dataset_meta.dataset_id: {name} is a hub id; {HUB_NOTE}")
    if "\x00" in dataset_id or _GLOB.search(dataset_id):
        raise Refused(f"dataset_meta.dataset_id: {name} holds characters a file name may not")
    if ".." in dataset_id.replace(os.sep, "/").split("/"):
        raise Refused(f"dataset_meta.dataset_id: {name} climbs out of the data directory")
    path = os.path.realpath(os.path.join(root, dataset_id))
    if os.path.commonpath([root, path]) != root:
        raise Refused(f"dataset_meta.dataset_id: {name} is outside this server's data directory")
    if os.path.isdir(path):
        raise Refused(f"dataset_meta.dataset_id: {name} is a directory; name one data file")
    if not os.path.isfile(path):
        raise Refused(f"dataset_meta.dataset_id: no file {name} in the data directory; {HUB_NOTE}")
    if not path.endswith(DATA_SUFFIXES):
        raise Refused(
            f"dataset_meta.dataset_id: {name} is not one of the file types {listed(DATA_SUFFIXES)}"
        )
    size = os.path.getsize(path)
    if size > max_bytes:
        raise Refused(
            f"dataset_meta.dataset_id: {name} is {size} bytes, over this server's {max_bytes}", 413
        )
    return path


def init_args(value: Any, allowed: Mapping[str, tuple[type, ...]]) -> dict[str, Any]:
    """A preprocessor's `init_args`: the names it takes, each a short string, a number, a
    boolean or null, as `allowed` says."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Refused(f"init_args: expected an object, got {shown(value)}")
    checked: dict[str, Any] = {}
    for name, arg in value.items():
        if name not in allowed:
            raise Refused(f"init_args: {shown(name)} is not taken; allowed: {listed(allowed)}")
        kinds = allowed[name]
        plain = isinstance(arg, kinds) and not (isinstance(arg, bool) and bool not in kinds)
        if not plain or (isinstance(arg, str) and len(arg) > MAX_STRING):
            wanted = "/".join("null" if k is type(None) else k.__name__ for k in kinds)
            limit = f" (strings up to {MAX_STRING} characters)" if str in kinds else ""
            raise Refused(f"init_args.{name}: expected {wanted}{limit}, got {shown(arg)}")
        checked[name] = arg
    return checked


@dataclass(frozen=True)
class Models:
    """The served models (`--model NAME=PATH`): a template's `model_id` names one of them."""

    paths: dict[str, str]

    @classmethod
    def parse(cls, pairs: Sequence[str]) -> Models:
        paths: dict[str, str] = {}
        for pair in pairs:
            name, sep, path = pair.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--model: expected NAME=PATH, got {pair!r}")
            if name in paths:
                raise ValueError(f"--model: {name!r} given twice")
            paths[name] = path
        return cls(paths)

    def name_of(self, model_id: Any) -> str:
        """The served model's NAME that `model_id` (`ms://X`, `hf://X` or `X`) names."""
        if not isinstance(model_id, str) or not model_id or len(model_id) > MAX_ID:
            raise Refused(f"model_id: expected a model name, got {shown(model_id)}")
        bare = model_id
        for scheme in ("ms://", "hf://"):
            if bare.startswith(scheme):
                bare = bare[len(scheme) :]
                break
        for name in self.paths:
            if bare in (name, name.lstrip("/")):
                return name
        raise Refused(
            f"model_id: {shown(model_id)} is not served here; served: {listed(self.paths)}"
        )
