"""`--draft` forms, defaults that fit any target, and --no-speculation loading no draft (CLI in-process)."""

from __future__ import annotations

import json

import pytest

from verifypd.cli import build_parser, main
from verifypd.domain.drafts import DEFAULT_DRAFT, DraftSpecError, parse_draft, resolve_draft


@pytest.mark.parametrize(
    "text, kind, fields",
    [
        ("ngram", "ngram", dict(min_n=2, max_n=4)),
        ("ngram:1-3", "ngram", dict(min_n=1, max_n=3)),
        ("none", "none", {}),
        ("self:12", "self", dict(layers=12)),
        ("./my-draft", "model", dict(model="./my-draft")),
        ("eagle:heads/smollm2", "eagle", dict(model="heads/smollm2", lookup=False)),
        ("eagle+ngram:heads/smollm2", "eagle", dict(model="heads/smollm2", lookup=True)),
    ],
)
def test_draft_forms(text, kind, fields):
    spec = parse_draft(text)
    assert spec.kind == kind and all(getattr(spec, k) == v for k, v in fields.items())
    assert spec.needs_model == (kind in ("self", "eagle", "model"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("ngram:3", "ngram:MIN-MAX"),
        ("ngram:4-2", "1 <= MIN <= MAX"),
        ("ngram:0-2", "1 <= MIN <= MAX"),
        ("self:x", "integer N"),
        ("", "--draft is empty"),
        ("eagle:", "eagle:PATH needs the head's directory"),
        ("eagle+ngram: ", "eagle\\+ngram:PATH needs the head's directory"),
    ],
)
def test_bad_draft_forms_name_the_flag(text, message):
    with pytest.raises(DraftSpecError, match=message):
        parse_draft(text)


def test_defaults():
    assert DEFAULT_DRAFT == "ngram"
    assert resolve_draft(None) == "ngram" and resolve_draft("self:3") == "self:3"
    # The best draft measured per device: the embedded model's shipped head on a GPU, lookup elsewhere.
    assert resolve_draft(None, target="smollm2", gpu=True) == "eagle:smollm2"
    assert resolve_draft(None, target="/models/llama", gpu=True) == "ngram"
    assert resolve_draft(None, target="smollm2", gpu=False) == "ngram"
    assert resolve_draft("ngram", target="smollm2", gpu=True) == "ngram"
    assert resolve_draft(None, no_speculation=True) == "none" and resolve_draft("self:3", True) == "none"


def _generate(capsys, *args) -> tuple[int, str, str]:
    code = main(
        [
            "generate",
            "--offline",
            "w5 w6 w7 w5 w6",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-blocks",
            "64",
            "--max-tokens",
            "8",
            "--json",
            *args,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_no_speculation_with_any_target_and_no_draft(tiny_models, capsys):
    code, out, err = _generate(capsys, "--target", tiny_models[0], "--no-speculation")
    assert code == 0, err
    result = json.loads(out)
    assert result["draft"] == "none" and result["usage"]["draft_tokens"] == 0 and len(result["token_ids"]) == 8


def test_user_target_without_draft_uses_prompt_lookup(tiny_models, capsys):
    code, out, err = _generate(capsys, "--target", tiny_models[0])
    assert code == 0, err
    assert json.loads(out)["draft"] == "ngram"


def test_self_draft_deeper_than_the_target_gets_the_valid_range(tiny_models, capsys):
    code, out, err = _generate(capsys, "--target", tiny_models[0], "--draft", "self:12")
    assert code == 2 and "--draft self:N needs 1 <= N <= 3" in err and "got 12" in err, err
    code, out, err = _generate(capsys, "--target", tiny_models[0], "--draft", "ngram:9")
    assert code == 2 and "ngram:MIN-MAX" in err, err


def test_help_says_what_the_default_draft_is_and_why():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("serve", "generate"):
        text = " ".join(sub.choices[command].format_help().split())
        assert "on a GPU the embedded model's shipped head (eagle:smollm2)" in text, command
        assert "on the CPU, and for any other target, ngram" in text and "states the rule" in text, command


def test_the_summary_line_tells_speculation_off_from_no_draft_proposed(tiny_models, capsys):
    """Without --json the last line says why no draft token was verified: speculation was off, or the
    draft proposed none (prompt lookup found no earlier occurrence: ngram:32-32 never can here)."""
    common = ["generate", "--offline", "w5 w6 w7", "--device", "cpu", "--dtype", "float32", "--max-tokens", "4"]
    for extra, said in [(["--no-speculation"], "speculation off"), (["--draft", "ngram:32-32"], "no draft proposed")]:
        assert main([*common, "--target", tiny_models[0], *extra]) == 0
        err = capsys.readouterr().err
        assert f"4 tokens, {said}," in err, err
