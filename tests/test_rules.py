"""The client-field rules of `protocol/rules.py`: every id and name we hand out passes, and
nothing that could become a KV key, a subject token or a path segment of another meaning does."""

from __future__ import annotations

import math
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import rules, subjects
from protocol.api import AdamParams, LoraConfig
from protocol.errors import UserError
from protocol.paths import parse_path

_SAFE = set(string.ascii_letters + string.digits + "._:-")


@pytest.mark.parametrize(
    "made",
    [
        "sess-0123456789abcdef",
        "sess-0123456789abcdef:train:12",
        "sess-ab:sample:0",
        "req-" + "a" * 32 + "-forward_backward",
    ],
)
def test_every_id_we_hand_out_passes(made: str) -> None:
    assert rules.check_id("id", made) == made


@given(st.text(max_size=200))
def test_an_id_that_passes_is_a_safe_kv_key_and_subject_token(value: str) -> None:
    try:
        rules.check_id("model_id", value)
    except UserError as err:
        assert "model_id" in str(err) and "\n" not in str(err)
        return
    assert value and len(value) <= rules.MAX_ID_CHARS and set(value) <= _SAFE
    assert subjects.untoken(subjects.token(value)) == value


@given(st.text(max_size=300))
def test_a_name_that_passes_is_one_safe_directory_name(name: str) -> None:
    try:
        rules.check_checkpoint_name("path", name)
    except UserError as err:
        assert str(err).startswith("path: ")
        return
    assert name not in (".", "..") and "/" not in name and not name.startswith((".", "-"))
    assert len(name.encode()) <= rules.MAX_NAME_BYTES and name.isascii() and name.isprintable()


@pytest.mark.parametrize(
    "path",
    [
        "tinker://a b/weights/x",
        "tinker://r/weights/../x",
        "tinker://r/weights/a\x00b",
        "tinker://r/weights/" + "\N{GRINNING FACE}" * 40,
        "tinker://r/weights/~",
        "tinker://*/weights/x",
        "twinkle://r/weights/../x",
        "twinkle://*/weights/x",
        "twinkle:/r/weights/x",
        "TWINKLE://r/weights/x",
    ],
)
def test_a_tinker_path_with_an_unsafe_part_is_refused(path: str) -> None:
    with pytest.raises(UserError, match="path"):
        parse_path(path)


def test_a_twinkle_path_names_the_same_checkpoint_as_its_tinker_path() -> None:
    tinker = parse_path("tinker://sess-ab:train:0/weights/epoch-1")
    twinkle = parse_path("twinkle://sess-ab:train:0/weights/epoch-1")
    assert twinkle == tinker and str(twinkle) == "tinker://sess-ab:train:0/weights/epoch-1"
    assert tinker.twinkle_path == "twinkle://sess-ab:train:0/weights/epoch-1"


@pytest.mark.parametrize("seq_id", [None, -1, 0, rules.MAX_SEQ_ID + 1, 2**63])
def test_seq_ids_out_of_range(seq_id: int | None) -> None:
    with pytest.raises(UserError, match="seq_id"):
        rules.check_seq_id("seq_id", seq_id)


def test_a_seq_far_ahead_of_the_model_is_refused() -> None:
    rules.check_seq_ahead("seq_id", 10 + rules.MAX_SEQ_AHEAD, 10)
    with pytest.raises(UserError, match="ahead"):
        rules.check_seq_ahead("seq_id", 11 + rules.MAX_SEQ_AHEAD, 10)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("learning_rate", -1.0),
        ("learning_rate", math.inf),
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("eps", 0.0),
        ("weight_decay", -1.0),
        ("grad_clip_norm", -1.0),
        ("eps", math.nan),
    ],
)
def test_adam_params_no_step_can_use(field: str, value: float) -> None:
    with pytest.raises(UserError, match=f"adam_params.{field}"):
        rules.check_adam(AdamParams(**{field: value}))  # type: ignore[arg-type]


def test_a_huge_but_finite_learning_rate_is_for_the_step_to_judge() -> None:
    rules.check_adam(AdamParams(learning_rate=1e38))


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(rank=0),
        LoraConfig(rank=33),
        LoraConfig(seed=2**64),
        LoraConfig(train_attn=False, train_mlp=False, train_unembed=False),
    ],
)
def test_lora_configs_a_worker_cannot_hold(config: LoraConfig) -> None:
    with pytest.raises(UserError, match="lora_config"):
        rules.check_lora_config(config, max_rank=32)


# -- user metadata and tags: bounded in UTF-8 bytes ------------------------------------------------

_WIDE = "\U0001f600"  # 4 bytes of UTF-8, one character


def test_labels_are_bounded_in_bytes_not_characters() -> None:
    """64 tags and 64 entries of 1024 four-byte characters passed a character count: a 786 KB
    session record, read by every listing and sweep."""
    wide = _WIDE * 1024
    with pytest.raises(UserError, match=r"tags: tag .* is 4093 bytes; .*1024 bytes of UTF-8"):
        rules.check_tags("tags", [f"{i}{wide}"[:1024] for i in range(64)])
    with pytest.raises(UserError, match=r"user_metadata: key .* is 4096 bytes"):
        rules.check_user_metadata("user_metadata", {wide: "v"})
    with pytest.raises(UserError, match=r"user_metadata: the value of 'k' is 4096 bytes"):
        rules.check_user_metadata("user_metadata", {"k": wide})
    # within each entry's cap, the record's total is still bounded
    within = _WIDE * 200  # 800 bytes
    with pytest.raises(UserError, match=r"user_metadata: \d+ bytes in all; .*16 KiB in all"):
        rules.check_user_metadata("user_metadata", {f"{i}": within for i in range(64)})
    with pytest.raises(UserError, match=r"tags: \d+ bytes in all"):
        rules.check_tags("tags", [f"{i}{within}" for i in range(64)])
    # a session's tags and metadata share one budget
    half = {f"{i}": within for i in range(12)}  # ~9.6 KB
    rules.check_user_metadata("user_metadata", half)
    rules.check_tags("tags", [f"{i}{within}" for i in range(12)])
    with pytest.raises(UserError, match=r"tags and user_metadata: \d+ bytes in all"):
        rules.check_session_labels([f"{i}{within}" for i in range(12)], half)


def test_honest_labels_pass_and_read_back_as_strings() -> None:
    tags, metadata = rules.check_session_labels(
        ["cookbook", "rl", "日本語"], {"epoch": 3, "lr": 1e-4, "note": "é" * 500, "ok": True}
    )
    assert tags == ["cookbook", "rl", "日本語"]
    assert metadata == {"epoch": "3", "lr": "0.0001", "note": "é" * 500, "ok": "true"}
    full = {f"key-{i:02d}": "v" * 200 for i in range(64)}  # 64 entries, ~13 KB of ASCII
    assert rules.check_user_metadata("user_metadata", full) == full
    assert rules.check_session_labels([], None) == ([], {})
