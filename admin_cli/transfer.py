"""`twinkle-admin checkpoints export` and `checkpoints import`: adapters out and in, over HTTP.

- `export tinker://... DIR` writes the checkpoint's PEFT folder (`adapter_config.json` +
  `adapter_model.safetensors`, loadable by `peft.PeftModel.from_pretrained` and vLLM); with
  `--merged`, a worker merges the adapter into the base model and DIR gets the whole model
  (safetensors, config, tokenizer) that `transformers` loads. `--layout` chooses how a MoE
  adapter's experts are written: `peft` (PEFT's `target_parameters`, as stored), `per-expert`
  (2-D keys per expert, as tinker-cookbook's `build_lora_adapter` writes them) or `tinker`
  (Tinker's own 3-D tensors, what the cookbook's `build_hf_model` reads); a worker rewrites
  them. Files come down by signed URLs.
- `import DIR --tenant T --name N` uploads a PEFT adapter folder trained anywhere on a served
  base model; it becomes `tinker://<new run>/weights/N` of tenant T, with fresh optimizer state,
  which the tenant loads with `create_training_client_from_state`.

A job a worker runs answers `pending` at first; the command asks again until it is done or
`--timeout` passes. Every failure is one `error: ...` line on stderr and exit 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer

from admin_cli.client import segment
from protocol.paths import ADAPTER_CONFIG, ADAPTER_WEIGHTS

if TYPE_CHECKING:
    from admin_cli.app import Admin

# The wire values of `protocol.jobs.AdapterLayout` (the CLI speaks HTTP only; a test keeps the
# two equal).
AdapterLayout = Literal["peft", "per-expert", "tinker"]


def _fail(message: str, code: int = 1) -> NoReturn:
    from admin_cli.app import fail

    fail(message, code)


def _admin(ctx: typer.Context) -> Admin:
    from admin_cli.app import Admin

    admin = ctx.find_object(Admin)
    assert admin is not None, "the root callback sets the Admin object"
    return admin


def _finished(admin: Admin, answer: Any, timeout_s: float) -> Any:
    """Ask again for a pending transfer until it is done (each ask waits on the gateway)."""
    deadline = time.monotonic() + timeout_s
    while answer.get("state") == "pending":
        if time.monotonic() > deadline:
            _fail(
                f"still running after {timeout_s:.0f} s (request {answer['request_id']});"
                " ask again with a longer --timeout"
            )
        answer = admin.call("GET", f"transfers/{segment(answer['request_id'])}")
    return answer


TimeoutOption = Annotated[
    float, typer.Option("--timeout", min=1, help="seconds to wait for a worker's job")
]


def export(
    ctx: typer.Context,
    tinker_path: Annotated[str, typer.Argument(help="tinker://RUN/KIND/NAME")],
    directory: Annotated[Path, typer.Argument(help="folder to write (created; must be empty)")],
    merged: Annotated[
        bool, typer.Option("--merged", help="the base model with the adapter merged in")
    ] = False,
    layout: Annotated[
        AdapterLayout,
        typer.Option(
            "--layout",
            help="how a MoE adapter's experts are written: peft (target_parameters),"
            " per-expert (experts.{e}.gate_proj ...) or tinker (3-D w1/w2/w3)",
        ),
    ] = "peft",
    timeout_s: TimeoutOption = 900.0,
) -> None:
    """Write a checkpoint as a PEFT adapter folder, or with --merged as a whole model."""
    if merged and layout != "peft":
        raise typer.BadParameter("--layout applies to an adapter export, not with --merged")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise typer.BadParameter(f"{directory} exists and is not an empty folder")
    admin = _admin(ctx)
    body = {"path": tinker_path, "merged": merged, "layout": layout}
    answer = admin.call("POST", "checkpoints/export", body)
    answer = _finished(admin, answer, timeout_s)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in answer["files"]:
        name = Path(entry["name"]).name  # never a path of the gateway's choosing
        url, target = str(entry["url"]), directory / name
        got = admin.use(lambda client: client.fetch(url, target))  # noqa: B023 - called at once
        if got != entry["size"]:
            _fail(f"{name}: received {got} bytes, expected {entry['size']}")
    if "export_id" in answer:  # written for this export by a worker: not kept
        admin.call("DELETE", f"exports/{segment(answer['export_id'])}")
    names = ", ".join(entry["name"] for entry in answer["files"])
    what = "merged model" if merged else f"PEFT adapter ({layout} layout)"
    admin.say(answer, f"exported {tinker_path} as a {what} to {directory}: {names}")


def import_(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(help="a PEFT adapter folder")],
    tenant: Annotated[str, typer.Option("--tenant", help="the tenant that will own it")],
    name: Annotated[str, typer.Option("--name", help="the checkpoint's name")],
    base_model: Annotated[
        str | None,
        typer.Option(
            "--base-model",
            show_default=False,
            help="the served base model (default: the adapter's base_model_name_or_path)",
        ),
    ] = None,
    timeout_s: TimeoutOption = 900.0,
) -> None:
    """Make a PEFT adapter trained elsewhere a tenant's training checkpoint."""
    if not directory.is_dir():
        _fail(f"{directory}: not a folder")
    if not (directory / ADAPTER_CONFIG).is_file():
        _fail(f"{directory / ADAPTER_CONFIG}: missing; a PEFT adapter folder has one")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        legacy = " (adapter_model.bin is not accepted: save with safetensors)"
        found = legacy if (directory / "adapter_model.bin").exists() else ""
        _fail(f"{directory / ADAPTER_WEIGHTS}: missing{found}")
    admin = _admin(ctx)
    files = {n: directory / n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    params: dict[str, str | None] = {"tenant": tenant, "name": name, "base_model": base_model}
    answer = admin.use(lambda client: client.upload("checkpoints/import", files, params))
    answer = _finished(admin, answer, timeout_s)
    admin.say(
        answer,
        f"imported {directory} as {answer['path']} for tenant {answer['tenant']}"
        f" (rank {answer['rank']}, {answer['size_bytes']} bytes)",
    )


def register(checkpoints: typer.Typer) -> None:
    checkpoints.command("export")(export)
    checkpoints.command("import")(import_)
