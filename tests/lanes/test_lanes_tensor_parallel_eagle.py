"""EAGLE heads over a `--tensor-parallel 2` target on the CPU (gloo, one follower process): the head runs
whole on rank 0 and reads the features rank 0's forwards write (the residual stream is whole after each
all-reduce). Greedy and seeded output equal plain decoding's at TP = 1 and TP = 2, token for token, with
`eagle:` and `eagle+ngram:`; and the head proposes at TP = 2 exactly what it proposes at TP = 1 at every
(request, position), which a stale or partial feature would change even where the output (lossless
whatever the drafts) does not. A head of the wrong width fails before any follower starts.

A process can be rank 0 of one process group only, so each TP = 2 rank set runs its jobs in a process of
its own (tests/support/tp_engine_run.py); the TP = 1 references run here."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
import torch
from engine_cases import repeating_prompts, write_head
from engine_helpers import make_engine
from tp_engine_run import record_proposals

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.model.eagle_head import random_eagle_head, save_eagle_head
from verifypd.model.loader import ModelLoadError, load_model

pytestmark = pytest.mark.slow  # tensor-parallel rank processes (tests/README.md)

K = 3
SAMPLED = [  # (temperature, top_p) per request of the seeded jobs
    dict(temperature=1.0, top_p=1.0, seed=11),
    dict(temperature=0.7, top_p=0.9, seed=12),
    dict(temperature=1.3, top_p=1.0, seed=13),
    dict(temperature=1.0, top_p=0.8, seed=14),
    dict(temperature=0.5, top_p=1.0, seed=15),
]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(4, 12))] for _ in range(n)]


def _specs(prompts, prefix: str, max_tokens=None, samplings=None) -> list[dict]:
    """Request specs as tp_engine_run takes them: lengths differ, so requests finish apart."""
    return [
        dict(
            prompt=p,
            max_tokens=max_tokens or 10 + 3 * i,
            request_id=f"{prefix}{i}",
            sampling=samplings[i] if samplings else {},
        )
        for i, p in enumerate(prompts)
    ]


JOBS = {
    "greedy": _specs(_prompts(6, seed=3), "g"),
    "coin": _specs(_prompts(6, seed=8), "c"),
    "seeded": _specs(_prompts(5, seed=4), "s", max_tokens=16, samplings=SAMPLED),
    "mixed": _specs(repeating_prompts(6, seed=2), "m", max_tokens=24),
    # a low temperature: sampled continuations repeat the context often enough for lookup to propose
    "mixed_seeded": _specs(
        repeating_prompts(5, seed=9),
        "n",
        max_tokens=24,
        samplings=[dict(temperature=0.3, seed=100 + i) for i in range(5)],
    ),
}


def _request_specs(specs: list[dict]) -> list[RequestSpec]:
    return [
        RequestSpec(
            tuple(s["prompt"]),
            max_tokens=s["max_tokens"],
            stop_at_eos=False,
            request_id=s["request_id"],
            sampling=SamplingParams(**s["sampling"]),
        )
        for s in specs
    ]


def _run_local(engine, specs: list[dict]) -> dict:
    """What tp_engine_run reports of a job, from an in-process engine."""
    seen = record_proposals(engine)
    done = engine.generate(_request_specs(specs))
    vars(engine.router.context).pop("commit_verdicts")
    return {
        "tokens": {r: c.token_ids for r, c in done.items()},
        "accepted": {r: c.usage["accepted_tokens"] for r, c in done.items()},
        "proposals": seen,
    }


def _start(job_set: dict, tmp_path, name: str) -> tuple[subprocess.Popen, object]:
    from verifypd.lanes.processes import child_env

    path_in, path_out = tmp_path / f"{name}.in.json", tmp_path / f"{name}.out.json"
    path_in.write_text(json.dumps(job_set))
    script = str(__import__("tp_engine_run").__file__)
    proc = subprocess.Popen(
        [sys.executable, script, str(path_in), str(path_out)],
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, path_out


def _finish(proc: subprocess.Popen, path_out) -> dict:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(path_out.read_text())


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    # std 0.6: a head whose drafts depend on the features in earnest (tests/router/test_router_draft_after.py)
    return write_head(tiny_models, tmp_path_factory.mktemp("tp_eagle") / "head", std=0.6)


@pytest.fixture(scope="module")
def tp2(tiny_models, head, tmp_path_factory):
    """Both TP = 2 rank sets, run at once: the head's (every job; eagle+ngram over the same models) and
    plain decoding's (--no-speculation: no draft, no features)."""
    tmp = tmp_path_factory.mktemp("tp_eagle_runs")
    mixed = "eagle+ngram:" + head.removeprefix("eagle:")
    head_jobs = [
        dict(name="greedy", specs=JOBS["greedy"]),
        dict(name="coin", specs=JOBS["coin"], simulated_acceptance=0.6),
        dict(name="seeded", specs=JOBS["seeded"]),
        dict(name="mixed", specs=JOBS["mixed"], draft=mixed),
        dict(name="mixed_seeded", specs=JOBS["mixed_seeded"], draft=mixed),
    ]
    plain_jobs = [dict(name=name, specs=JOBS[name]) for name in ("greedy", "seeded", "mixed", "mixed_seeded")]
    common = dict(target=tiny_models[0], tensor_parallel=2)
    runs = [
        _start(dict(common, draft=head, k=K, jobs=head_jobs), tmp, "head"),
        _start(dict(common, draft="none", k=0, jobs=plain_jobs, late_draft=head), tmp, "plain"),
    ]
    try:
        return {"head": _finish(*runs[0]), "plain": _finish(*runs[1])}
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def tp1_plain(tiny_models):
    engine = make_engine(tiny_models[0], "none", k=0)
    return {name: _run_local(engine, specs)["tokens"] for name, specs in JOBS.items() if name != "coin"}


