"""A request's output text as its tokens arrive, released in pieces that never change afterwards."""
from __future__ import annotations

from mdsl.serving.tokenizer import Tokenizer


class TextStream:
    """Detokenizes a growing output incrementally (a window of the last tokens, as vLLM does: the text a
    token adds is the window's text less the text of the window without it) and cuts it at the first
    stop string. Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could be
    the start of a stop string; `finish` releases the rest. A stop token (the user's ids, the EOS) ends
    the request and adds no text, as a stop string adds none. Without a tokenizer the text is empty."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple = (), stop_ids: frozenset = frozenset()):
        self._tokenizer = tokenizer
        self._stop_strings = stop_strings
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        self._stop_ids = stop_ids
        self._ids: list = []           # the tokens that have text
        self._prefix = self._read = 0  # the window: _ids[_prefix:_read] decodes to the window's text
        self.text = ""
        self.released = 0              # characters of `text` released
        self.stopped = False           # a stop string ended the text

    def push(self, token: int) -> str:
        """The next output token; the text that may be released now."""
        if self.stopped or token in self._stop_ids:
            return ""
        self._ids.append(token)
        self._decode(final=False)
        return self._release(len(self.text) if self.stopped else len(self.text) - self._hold)

    def finish(self) -> str:
        """The request ended: the text still held back."""
        if not self.stopped:
            self._decode(final=True)
        return self._release(len(self.text))

    def _decode(self, final: bool) -> None:
        window = self._tokenizer.decode(self._ids[self._prefix:])
        if window is None:
            return
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        if len(window) <= len(before) or (window.endswith("\ufffd") and not final):
            return
        start = len(self.text)
        self.text += window[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        hits = [i for s in self._stop_strings if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released:end], end
        return piece
