"""Structured output: a request's constraint, compiled to a grammar, and the matcher that turns it
into token masks. Torch-free (numpy bitmasks); the engine is llguidance (bench/serving/grammar_engines.py,
docs/structured_output.md), an optional dependency: `pip install verifypd[structured]`.

A constrained request's output at position t is chosen from the target's distribution masked to
the tokens the grammar allows after the tokens before t. With speculation, one verify step scores
the pending token and k drafts: its k + 1 positions each need their own mask, the one after the
committed tokens and the drafts before that position (`GrammarState.step_masks`). A draft the
grammar forbids can never win the masked choice; the rows after it are left unmasked (all ones):
they cannot be chosen from, since the draft before them is rejected. Rows from the grammar's end on
(a draft that completes it stops the matcher) allow only EOS: a kept draft that ends the output is
followed by EOS, as without speculation.

Bitmask layout (llguidance's, and what `verifypd.model.token_mask` reads): int32 [rows, ceil(V/32)],
token v allowed iff bit (v % 32) of word v // 32 is set.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from verifypd.domain.requests import CONSTRAINT_KINDS as KINDS
from verifypd.domain.requests import Constraint, InvalidRequest

MAX_CONSTRAINT_CHARS = 64 * 1024
# JSON as json.dumps writes it (", " and ": ", no other whitespace): flexible whitespace lets a
# model pad its output with newlines until max_tokens. A schema's "x-guidance" may override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL_HINT = "structured output needs the grammar engine: pip install 'verifypd[structured]' (llguidance)"


def _engine():
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


def available() -> bool:
    return _engine() is not None


def grammar_of(c: Constraint) -> str:
    """The llguidance grammar of `c`, checked: InvalidRequest naming `c.field` if it is not valid
    (or the engine is not installed)."""
    g = _engine()
    if g is None:
        raise InvalidRequest(f"{c.field}: {INSTALL_HINT}")
    if c.kind not in KINDS:
        raise InvalidRequest(f"{c.field}: unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}")
    if len(c.text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{c.field}: {len(c.text)} characters; at most {MAX_CONSTRAINT_CHARS}")
    if c.kind == "json":
        grammar = g.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    elif c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except ValueError as exc:
            raise InvalidRequest(f"{c.field}: the schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{c.field}: the schema must be a JSON object, got {type(schema).__name__}")
        grammar = g.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    elif c.kind == "regex":
        if not c.text:
            raise InvalidRequest(f"{c.field}: the regular expression is empty")
        grammar = g.LLMatcher.grammar_from_regex(c.text)
    else:
        if not c.text.strip():
            raise InvalidRequest(f"{c.field}: the grammar is empty")
        grammar = g.LLMatcher.grammar_from_lark(c.text)
    error = g.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"{c.field}: not a valid {c.kind.replace('_', ' ')}: {error.strip()[:500]}")
    return grammar


def check(c: Constraint | None) -> None:
    """The front ends' check: a bad constraint is the caller's error, before the request queues."""
    if c is not None:
        grammar_of(c)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allows(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


class GrammarCompiler:
    """Compiles constraints against one tokenizer (a transformers fast tokenizer) and a model vocabulary
    of `vocab_size` ids (the logits' width; ids past the tokenizer's are never allowed). The engine's
    view of the tokenizer costs ~0.4 s to build (SmolLM2): built on the first constrained request."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.hf_tokenizer, self.vocab_size, self.eos = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                if self.hf_tokenizer is None:
                    raise InvalidRequest("response_format: structured output needs the model's tokenizer")
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos or None
                )
            return self._tokenizer

    def state(self, c: Constraint) -> GrammarState:
        g = _engine()
        grammar = grammar_of(c)
        assert g is not None  # (grammar_of raised otherwise)
        matcher = g.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{c.field}: {matcher.get_error()[:500]}")
        return GrammarState(matcher, mask_words(self.vocab_size))


class GrammarError(RuntimeError):
    """A committed token the grammar forbids: a lane broke the masking contract."""


class GrammarState:
    """One request's matcher. It follows the request's committed output lazily (`_catch_up`), so no
    commit path needs to tell it anything; `step_masks` advances through drafts and rolls them back."""

    def __init__(self, matcher: Any, words: int):
        self.matcher, self.words = matcher, words
        self.consumed = 0  # output tokens the matcher has taken

    def _catch_up(self, output_ids: Sequence[int]) -> None:
        new = output_ids[self.consumed :]
        if new and not self.matcher.consume_tokens(list(new)):
            raise GrammarError(f"output token the grammar forbids: {self.matcher.get_error()[:300]}")
        self.consumed = len(output_ids)

    def step_masks(self, output_ids: Sequence[int], drafts: Sequence[int] = ()) -> np.ndarray:
        """int32 [len(drafts) + 1, words]: row j is the mask of the position after the committed output
        and drafts[:j]. Rows past a draft the grammar forbids are all ones: never chosen from (module
        doc). From the end of the grammar on (a draft completed it and the matcher stopped, or EOS was
        drafted) every row allows only EOS, as decoding without drafts would: the target's choice
        after a kept draft that ends the grammar is EOS, never a free token."""
        self._catch_up(output_ids)
        masks = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        m = self.matcher
        advanced = 0
        for j in range(len(drafts) + 1):
            m.unsafe_compute_mask_ptr(masks[j].ctypes.data, masks[j].nbytes)  # (a stopped matcher's: EOS)
            if m.is_stopped():  # the grammar's end: EOS only from here on
                masks[j + 1 :] = masks[j]
                break
            if j == len(drafts):
                break
            token = int(drafts[j])
            if not allows(masks[j], token) or not m.consume_token(token):
                break
            advanced += 1
        if advanced:
            m.rollback(advanced)
        return masks

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())
