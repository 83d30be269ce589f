"""The `twinkle-admin` commands: one per admin route, each a call and a view of its answer.

Global options pick the gateway (`--gateway`, `TWINKLE_GATEWAY`), the admin key (`--admin-key`,
`TWINKLE_ADMIN_KEY`) and the output: `rich` tables for people, or with `--json` the API's JSON
answer alone on stdout. A refused or failed call prints `error: <detail>` as one line on stderr
and exits 1; Typer's usage errors exit 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, RenderableType

from admin_cli import tables
from admin_cli.client import AdminClient, AdminError, segment

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
PIPE_WIDTH = 1000  # a table written to a pipe or a file: whole lines, no id folded
T = TypeVar("T")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Operate a Twinkle Async cluster through its gateway's admin API (/admin/v1).",
)
tenants_app = typer.Typer(no_args_is_help=True, help="Create, list and show tenants.")
keys_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke tenants' API keys.")
quotas_app = typer.Typer(no_args_is_help=True, help="Show and set a tenant's limits.")
runs_app = typer.Typer(
    no_args_is_help=True, help="Training runs: list, show, metrics, unload, delete."
)
checkpoints_app = typer.Typer(
    no_args_is_help=True,
    help="Checkpoints: list, delete, publish, unpublish, expire, export, import.",
)
sessions_app = typer.Typer(no_args_is_help=True, help="Client sessions: list, show.")
prices_app = typer.Typer(
    no_args_is_help=True, help="Show and set the prices usage is costed at, per million tokens."
)
workers_app = typer.Typer(no_args_is_help=True, help="Worker processes and their load.")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(quotas_app, name="quotas")
app.add_typer(runs_app, name="runs")
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(sessions_app, name="sessions")
app.add_typer(prices_app, name="prices")
app.add_typer(workers_app, name="workers")


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, then exit: 1 for a refused or failed call, 2 for a usage error."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@dataclass
class Admin:
    """What the global options chose, and the one client every command of this run uses."""

    gateway: str
    admin_key: str | None
    as_json: bool
    _client: AdminClient | None = field(default=None, repr=False)

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str | None] | None = None,
    ) -> Any:
        return self.use(lambda client: client.call(method, path, body=body, params=params))

    def use(self, action: Callable[[AdminClient], T]) -> T:
        """`action(client)`; a refused or failed call prints one line and exits 1."""
        if not self.admin_key:
            fail("no admin key: pass --admin-key or set TWINKLE_ADMIN_KEY", code=2)
        if self._client is None:
            self._client = AdminClient(self.gateway, self.admin_key)
        try:
            return action(self._client)
        except AdminError as err:
            fail(err.message)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def show(self, answer: Any, view: Callable[[Any], RenderableType]) -> None:
        """The answer as JSON with `--json`, else `view(answer)` for people."""
        if self.as_json:
            typer.echo(json.dumps(answer))
            return
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = PIPE_WIDTH
        console.print(view(answer))

    def say(self, answer: Any, line: str) -> None:
        """The answer as JSON with `--json`, else one line for people."""
        typer.echo(json.dumps(answer) if self.as_json else line)


def _admin(ctx: typer.Context) -> Admin:
    admin = ctx.find_object(Admin)
    assert admin is not None, "the root callback sets the Admin object"
    return admin


@app.callback()
def root(
    ctx: typer.Context,
    gateway: Annotated[
        str, typer.Option(envvar="TWINKLE_GATEWAY", help="the gateway's base URL")
    ] = DEFAULT_GATEWAY,
    admin_key: Annotated[
        str | None,
        typer.Option(
            envvar="TWINKLE_ADMIN_KEY",
            show_default=False,
            help="the key the gateway was started with (--admin-key)",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the API's JSON answer, nothing else")
    ] = False,
) -> None:
    if not gateway.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{gateway!r} is not an http(s):// URL", param_hint="--gateway")
    if admin_key is not None and not (admin_key.isascii() and admin_key.isprintable()):
        raise typer.BadParameter("printable ASCII only", param_hint="--admin-key")
    admin = Admin(gateway=gateway, admin_key=admin_key, as_json=as_json)
    ctx.obj = admin
    ctx.call_on_close(admin.close)


TenantOption = Annotated[str | None, typer.Option("--tenant", help="only this tenant's")]


# -- tenants ------------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="1-63 of a-z 0-9 _ -, starting alphanumeric")],
    display_name: Annotated[str, typer.Option(help="a name for people")] = "",
) -> None:
    """Create a tenant (then give it a key with `keys create --tenant NAME`)."""
    admin = _admin(ctx)
    answer = admin.call("POST", "tenants", {"name": name, "display_name": display_name})
    admin.say(answer, f"created tenant {answer['name']}")


@tenants_app.command("list")
def tenants_list(ctx: typer.Context) -> None:
    """Every tenant: created here, or a bootstrap key's."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "tenants"), tables.tenants)


