"""Incremental detokenization and stop-string detection. Torch-free.

Decoding each token alone breaks multi-byte characters and sentencepiece spacing, so we decode
the output together with a few prompt tokens of left context and emit only the new suffix,
holding back text that ends in an incomplete UTF-8 sequence (U+FFFD).
"""
from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._decode = decode
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._context_text = decode(self._context)
        self._ids: list[int] = []
        self.text = ""  # text emitted so far (never retracted)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)

    def add(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        """Appends tokens; returns (new text, stop string hit). After a hit the text ends before it."""
        self._ids.extend(new_ids)
        full = self._decode(self._context + self._ids)
        if full.startswith(self._context_text):
            full = full[len(self._context_text):]
        stable = full.rstrip("\ufffd")
        if self._stop:
            search_from = max(0, len(self.text) - self._max_stop + 1)
            hits = [i for i in (stable.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = stable[len(self.text):cut] if cut > len(self.text) else ""
                self.text += delta
                return delta, True
            # Hold back a tail that could be the start of a stop string.
            stable = stable[: max(len(self.text), len(stable) - self._max_stop + 1)] if not self._final else stable
        if not stable.startswith(self.text):  # tokenizer re-segmented earlier text; emit nothing new
            return "", False
        delta = stable[len(self.text):]
        self.text = stable
        return delta, False

    _final = False

    def flush(self) -> str:
        """Releases held-back text at the end of generation."""
        self._final = True
        delta, _ = self.add([])
        return delta
