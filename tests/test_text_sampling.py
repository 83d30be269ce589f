"""Samples of a text prompt (`protocol.text_sampling`): the answer's text, stops cut off."""

from __future__ import annotations

import pytest

from protocol.errors import UserError
from protocol.jobs import TextPrompt
from protocol.sampling import SampledSequence, SampleOutput
from protocol.text_sampling import answer, check_prompt, decode_answer, prompt_tokens

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _decode(tokens: list[int]) -> str:
    return "".join(LETTERS[t % 26] for t in tokens)


def test_each_sequence_answers_its_text_with_a_stop_string_cut_off() -> None:
    output = SampleOutput(
        sequences=[
            SampledSequence([0, 1, 2, 3], [-0.1, -0.2, -0.3, -0.4], "stop"),
            SampledSequence([4, 5], [-1.0, -2.0], "length", [[(4, -1.0), (9, -3.0)], [(5, -2.0)]]),
        ]
    )
    got = decode_answer(answer(output, 7, ("cd",), _decode))
    assert got.prompt_tokens == 7
    first, second = got.sequences
    assert (first.text, first.finish_reason, first.token_texts) == ("ab", "stop", list("abcd"))
    assert second.text == "ef" and second.finish_reason == "length"  # "length": never cut
    assert second.top == [[("e", -1.0), ("j", -3.0)], [("f", -2.0)]]


def test_a_prompt_is_text_or_messages_bounded() -> None:
    assert prompt_tokens(TextPrompt(text="ab"), lambda t: [len(t)], lambda m: [0]) == [2]
    chat = TextPrompt(messages=[{"role": "user", "content": "x"}])
    assert prompt_tokens(chat, lambda t: [1], lambda m: [len(m), 9]) == [1, 9]
    for bad in (
        TextPrompt(),
        TextPrompt(text=""),
        TextPrompt(text="x", messages=[]),
        TextPrompt(messages=[]),
        TextPrompt(text="x" * (2 << 20)),
    ):
        with pytest.raises(UserError):
            check_prompt(bad)


def test_streamed_text_sends_only_what_cannot_change() -> None:
    from protocol.text_sampling import ReceivedText, StreamedText, TextProgress

    streamed = StreamedText(["STOP"])
    assert streamed.update({0: "hello"}) == [(0, 0, "he")]  # "llo" could begin "STOP"
    assert streamed.update({0: "hello wor"}) == [(0, 2, "llo ")]
    assert streamed.update({0: "hello wor"}) == []  # nothing new
    assert streamed.update({0: "hello world"}) == [(0, 6, "wo")]
    assert streamed.update({0: "hello world!STOP and on", 1: "x"}) == [(0, 8, "rld!")]
    assert streamed.update({0: "hello world!STOP and on and on"}) == []  # past its stop
    assert streamed.closed == {0}
    plain = StreamedText([])
    assert plain.update({0: "ab", 1: "c"}) == [(0, 0, "ab"), (1, 0, "c")]
    assert plain.update({0: "ab\ufffd\ufffd"}) == []

    received = ReceivedText()
    assert received.add(TextProgress(rows=[(0, 0, "he"), (1, 0, "x")])) == [(0, "he"), (1, "x")]
    assert received.add(TextProgress(rows=[(0, 6, "wo")])) == []  # one before it was lost
    assert received.add(TextProgress(rows=[(0, 2, "llo ")])) == [(0, "llo ")]
    assert received.rest(0, "hello world!") == "world!"
    assert received.rest(1, "x") == ""
    assert received.rest(2, "new") == "new"
    assert received.rest(0, "something else") == ""  # never sends text twice
