"""bench/drafts/eagle_gpu.sh builds the `verifypd distill` command of the GPU training calls: EAGLE_DRAFT_VOCAB
picks the draft vocabulary (N: N tokens over the target's frozen lm_head rows; 0, the default and the
committed head's: the whole vocabulary, which `verifypd distill` takes without --draft-vocab and refuses
--frozen-lm-head for)."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def distill_args(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "bench/drafts/eagle_gpu.sh", "print-distill"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path), **env},
        timeout=30,
    )


def test_default_recipe_is_the_committed_heads_vocabulary(tmp_path):
    """The shipped head (verifypd/heads/smollm2_eagle) drafts over the target's whole vocabulary: no map."""
    done = distill_args(tmp_path)
    assert done.returncode == 0, done.stderr
    args = done.stdout.split("\n")
    assert "--draft-vocab" not in args and "--frozen-lm-head" not in args
    assert args[args.index("--samples") + 1] == "12000"


@pytest.mark.parametrize("size", ["16384", "32768"])
def test_larger_draft_vocabulary(tmp_path, size):
    args = distill_args(tmp_path, EAGLE_DRAFT_VOCAB=size).stdout.split("\n")
    assert args[args.index("--draft-vocab") + 1] == size
    assert args.count("--draft-vocab") == 1 and "--frozen-lm-head" in args


def test_zero_is_the_whole_vocabulary_without_a_map(tmp_path):
    done = distill_args(tmp_path, EAGLE_DRAFT_VOCAB="0")
    assert done.returncode == 0, done.stderr
    args = done.stdout.split("\n")
    assert "--draft-vocab" not in args and "--frozen-lm-head" not in args
    assert "--intermediate-size" in args and "--chain-steps" in args  # the rest of the recipe is there


@pytest.mark.parametrize("bad", ["8k", "-1", ""])
def test_bad_draft_vocab_exits_2_naming_the_variable(tmp_path, bad):
    done = distill_args(tmp_path, EAGLE_DRAFT_VOCAB=bad)
    if bad == "":  # empty = unset: the default
        assert done.returncode == 0 and "--draft-vocab" not in done.stdout
        return
    assert done.returncode == 2 and "EAGLE_DRAFT_VOCAB" in done.stderr
