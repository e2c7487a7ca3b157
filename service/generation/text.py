"""From tokens to the text a client sees: incremental detokenization and stop sequences.

Two things make this more than `decode(token)`. A byte-level token can end in the middle of a
UTF-8 character, so text is released only once it decodes cleanly. And a stop sequence can span
several tokens, so text that could be the start of a stop sequence is held back until the next
tokens say whether it is one; a stop sequence is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_INCOMPLETE = "\ufffd"  # what a decoder gives for a partial UTF-8 character


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text the client may show
    stopped: bool = False  # a stop sequence completed; text ends just before it


class IncrementalDetokenizer:
    """Decodes a growing token sequence into text, a piece at a time.

    It decodes a short window of recent tokens (from `_prefix` on) rather than the whole sequence,
    so a step costs the same at token 10 and at token 1000, while still giving tokenizers whose
    pieces depend on their neighbours (leading spaces, byte fallbacks) the context they need. The
    window grows to WINDOW tokens before it moves up: until then the text it decoded for a release
    is the next token's `_before`, so a token costs one decode, not two (one more per move).
    """

    WINDOW = 8

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are released and out of context
        self._read = 0  # tokens before it have been released as text
        self._before = ""  # the decoding of ids[_prefix:_read], kept: it changes only on release

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        after = self._decoder.decode(self._ids[self._prefix :])
        if len(after) > len(self._before) and not after.endswith(_INCOMPLETE):
            released = after[len(self._before) :]
            last_read, self._read = self._read, len(self._ids)
            if self._read - self._prefix > self.WINDOW:
                # The window moves up to the last release: the tokens released before it are no
                # longer needed as context for decoding what follows.
                self._prefix = last_read
                self._before = self._decoder.decode(self._ids[self._prefix : self._read])
            else:
                self._before = after
            return released
        return ""

    def flush(self) -> str:
        """What is still held at the end (an incomplete character decodes as U+FFFD)."""
        after = self._decoder.decode(self._ids[self._prefix :])
        released = after[len(self._before) :]
        self._prefix = self._read = len(self._ids)
        self._before = ""
        return released


class StopMatcher:
    """Releases text unless it is, or may become, one of the stop sequences."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> TextDelta:
        if not self._stops:
            return TextDelta(text)
        pending = self._held + text
        first = min(
            (i for i in (pending.find(stop) for stop in self._stops) if i >= 0),
            default=-1,
        )
        if first >= 0:
            self._held = ""
            return TextDelta(pending[:first], stopped=True)
        keep = self._longest_partial(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return TextDelta(pending[: len(pending) - keep])

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, text: str) -> int:
        """The length of the longest suffix of text that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class TextStream:
    """Token ids in, releasable text out, for one sequence."""

    def __init__(self, decoder: Decoder, stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(decoder)
        self._stops = StopMatcher(stops)

    def push(self, token_id: int) -> TextDelta:
        return self._stops.feed(self._detokenizer.push(token_id))

    def finish(self) -> str:
        """The rest of the text when the sequence ends for another reason than a stop sequence.
        An incomplete character or a partial stop sequence at the very end is text after all."""
        tail = self._stops.feed(self._detokenizer.flush())
        if tail.stopped:
            return tail.text
        return tail.text + self._stops.flush()
