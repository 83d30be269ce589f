"""Target log-probs of the output layer: the fused loss function and the chunked, recomputed
path give what log_softmax and autograd give, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.lora import Segment
from workers.engine.passes import target_logprobs


def _reference(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module) -> torch.Tensor:
    return torch.log_softmax(head(hidden), dim=-1).gather(-1, targets)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 64])
@pytest.mark.parametrize("k", [1, 4])
def test_chunked_logprobs_and_gradients_equal_log_softmax(chunk_tokens: int, k: int) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(13, 16, dtype=torch.float64, requires_grad=True)
    # k > 1 with repeated targets in a row: their gradients add up at one logit
    targets = torch.randint(0, 50, (13, k))
    if k > 1:
        targets[:, 1] = targets[:, 0]
    upstream = torch.randn(13, k, dtype=torch.float64)

    got = target_logprobs(hidden, targets, head, [Segment(-1, 0, 13)], chunk_tokens, recompute=True)
    (grad_got,) = torch.autograd.grad((got * upstream).sum(), hidden)
    want = _reference(hidden, targets, head)
    (grad_want,) = torch.autograd.grad((want * upstream).sum(), hidden)

    assert got.dtype == torch.float32  # logits go to fp32 for the loss
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-5, atol=1e-6)


def test_the_head_weight_gradient_is_the_reference_one() -> None:
    torch.manual_seed(1)
    head = nn.Linear(8, 20, bias=False)
    hidden = torch.randn(10, 8)
    targets = torch.randint(0, 20, (10, 1))

    target_logprobs(hidden, targets, head, [], 4, recompute=True).sum().backward()  # type: ignore[no-untyped-call]
    got = head.weight.grad.clone()  # type: ignore[union-attr]
    head.weight.grad = None
    _reference(hidden, targets, head).sum().backward()  # type: ignore[no-untyped-call]

    torch.testing.assert_close(got, head.weight.grad, rtol=1e-5, atol=1e-6)