@tenants_app.command("show")
def tenants_show(ctx: typer.Context, name: str) -> None:
    """A tenant with its limits, usage and keys."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", f"tenants/{segment(name)}"), tables.tenant)


@tenants_app.command("usage")
def tenants_usage(
    ctx: typer.Context,
    name: str,
    days: Annotated[
        int, typer.Option(min=1, max=14, help="UTC days up to today, today included")
    ] = 7,
) -> None:
    """A tenant's tokens and their cost, per day and per training run."""
    admin = _admin(ctx)
    answer = admin.call("GET", f"tenants/{segment(name)}/usage", params={"days": str(days)})
    admin.show(answer, tables.tenant_usage)


# -- keys ---------------------------------------------------------------------------------------


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option("--tenant", help="the tenant the key acts as")],
    label: Annotated[str, typer.Option(help="what the key is for")] = "",
) -> None:
    """Mint an API key for a tenant; the key is printed once and never shown again."""
    admin = _admin(ctx)
    answer = admin.call("POST", "keys", {"tenant": tenant, "label": label})
    if admin.as_json:
        typer.echo(json.dumps(answer))
        return
    labelled = f" ({answer['label']})" if answer.get("label") else ""
    typer.echo(f"created key {answer['key_id']} for tenant {answer['tenant']}{labelled}:")
    typer.echo(answer["key"])
    typer.echo("note: store this key now; it is not shown again.")


@keys_app.command("list")
def keys_list(ctx: typer.Context, tenant: TenantOption = None) -> None:
    """Keys by id, prefix and label (a key itself is never shown after it is created)."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "keys", params={"tenant": tenant}), tables.keys)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke a key: every gateway refuses it from its next call."""
    admin = _admin(ctx)
    answer = admin.call("POST", f"keys/{segment(key_id)}/revoke")
    admin.say(
        answer,
        f"revoked key {answer['key_id']} ({answer['prefix']}..., tenant {answer['tenant']})",
    )


# -- quotas and usage ---------------------------------------------------------------------------


def _limit(help: str) -> Any:
    return typer.Option(min=0, show_default=False, help=help)


