"""Text <-> token ids for front ends and the router's detokenizer. Torch-free.

Wraps a transformers tokenizer; models loaded with random weights have none, so they take token
id prompts only and "decode" to space-separated ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from verifypd.domain.requests import InvalidRequest


class TextCodec:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send the prompt as token_ids")
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template: send the prompt as text or token_ids")
        for n, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant"):
                raise InvalidRequest(
                    f"chat.messages[{n}].role must be system, user or assistant; got {m.get('role')!r}"
                )
        if not messages:
            raise InvalidRequest("chat.messages is empty: give at least one message")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs name their tokens so). A token
        that is part of a UTF-8 character reads as U+FFFD, as in vLLM's and OpenAI's logprobs."""
        if self.tokenizer is None:
            return f" {token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# Every pattern transformers' clean_up_tokenization rewrites (" ." -> ".", " n't" -> "n't", ...).
CLEANUP_PROBE = "a . b , c ? d ! e 's f n't g 'm h 've i 're j do not"


def _backend_decode(tokenizer):
    """The Rust tokenizer's own decode where transformers' wrapper adds nothing to it (a fast
    tokenizer whose wrapper does not clean up spaces: it then returns the backend's text as is).
    The router's detokenizer decodes twice per generated token, on the step's critical path:
    SmolLM2's tokenizer takes 4.5 us a call through the wrapper, 1.0 us direct (CPU here).
    clean_up_tokenization_spaces may be set and still not applied: transformers 5 ignores it for
    BPE tokenizers (it warns at load; the embedded model's GGUF sets it, on the GPU machine's
    transformers too). Then the wrapper's text of a probe holding every pattern the clean-up
    rewrites equals the backend's, which decides."""
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        try:
            ids = list(tokenizer(CLEANUP_PROBE, add_special_tokens=False)["input_ids"])
            if tokenizer.decode(ids, skip_special_tokens=True) != backend.decode(ids, skip_special_tokens=True):
                return None
        except Exception:  # a tokenizer that cannot say: keep the wrapper
            return None
    return backend.decode
