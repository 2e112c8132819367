"""Incremental detokenization and stop-string detection. Torch-free.

Decoding each token alone breaks multi-byte characters and sentencepiece spacing, so each step
decodes a short window of tokens: a few already turned into text (left context) plus the new ones,
and emits only the text past the context's own decoding (the sliding window of vLLM's and TGI's
detokenizers). A step's decode cost does not grow with the output: the window restarts where text
was last complete. Text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the
next token completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._decode = decode
        # Window over the token ids: [prefix, read) were turned into text already (they are the
        # left context of the next decode), [read, len) are not yet text.
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._decoded = ""  # text of the output tokens before `read`: final
        self._tail = ""  # complete characters of tokens [read, len), decoded again next time
        self.text = ""  # text emitted so far (never retracted): a prefix of _decoded + _tail
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._final = False

    def _advance(self) -> None:
        """Moves the text of tokens [read, len) into _decoded once it is complete: longer than the
        context's text and not ending in U+FFFD (an unfinished multi-byte character). Until then the
        complete part of it is _tail, emitted as usual but decoded again with the next token."""
        if self._read == len(self._ids):
            return
        window = self._ids[self._prefix :]
        context = self._decode(window[: self._read - self._prefix]) if self._read > self._prefix else ""
        full = self._decode(window)
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self._decoded += full[len(context) :]
            self._tail = ""
            self._prefix, self._read = self._read, len(self._ids)
        else:
            self._tail = full.rstrip("\ufffd")[len(context) :]

    def add(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        """Appends tokens; returns (new text, stop string hit). After a hit the text ends before it."""
        self._ids.extend(new_ids)
        self._advance()
        stable = self._decoded + self._tail
        if self._stop:
            search_from = max(0, len(self.text) - self._max_stop + 1)
            hits = [i for i in (stable.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = stable[len(self.text) : cut] if cut > len(self.text) else ""
                self.text += delta
                return delta, True
            # Hold back a tail that could be the start of a stop string.
            stable = stable[: max(len(self.text), len(stable) - self._max_stop + 1)] if not self._final else stable
        if not stable.startswith(self.text):  # the tokenizer re-segmented emitted text: emit nothing new
            return "", False
        delta = stable[len(self.text) :]
        self.text = stable
        return delta, False

    def flush(self) -> str:
        """Releases held-back text at the end of generation."""
        self._final = True
        delta, _ = self.add([])
        return delta
