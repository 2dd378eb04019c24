"""Streaming text (engine/decode/textstream.py): the pieces add up to exactly the text of the whole
reply when decoding is not additive (multi-byte characters split across tokens, a clean-up
that merges a token into the one before, SentencePiece's leading spaces), stop strings are
found across pieces, and the work is linear in the reply's length."""

from __future__ import annotations

import random

from engine.decode.textstream import TextStream


class PieceTokenizer:
    """Token i decodes to PIECES[i]'s bytes; decoding joins them as UTF-8 and then, like a
    tokenizer's clean-up of spaces, drops a space before punctuation, and, like SentencePiece,
    turns "_" into a space and drops the first one of a decode. A token's text can then
    change when the next one arrives (" " then ","), and a window decoded alone differs from
    the same tokens in context."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.decoded = 0  # tokens decoded so far, over every call

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        text = text.replace("_", " ")
        text = text[1:] if text.startswith(" ") else text
        for mark in ",.!?":
            text = text.replace(f" {mark}", mark)
        return text


def tokens_of(text: str) -> tuple[PieceTokenizer, list[int]]:
    """`text` cut into tokens at awkward places: inside multi-byte characters, and always
    before punctuation (so a "_" ends the token before it: its space is dropped only once
    the punctuation arrives)."""
    rng = random.Random(len(text))
    data, pieces, at = text.encode("utf-8"), [], 0
    while at < len(data):
        size = rng.choice([1, 1, 2, 3, 5])
        mark = next((i for i in range(at + 1, at + size) if data[i:i + 1] in b",.!?"), None)
        end = at + size if mark is None else mark
        pieces.append(data[at:end])
        at = end
    return PieceTokenizer(pieces), list(range(len(pieces)))


TEXT = "_Grüße_👋_from_東京_,_naïve_café_._Done_!" + "_😀" * 3 + "_?"


def stream(tokenizer, ids, stop=(), chunks=(1,), seed=0):
    """Push `ids` in chunks of the given sizes (chosen at random), then flush: the pieces."""
    rng = random.Random(seed)
    s = TextStream(tokenizer, stop)
    pieces, at = [], 0
    while at < len(ids) and not s.stopped:
        size = rng.choice(chunks)
        pieces.append(s.push(ids[at:at + size]))
        at += size
    pieces.append(s.flush())
    return pieces, s


def test_a_reply_that_is_not_a_prefix_extension_streams_exactly_its_final_text():
    tokenizer, ids = tokens_of(TEXT)
    final = tokenizer.decode(ids)
    # the case the stream must handle: the text so far is not the start of the final text
    assert any(not final.startswith(tokenizer.decode(ids[:k])) for k in range(1, len(ids)))
    for chunks in ((1,), (2,), (1, 3, 4)):
        for seed in range(3):
            pieces, s = stream(tokenizer, ids, chunks=chunks, seed=seed)
            assert "".join(pieces) == final == s.emitted
            assert not any("\ufffd" in p for p in pieces)
            assert sum(map(len, pieces[:-1])) > len(final) // 2  # it streamed, not only at the end


def test_the_bundled_tokenizer_streams_exactly_its_text(bundled_tokenizer):
    """Byte-level BPE: emoji and CJK characters whose bytes span several tokens."""
    text = "Grüße 👋🏽 from 東京都, naïve café — ½ ≠ ∞. 😀😃😄 done."
    ids = bundled_tokenizer.encode(text, add_special_tokens=False)
    final = bundled_tokenizer.decode(ids, skip_special_tokens=True)
    assert any(bundled_tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))
    for chunks in ((1,), (1, 2, 5)):
        pieces, _s = stream(bundled_tokenizer, ids, chunks=chunks)
        assert "".join(pieces) == final
        assert not any("\ufffd" in p for p in pieces)


def test_stop_strings_are_found_across_pieces():
    tokenizer, ids = tokens_of(TEXT)
    final = tokenizer.decode(ids)
    for stop in ("東京,", "café. Done", "! "):
        for chunks in ((1,), (1, 3)):
            pieces, s = stream(tokenizer, ids, stop=(stop, "never there"), chunks=chunks)
            assert "".join(pieces) == final[:final.index(stop)] == s.final_text
            assert s.stopped and not any(stop[:-1] in p for p in pieces if len(stop) > 2)


def test_stop_within_counts_the_tokens_that_complete_a_stop_string():
    tokenizer, ids = tokens_of(TEXT)
    final = tokenizer.decode(ids)
    stop = "naïve"
    end = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[:k + 1]))
    s = TextStream(tokenizer, (stop,))
    s.push(ids[:end - 3])
    assert s.stop_within(ids[end - 3:end - 1]) is None
    assert s.stop_within(ids[end - 3:end + 4]) == 4  # the 4th of these completes it
    assert final.index(stop) > 0


def test_streaming_is_linear_in_the_reply_length():
    tokenizer, ids = tokens_of(TEXT * 60)  # ~3,000 tokens
    pieces, _s = stream(tokenizer, ids, stop=("not in it",), chunks=(1, 2, 4))
    assert "".join(pieces) == tokenizer.decode(ids)
    # every push decodes a window of a few tokens: a bounded number of tokens per token
    # (re-decoding the reply each step would be ~len(ids) / 2 per token)
    assert tokenizer.decoded < 40 * len(ids)