@quotas_app.command("show")
def quotas_show(ctx: typer.Context, tenant: str) -> None:
    """A tenant's limits in force, each its own override or the default."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", f"quotas/{segment(tenant)}"), tables.quotas)


@quotas_app.command("set")
def quotas_set(
    ctx: typer.Context,
    tenant: str,
    max_adapters: Annotated[int | None, _limit("adapters (training runs) held at once")] = None,
    max_rank: Annotated[int | None, _limit("largest LoRA rank")] = None,
    max_tokens_per_request: Annotated[
        int | None, _limit("tokens in one forward_backward request")
    ] = None,
    tokens_per_minute: Annotated[
        int | None, _limit("trained tokens a minute; over it, requests queue")
    ] = None,
    max_concurrent_samples: Annotated[int | None, _limit("sample requests in flight")] = None,
    max_checkpoint_bytes: Annotated[int | None, _limit("bytes of checkpoints stored")] = None,
    clear: Annotated[
        list[str] | None,
        typer.Option(help="a limit to reset to the default (repeatable), e.g. max_rank"),
    ] = None,
) -> None:
    """Set some of a tenant's limits; only the limits given are sent."""
    given = {
        "max_adapters": max_adapters,
        "max_rank": max_rank,
        "max_tokens_per_request": max_tokens_per_request,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrent_samples": max_concurrent_samples,
        "max_checkpoint_bytes": max_checkpoint_bytes,
    }
    body: dict[str, int | None] = {k: v for k, v in given.items() if v is not None}
    for raw in clear or []:
        name = raw.replace("-", "_")
        if name not in tables.LIMIT_NAMES:
            raise typer.BadParameter(
                f"{raw!r} is not a limit (one of {', '.join(tables.LIMIT_NAMES)})",
                param_hint="--clear",
            )
        if name in body:
            raise typer.BadParameter(f"{name} is both set and cleared", param_hint="--clear")
        body[name] = None
    if not body:
        raise typer.BadParameter("nothing to change: give a limit or --clear NAME")
    admin = _admin(ctx)
    admin.show(admin.call("PUT", f"quotas/{segment(tenant)}", body), tables.quotas)


@app.command("usage")
def usage(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Argument(help="one tenant (default: all)")] = None,
) -> None:
    """What each tenant trained and sampled, and what it holds now."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "usage", params={"tenant": tenant}), tables.usage)


# -- prices -------------------------------------------------------------------------------------


def _price(kind: str) -> Any:
    return typer.Option(min=0.0, show_default=False, help=f"the price of a million {kind} tokens")


@prices_app.command("show")
def prices_show(ctx: typer.Context) -> None:
    """The prices usage is costed at (all 0 until set)."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "prices"), tables.prices)


@prices_app.command("set")
def prices_set(
    ctx: typer.Context,
    train: Annotated[float | None, _price("trained (forward_backward)")] = None,
    forward: Annotated[float | None, _price("forward-only")] = None,
    sample: Annotated[float | None, _price("sampled")] = None,
    currency: Annotated[
        str | None, typer.Option(show_default=False, help="a code of 1-8 capital letters, e.g. USD")
    ] = None,
) -> None:
    """Set some of the prices; the ones not given keep their value."""
    given: dict[str, float | str | None] = {
        "train": train,
        "forward": forward,
        "sample": sample,
        "currency": currency,
    }
    body = {name: value for name, value in given.items() if value is not None}
    for name, value in body.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise typer.BadParameter(f"{value} is not a finite number", param_hint=f"--{name}")
    if not body:
        raise typer.BadParameter(
            "nothing to change: give --train, --forward, --sample or --currency"
        )
    admin = _admin(ctx)
    admin.show(admin.call("PUT", "prices", body), tables.prices)


# -- runs ---------------------------------------------------------------------------------------


@runs_app.command("list")
def runs_list(ctx: typer.Context, tenant: TenantOption = None) -> None:
    """Training runs, every tenant's or one's."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "runs", params={"tenant": tenant}), tables.runs)


@runs_app.command("show")
def runs_show(ctx: typer.Context, run_id: str) -> None:
    """A run and its checkpoints."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", f"runs/{segment(run_id)}"), tables.run)


@runs_app.command("metrics")
def runs_metrics(ctx: typer.Context, run_id: str) -> None:
    """A run's metric history: each forward_backward's and optim_step's metrics."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", f"runs/{segment(run_id)}/metrics"), tables.run_metrics)


@runs_app.command("unload")
def runs_unload(ctx: typer.Context, run_id: str) -> None:
    """Take a run's adapter off its worker now, its state saved as weights/session-end."""
    admin = _admin(ctx)
    answer = admin.call("POST", f"runs/{segment(run_id)}/unload")
    admin.say(
        answer,
        f"unloading run {answer['run_id']} (request {answer['request_id']});"
        " its state is saved as weights/session-end",
    )


