"""compose.yaml checked against the code (no Docker engine needed): the services and their
images, every command and flag exists in our CLIs, configuration is TWINKLE_* only, the
gateway image carries no torch, and NATS is healthy-checked before anything depends on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from twinkle_async.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PASSTHROUGH_ENV = {"OMP_WAIT_POLICY"}


def test_services_and_profiles() -> None:
    assert {"nats", "gateway", "worker"} <= set(SERVICES)
    assert not SERVICES["worker"].get("profiles"), "the CPU worker runs by default"
    for name in ("worker-gpu", "sampler"):
        assert SERVICES[name]["profiles"] == ["gpu"]
    assert set(COMPOSE["volumes"]) >= {"nats-data", "checkpoints"}


def test_nats_is_jetstream_with_a_health_check() -> None:
    nats = SERVICES["nats"]
    assert re.fullmatch(r"nats:2\.1[4-9]-alpine", nats["image"]), (
        "alpine: the health check needs wget"
    )
    assert "/healthz?js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "max_payload: 8388608" in conf
    for name in ("gateway", "worker", "worker-gpu"):
        assert SERVICES[name]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_ports_are_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_configuration_is_twinkle_variables_only() -> None:
    for name, service in SERVICES.items():
        for key in service.get("environment", {}):
            assert key.startswith("TWINKLE_") or key in PASSTHROUGH_ENV, (name, key)


def test_images_build_from_dockerfiles_in_the_repo() -> None:
    for name, service in SERVICES.items():
        build = service.get("build")
        if build is None:
            continue
        dockerfile = ROOT / build["dockerfile"]
        assert dockerfile.exists(), name
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), (dockerfile.name, source)
    gateway = (ROOT / SERVICES["gateway"]["build"]["dockerfile"]).read_text()
    installs = [line for line in gateway.splitlines() if line.startswith("RUN")]
    assert not any("torch" in line for line in installs) and "COPY workers" not in gateway
    pins = [
        line
        for line in (ROOT / "requirements-gateway.txt").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert not any(line.startswith(("torch", "transformers", "vllm")) for line in pins)
    assert SERVICES["sampler"]["image"] == SERVICES["worker-gpu"]["image"]


def _command(name: str) -> list[str]:
    command = SERVICES[name]["command"]
    assert command[0] == "twinkle-async", name
    return [re.sub(r"\$\{[^}]*\}", "x", part) for part in command[1:]]


def test_gateway_command_and_flags_exist() -> None:
    args = _command("gateway")
    assert args[0] == "gateway"
    help_text = CliRunner().invoke(app, ["gateway", "--help"], terminal_width=200).output
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, flag


@pytest.mark.parametrize("name", ["worker", "worker-gpu", "sampler"])
def test_worker_commands_parse(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import __main__ as worker_main
    from workers import sampler_main

    for key, value in SERVICES[name]["environment"].items():
        monkeypatch.setenv(key, re.sub(r"\$\{[^}]*\}", "x", str(value)))
    args = _command(name)
    assert args[0] in {c.name for c in app.registered_commands} | {"worker", "sampler"}
    parser = worker_main.parse_args if args[0] == "worker" else sampler_main.parse_args
    parsed = parser(args[1:])
    assert parsed.base_model == "x"
    assert parsed.nats_url == "nats://nats:4222"
