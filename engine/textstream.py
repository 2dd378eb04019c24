"""Incremental detokenization: emit only text that is final (whole UTF-8 characters and
never a prefix of a stop string)."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decode() yields for an incomplete multi-byte sequence


class TextStream:
    """Turns a growing list of token ids into safe text increments."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = ""  # text already handed out
        self.final_text: str | None = None  # set once a stop string is found

    def push(self, ids: list[int]) -> str:
        """Add token ids; return the new text that can be shown now."""
        self.ids.extend(ids)
        text = self._decode(self.ids)
        cut = self._stop_index(text)
        if cut is not None:
            self.final_text = text[:cut]
            return self._advance(self.final_text)
        text = text.rstrip(REPLACEMENT)
        return self._advance(text[: len(text) - self._held_suffix(text)])

    def flush(self) -> str:
        """At the end: release text held back for a stop string that never completed."""
        if self.final_text is not None:
            return ""
        return self._advance(self._decode(self.ids))

    def stop_within(self, ids: list[int]) -> int | None:
        """How many of `ids` (not yet pushed) complete a stop string; None if none does."""
        if not self.stop or not ids:
            return None
        if self._stop_index(self._decode(self.ids + ids)) is None:
            return None
        return next(k for k in range(1, len(ids) + 1)
                    if self._stop_index(self._decode(self.ids + ids[:k])) is not None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stopped(self) -> bool:
        return self.final_text is not None

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        new = text[len(self.emitted):]
        self.emitted = text
        return new

    def _stop_index(self, text: str) -> int | None:
        # Only the unemitted tail (plus the longest stop string) can hold a new match.
        start = max(0, len(self.emitted) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_suffix(self, text: str) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
