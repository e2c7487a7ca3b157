"""Tokens to text: incremental detokenization (partial UTF-8) and stop sequences across tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from models import demo_models
from modelyard.service.generation.text import IncrementalDetokenizer, StopMatcher, TextStream
from modelyard.service.generation.tokenizer import TextCodec


class ByteDecoder:
    """Each token is one byte; decoding replaces an incomplete UTF-8 tail with U+FFFD, as a
    byte-level BPE decoder does."""

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(stream: TextStream, text: str) -> tuple[list[str], bool]:
    pieces = []
    for token in tokens(text):
        delta = stream.push(token)
        pieces.append(delta.text)
        if delta.stopped:
            return pieces, True
    pieces.append(stream.finish())
    return pieces, False


def test_multibyte_characters_are_released_whole() -> None:
    detok = IncrementalDetokenizer(ByteDecoder())
    pieces = [detok.push(t) for t in tokens("aé€b")]
    # "é" is 2 bytes and "€" 3: nothing is released until a character is complete.
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    assert detok.flush() == ""


def test_an_incomplete_character_at_the_end_is_flushed() -> None:
    detok = IncrementalDetokenizer(ByteDecoder())
    assert detok.push(tokens("€")[0]) == ""
    assert detok.flush() == "\ufffd"


def test_text_without_stops_is_released_at_once() -> None:
    pieces, stopped = run(TextStream(ByteDecoder(), ()), "hello")
    assert pieces == ["h", "e", "l", "l", "o", ""]
    assert not stopped


def test_a_stop_sequence_spanning_tokens_ends_the_text_before_it() -> None:
    pieces, stopped = run(TextStream(ByteDecoder(), ["\n\ndef"]), "x = 1\n\ndef f():")
    assert stopped
    assert "".join(pieces) == "x = 1"
    # The newlines were held back while they could still become the stop sequence.
    assert pieces[-1] == ""


def test_a_partial_stop_that_does_not_complete_is_released() -> None:
    pieces, stopped = run(TextStream(ByteDecoder(), ["abc"]), "xabxabd")
    assert not stopped
    assert "".join(pieces) == "xabxabd"
    assert pieces[:3] == ["x", "", ""]  # "ab" waits for the next character


def test_a_partial_stop_at_the_very_end_is_text_after_all() -> None:
    pieces, stopped = run(TextStream(ByteDecoder(), ["END"]), "doneEN")
    assert not stopped
    assert "".join(pieces) == "doneEN"


def test_overlapping_prefixes_find_the_earliest_stop() -> None:
    matcher = StopMatcher(["aab", "b"])
    assert matcher.feed("a").text == ""
    assert matcher.feed("a").text == ""
    delta = matcher.feed("ab")
    assert delta.stopped and delta.text == "a"


@pytest.mark.parametrize("stop", ["é", "€!"])
def test_stops_with_multibyte_characters(stop: str) -> None:
    pieces, stopped = run(TextStream(ByteDecoder(), [stop]), f"ab{stop}cd")
    assert stopped and "".join(pieces) == "ab"


class CountingDecoder:
    """The demo model's real tokenizer (byte-level BPE), counting its decode calls."""

    def __init__(self) -> None:
        self.codec = TextCodec.from_file(CODELM_TOKENIZER)
        self.calls = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return self.codec.decode(ids)


CODELM_TOKENIZER = demo_models.COMMITTED_ROOT / "codelm" / "1" / "tokenizer.json"
CODE = 'class Parser:\n    def parse(self, text: str) -> list[str]:\n        """Ünïcode ok €."""\n' * 4


def test_a_real_tokenizers_pieces_add_up_to_its_whole_decoding_at_about_one_decode_per_token() -> None:
    decoder = CountingDecoder()
    ids = decoder.codec.encode(CODE)
    detok = IncrementalDetokenizer(decoder)
    pieces = [detok.push(token) for token in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == decoder.codec.decode(ids) == CODE
    # One decode per token, and one more each time the window moves up (every few tokens).
    assert decoder.calls <= len(ids) * (1 + 1 / (IncrementalDetokenizer.WINDOW - 1)) + 2
