"""workers.engine.kernels: the linear-attention path a model runs, and the LoRA kind of a device."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.models.qwen3_5 import modeling_qwen3_5

from workers.engine.kernels import linear_attention_path, lora_path
from workers.tiny_model import build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("kernels")
    return {
        arch: AutoModelForCausalLM.from_pretrained(build_tiny_model(Path(root / arch), arch))
        for arch in ("qwen3", "qwen3_5")
    }


def test_tiny_qwen3_5_runs_the_torch_reference_and_qwen3_has_none(
    tiny_models: dict[str, torch.nn.Module],
) -> None:
    assert linear_attention_path(tiny_models["qwen3"]) == "none"
    # This machine has neither flash-linear-attention nor causal-conv1d installed.
    assert linear_attention_path(tiny_models["qwen3_5"]) == "torch"


def fake_kernel_package(name: str, module_path: str, function: str) -> dict[str, types.ModuleType]:
    """Modules standing in for an installed kernel package, with one function at `module_path`."""
    modules: dict[str, types.ModuleType] = {}
    parts = module_path.split(".")
    for i in range(1, len(parts) + 1):
        modules[".".join(parts[:i])] = types.ModuleType(".".join(parts[:i]))
    for i in range(1, len(parts)):
        setattr(modules[".".join(parts[:i])], parts[i], modules[".".join(parts[: i + 1])])

    def kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("reading the path must not call a kernel")

    kernel.__module__ = module_path
    setattr(modules[module_path], function, kernel)
    assert parts[0] == name
    return modules


def rewrap(
    monkeypatch: pytest.MonkeyPatch, attribute: str, func_name: str, package: str
) -> Callable[..., object]:
    """Decorate the modeling module's torch function again, as its import would with `package`."""
    original = getattr(modeling_qwen3_5, attribute).__wrapped__
    wrapped: Callable[..., object] = use_kernel_func_from_hub_with_fallback(func_name, package)(
        original
    )
    monkeypatch.setattr(modeling_qwen3_5, attribute, wrapped)
    return wrapped


def test_installed_kernel_packages_are_reported(
    tiny_models: dict[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path read from transformers' own wrapper when fla / causal-conv1d import."""
    model = tiny_models["qwen3_5"]
    fla = fake_kernel_package("fla", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    for name, module in fla.items():
        monkeypatch.setitem(sys.modules, name, module)
    rewrap(monkeypatch, "torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "fla")
    assert linear_attention_path(model) == "fla"

    conv = fake_kernel_package("causal_conv1d", "causal_conv1d", "causal_conv1d_fn")
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv["causal_conv1d"])
    rewrap(monkeypatch, "causal_conv1d_fn", "causal_conv1d_fn", "causal_conv1d")
    assert linear_attention_path(model) == "causal-conv1d+fla"

    monkeypatch.setattr(
        modeling_qwen3_5,
        "torch_chunk_gated_delta_rule",
        modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__,  # the bare torch code
    )
    assert linear_attention_path(model) == "causal-conv1d+torch"


def test_lora_path_of_the_cpu_is_the_loop() -> None:
    assert lora_path("cpu") == "loop"
    assert lora_path(torch.device("cpu"), torch.bfloat16) == "loop"
