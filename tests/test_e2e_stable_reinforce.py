"""`stable_reinforce` through the official SDK and a real cluster (torch sampler in the trainer).

A sampling client made with `record_stability_info=True` has each sequence recorded; training
datums name their sequences through provenance spans; the server trains with the recorded
sampler log-probs, whatever the client sends as `logprobs`. On-policy it equals
importance_sampling step for step; off-policy its loss is the truncated formula of
docs/compatibility.md, checked here against an independent evaluation; bad provenance (another
tenant's sequence, a tampered token, an advantage on a prompt token, no spans) is a user error
that leaves the client training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import OTHER_TENANT_KEY, Cluster
from tests.sdk_helpers import toy_batch, train_steps

pytestmark = pytest.mark.e2e

PROMPT = [7, 19, 23, 42, 101, 7]
TRUNCATION = 2.0


def sample(client: tinker.TrainingClient, n: int, seed: int) -> list[types.SampledSequence]:
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    response = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        n,
        types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[]),
    ).result()
    assert all(seq.sequence_id for seq in response.sequences)
    return list(response.sequences)


def rl_datum(
    seq: types.SampledSequence, advantage: float, sent_logprobs: list[float] | None = None
) -> types.Datum:
    """The cookbook's layout: input = prompt + all but the last sampled token, targets shifted
    by one, advantages on sampled positions only; provenance as `rl_loop.py` writes it."""
    full = PROMPT + list(seq.tokens)
    n_prompt = len(PROMPT) - 1
    q = sent_logprobs if sent_logprobs is not None else [0.0] * n_prompt + list(seq.logprobs)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": q,
            "advantages": [0.0] * n_prompt + [advantage] * len(seq.tokens),
        },
    )
    assert seq.sequence_id is not None
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
        ],
    )


def logprobs_of(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def truncated_loss(data: list[types.Datum], out: types.ForwardBackwardOutput) -> tuple[float, int]:
    """The loss the formula gives on the returned logprobs, evaluated here independently
    (Σ −min(exp(lp − q), C)·A, q the sampler's logprobs), and how many tokens were truncated."""
    expected, truncated = 0.0, 0
    for datum, lp in zip(data, logprobs_of(out), strict=True):
        q = np.asarray(datum.loss_fn_inputs["logprobs"].data, dtype=np.float64)
        adv = np.asarray(datum.loss_fn_inputs["advantages"].data, dtype=np.float64)
        ratio = np.where(adv != 0, np.exp(lp - q), 1.0)
        truncated += int(np.sum(ratio > TRUNCATION))
        expected += float(np.sum(-np.minimum(ratio, TRUNCATION) * adv))
    return expected, truncated


def test_on_policy_it_trains_as_importance_sampling_with_the_recorded_logprobs(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    ours = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=4).result()
    twin = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=4).result()
    seqs = sample(ours, 4, seed=11)
    advantages = [1.0, -0.5, 0.75, -1.0]
    # The client sends garbage as `logprobs`: the server uses what it recorded.
    garbage = [[-30.0] * (len(PROMPT) - 1 + len(s.tokens)) for s in seqs]
    data = [rl_datum(s, a, g) for s, a, g in zip(seqs, advantages, garbage, strict=True)]
    reference = [rl_datum(s, a) for s, a in zip(seqs, advantages, strict=True)]
    reference = [
        types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in reference
    ]
    for _ in range(3):
        got = ours.forward_backward(data, "stable_reinforce").result()
        want = twin.forward_backward(reference, "importance_sampling").result()
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=1e-5)
        for a, b, datum in zip(logprobs_of(got), logprobs_of(want), reference, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
            q = np.asarray(datum.loss_fn_inputs["logprobs"].data, dtype=np.float64)
            assert np.all(np.exp(a - q)[len(PROMPT) - 1 :] < TRUNCATION)  # still near-policy
        # Small steps keep the data near-policy (r < 2), where both losses agree.
        ours.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        twin.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def test_off_policy_the_importance_weight_is_truncated(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=5
    ).result()
    seqs = sample(client, 3, seed=12)
    # Move the policy towards the sampled tokens, so the learner's log-probs rise far above
    # the sampler's (r > 2 on many tokens).
    sft = [
        types.Datum(
            model_input=types.ModelInput.from_ints((PROMPT + list(s.tokens))[:-1]),
            loss_fn_inputs={"target_tokens": (PROMPT + list(s.tokens))[1:]},
        )
        for s in seqs
    ]
    train_steps(client, sft, 6, lr=3e-2)
    data = [rl_datum(s, a) for s, a in zip(seqs, [1.0, -2.0, 0.5], strict=True)]
    out = client.forward_backward(data, "stable_reinforce").result()
    expected, truncated = truncated_loss(data, out)
    assert truncated >= 3, "the policy did not move far enough for the test to mean anything"
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_bad_provenance_is_a_user_error_and_the_client_keeps_training(
    cluster: Cluster, service: tinker.ServiceClient, tiny_model: Path
) -> None:
    from tinker.types.request_error_category import RequestErrorCategory

    client = service.create_lora_training_client(
        base_model=str(tiny_model), rank=8, seed=6
    ).result()
    seq = sample(client, 1, seed=13)[0]
    good = rl_datum(seq, 1.0)

    other = tinker.ServiceClient(base_url=cluster.base_url, api_key=OTHER_TENANT_KEY)
    try:
        thief = other.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
        with pytest.raises(tinker.BadRequestError) as foreign:
            thief.forward_backward([good], "stable_reinforce").result()
        assert "no stability record" in str(foreign.value)
    finally:
        other.close("success").result()

    no_spans = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
    with pytest.raises(tinker.BadRequestError) as missing:
        client.forward_backward([no_spans], "stable_reinforce").result()
    assert "needs provenance on every datum" in str(missing.value)

    targets = list(good.loss_fn_inputs["target_tokens"].data)
    targets[-1] = (int(targets[-1]) + 1) % 200
    tampered = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": targets},
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    with pytest.raises(tinker.RequestFailedError) as differ:
        client.forward_backward([tampered], "stable_reinforce").result()
    assert differ.value.category == RequestErrorCategory.User
    assert "differ from the tokens" in str(differ.value)

    advantages = list(good.loss_fn_inputs["advantages"].data)
    advantages[0] = 1.0  # a prompt position
    on_prompt = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "advantages": advantages},
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    with pytest.raises(tinker.RequestFailedError) as stray:
        client.forward_backward([on_prompt], "stable_reinforce").result()
    assert "not a sampled token" in str(stray.value)

    assert client.forward_backward([good], "stable_reinforce").result().metrics["loss:sum"]
    assert train_steps(client, toy_batch(n=2), 1)


def test_the_vllm_sampler_records_stability_info_too(
    vllm_cluster: Cluster, tiny_model: Path
) -> None:
    service = tinker.ServiceClient(base_url=vllm_cluster.base_url, api_key=vllm_cluster.api_key)
    try:
        client = service.create_lora_training_client(
            base_model=str(tiny_model), rank=8, seed=7, train_unembed=False
        ).result()
        seqs = sample(client, 2, seed=14)
        data = [rl_datum(s, a) for s, a in zip(seqs, [1.0, -1.0], strict=True)]
        out = client.forward_backward(data, "stable_reinforce").result()
        expected, _ = truncated_loss(data, out)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    finally:
        service.close("success").result()
