"""Adapters in and out in standard formats: import a PEFT adapter, export a merged model or
an adapter in another layout.

Job: the engine-thread half of `twinkle-admin checkpoints import` and `... export --merged` /
`--layout` (the gateway's `admin_transfer_routes` is the other half).

- `import_adapter`: an adapter trained anywhere, staged by the gateway as PEFT's two files,
  is checked against this worker's model (`SlotCheckpoints.read`: every tensor a LoRA matrix
  of an adaptable layer with the right shape, rank within the cap; plus target modules this
  model has and finite values) and written as a `weights` training checkpoint with fresh
  optimizer state (zero moments, step 0), so `create_training_client_from_state` trains it on.
  A MoE adapter's experts may come in any `AdapterLayout` (`workers.trainer.expert_files`) when
  they are representable as Tinker's shared-outer LoRA; otherwise the first tensor that is not
  is named.
- `export_merged`: a checkpoint's adapter folded into a fresh copy of the base weights
  (`W + alpha/r · B·A`), written as a whole `transformers` model with its config and tokenizer;
  with a layout, the checkpoint's adapter folder rewritten in that layout instead.

Invariants:
- Nothing here touches a slot: the tenants training on this worker never see a transfer.
- An incompatible adapter is a `UserError` that names the file and the reason; the staged
  upload is removed either way, and nothing is left in the checkpoint store.
- Both write under a temporary name and rename into place; a retried job rewrites the same
  result (the names are fixed by the job).
- With an artifact store (`workers.artifacts`) nothing is on a shared disk: the upload is
  staged in the store (`import_staging_key`), the imported checkpoint goes up as a content of
  its own (`checkpoint_key`), and an export reads the checkpoint's content from the store and
  puts its files under `merged_export_key`, where the gateway presigns them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import safetensors
import torch
from transformers import AutoTokenizer

from protocol.api import LoraConfig
from protocol.errors import UserError
from protocol.jobs import (
    ExportMergedJob,
    ImportAdapterJob,
    import_staging_dir,
    import_staging_key,
    merged_export_dir,
    merged_export_key,
)
from protocol.paths import (
    CONTENT_ID_FILE,
    TinkerPath,
    checkpoint_dir,
    checkpoint_key,
    parse_path,
)
from protocol.records import CheckpointRecord
from protocol.rules import check_lora_config
from workers.artifacts import ArtifactStore, staging_dir
from workers.engine.lora import LayerGroup, LayerLayout
from workers.engine.model import MultiSlotModel, load_causal_lm
from workers.engine.moe_lora import EXPERT_PROJECTIONS, expert_shape, expert_weights
from workers.engine.shared_bank import BANK_PARAMETERS, bank_shape, shares_gate_up_a
from workers.engine.sliced_lora import find_sliced_linears, part_path
from workers.trainer.checkpoints import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MOMENTS,
    AdapterCheckpoint,
    adapter_key,
    adapter_scales,
    match_layers,
    read_checkpoint,
    tensor_shapes,
    trainer_tensors,
    write_checkpoint,
)
from workers.trainer.expert_files import DOWN, GATE_UP, PER_EXPERT_NAMES, UP
from workers.trainer.parking import GROUP_FLAGS
from workers.trainer.residency import Residency
from workers.trainer.slot_checkpoints import StoredAdapter

_PREFIX = "base_model.model."
_BASE_COPY = ".base_layer.weight"


def _adaptable(residency: Residency) -> list[str]:
    """The layers an adapter may target: linears, and fused experts by their projections'
    names (Tinker's `w1`, per-expert `gate_proj`, PEFT's `target_parameters`)."""
    experts = list(residency.files.model.experts)
    names = [*PER_EXPERT_NAMES.values(), GATE_UP, DOWN]
    return [
        *(layout.path for layout in residency.bank.whole_layouts),
        *(f"{path}.{name}" for path in experts for name in names),
        *residency.files.model.sliced,  # a block LoRA on the linear (sliced_files.py)
    ]


def check_target_modules(config: dict[str, Any], adaptable: list[str]) -> None:
    """Every module (or fused parameter) an adapter's config targets must be one this server
    adapts."""
    parameters = config.get("target_parameters")
    if parameters is not None and not isinstance(parameters, list):
        raise UserError(f"{ADAPTER_CONFIG}: target_parameters must be a list of names")
    # a fused experts parameter, or a linear's weight (`checkpoints.by_weight_paths`)
    parameters_of = [
        *(path for path in adaptable if path.endswith((f".{GATE_UP}", f".{UP}", f".{DOWN}"))),
        *(f"{path}.weight" for path in adaptable),
    ]
    for target in parameters or []:
        if not isinstance(target, str) or not any(
            path == target or path.endswith("." + target) for path in parameters_of
        ):
            raise UserError(
                f"{ADAPTER_CONFIG}: target parameter {str(target)[:60]!r} is neither a fused"
                f" experts parameter this server can adapt ({GATE_UP}, {UP}, {DOWN}) nor the"
                " weight of a layer it adapts"
            )
    targets = config.get("target_modules")
    if config.get("modules_to_save"):
        raise UserError(
            f"{ADAPTER_CONFIG}: modules_to_save {config['modules_to_save']!r} is not supported"
            " (only LoRA matrices are imported)"
        )
    if config.get("bias", "none") != "none":
        raise UserError(f"{ADAPTER_CONFIG}: bias {config['bias']!r} is not supported (none)")
    if not isinstance(targets, list):
        return  # a regex (or "all-linear"): the tensors' own paths are checked one by one
    leaves = sorted({path.rpartition(".")[2] for path in adaptable})
    for target in targets:
        if not isinstance(target, str) or not any(
            path == target or path.endswith("." + target) for path in adaptable
        ):
            raise UserError(
                f"{ADAPTER_CONFIG}: target module {str(target)[:60]!r} is not a layer this"
                f" server can adapt (adaptable: {', '.join(leaves)})"
            )


def _checked_adapter(residency: Residency, directory: Path) -> StoredAdapter:
    """The adapter in `directory`, checked against this model; a `UserError` otherwise.

    The tensor file's header is checked first (names and shapes, no data read), so a file
    that does not fit this model costs no memory; only then are the tensors loaded.
    """
    config = _read_config(directory / ADAPTER_CONFIG)
    check_target_modules(config, _adaptable(residency))
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise UserError(f"{ADAPTER_CONFIG}: lora_alpha {alpha!r} is not a positive number")
    _rank(config)
    scales = adapter_scales(config)
    layouts = residency.bank.whole_layouts
    model = residency.files.model
    with _fitting(residency):  # raises before any tensor is read
        header = trainer_tensors(_header(directory / ADAPTER_WEIGHTS, layouts), model, scales)
        _complete(header, layouts, scales.rank, meta=True)
        _match(residency, header, scales.rank)
        checkpoint = read_checkpoint(directory, with_optimizer=False, model=model)
        _complete(checkpoint.tensors, layouts, checkpoint.rank, meta=False)
        groups = _match(residency, checkpoint.tensors, checkpoint.rank)
    spec = LoraConfig(
        rank=checkpoint.rank, **{flag: group in groups for group, flag in GROUP_FLAGS.items()}
    )
    check_lora_config(spec, residency.bank.max_rank)
    for key, tensor in checkpoint.tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise UserError(f"{ADAPTER_WEIGHTS}: {key} holds non-finite values (NaN or inf)")
    return StoredAdapter(checkpoint, spec, frozenset(groups))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{ADAPTER_CONFIG}: missing") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{ADAPTER_CONFIG}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{ADAPTER_CONFIG}: expected a JSON object")
    return config


def _rank(config: dict[str, Any]) -> int:
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UserError(f"{ADAPTER_CONFIG}: r {rank!r} is not a positive integer")
    return rank


def _header(path: Path, layouts: Sequence[LayerLayout]) -> dict[str, torch.Tensor]:
    """The file's tensors as shapes only (`meta` tensors)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except FileNotFoundError:
        raise UserError(f"{ADAPTER_WEIGHTS}: missing") from None
    except (OSError, safetensors.SafetensorError) as error:
        raise UserError(f"{ADAPTER_WEIGHTS}: unreadable ({error})") from None
    sizes = {layout.path: (layout.out_features, layout.in_features) for layout in layouts}
    for key, shape in shapes.items():
        if key.endswith(_BASE_COPY):  # PEFT's copy of an adapted lm_head's base weight
            module = key[len(_PREFIX) : -len(_BASE_COPY)]
            if sizes.get(module) != shape:
                raise UserError(f"{ADAPTER_WEIGHTS}: unexpected tensor {key!r} {shape}")
    return {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}


