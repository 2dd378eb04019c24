"""Incremental detokenization: a reply's token ids in, final text out, piece by piece, in time
linear in the reply's length, and the pieces add up to exactly the text of the whole reply.

Decoding is not additive: a multi-byte character split across tokens decodes to U+FFFD until
its last byte arrives, a tokenizer's clean-up can change the end of the text when the next
token comes (" ," -> ","), and a SentencePiece token loses its leading space at the start of
a decode. So only a window is decoded: the tokens whose text is not sent yet, after a few
tokens of context (`CONTEXT`). Text is sent once it is stable: the part the window's text
shares with the same window less its last token (a token only changes the text just before
it), without a trailing U+FFFD or the start of a stop string. Stop strings are found in the
sent text's tail plus the unsent text, so one split across steps is found. At the end the
whole reply is decoded once and what was held back is sent.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete multi-byte sequence
CONTEXT = 4  # tokens decoded before the unsent ones: what a merge or a leading space needs


class TextStream:
    """Turns a growing list of token ids into safe text increments."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = ""  # text already handed out
        self.final_text: str | None = None  # set once a stop string is found
        self._longest = max((len(s) for s in stop), default=0)
        self._start = 0  # the window's first token
        self._read = 0  # every token before this one has all its text sent
        self._head = ""  # decode(ids[_start:_read]): the window's context text
        self._shown = 0  # characters of the window's text (decode(ids[_start:])) sent

    @property
    def stopped(self) -> bool:
        return self.final_text is not None

    def push(self, ids: list[int]) -> str:
        """Add token ids; return the new text that can be shown now."""
        self.ids.extend(ids)
        if self.stopped:
            return ""
        window = self._decode(self._start)
        if not window.startswith(self._head):  # a merge reached into the context: wait
            return ""
        hit = self._stop_in(window)
        if hit is not None:
            self.final_text = self.emitted + window[self._shown:hit]
            return self._send(self.final_text[len(self.emitted):], len(window))
        # Without the last token: what the next tokens can no longer change.
        before = self._decode(self._start, len(self.ids) - 1) if len(self.ids) > self._read else ""
        stable = os.path.commonprefix([window, before]) if before else window[:len(self._head)]
        stable = stable.rstrip(REPLACEMENT)
        new = stable[self._shown:]
        if self.stop:  # the start of a stop string waits for the text after it
            new = new[:max(0, len(new) - self._held(self.emitted[-self._longest:] + new))]
        text = self._send(new, self._shown + len(new))
        if self._shown >= len(before) and before and window.startswith(before):
            self._advance(len(self.ids) - 1)  # every token but the last is sent in full
        return text

    def flush(self) -> str:
        """At the end: the text held back (an unfinished stop string, the last token's)."""
        if self.stopped:
            return ""
        final = self.tokenizer.decode(self.ids, skip_special_tokens=True)  # once: linear
        if final.startswith(self.emitted):
            return self._send(final[len(self.emitted):], self._shown)
        # Not reached with the tokenizers tried; the window's text then ends the reply.
        log.warning("streamed text differs from the reply's decoded text")
        return self._send(self._decode(self._start)[self._shown:], self._shown)

    def stop_within(self, ids: list[int]) -> int | None:
        """How many of `ids` (not yet pushed) complete a stop string; None if none does."""
        if not self.stop or not ids or self.stopped:
            return None
        if self._stop_in(self._decode(self._start, extra=ids)) is None:
            return None
        return next(k for k in range(1, len(ids) + 1)
                    if self._stop_in(self._decode(self._start, extra=ids[:k])) is not None)

    def _decode(self, start: int, end: int | None = None, extra: list[int] = ()) -> str:
        window = self.ids[start:end] + list(extra)
        return self.tokenizer.decode(window, skip_special_tokens=True)

    def _send(self, text: str, shown: int) -> str:
        self.emitted += text
        self._shown = shown
        return text

    def _advance(self, read: int) -> None:
        """Tokens before `read` are sent in full: the window starts CONTEXT tokens before."""
        self._read = read
        start = max(0, read - CONTEXT)
        self._head = self._decode(start, read)
        self._start, self._shown = start, len(self._head)

    def _stop_in(self, window: str) -> int | None:
        """Where in `window` (the window's text) the first stop string starts, among those
        ending in its unsent text; None if none does. The sent text holds none."""
        if not self.stop:
            return None
        tail = self.emitted[-(self._longest - 1):] if self._longest > 1 else ""
        text = tail + window[self._shown:]
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        return self._shown + max(0, min(hits) - len(tail)) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
