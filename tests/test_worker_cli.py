"""The worker and sampler command lines: flags and `TWINKLE_*` variables give the same settings,
the defaults are `WorkerSettings`'s, bad input is a usage error, and every flag `twinkle-async up`
passes to its children parses."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from twinkle_async.cli import app
from twinkle_async.up import UpOptions, _commands
from workers import __main__ as worker_main
from workers.sampler import main as sampler_main
from workers.settings import WorkerSettings


@pytest.fixture(autouse=True)
def no_twinkle_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("TWINKLE_"):
            monkeypatch.delenv(key)


def same(settings: WorkerSettings) -> WorkerSettings:
    """Settings with the per-process random worker id blanked, for comparison."""
    return dataclasses.replace(settings, worker_id="")


WORKER_FLAGS = {
    "--base-model": ("TWINKLE_BASE_MODEL", "org/model"),
    "--nats-url": ("TWINKLE_NATS_URL", "nats://nats:4222"),
    "--data-dir": ("TWINKLE_DATA_DIR", "/data"),
    "--max-slots": ("TWINKLE_MAX_SLOTS", "12"),
    "--max-rank": ("TWINKLE_MAX_RANK", "64"),
    "--max-parked": ("TWINKLE_MAX_PARKED", "100"),
    "--device": ("TWINKLE_DEVICE", "cuda"),
    "--threads": ("TWINKLE_TORCH_THREADS", "3"),
    "--shards": ("TWINKLE_SHARDS", "4"),
    "--gap-timeout-s": ("TWINKLE_GAP_TIMEOUT_S", "7.5"),
    "--sampler": ("TWINKLE_SAMPLER", "none"),
    "--metrics-host": ("TWINKLE_METRICS_HOST", "0.0.0.0"),
    "--metrics-port": ("TWINKLE_METRICS_PORT", "9100"),
    "--log-level": ("TWINKLE_LOG_LEVEL", "DEBUG"),
}

SAMPLER_FLAGS = {
    "--base-model": ("TWINKLE_BASE_MODEL", "org/model"),
    "--backend": ("TWINKLE_SAMPLER_BACKEND", "torch"),
    "--nats-url": ("TWINKLE_NATS_URL", "nats://nats:4222"),
    "--data-dir": ("TWINKLE_DATA_DIR", "/data"),
    "--max-lora-rank": ("TWINKLE_MAX_RANK", "16"),
    "--max-loras": ("TWINKLE_MAX_LORAS", "6"),
    "--metrics-host": ("TWINKLE_METRICS_HOST", "0.0.0.0"),
    "--metrics-port": ("TWINKLE_METRICS_PORT", "9101"),
    "--log-level": ("TWINKLE_LOG_LEVEL", "DEBUG"),
}


def test_worker_flags_and_variables_give_the_same_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [part for flag, (_, v) in WORKER_FLAGS.items() for part in (flag, v)]
    from_flags = worker_main.parse_args(argv)
    assert from_flags == WorkerSettings(
        base_model="org/model",
        nats_url="nats://nats:4222",
        data_dir=Path("/data"),
        max_slots=12,
        max_rank=64,
        max_parked=100,
        device="cuda",
        threads=3,
        n_shards=4,
        gap_timeout_s=7.5,
        sampler="",
        metrics_host="0.0.0.0",
        metrics_port=9100,
        log_level="DEBUG",
        worker_id=from_flags.worker_id,
    )
    for name, v in WORKER_FLAGS.values():
        monkeypatch.setenv(name, v)
    assert same(worker_main.parse_args([])) == same(from_flags)
    # a flag wins over its variable
    assert worker_main.parse_args(["--max-slots", "2"]).max_slots == 2


def test_merging_is_on_unless_a_flag_or_variable_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert worker_main.parse_args(["--base-model", "m"]).merge is True
    assert worker_main.parse_args(["--base-model", "m", "--no-merge"]).merge is False
    monkeypatch.setenv("TWINKLE_MERGE", "0")
    assert worker_main.parse_args(["--base-model", "m"]).merge is False
    assert worker_main.parse_args(["--base-model", "m", "--merge"]).merge is True


def test_sampler_flags_and_variables_give_the_same_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [part for flag, (_, v) in SAMPLER_FLAGS.items() for part in (flag, v)]
    from_flags = sampler_main.parse_args(argv)
    assert (from_flags.sampler, from_flags.max_rank, from_flags.max_slots) == ("torch", 16, 6)
    assert (from_flags.metrics_host, from_flags.metrics_port) == ("0.0.0.0", 9101)
    assert "-sampler-" in from_flags.worker_id
    for name, v in SAMPLER_FLAGS.values():
        monkeypatch.setenv(name, v)
    assert same(sampler_main.parse_args([])) == same(from_flags)


def test_defaults_are_the_settings_defaults() -> None:
    parsed = worker_main.parse_args(["--base-model", "m"])
    assert same(parsed) == same(WorkerSettings(base_model="m"))
    assert parsed.max_parked is None and parsed.metrics_port == 0
    sampler = sampler_main.parse_args(["--base-model", "m"])
    assert (sampler.sampler, sampler.max_slots, sampler.max_rank) == ("vllm", 4, 32)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no base model, no TWINKLE_BASE_MODEL
        ["--base-model", "m", "--sampler", "vllm"],
        ["--base-model", "m", "--max-parked", "-1"],
        ["--base-model", "m", "--metrics-port", "x"],
        ["--base-model", "m", "--no-such-flag"],
    ],
)
def test_bad_command_lines_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(typer.TyperException):
        worker_main.parse_args(argv)


@pytest.mark.parametrize(
    ("backend", "devices", "trainer_sampler", "roles"),
    [
        ("torch", 1, "torch", ["trainer"]),
        ("vllm", 1, "", ["trainer", "sampler"]),
        ("none", 1, "", ["trainer"]),
        ("torch", 2, "torch", ["trainer"]),
        ("vllm", 4, "", ["trainer", "sampler"]),
    ],
)
def test_every_flag_up_passes_parses(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    devices: int,
    trainer_sampler: str,
    roles: list[str],
) -> None:
    """Also: only the sampler `up --sampler` names serves the pool's sample jobs (with a vLLM
    sampler the trainer's torch sampler is off: two backends draw different tokens for one seed),
    with one device per trainer or several."""
    seen: list[UpOptions] = []

    async def fake_run_up(options: UpOptions) -> None:
        seen.append(options)

    monkeypatch.setattr("twinkle_async.up.run_up", fake_run_up)
    argv = ["up", "--base-model", "m", "--max-parked", "5", "--threads", "2", "--sampler", backend]
    argv += ["--devices", str(devices)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    (options,) = seen
    parsers = {"workers": worker_main.parse_args, "workers.sampler.main": sampler_main.parse_args}
    commands = _commands("m", "nats://127.0.0.1:4222", options)
    assert [awaited.role for awaited, _ in commands] == roles
    for awaited, command in commands:
        role = awaited.role
        module, args = command[2], command[3:]
        settings = parsers[module](args)
        assert settings.base_model == "m"
        if role == "trainer":
            assert (settings.max_parked, settings.threads) == (5, 2)
            assert (settings.sampler, settings.devices) == (trainer_sampler, devices)
        else:
            assert settings.sampler == backend


def test_up_refuses_an_unknown_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_run_up(options: UpOptions) -> None:
        raise AssertionError("up ran")

    monkeypatch.setattr("twinkle_async.up.run_up", fake_run_up)
    result = CliRunner().invoke(app, ["up", "--base-model", "m", "--sampler", "vlm"])
    assert result.exit_code == 2, result.output


def test_devices_that_cannot_share_a_local_models_experts_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--devices` must divide a MoE model's experts (each rank holds as many): refused by `up`
    and by the worker before anything starts, naming the counts that work."""

    async def fake_run_up(options: UpOptions) -> None:
        raise AssertionError("up ran")

    monkeypatch.setattr("twinkle_async.up.run_up", fake_run_up)
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8}')
    result = CliRunner().invoke(app, ["up", "--base-model", str(model), "--devices", "3"])
    assert result.exit_code == 2, result.output
    assert "8 experts" in result.output and "1, 2, 4, 8" in result.output
    with pytest.raises(typer.BadParameter, match="do not split evenly over 3 devices"):
        worker_main.parse_args(["--base-model", str(model), "--devices", "3"])
    for bad in ("0", "65", "x"):
        with pytest.raises(typer.TyperException):
            worker_main.parse_args(["--base-model", str(model), "--devices", bad])
    assert worker_main.parse_args(["--base-model", str(model), "--devices", "4"]).devices == 4
    # a dense model, or one named by hub id (checked when its engine loads it), takes any count
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    assert worker_main.parse_args(["--base-model", str(model), "--devices", "3"]).devices == 3
    assert worker_main.parse_args(["--base-model", "org/model", "--devices", "3"]).devices == 3
