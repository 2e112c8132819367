"""The incremental detokenizer against the definition of the right text: decoding all output tokens
at once. With the embedded model's real byte-level BPE tokenizer, over random token streams that
split multi-byte characters across tokens and across steps, with and without stop strings; and its
cost: a step decodes a window of a few tokens, never the whole output."""

from __future__ import annotations

import random

import pytest

from verifypd.model.loader import embedded_model_path
from verifypd.router.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _decode(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def _streams(tok, n: int, seed: int):
    """Token streams: text with accents, CJK and emoji (multi-byte, split over byte tokens), random
    vocabulary ids (incl. special tokens and lone continuation bytes), and pieces of both."""
    rng = random.Random(seed)
    texts = [
        "Déjà vu: naïve café — 東京タワー 🚀🎉 ok.",
        " def f(x):\n    return x ** 2  # ünïcödé",
        "plain ascii words for the window edge " * 3,
    ]
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)])
        if i % 3 == 1:
            ids = [rng.randrange(tok.vocab_size) for _ in range(60)]
        elif i % 3 == 2:
            ids = ids[:20] + [rng.randrange(tok.vocab_size) for _ in range(10)] + ids[20:]
        yield ids


def _run(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> tuple[str, bool]:
    """Feeds ids in steps of 1-5 tokens (as verify steps commit them); returns the streamed text."""
    out, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 5)
        delta, hit = detok.add(ids[i : i + n])
        out += delta
        i += n
        if hit:
            return out, True
    return out + detok.flush(), False


@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_text_equals_decoding_everything(tokenizer, seed):
    rng = random.Random(seed)
    decode = _decode(tokenizer)
    prompt = tokenizer.encode("Ünïcode prompt: 日本")
    for ids in _streams(tokenizer, 9, seed):
        want = decode(prompt[-4:] + ids)
        want = want[len(decode(prompt[-4:])) :].rstrip("\ufffd")
        got, _ = _run(IncrementalDetokenizer(decode, prompt), ids, rng)
        assert got == want, (ids, got, want)


def test_stop_strings_cut_the_text_exactly(tokenizer):
    rng = random.Random(5)
    decode = _decode(tokenizer)
    ids = tokenizer.encode(" naïve café — 東京タワー 🚀 then STOP here, and more text after it")
    full = decode(ids)
    for stop in ("STOP", "東京", "🚀", "café —", "after it"):
        got, hit = _run(IncrementalDetokenizer(decode, [], stop=(stop,)), ids, rng)
        assert hit and got == full[: full.index(stop)], (stop, got)
    got, hit = _run(IncrementalDetokenizer(decode, [], stop=("absent",)), ids, rng)
    assert not hit and got == full


def test_a_step_decodes_a_window_not_the_whole_output(tokenizer):
    decode = _decode(tokenizer)
    longest = [0]

    def counting(ids):
        longest[0] = max(longest[0], len(ids))
        return decode(ids)

    ids = tokenizer.encode("a long answer that keeps going. " * 80)  # ~ 640 tokens
    detok = IncrementalDetokenizer(counting, tokenizer.encode("prompt"))
    for i in range(0, len(ids), 3):
        detok.add(ids[i : i + 3])
    assert detok.flush() == "" and detok.text == decode(ids)
    assert longest[0] <= 16, longest[0]


def test_text_before_an_unfinished_character_is_not_held_back(tokenizer):
    decode = _decode(tokenizer)
    ids = tokenizer.encode("word 🚀🚀")
    cut = next(i for i in range(1, len(ids)) if decode(ids[:i]).endswith("\ufffd"))  # inside an emoji's bytes
    want = decode(ids[:cut]).rstrip("\ufffd")
    detok = IncrementalDetokenizer(decode, [])
    assert detok.add(ids[:cut]) == (want, False) and want.startswith("word")
    assert detok.flush() == ""  # generation ended inside the character: what was complete was sent
    detok = IncrementalDetokenizer(decode, [])
    assert detok.add(ids[: cut - 1])[0] + detok.add(ids[cut - 1 :])[0] == decode(ids)


def test_codec_decodes_through_the_backend_as_the_wrapper_does(tokenizer):
    """TextCodec skips transformers' decode wrapper (the detokenizer's two calls per token) only where
    that gives the wrapper's text: random windows with special tokens and split multi-byte characters."""
    from verifypd.domain.tokenizer import TextCodec

    codec = TextCodec(tokenizer)
    assert codec._backend_decode is not None  # the embedded (byte-level BPE) tokenizer takes the fast path
    rng = random.Random(3)
    windows = [ids[i : i + rng.randint(1, 7)] for ids in _streams(tokenizer, 12, 3) for i in range(0, len(ids), 3)]
    windows += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 7))] for _ in range(300)]
    windows += [[tokenizer.eos_token_id], [tokenizer.eos_token_id, 30, 40]]
    for w in windows:
        assert codec.decode(w) == tokenizer.decode(w, skip_special_tokens=True), w
    tokenizer.clean_up_tokenization_spaces = True  # set but not applied to a BPE tokenizer (transformers 5)
    try:
        codec = TextCodec(tokenizer)
        assert codec._backend_decode is not None
        for w in windows:
            assert codec.decode(w) == tokenizer.decode(w, skip_special_tokens=True), w
    finally:
        tokenizer.clean_up_tokenization_spaces = False


class _CleaningWrapper:
    """A fast tokenizer whose wrapper does clean up spaces (as transformers does for WordPiece)."""

    def __init__(self, inner):
        self.inner, self.is_fast, self.clean_up_tokenization_spaces = inner, True, True
        self.backend_tokenizer = inner.backend_tokenizer

    def __call__(self, text, **kw):
        return self.inner(text, **kw)

    def decode(self, ids, **kw):
        return self.inner.decode(ids, **kw).replace(" .", ".").replace(" n't", "n't")


def test_codec_keeps_the_wrapper_where_it_cleans_up_spaces(tokenizer):
    from verifypd.domain.tokenizer import TextCodec

    codec = TextCodec(_CleaningWrapper(tokenizer))
    assert codec._backend_decode is None
    ids = tokenizer("it is n't here .", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "it is n't here ."
    assert codec.decode(ids) == "it isn't here."  # the wrapper's text, not the backend's
