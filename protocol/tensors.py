"""TensorData codecs: the SDK's protobuf ForwardBackwardRequest in, ForwardBackwardOutput out.

Decoded requests hold numpy arrays (dense, row-major, little-endian); the worker turns them into
torch tensors. Sparse CSR tensors are densified with their pad value (0 for inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DatumArrays:
    """One datum: its input token ids and its `loss_fn_inputs`, dense."""

    tokens: np.ndarray  # int32 [N]: the encoded_text chunks concatenated
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # int64 / float32, shape [N] or [N, K]


@dataclass
class FwdBwdRequest:
    """A decoded `ForwardBackwardRequest` (one chunk of a forward_backward or forward call)."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float | str]  # v2 preferred, legacy numeric map merged under it
    datums: list[DatumArrays]

    @property
    def n_tokens(self) -> int:
        return sum(int(d.tokens.shape[0]) for d in self.datums)
