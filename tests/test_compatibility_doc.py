"""docs/compatibility.md covers the installed SDK: every public call of its four clients, every
sampling option and every loss name appears in the table, and no row is left undecided."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import tinker
from tinker import types

DOC = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
# Plumbing the SDK exposes on its clients that is not a call a user makes of the server.
NOT_CALLS = {"holder", "get_telemetry", "get_console_url", "create", "on_queue_state_change"}


def public_calls(cls: type) -> set[str]:
    return {
        name.removesuffix("_async")
        for name, _ in inspect.getmembers(cls, callable)
        if not name.startswith("_") and name.removesuffix("_async") not in NOT_CALLS
    }


@pytest.mark.parametrize(
    "cls",
    [tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient],
    ids=lambda cls: cls.__name__,
)
def test_every_public_call_of_the_sdk_is_in_the_table(cls: type) -> None:
    text = DOC.read_text()
    missing = sorted(name for name in public_calls(cls) if f"`{name}" not in text)
    assert not missing, f"{cls.__name__} calls missing from {DOC.name}: {missing}"


def test_every_sampling_option_and_loss_is_in_the_table() -> None:
    text = DOC.read_text()
    options = set(types.SampleRequest.model_fields) - {
        "prompt",
        "sampling_session_id",
        "seq_id",
        "base_model",
        "model_path",
        "type",
        "num_samples",
        "sampling_params",
        "prompt_logprobs",
    }
    losses = set(typing.get_args(types.LossFnType))
    missing = sorted(name for name in options | losses if f"`{name}" not in text)
    assert not missing, missing


def test_no_row_is_left_undecided() -> None:
    text = DOC.read_text()
    for marker in ("CHECK", "TODO", "TBD"):
        assert marker not in text, f"{DOC.name} still has a {marker} row"
