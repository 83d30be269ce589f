"""A raw HTTP client speaking the SDK's wire format, for what the SDK will not send on purpose:
duplicate submits, malformed bodies, unknown ids. Bodies are built with the SDK's own types
and protobuf conversion."""

from __future__ import annotations

import time
from typing import Any

import httpx
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output


class Wire:
    def __init__(self, base_url: str, api_key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}, timeout=60.0)

    def close(self) -> None:
        self.http.close()

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        if body is not None:
            kwargs["json"] = body
        return self.http.post(f"/api/v1/{path}", **kwargs)

    def session(self) -> str:
        resp = self.post(
            "create_session",
            {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        )
        resp.raise_for_status()
        return str(resp.json()["session_id"])

    def create_model(
        self, session_id: str, base_model: str, seq: int = 0, rank: int = 8, seed: int = 0
    ) -> str:
        resp = self.post(
            "create_model",
            {
                "session_id": session_id,
                "model_seq_id": seq,
                "base_model": base_model,
                "lora_config": {
                    "rank": rank,
                    "seed": seed,
                    "train_unembed": True,
                    "train_mlp": True,
                    "train_attn": True,
                },
                "type": "create_model",
            },
        )
        resp.raise_for_status()
        self.result(resp.json()["request_id"])
        return str(resp.json()["model_id"])

    def fwdbwd_body(
        self,
        model_id: str,
        seq_id: int,
        data: list[types.Datum],
        loss_fn: str = "cross_entropy",
        forward_only: bool = False,
    ) -> bytes:
        request = types.ForwardBackwardRequest(
            model_id=model_id,
            seq_id=seq_id,
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        )
        msg = forward_backward_request_to_proto(request)
        msg.loss_fn = loss_fn
        msg.forward_only = forward_only
        return msg.SerializeToString()

    def forward_backward(self, body: bytes) -> httpx.Response:
        return self.post(
            "forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
        )

    def optim_step(self, model_id: str, seq_id: int, lr: float = 1e-2) -> httpx.Response:
        return self.post(
            "optim_step",
            {
                "model_id": model_id,
                "seq_id": seq_id,
                "type": "optim_step",
                "adam_params": {
                    "learning_rate": lr,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-12,
                    "weight_decay": 0.0,
                    "grad_clip_norm": 0.0,
                },
            },
        )

    def result(self, request_id: str, timeout_s: float = 120.0) -> httpx.Response:
        """Poll until the future is no longer pending; return the final response."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            resp = self.post(
                "retrieve_future",
                {"request_id": request_id, "allow_metadata_only": False},
                # as SDK 0.38 asks for a ForwardBackwardOutput or a SampleResponse (any other
                # answer is JSON whatever it asks)
                headers={"Accept": "application/x-protobuf"},
            )
            if (
                resp.headers.get("content-type", "").startswith("application/json")
                and resp.json().get("type") == "try_again"
            ):
                continue
            return resp
        raise TimeoutError(request_id)

    @staticmethod
    def fwdbwd_output(resp: httpx.Response) -> types.ForwardBackwardOutput:
        assert resp.headers["content-type"].startswith("application/x-protobuf"), resp.text
        return deserialize_forward_backward_output(resp.content)


__all__ = ["Wire", "public_pb"]