@pytest.mark.parametrize("job", ["greedy", "seeded", "mixed", "mixed_seeded"])
def test_tp2_head_output_equals_plain_decoding_at_tp1_and_tp2(tp2, tp1_plain, job):
    head, plain = tp2["head"][job], tp2["plain"][job]
    assert head["features_on_rank0"] and not plain["features_on_rank0"]
    assert plain["tokens"] == tp1_plain[job]  # TP = 2 --no-speculation
    assert head["tokens"] == tp1_plain[job]  # TP = 2 with the head
    assert sum(head["drafted"].values()) > 0 and sum(plain["drafted"].values()) == 0
    assert head["draft_after_calls"] > 0  # the head's drafts launched right after each verify call ran
    if job.startswith("mixed"):
        assert head["lookup_proposed"] > 0  # prompt lookup's proposals were verified too


def test_tp2_head_proposes_what_it_proposes_at_tp1(tiny_models, head, tp2):
    """Greedy: the same drafts at every verified (request, position): the same features, the same head."""
    tp1 = _run_local(make_engine(tiny_models[0], head, k=K), JOBS["greedy"])
    got = tp2["head"]["greedy"]
    assert got["tokens"] == tp1["tokens"]
    assert len(tp1["proposals"]) >= 20
    assert {key: got["proposals"].get(key) for key in sorted(tp1["proposals"])} == dict(
        sorted(tp1["proposals"].items())
    )
    assert got["proposals"].keys() == tp1["proposals"].keys()


