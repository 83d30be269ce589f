"""Spending a seq: the one request that owns `(model_id or sampling session, seq_id)`.

A client numbers its calls (a training model's `seq_id`, a sampling client's `seq_id`), and the
gateway spends a training model's next seq itself when it unloads a finished session's model.
Each of them claims the seq in `tw_futures` (`FutureStore.claim`) with its request type and a
digest of what it sends:

- the first claim owns the seq, under a new request id;
- a genuine retry (same type, same digest) gets that first request id back, so it is not run
  twice;
- anything else reusing the seq is a `SeqTaken`, a 400 naming the call that owns it.

The claim is what makes a retry a retry, so every submit path spends its seq here, the same way.
"""

from __future__ import annotations

from protocol.errors import UserError
from protocol.jobs import SeqClaim
from twinkle_async.futures import FutureStore, new_request_id


class SeqTaken(UserError):
    """A different call reused a seq another request owns; `claim` is the owner's."""

    def __init__(self, message: str, claim: SeqClaim) -> None:
        super().__init__(message)
        self.claim = claim


async def claim_seq(
    futures: FutureStore,
    owner: str,
    seq_id: int,
    request_type: str,
    digest: str,
    *,
    named: str,
    field: str = "seq_id",
) -> tuple[SeqClaim, bool]:
    """Claim `(owner, seq_id)` for a `request_type` call whose body has `digest`.

    Returns the claim that owns the seq and whether it is this call's own (False: a retry,
    answered with the first request id and not charged again). `named` is how the error names
    the owner (`model 'm'`, `sampling session 's'`); `field` is the body field holding the seq.
    """
    mine = SeqClaim(
        request_id=new_request_id(request_type), request_type=request_type, digest=digest
    )
    claim = await futures.claim(owner, seq_id, mine)
    if claim.request_type != request_type or claim.digest != digest:
        raise SeqTaken(
            f"{field}: {seq_id} of {named} was already used by another {claim.request_type}"
            f" call (request {claim.request_id}); each call takes the next {field}",
            claim,
        )
    return claim, claim == mine
