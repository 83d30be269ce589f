"""A MoE adapter's files in every layout, out and in (tiny Qwen3-MoE, gpt-oss, Qwen3.5-MoE; CPU).

Out (`checkpoints export --layout`, worker side): the per-expert layout is exactly what
tinker-cookbook's `build_lora_adapter` makes of the Tinker layout. In (`checkpoints import`,
worker side): an adapter in PEFT's `target_parameters`, per-expert or Tinker layout comes back
bit-exactly when it is shared-outer; otherwise the first tensor that is not is named, before
anything is stored.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest
import safetensors.torch
import torch

from admin_cli import transfer as cli_transfer
from protocol import jobs
from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.jobs import ImportAdapterJob, import_staging_dir
from protocol.paths import checkpoint_dir, parse_path
from tests.engine_helpers import Trainer, export_layout
from workers.tiny_model import build_tiny_model
from workers.trainer.parking import trained_groups

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MLP_ONLY = {"train_attn": False, "train_unembed": False}
Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "qwen3_5_moe"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def engine(moe_model: Path) -> Trainer:
    return Trainer(str(moe_model), max_slots=3, max_rank=8)


def _trained(engine: Trainer, model_id: str, directory: Path, **flags: bool) -> Path:
    """A sampler checkpoint of an adapter whose every factor is non-zero."""
    engine.create(model_id, LoraConfig(rank=4, seed=2, **flags))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(4)
    spec = engine.spec(model_id)
    for layout, _, b in engine.bank.slot_views(engine.bank.weights, engine.slot(model_id), 4):
        if layout.group in trained_groups(spec):
            b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
    engine.save(model_id, directory, kind="sampler_weights", meta={})
    return directory


def _rows(engine: Trainer, model_id: str) -> list[torch.Tensor]:
    slot, rank = engine.slot(model_id), engine.spec(model_id).rank
    return [
        v for _, a, b in engine.bank.slot_views(engine.bank.weights, slot, rank) for v in (a, b)
    ]


def _load(folder: Path) -> tuple[dict[str, object], Tensors]:
    config = json.loads((folder / "adapter_config.json").read_text())
    return config, safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))


def _save(folder: Path, config: dict[str, object], tensors: Tensors) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _import(engine: Trainer, root: Path, folder: Path, name: str = "in") -> str:
    """`checkpoints import` on the worker: the folder staged, then the job run."""
    from workers.trainer.transfer import import_adapter

    staging_id = uuid.uuid4().hex
    staging = import_staging_dir(root, staging_id)
    staging.mkdir(parents=True)
    for file in ADAPTER_FILES:
        shutil.copy(folder / file, staging / file)
    job = ImportAdapterJob(
        request_id="req",
        model_id=f"import-{staging_id[:8]}",
        tenant_id="t",
        seq_id=0,
        staging_id=staging_id,
        name=name,
        base_model=engine.base_model,
    )
    answer, _ = import_adapter(engine.core, engine.residency, root, job)
    assert not staging.exists()
    return str(answer["path"])


def _refused(
    engine: Trainer, root: Path, folder: Path, *details: str
) -> pytest.ExceptionInfo[UserError]:
    with pytest.raises(UserError) as error:
        _import(engine, root, folder)
    for detail in details:
        assert detail in error.value.message, error.value.message
    assert not list(root.glob("import-*")), "a refused import left files behind"
    return error


def test_the_cli_layouts_are_the_protocols() -> None:
    assert get_args(cli_transfer.AdapterLayout) == get_args(jobs.AdapterLayout)


def test_the_per_expert_export_is_what_the_cookbook_builds(
    engine: Trainer, moe_model: Path, tmp_path: Path
) -> None:
    from tinker_cookbook import weights as cookbook_weights

    # no lm_head: the cookbook names Tinker's `unembed_tokens`, not ours
    checkpoint = _trained(engine, "m", tmp_path / "sampler", train_unembed=False)
    tinker = export_layout(engine, checkpoint, tmp_path / "root", "tinker")
    cookbook = tmp_path / "cookbook"
    cookbook_weights.build_lora_adapter(
        base_model=str(moe_model), adapter_path=str(tinker), output_path=str(cookbook)
    )
    ours = export_layout(engine, checkpoint, tmp_path / "root", "per-expert")
    our_config, our_tensors = _load(ours)
    their_config, their_tensors = _load(cookbook)
    assert sorted(our_tensors) == sorted(their_tensors)
    assert any(".mlp.experts.0.gate_proj.lora_A.weight" in key for key in our_tensors)
    for key, tensor in their_tensors.items():
        assert torch.equal(our_tensors[key], tensor), key
    assert our_config["target_modules"] == their_config["target_modules"]
    assert our_config["r"] == their_config["r"]
    assert our_config["lora_alpha"] == their_config["lora_alpha"]


@pytest.mark.parametrize("layout", ["peft", "per-expert", "tinker", "cookbook"])
def test_an_adapter_in_any_layout_imports_exactly(
    engine: Trainer, moe_model: Path, tmp_path: Path, layout: str
) -> None:
    checkpoint = _trained(engine, "m", tmp_path / "sampler", train_unembed=False)
    root = tmp_path / "root"
    if layout == "peft":
        folder = checkpoint
    elif layout == "cookbook":
        from tinker_cookbook import weights as cookbook_weights

        folder = tmp_path / "cookbook"
        cookbook_weights.build_lora_adapter(
            base_model=str(moe_model),
            adapter_path=str(export_layout(engine, checkpoint, root, "tinker")),
            output_path=str(folder),
        )
    else:
        folder = export_layout(engine, checkpoint, root, layout)  # type: ignore[arg-type]
    path = _import(engine, root, folder)
    engine.load("x", checkpoint_dir(root, parse_path(path)), with_optimizer=True)
    assert engine.spec("x").rank == 4 and not engine.spec("x").train_unembed
    for original, imported in zip(_rows(engine, "m"), _rows(engine, "x"), strict=True):
        assert torch.equal(original, imported)


def _experts_of(engine: Trainer) -> tuple[str, int]:
    path, layer = next(iter(engine.bank.expert_layers.items()))
    return f"base_model.model.{path}", layer.shape.num_experts


def test_a_per_expert_adapter_that_is_not_shared_outer_is_refused(
    engine: Trainer, tmp_path: Path
) -> None:
    checkpoint = _trained(engine, "m", tmp_path / "sampler", **MLP_ONLY)
    root = tmp_path / "root"
    config, tensors = _load(export_layout(engine, checkpoint, root, "per-expert"))
    block, n = _experts_of(engine)

    changed = dict(tensors)
    gate_a = f"{block}.{n - 1}.gate_proj.lora_A.weight"
    changed[gate_a] = changed[gate_a] + 1e-3
    _refused(engine, root, _save(tmp_path / "own-a", config, changed), gate_a, "every expert")
    changed = dict(tensors)
    down_b = f"{block}.2.down_proj.lora_B.weight"
    changed[down_b] = changed[down_b] * 2
    _refused(engine, root, _save(tmp_path / "own-b", config, changed), down_b, "every expert")
    missing = dict(tensors)
    up_b = f"{block}.3.up_proj.lora_B.weight"
    del missing[up_b]
    _refused(engine, root, _save(tmp_path / "missing", config, missing), up_b, "missing")
    extra = dict(tensors)
    extra[f"{block}.{n}.up_proj.lora_A.weight"] = tensors[f"{block}.0.up_proj.lora_A.weight"] * 1
    _refused(engine, root, _save(tmp_path / "extra", config, extra), f"{n} experts")


def test_a_peft_adapter_that_is_not_shared_outer_is_refused(
    engine: Trainer, moe_model: Path, tmp_path: Path
) -> None:
    checkpoint = _trained(engine, "m", tmp_path / "sampler", **MLP_ONLY)
    root = tmp_path / "root"
    config, tensors = _load(checkpoint)
    block, n = _experts_of(engine)
    gate_up_b, down_b = f"{block}.base_layer.lora_B.weight", f"{block}.lora_B.weight"

    off_block = dict(tensors)
    off_block[gate_up_b] = off_block[gate_up_b].clone()
    off_block[gate_up_b][0, -1] = 1e-3  # a gate row (first) using an up rank (last)
    folder = _save(tmp_path / "off-block", config, off_block)
    _refused(engine, root, folder, gate_up_b, "block-diagonal")
    own_down = dict(tensors)
    own_down[down_b] = own_down[down_b].clone()
    own_down[down_b][:, -1] += 1e-3  # the last expert's copy of the shared B
    _refused(engine, root, _save(tmp_path / "own-down", config, own_down), down_b, "expert")
    unscaled = {**config, "alpha_pattern": {}}  # gate_up at rank 2r would be scaled alpha/2r
    _refused(engine, root, _save(tmp_path / "unscaled", unscaled, tensors), "scaled by", "32")
    wider = {key: value for key, value in tensors.items() if key != gate_up_b}
    wider[gate_up_b] = torch.zeros(tensors[gate_up_b].shape[0] + 2, tensors[gate_up_b].shape[1])
    _refused(engine, root, _save(tmp_path / "wider", config, wider), gate_up_b, "other shapes")

    # what PEFT itself trains on fused experts: an A of its own per expert
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=targets)
    get_peft_model(model, peft_config).save_pretrained(tmp_path / "peft-trained")
    _refused(engine, root, tmp_path / "peft-trained", "base_layer.lora_A.weight", "expert 1")


def test_reading_checks_only_shapes_before_data(
    engine: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that does not fit is refused from its header: no tensor is loaded."""
    import workers.trainer.checkpoints as checkpoints

    checkpoint = _trained(engine, "m", tmp_path / "sampler", **MLP_ONLY)
    config, tensors = _load(checkpoint)
    block, n = _experts_of(engine)
    down_a, down_b = f"{block}.lora_A.weight", f"{block}.lora_B.weight"
    tensors[down_a] = torch.cat([tensors[down_a], tensors[down_a]])  # rank 8, the config says 4
    tensors[down_b] = torch.cat([tensors[down_b], tensors[down_b]], 1)
    loads: list[Path] = []
    read: Callable[[Path], Tensors] = checkpoints._read_tensors
    monkeypatch.setattr(checkpoints, "_read_tensors", lambda path: loads.append(path) or read(path))
    _refused(engine, tmp_path / "root", _save(tmp_path / "rank", config, tensors), down_a, "rank 8")
    assert loads == []


def test_the_gateway_tells_the_stored_layout_from_the_config(tmp_path: Path) -> None:
    """Which exports it can serve as stored: the config names the experts' layout."""
    from twinkle_async.gateway.admin_transfer_routes import _stored_layout

    def stored(config: object) -> str | None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
        return _stored_layout(tmp_path)

    assert stored({"target_parameters": ["model.layers.0.mlp.experts.gate_up_proj"]}) == "peft"
    legacy = r"model\.layers\.0\.mlp\.experts\.w1|model\.layers\.0\.self_attn\.q_proj"
    assert stored({"target_modules": legacy}) == "tinker"  # written before PEFT's layout
    assert stored({"target_modules": ["q_proj", "w1", "w2", "w3"]}) == "tinker"
    assert stored({"target_modules": ["q_proj", "gate_proj"], "target_parameters": None}) is None
    assert stored([1]) is None
    (tmp_path / "adapter_config.json").unlink()
    assert _stored_layout(tmp_path) is None
