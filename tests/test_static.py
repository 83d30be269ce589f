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
    "twinkle_async": {
        "protocol",
        "aiohttp",
        "nats",
        "msgspec",
        "zstandard",
        "typer",
        "uvloop",
        "numpy",
        "google",
        "prometheus_client",
    },
    "admin_cli": {"typer", "aiohttp", "httpx", "msgspec", "rich"},
    "workers": {
        "protocol",
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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_rules(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    violations = []
    for path in files:
        extra = imported_roots(path) - STDLIB - {package, "__future__"} - ALLOWED[package]
        if extra:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(extra)}")
    assert not violations, "\n".join(violations)


def test_gateway_never_imports_torch_or_workers() -> None:
    for path in (ROOT / "twinkle_async").rglob("*.py"):
        roots = imported_roots(path)
        assert "torch" not in roots and "workers" not in roots, path
