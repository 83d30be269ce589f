"""Samples of a text prompt (`jobs.TextPrompt`, the OpenAI-compatible routes): the sampler
tokenizes the prompt, samples as for any `asample`, and answers each sequence's text.

The answer (`TextAnswer`, JSON) carries per sequence its text (special tokens dropped, a stop
string that ended it cut off, as OpenAI's API does), its tokens, each token's logprob and, when
asked, each position's top alternatives as text.

A streamed prompt's sampler also publishes, while it generates, the text each sequence has so
far (`TextProgress`, core NATS: a lost message is made good by the next or by the answer). It
sends only text that cannot change: never past a stop string, never the last characters that
could still begin one, never a character whose bytes are not all drawn yet (`StreamedText`).
The gateway appends what continues what it has sent (`ReceivedText`), and the answer's text
gives the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from protocol import api
from protocol.errors import UserError
from protocol.jobs import TextPrompt
from protocol.sampling import SampleOutput

MAX_TEXT = 1 << 20  # characters of a prompt, all messages together
MAX_MESSAGES = 1024


class TextSequence(msgspec.Struct, frozen=True):
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    token_texts: list[str] = []  # each token's own text
    top: list[list[tuple[str, float]]] | None = None


class TextAnswer(msgspec.Struct, frozen=True):
    prompt_tokens: int
    sequences: list[TextSequence]


def prompt_tokens(
    prompt: TextPrompt,
    encode: Callable[[str], list[int]],
    chat: Callable[[list[dict[str, str]]], list[int]],
) -> list[int]:
    """The prompt's token ids: `text` encoded, or `messages` through the chat template."""
    if prompt.messages is not None:
        return chat(prompt.messages)
    return encode(prompt.text or "")


def with_prompt(body: api.SampleRequest, tokens: list[int]) -> api.SampleRequest:
    return msgspec.structs.replace(
        body, prompt=api.ModelInput(chunks=[api.EncodedTextChunk(tokens=tokens)])
    )


def answer(
    output: SampleOutput,
    prompt_len: int,
    stops: Sequence[str],
    decode: Callable[[list[int]], str],
) -> bytes:
    sequences = []
    for seq in output.sequences:
        text = decode(seq.tokens)
        if seq.stop_reason == "stop":
            for stop in stops:
                cut = text.find(stop)
                if cut >= 0:
                    text = text[:cut]
                    break
        top = None
        if seq.topk_logprobs is not None:
            top = [[(decode([token]), lp) for token, lp in row] for row in seq.topk_logprobs]
        sequences.append(
            TextSequence(
                text=text,
                tokens=list(seq.tokens),
                logprobs=[float(v) for v in seq.logprobs],
                finish_reason=seq.stop_reason,
                token_texts=[decode([token]) for token in seq.tokens],
                top=top,
            )
        )
    return msgspec.json.encode(TextAnswer(prompt_tokens=prompt_len, sequences=sequences))


def decode_answer(payload: bytes) -> TextAnswer:
    return msgspec.json.decode(payload, type=TextAnswer)


def check_prompt(prompt: TextPrompt) -> TextPrompt:
    """A text or a chat of text messages, bounded."""
    if (prompt.text is None) == (prompt.messages is None):
        raise UserError("prompt: a text or chat messages")
    if prompt.messages is not None:
        if not 1 <= len(prompt.messages) <= MAX_MESSAGES:
            raise UserError(f"messages: 1..{MAX_MESSAGES} messages")
        total = sum(len(m.get("content", "")) for m in prompt.messages)
    else:
        total = len(prompt.text or "")
        if not total:
            raise UserError("prompt: empty")
    if total > MAX_TEXT:
        raise UserError(f"prompt: {total} characters, over {MAX_TEXT}")
    return prompt


class TextProgress(msgspec.Struct, frozen=True):
    """Text that sequences of a streamed sample gained: (sample index, the offset in the
    sequence's text it starts at, the text)."""

    rows: list[tuple[int, int, str]]


class StreamedText:
    """The sampler's side: the text of each sequence that is safe to send, and what was sent."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.sent: dict[int, str] = {}
        self.closed: set[int] = set()  # sequences that reached a stop string

    def update(self, texts: dict[int, str]) -> list[tuple[int, int, str]]:
        """What each sequence gained since the last update, from its whole text so far."""
        gained = []
        for index, text in sorted(texts.items()):
            if index in self.closed:
                continue
            cuts = [cut for cut in (text.find(stop) for stop in self.stops) if cut >= 0]
            if cuts:
                safe = text[: min(cuts)]
                self.closed.add(index)
            else:
                safe = text[: len(text) - self.hold] if self.hold else text
            safe = safe.rstrip("\ufffd")  # a character still missing bytes
            sent = self.sent.get(index, "")
            if len(safe) > len(sent) and safe.startswith(sent):
                gained.append((index, len(sent), safe[len(sent) :]))
                self.sent[index] = safe
        return gained


class ReceivedText:
    """The gateway's side: the text sent to the client for each sequence."""

    def __init__(self) -> None:
        self.sent: dict[int, str] = {}

    def add(self, progress: TextProgress) -> list[tuple[int, str]]:
        """The (index, text) pieces that continue what was sent; the rest is dropped (a
        message lost or late: the answer makes it good)."""
        pieces = []
        for index, offset, text in progress.rows:
            sent = self.sent.get(index, "")
            if offset == len(sent) and text:
                self.sent[index] = sent + text
                pieces.append((index, text))
        return pieces

    def rest(self, index: int, final: str) -> str:
        """What the sequence's final text adds to what was sent."""
        sent = self.sent.get(index, "")
        return final[len(sent) :] if final.startswith(sent) else ""