@runs_app.command("delete")
def runs_delete(ctx: typer.Context, run_id: str) -> None:
    """Delete a run and every checkpoint it saved."""
    admin = _admin(ctx)
    answer = admin.call("DELETE", f"runs/{segment(run_id)}")
    admin.say(answer, f"deleted run {answer['deleted']} and {answer['checkpoints']} checkpoint(s)")


# -- checkpoints --------------------------------------------------------------------------------


@checkpoints_app.command("list")
def checkpoints_list(
    ctx: typer.Context,
    tenant: TenantOption = None,
    run: Annotated[str | None, typer.Option("--run", help="only this run's")] = None,
) -> None:
    """Checkpoints, every tenant's or one tenant's or one run's."""
    admin = _admin(ctx)
    answer = admin.call("GET", "checkpoints", params={"tenant": tenant, "run_id": run})
    admin.show(answer, tables.checkpoints)


@checkpoints_app.command("delete")
def checkpoints_delete(ctx: typer.Context, tinker_path: str) -> None:
    """Delete one checkpoint (tinker://RUN/weights/NAME or .../sampler_weights/NAME)."""
    admin = _admin(ctx)
    answer = admin.call("POST", "checkpoints/delete", {"path": tinker_path})
    admin.say(answer, f"deleted {answer['deleted']}")


@checkpoints_app.command("publish")
def checkpoints_publish(ctx: typer.Context, tinker_path: str) -> None:
    """Make a checkpoint public: any tenant may load it."""
    admin = _admin(ctx)
    admin.show(admin.call("POST", "checkpoints/publish", {"path": tinker_path}), tables.checkpoint)


@checkpoints_app.command("unpublish")
def checkpoints_unpublish(ctx: typer.Context, tinker_path: str) -> None:
    """Make a checkpoint private again: only its tenant may load it."""
    admin = _admin(ctx)
    answer = admin.call("POST", "checkpoints/unpublish", {"path": tinker_path})
    admin.show(answer, tables.checkpoint)


def _ttl_s(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        seconds = int(value)
    except ValueError:
        seconds = -1
    if seconds < 0:
        raise typer.BadParameter(f"{value!r}: give whole seconds (>= 0) or none")
    return seconds


@checkpoints_app.command("ttl")
def checkpoints_ttl(
    ctx: typer.Context,
    tinker_path: str,
    seconds: Annotated[
        str, typer.Argument(metavar="SECONDS|none", help="expire this long from now; none: never")
    ],
) -> None:
    """Set when a checkpoint expires, or `none` to keep it."""
    ttl_s = _ttl_s(seconds)
    admin = _admin(ctx)
    answer = admin.call("POST", "checkpoints/ttl", {"path": tinker_path, "ttl_seconds": ttl_s})
    admin.show(answer, tables.checkpoint)


# -- sessions, workers, queues ------------------------------------------------------------------


@sessions_app.command("list")
def sessions_list(ctx: typer.Context, tenant: TenantOption = None) -> None:
    """Client sessions, active and finished."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "sessions", params={"tenant": tenant}), tables.sessions)


@sessions_app.command("show")
def sessions_show(ctx: typer.Context, session_id: str) -> None:
    """A session and the runs it created."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", f"sessions/{segment(session_id)}"), tables.session)


@workers_app.command("list")
def workers_list(ctx: typer.Context) -> None:
    """Every worker: pool, base model, role, slots, queue depth, heartbeat, staleness."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "workers"), tables.workers)


@app.command("queues")
def queues(ctx: typer.Context) -> None:
    """The ops and sample streams, each pool's backlog and every consumer's depths."""
    admin = _admin(ctx)
    admin.show(admin.call("GET", "queues"), tables.queues)


from admin_cli import transfer  # noqa: E402 - registers `checkpoints export` and `import`

transfer.register(checkpoints_app)


def main() -> None:
    app(prog_name="twinkle-admin")