def _match(residency: Residency, tensors: dict[str, torch.Tensor], rank: int) -> set[LayerGroup]:
    """`match_layers` on these tensors (the trainer's form)."""
    probe = AdapterCheckpoint(base_model="", rank=rank, lora_alpha=1.0, tensors=tensors)
    return match_layers(probe, residency.bank.whole_layouts, max_rank=residency.bank.max_rank)


@contextmanager
def _fitting(residency: Residency) -> Iterator[None]:
    """A shape error says so when the shapes are another model's."""
    try:
        yield
    except UserError as error:
        if "has shape" in error.message:
            raise UserError(
                f"{error.message}: the adapter was trained on a base model with other shapes"
                f" than {residency.files.base_model!r}"
            ) from None
        raise


def _complete(
    tensors: dict[str, torch.Tensor], layouts: Sequence[LayerLayout], rank: int, *, meta: bool
) -> None:
    """Give the layers an adapter left out of a layer group it trains a zero update.

    PEFT adapters often train some projections of a block (`q_proj`, `v_proj`); a slot trains
    whole groups. A left-out layer gets A as a fresh adapter has it (kaiming-uniform, seeded)
    and B = 0: the adapter computes exactly what it did, and those layers train from here on.
    """
    present = {key[len(_PREFIX) :].rpartition(".lora_")[0] for key in tensors if "lora_" in key}
    covered = {layout.group for layout in layouts if layout.path in present}
    generator = torch.Generator().manual_seed(0)
    for layout in layouts:
        if layout.group not in covered or layout.path in present:
            continue
        a_shape, b_shape = tensor_shapes(layout, rank)
        if meta:
            a = torch.empty(a_shape, device="meta")
            b = torch.empty(b_shape, device="meta")
        else:
            a = torch.empty(math.prod(a_shape[:-1]), a_shape[-1], dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            a = a.view(a_shape)
            b = torch.zeros(b_shape, dtype=torch.float32)
        tensors[adapter_key(layout.path, "A")] = a
        tensors[adapter_key(layout.path, "B")] = b


def import_adapter(
    model: MultiSlotModel,
    residency: Residency,
    root: Path,
    job: ImportAdapterJob,
    store: ArtifactStore | None = None,
    data_dir: Path | None = None,
) -> tuple[dict[str, Any], CheckpointRecord]:
    """Write the staged adapter as `tinker://<model_id>/weights/<name>`; its record."""
    path = TinkerPath(run_id=job.model_id, kind="weights", name=job.name)
    store_key = digest = ""
    staging: Path | None = None
    if store is None:
        staging = import_staging_dir(root, job.staging_id)
        target = checkpoint_dir(root, path)
    else:
        assert data_dir is not None
        target = staging_dir(data_dir, job.model_id) / "imported"
    try:
        if store is not None:
            staging = _staged_upload(store, job)
        assert staging is not None
        if not staging.is_dir():
            raise UserError(f"upload {job.staging_id!r} is gone from the checkpoint store")
        stored = _checked_adapter(residency, staging)
        temporary = target.with_name(target.name + ".tmp")
        shutil.rmtree(temporary, ignore_errors=True)
        size = _write_imported(residency, stored, temporary, job)
        if job.max_bytes and size > job.max_bytes:
            shutil.rmtree(temporary, ignore_errors=True)
            raise UserError(
                f"{ADAPTER_WEIGHTS}: the imported checkpoint takes {size} bytes, over the"
                f" {job.max_bytes} bytes the tenant may still store (max_checkpoint_bytes)"
            )
        content_id = uuid.uuid4().hex[:16]
        (temporary / CONTENT_ID_FILE).write_text(content_id)
        shutil.rmtree(target, ignore_errors=True)  # a retried job's earlier result
        os.replace(temporary, target)
        if store is not None:  # a content of its own; the record, written next, commits it
            store_key = checkpoint_key(path, content_id)
            uploaded = store.upload(store_key, target)
            size, digest = uploaded.size_bytes, uploaded.sha256
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if store is not None:
            shutil.rmtree(target.parent, ignore_errors=True)
            store.delete(import_staging_key(job.staging_id))
    now = time.time()
    record = CheckpointRecord(
        run_id=job.model_id,
        tenant_id=job.tenant_id,
        checkpoint_id=path.checkpoint_id,
        kind="weights",
        path=str(path),
        directory="" if store is not None else str(target),
        created_at=now,
        size_bytes=size,
        base_model=residency.files.base_model,
        lora=stored.spec,
        with_optimizer=True,
        user_metadata={"imported": "peft"},
        content_id=content_id,
        store_key=store_key,
        sha256=digest,
    )
    answer = {"path": str(path), "size_bytes": size, "rank": stored.spec.rank}
    return answer, record


def _staged_upload(store: ArtifactStore, job: ImportAdapterJob) -> Path:
    """A local copy of the upload the gateway staged in the store (checked against the
    manifest the gateway wrote last); a `UserError` when it is not there."""
    key = import_staging_key(job.staging_id)
    if not store.exists(key):
        raise UserError(f"upload {job.staging_id!r} is gone from the checkpoint store")
    return store.download(key)


def _write_imported(
    residency: Residency, stored: StoredAdapter, directory: Path, job: ImportAdapterJob
) -> int:
    checkpoint = stored.checkpoint
    # PEFT stores a copy of the base weight beside an adapted lm_head: never ours to keep
    checkpoint.tensors = {
        key: value.contiguous()
        for key, value in checkpoint.tensors.items()
        if not key.endswith(".base_layer.weight")
    }
    checkpoint.spec = stored.spec
    checkpoint.moments = {
        f"{key}.{moment}": torch.zeros_like(value)
        for key, value in checkpoint.tensors.items()
        for moment in MOMENTS
    }
    checkpoint.step = 0
    checkpoint.base_model = residency.files.base_model
    checkpoint.meta = {
        "model_id": job.model_id,
        "seq_id": job.seq_id,
        "base_model": residency.files.base_model,
        "saved_at": time.time(),
        "imported_from": "peft",
    }
    return write_checkpoint(directory, checkpoint, kind="weights", model=residency.files.model)


def export_merged(
    model: MultiSlotModel,
    residency: Residency,
    root: Path,
    job: ExportMergedJob,
    store: ArtifactStore | None = None,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """Write the base model with the checkpoint's adapter merged in (or, with `job.layout`,
    the adapter folder in that layout); the files written (and, in a store, their prefix)."""
    path = parse_path(job.path)
    if store is None:
        source = checkpoint_dir(root, path)
        target = merged_export_dir(root, job.export_id)
    else:
        if not job.content_id:
            raise UserError(f"path: checkpoint {job.path!r} has no content in the artifact store")
        assert data_dir is not None
        source = store.download(checkpoint_key(path, job.content_id))
        target = staging_dir(data_dir, f"export-{job.export_id}") / "files"
    if not source.is_dir():
        raise UserError(f"path: checkpoint {job.path!r} has no files in the checkpoint store")
    try:
        stored = residency.files.read(source, with_optimizer=False)
        temporary = target.with_name(target.name + ".tmp")
        shutil.rmtree(temporary, ignore_errors=True)
        if job.layout is not None:
            write_checkpoint(
                temporary,
                stored.checkpoint,
                kind="sampler_weights",
                model=residency.files.model,
                layout=job.layout,
            )
        else:
            _write_merged(model, stored, temporary)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(temporary, target)
        files = [
            {"name": entry.name, "size": entry.stat().st_size}
            for entry in sorted(target.iterdir())
            if entry.is_file()
        ]
        answer: dict[str, Any] = {"export_id": job.export_id, "files": files, "layout": job.layout}
        if store is not None:
            answer["store_key"] = merged_export_key(job.export_id)
            store.upload(answer["store_key"], target)
    finally:
        if store is not None:
            shutil.rmtree(target.parent, ignore_errors=True)
    return answer


def _write_merged(model: MultiSlotModel, stored: StoredAdapter, directory: Path) -> None:
    base = load_causal_lm(model.base_model, model.dtype)
    try:
        _merge(base, stored)
        base.save_pretrained(directory, safe_serialization=True)
    finally:
        del base
        gc.collect()
    try:
        AutoTokenizer.from_pretrained(model.base_model).save_pretrained(directory)
    except (OSError, ValueError):
        pass  # a base model without a tokenizer: the weights and config are the export


@torch.no_grad()
def _merge(model: torch.nn.Module, stored: StoredAdapter) -> None:
    """`W += alpha/r · B·A` on every adapted linear, computed in fp32."""
    checkpoint = stored.checkpoint
    scale = checkpoint.lora_alpha / checkpoint.rank
    modules = dict(model.named_modules())
    sliced = find_sliced_linears(
        model, [path for path, m in modules.items() if isinstance(m, torch.nn.Linear)]
    )
    # a slice's pair, by where it is kept: (the fused linear, the slice)
    parts = {part_path(p, piece): (p, piece) for p, s in sliced.items() for piece in s.slices}
    config = getattr(model, "config", None)
    for key in checkpoint.tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[len("base_model.model.") : -len(".lora_A.weight")]
        a = checkpoint.tensors[adapter_key(path, "A")]
        b = checkpoint.tensors[adapter_key(path, "B")]
        experts_path, _, projection = path.rpartition(".")
        if projection in EXPERT_PROJECTIONS and path not in modules:
            _merge_experts(modules[experts_path], projection, a, b, scale)
            continue
        if path in parts:  # a slice of a fused linear: its rows only
            fused, piece = parts[path]
            linear = modules[fused]
            assert isinstance(linear, torch.nn.Linear)
            rows = linear.weight.detach()[piece.start : piece.stop]
            rows.copy_((rows.to(torch.float32) + scale * (b @ a)).to(rows.dtype))
            continue
        if path not in modules and _merge_shared(modules[experts_path], projection, a, b, scale):
            continue
        linear = modules[path]
        assert isinstance(linear, torch.nn.Linear)
        if config is not None and linear is _output_embeddings(model) and _tied(model):
            # the merged unembedding differs from the embedding: they no longer share a tensor
            linear.weight = torch.nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
            config.tie_word_embeddings = False
            config.get_text_config().tie_word_embeddings = False
        merged = linear.weight.detach().to(torch.float32) + scale * (b @ a)
        linear.weight.copy_(merged.to(linear.weight.dtype))


def _merge_shared(
    parent: torch.nn.Module, leaf: str, a: torch.Tensor, b: torch.Tensor, scale: float
) -> bool:
    """Merge a pair laid out over several frozen tensors (`workers.engine.shared_bank`): a
    GLU's one pair over gate and up, or a shared-expert bank's; False if `parent.leaf` is
    neither."""
    delta = scale * (b @ a)
    halves: list[tuple[torch.Tensor, torch.Tensor]]
    if leaf == "gate_up_proj" and shares_gate_up_a(parent):
        gate = cast(torch.nn.Linear, parent.gate_proj).weight
        up = cast(torch.nn.Linear, parent.up_proj).weight
        halves = [(gate, delta[: gate.shape[0]]), (up, delta[gate.shape[0] :])]
    elif leaf in BANK_PARAMETERS and (shape := bank_shape(parent)) is not None:
        n, inter, hidden = shape
        weight = cast(torch.Tensor, getattr(parent, leaf))
        if leaf == "down_proj":  # [H, n·I] → [n, H, I]
            halves = [(weight, delta.view(hidden, n, inter).permute(1, 0, 2))]
        else:  # [n·I, H] → [n, I, H]
            halves = [(weight, delta.view(n, inter, hidden))]
    else:
        return False
    for weight, update in halves:
        weight.data.copy_((weight.to(torch.float32) + update).to(weight.dtype))
    return True


def _merge_experts(
    experts: torch.nn.Module, projection: str, a: torch.Tensor, b: torch.Tensor, scale: float
) -> None:
    """`W_e += alpha/r · B_e·A_e` for every expert of a fused block, the shared factor
    broadcast (Tinker's 3-D A `[E or 1, r, in]`, B `[E or 1, out, r]`), in the block's layout."""
    shape = expert_shape(experts)
    if shape is None:
        raise UserError(
            f"{ADAPTER_WEIGHTS}: {projection} targets a block that is not fused experts"
        )
    n = shape.num_experts
    frozen = expert_weights(experts, shape)
    delta = scale * torch.bmm(b.expand(n, -1, -1), a.expand(n, -1, -1))  # [E, out, in]
    if projection == "w2":
        weight = frozen.down
        update = delta.transpose(1, 2) if shape.transposed else delta
    elif not shape.gated:  # up_proj [E, I, H], all of it
        weight, update = frozen.gate_up, delta
    else:
        weight = frozen.gate_up
        rows = weight.transpose(1, 2) if shape.transposed else weight  # [E, 2I, H] view
        first = projection == "w1"  # gate: the first half, or the even rows when interleaved
        if shape.concatenated:
            index = slice(0, shape.intermediate) if first else slice(shape.intermediate, None)
        else:
            index = slice(0, None, 2) if first else slice(1, None, 2)
        part = rows[:, index]
        part.copy_((part.to(torch.float32) + delta).to(part.dtype))
        return
    weight.copy_((weight.to(torch.float32) + update).to(weight.dtype))


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def _tied(model: torch.nn.Module) -> bool:
    output = _output_embeddings(model)
    get_input = getattr(model, "get_input_embeddings", None)
    if output is None or get_input is None:
        return False
    return bool(output.weight is get_input().weight)
