"""Tinker base models of a family we cannot build are refused by name.

`protocol.rules.UNBUILDABLE_FAMILIES` lists the Tinker models whose family has no model class in
the installed transformers. Through the official SDK and the session's real cluster, creating a
training client of one answers a 400 that names the model and its family (not the answer for a
model merely not served here), and the same client goes on working. The table itself is checked
against the two facts it states: each id is in Tinker's lineup, and each family really has no
class in the installed transformers (a release that gains one fails this test, and the entry
goes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from tinker_cookbook.hyperparam_utils import _LORA_PARAMS_PER_RANK_BY_COMPONENT as PUBLISHED
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from protocol.rules import UNBUILDABLE_FAMILIES
from tests.sdk_helpers import toy_batch, train_steps

KIMI_K3 = "moonshotai/Kimi-K3.1-Pro"


def test_the_table_names_tinker_models_of_families_without_a_class() -> None:
    assert UNBUILDABLE_FAMILIES[KIMI_K3] == "kimi_k3"
    assert set(UNBUILDABLE_FAMILIES) <= set(PUBLISHED)
    assert not set(UNBUILDABLE_FAMILIES.values()) & set(CONFIG_MAPPING_NAMES)


@pytest.mark.e2e
def test_create_model_refuses_an_unbuildable_family_by_name(
    service: tinker.ServiceClient, tiny_model: Path
) -> None:
    with pytest.raises(tinker.BadRequestError) as refused:
        service.create_lora_training_client(base_model=KIMI_K3, rank=4).result()
    message = str(refused.value)
    assert refused.value.status_code == 400
    assert KIMI_K3 in message and "kimi_k3" in message and "no implementation" in message
    assert "not served here" not in message  # not the answer for a model merely not served

    # a model we do not know at all still gets the generic answer
    with pytest.raises(tinker.BadRequestError) as unknown:
        service.create_lora_training_client(base_model="org/no-such-model", rank=4).result()
    assert "not served here" in str(unknown.value) and "family" not in str(unknown.value)

    # the same SDK client's next valid call works
    client = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert len(train_steps(client, toy_batch(n=2), 1)) == 1
