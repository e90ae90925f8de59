"""Incremental detokenization with stop strings: generated token ids become text deltas;
the engine (``SamplingParams.stop``) and the server's streams share this one matcher."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Turns generated token ids into text deltas, incrementally.

    Each token decodes only a short window of recent ids (from the last emitted point),
    so a long output costs O(tokens), not O(tokens^2). A token whose text ends in an
    incomplete character (U+FFFD) is held back, but at most ``max_hold_tokens`` tokens:
    invalid bytes are then released as U+FFFD instead of stalling the stream. Text that
    may be the start of a stop string is held back until it can be decided. The text ends
    before the first stop string, or after it with ``include_stop``.
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop: list[str], max_hold_tokens: int = 6,
        include_stop: bool = False,
    ) -> None:
        self._decode = decode
        self.stop = stop
        self.max_hold_tokens = max_hold_tokens
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut at a stop string once one appears)
        self.sent = 0  # characters already returned
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] give context for decoding the next ids
        self._read = 0  # ids whose text is in self.text
        self._longest_stop = max((len(x) for x in stop), default=0)
        self.include_stop = include_stop

    def _cut(self, start: int) -> None:
        """Ends the text at the first stop string found from ``start`` (if any)."""
        hits = [(i, len(x)) for x in self.stop if (i := self.text.find(x, start)) >= 0]
        if hits:
            i, n = min(hits)
            self.text = self.text[: i + (n if self.include_stop else 0)]
            self.stopped = True

    def _decode_new(self) -> str | None:
        """Text of the ids after ``_read``, or None while it is an incomplete character."""
        before = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        if full.endswith("\ufffd") and held < self.max_hold_tokens:
            return None
        if not full.startswith(before):  # the context changed its own text: rare
            new = self._decode(self.ids[self._read :])
        else:
            new = full[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def feed(self, token: int) -> str:
        """The text that is final after ``token`` (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        new = self._decode_new()
        if not new:
            return ""
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new
        self._cut(start)
        end = len(self.text)
        if not self.stopped:
            hold = 0  # the longest end that may be the start of a stop string
            for x in self.stop:
                for k in range(min(len(x) - 1, end - self.sent), hold, -1):
                    if self.text[end - k : end] == x[:k]:
                        hold = k
                        break
            end -= hold
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta

    def flush(self) -> str:
        """What is left at the end of the request (held ids decoded as they are)."""
        if not self.stopped and self._read < len(self.ids):
            self.text += self._decode(self.ids[self._read :])
            self._read = len(self.ids)
            self._cut(self.sent)
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
