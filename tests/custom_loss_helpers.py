"""Custom losses as the official SDK uploads them, for the tests that check or run them.

`upload` traces a Python loss with the SDK (`trace_loss`, `encode_graph`) and checks it as the
gateway does (`protocol.custom_loss.check_custom_loss`); `unchecked` skips today's checks, as a
worker may receive a loss stored before them. The losses here are the ones more than one test
module runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from protocol import api
from protocol import custom_loss as spec

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def upload_json(fn: LossFn, ranks: dict[str, Any], seq: int = 0) -> dict[str, Any]:
    """The JSON body the SDK posts to create_custom_loss for `fn`."""
    handle = trace_loss(fn, ranks, "sess-1")
    request = types.CreateCustomLossRequest(
        session_id="sess-1",
        custom_loss_seq_id=seq,
        name=handle.name,
        inputs=list(handle.inputs),
        graph=encode_graph(handle),
    )
    body: dict[str, Any] = request.model_dump(mode="json")
    return body


def check(body: dict[str, Any]) -> spec.CustomLoss:
    request = api.decode(json.dumps(body).encode(), api.CreateCustomLossRequest)
    return spec.check_custom_loss("sess-1:loss:0", request.name, request.inputs, request.graph)


def upload(fn: LossFn, ranks: dict[str, Any]) -> spec.CustomLoss:
    return check(upload_json(fn, ranks))


def unchecked(fn: LossFn, ranks: dict[str, Any]) -> spec.CustomLoss:
    """The loss the SDK uploads for `fn`, as a worker may receive it without today's checks
    (one stored before placement keywords were refused)."""
    body = upload_json(fn, ranks)
    request = api.decode(json.dumps(body).encode(), api.CreateCustomLossRequest)
    metrics = list(request.graph.nodes[-1].args[0]["tuple"][1]["dict"])
    return spec.CustomLoss(
        "sess-1:loss:0", request.name, request.inputs, request.graph.nodes, metrics
    )


def scalar_chain(logprobs, weights):  # type: ignore[no-untyped-def]
    x = (logprobs * weights).sum()
    for _ in range(1990):  # 1992 nodes that each produce one element
        x = x * 1.0
    return x, {}


def on_meta(logprobs, weights):  # type: ignore[no-untyped-def]
    nll = -(logprobs * weights).sum()
    return torch.zeros_like(nll, device="meta"), {"custom/nll:sum": nll}
