"""Static guards: the import rules of DESIGN.md §10, checked on the source, not at run time."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)

# package -> what it may import besides the standard library and itself
ALLOWED: dict[str, set[str]] = {
    # protocol: pure data; numpy only for the TensorData codecs the issue asks of it
    "protocol": {"msgspec", "google", "numpy"},
    # the NATS KV operations, one implementation for gateway and workers: neither may import
    # the other, and protocol does no I/O, so both import this package
    "natskv": {"protocol", "nats", "msgspec"},
    "twinkle_async": {
        "protocol",
        "natskv",
        "aiohttp",
        "nats",
        "msgspec",
        "zstandard",
        "typer",
        "uvloop",
        "numpy",
        "google",
        "prometheus_client",
        "obstore",  # checkpoint files in the artifact store (`gateway/store_files.py`)
    },
    # still HTTP only: from `protocol` it takes names of the wire format it speaks (the adapter
    # files an import uploads as multipart parts), declared there once for gateway and workers
    "admin_cli": {"typer", "aiohttp", "httpx", "msgspec", "rich", "protocol"},
    "workers": {
        "protocol",
        "natskv",
        "torch",
        "transformers",
        "peft",
        "safetensors",
        "numpy",
        "nats",
        "msgspec",
        "tokenizers",
        "uvloop",
        "google",
        "vllm",
        "typer",
        "prometheus_client",
        "obstore",  # the artifact store (`workers.artifacts`)
        "PIL",  # a VL model's images decoded once, on the worker (`workers.engine.vision`)
    },
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


# `workers/processor`: the Twinkle processor service, run by twinkle-kit's own interpreter,
# which has twinkle and its dependencies but none of ours: it imports no other package here
PROCESSOR = ROOT / "workers" / "processor"
PROCESSOR_ALLOWED = {"aiohttp", "numpy", "twinkle", "torch"}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_rules(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    violations = []
    for path in files:
        if PROCESSOR in path.parents:
            extra = imported_roots(path) - STDLIB - {"__future__"} - PROCESSOR_ALLOWED
            if extra - {"workers"} or any(
                not name.startswith("workers.processor")
                for name in imported_modules(path)
                if name.split(".")[0] == "workers"
            ):
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
            continue
        extra = imported_roots(path) - STDLIB - {package, "__future__"} - ALLOWED[package]
        if extra:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not violations, "\n".join(violations)


def test_gateway_never_imports_torch_or_workers() -> None:
    for path in (ROOT / "twinkle_async").rglob("*.py"):
        roots = imported_roots(path)
        assert "torch" not in roots and "workers" not in roots, path


def awaited_kv_listings(path: Path) -> list[int]:
    """Lines awaiting nats-py's `KeyValue.keys()`, `history()` or `watchall()`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Await) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        if not isinstance(func, ast.Attribute):
            continue
        bare_keys = func.attr == "keys" and not node.value.args  # `Bus.keys` takes a bucket
        if bare_keys or func.attr in {"history", "watchall"}:
            lines.append(node.lineno)
    return lines


def test_no_kv_listing_through_a_nats_py_watcher() -> None:
    """nats-py's KV watcher can end its initial replay before entries already on the wire are
    read (nats-io/nats.py#842), so `keys()` may answer "no keys" for a bucket that has some.
    Listings go through `Bus.keys` / `Bus.values` (one stream-info request) instead."""
    found = []
    for package in [*ALLOWED, "tests", "bench", "examples"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for line in awaited_kv_listings(path)]
    assert not found, "\n".join(found)


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports (`from a.b import c` gives `a.b` and `a.b.c`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# room of workers/ -> the rooms it may not import (docs/architecture.md)
FORBIDDEN_ROOMS: dict[str, set[str]] = {
    "engine": {"trainer", "sampler", "group"},
    "trainer": {"sampler", "group"},
    # the sampler stands on the model and a protocol for snapshot slots, which the trainer's
    # residency implements; `workers.__main__` puts the two together
    "sampler": {"trainer", "group"},
    "group": set(),  # a group runs the trainer's operations, and its torch sampler, on N devices
}


@pytest.mark.parametrize("room", sorted(FORBIDDEN_ROOMS))
def test_worker_rooms_import_only_what_they_may(room: str) -> None:
    violations = []
    for path in sorted((ROOT / "workers" / room).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "workers" and len(parts) > 1 and parts[1] in FORBIDDEN_ROOMS[room]:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "\n".join(violations)


def test_worker_modules_live_in_a_room() -> None:
    """Only the process entry points and what every room shares stay at the top of workers/."""
    shared = {
        "__init__",
        "artifacts",  # the artifact store: trainer and sampler both read it
        "__main__",
        "bus",
        "metrics",
        "settings",
        "tiny_model",
        "tiny_families",
        "usage",
        "watchdog",
    }
    loose = {p.stem for p in (ROOT / "workers").glob("*.py")} - shared
    assert not loose, f"modules outside engine/, trainer/, sampler/, group/: {sorted(loose)}"


OURS = ("protocol", "natskv", "twinkle_async", "workers", "admin_cli")


def _module_file(name: str) -> Path | None:
    """The file of one of our modules (a package's `__init__.py`), or None if there is none."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_every_import_of_our_modules_resolves() -> None:
    """Scripts no test runs (bench/, examples/) still import what exists: a module moved to
    another package breaks `from workers import optimizer` only when the script runs."""
    broken = []
    for package in [*OURS, "tests", "bench", "examples"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    wanted = [(alias.name, None) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    wanted = [(node.module, alias.name) for alias in node.names]
                else:
                    continue
                for module, name in wanted:
                    if module.split(".")[0] not in OURS:
                        continue
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found = _module_file(module)
                    if found is None:
                        broken.append(f"{where}: no module {module}")
                    elif not (
                        name is None
                        or name == "*"
                        or _module_file(f"{module}.{name}") is not None
                        or name in _top_level_names(found)
                    ):
                        broken.append(f"{where}: {module} has no {name}")
    assert not broken, "\n".join(broken)


# Documents outside the repository, which a reader of the code cannot open.
_OUTSIDE = ("DESIGN.md", "reference/", "reference environment notes", "STYLE.md")


def test_docstrings_cite_only_files_in_the_repository() -> None:
    """A docstring or comment points at `docs/` (or another file of the repository), never at
    notes that live outside it."""
    found = []
    for package in [*OURS, "tests", "bench", "examples"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == Path(__file__):
                continue
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if any(cited in line for cited in _OUTSIDE):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