def test_partial_acceptance_tp2_equals_tp1(tiny_models, head, tp2):
    """A random head is rarely right on the tiny target, so both verify lanes keep drafts by the same
    seeded coin (SIMULATED acceptance: not the target's distribution): accepted counts between 0 and k
    occur, the head's rows move by each verdict (drafts launched after a verify call, shifted on rank 0),
    and TP = 2 still gives TP = 1's tokens, accepted counts and proposals."""
    engine = make_engine(tiny_models[0], head, k=K)
    engine.verify_lane.simulated_acceptance = 0.6
    tp1 = _run_local(engine, JOBS["coin"])
    got = tp2["head"]["coin"]
    assert sum(tp1["accepted"].values()) > 0
    assert got["tokens"] == tp1["tokens"] and got["accepted"] == tp1["accepted"]
    assert len(tp1["proposals"]) >= 10 and got["proposals"] == tp1["proposals"]


def test_head_of_another_width_fails_before_any_follower_starts(tiny_models, tmp_path, monkeypatch, capsys):
    """A ModelLoadError naming the head's directory and the field; the command line exits 2 with it."""
    from verifypd import cli
    from verifypd.core.assembly import load_stack_models
    from verifypd.engine import EngineOptions
    from verifypd.lanes.tensor_parallel import ranks as tp_ranks

    target = load_model(tiny_models[0], torch.device("cpu"), torch.float32)
    narrow = dataclasses.replace(target.shape, hidden_size=32, head_dim=8)
    save_eagle_head(tmp_path / "narrow", *random_eagle_head(narrow, seed=1))

    def no_followers(*args, **kwargs):
        raise AssertionError("a follower was started for a head that cannot load")

    monkeypatch.setattr(tp_ranks, "LeaderRanks", no_followers)
    options = EngineOptions(
        target=tiny_models[0], draft=f"eagle:{tmp_path / 'narrow'}", device="cpu", tensor_parallel=2
    )
    with pytest.raises(ModelLoadError) as err:
        load_stack_models(options)
    message = str(err.value)
    assert f"eagle:{tmp_path / 'narrow'}" in message and "hidden_size 32" in message, message
    assert "target's hidden size 64" in message, message
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")  # cli.main sets it; undone at teardown
    capsys.readouterr()
    args = ["generate", "--offline", "--raw", "hi", "--target", tiny_models[0], "--max-tokens", "2"]
    rc = cli.main([*args, "--draft", f"eagle:{tmp_path / 'narrow'}", "--device", "cpu", "--tensor-parallel", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, (rc, err[-800:])


def test_a_rank_set_built_without_features_refuses_a_head_later(tp2):
    """The rank set's one target runner (its CUDA graphs, captured with the followers') writes no
    features, so a head's engine built over it afterwards would read none: refused, with the reason."""
    error = tp2["plain"]["late_draft_error"]
    assert error is not None and "built with another feature pool" in error and "first" in error, error


def test_eagle_tp_bench_smoke(tmp_path):
    """bench/tensor_parallel/eagle_tp.py --smoke (CPU, gloo): both systems over their own rank sets, the
    metadata every benchmark records, labelled rows, and the head's rows drafted."""
    import pathlib

    from verifypd.lanes.processes import child_env

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "eagle_tp.json"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "tensor_parallel" / "eagle_tp.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys() and result["tensor_parallel"] == 2
    assert "SIMULATED" in result["acceptance"] and "random" in result["weights"]
    rows = {(r["system"], r["batch"]): r for r in result["rows"]}
    systems = {s for s, _ in rows}
    assert len(systems) == 4 and {b for _, b in rows} == {1, 2} and len(rows) == 8, sorted(rows)
    assert any(s.startswith("--no-speculation") for s in systems) and any("REAL acceptance" in s for s in systems)
    for (system, _), row in rows.items():
        assert "speedup_vs_no_speculation" in row and row["tokens"] == row["batch"] * result["gen_len"]
        if system.startswith("--no-speculation"):
            assert row["mean_k"] == 0, row
        elif "SIMULATED" in system and "k=adaptive" not in system:  # a fixed k drafts every step
            assert row["mean_k"] > 0, row
        # The adaptive rows may stay at k = 0: in the smoke's 7 steps a few simulated rejections can
        # make the policy's measured acceptance too low for its (conservative) costs of drafting.
