"""Runs jobs on one in-process engine over a `--tensor-parallel` target in a process of its own
(`python tests/support/tp_engine_run.py IN.json OUT.json`): a process can be rank 0 of one process group
only, so a test that compares several tensor-parallel engines starts one of these per rank set.

IN: {"target", "draft", "k", "tensor_parallel", "jobs": [{"name", "draft" (optional: another draft over
the same models, e.g. eagle+ngram:), "simulated_acceptance" (optional), "specs": [{"prompt", "max_tokens",
"request_id", "sampling": {SamplingParams fields}}]}]}. Jobs run in order; a job with a new draft gets a
new engine over the same models (the rank set's runner, pool and features).
OUT: {name: {"tokens": {request: ids}, "accepted": {request: n}, "drafted": {request: n},
"proposals": {"request@position": drafts}, "draft_after_calls": n, "lookup_proposed": n}}; with
"late_draft" in IN, "late_draft_error": the error of building that draft's engine over the same models
after the jobs.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from engine_helpers import make_engine  # run as a script: its directory (tests/support) is on sys.path

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.engine import Engine


def record_proposals(engine) -> dict[str, list[int]]:
    """Every verified item's drafts (host values), by "request@pending position", from now on."""
    seen: dict[str, list[int]] = {}
    ctx = engine.router.context
    commit = ctx.commit_verdicts

    def recording(work, items, results):
        for i in items:
            if len(i.draft_tokens):
                seen[f"{i.request_id}@{i.start_pos}"] = list(i.draft_tokens)
        return commit(work, items, results)

    ctx.commit_verdicts = recording
    return seen


def late_draft_error(first, draft: str) -> str | None:
    """The error of building an engine with `draft` over `first`'s models (None: it was built)."""
    from verifypd.domain.models import draft_spec
    from verifypd.model.build import load_draft_model

    m = first.models
    head = load_draft_model(draft_spec(draft), m.target, m.device, m.dtype, first.options.max_context)
    try:
        Engine(dataclasses.replace(first.options, draft=draft), models=dataclasses.replace(m, draft_model=head))
    except RuntimeError as exc:
        return str(exc)
    return None


def main(path_in: str, path_out: str) -> None:
    with open(path_in) as f:
        job_set = json.load(f)
    first = make_engine(job_set["target"], job_set["draft"], k=job_set["k"], tensor_parallel=job_set["tensor_parallel"])
    engines = {job_set["draft"]: first}
    out = {}
    try:
        for job in job_set["jobs"]:
            draft = job.get("draft", job_set["draft"])
            if draft not in engines:
                engines[draft] = Engine(
                    dataclasses.replace(first.options, draft=draft),
                    models=dataclasses.replace(first.models, draft_name=draft),
                )
            engine = engines[draft]
            engine.verify_lane.simulated_acceptance = job.get("simulated_acceptance")
            seen = record_proposals(engine)
            after0 = engine.router.draft_after.calls
            lookup0 = engine.router.lookup.proposed if engine.router.lookup is not None else 0
            specs = [
                RequestSpec(
                    tuple(s["prompt"]),
                    max_tokens=s["max_tokens"],
                    stop_at_eos=False,
                    request_id=s["request_id"],
                    sampling=SamplingParams(**s.get("sampling", {})),
                )
                for s in job["specs"]
            ]
            done = engine.generate(specs)
            vars(engine.router.context).pop("commit_verdicts")  # the recording wrapper
            out[job["name"]] = {
                "tokens": {r: c.token_ids for r, c in done.items()},
                "accepted": {r: c.usage["accepted_tokens"] for r, c in done.items()},
                "drafted": {r: c.usage["draft_tokens"] for r, c in done.items()},
                "proposals": seen,
                "draft_after_calls": engine.router.draft_after.calls - after0,
                "lookup_proposed": (engine.router.lookup.proposed if engine.router.lookup is not None else 0) - lookup0,
                "features_on_rank0": first.verify_lane.target.features is not None,
            }
        if job_set.get("late_draft"):  # a feature draft's engine over a rank set built without features
            out["late_draft_error"] = late_draft_error(first, job_set["late_draft"])
    finally:
        if first.models.ranks is not None:
            first.models.ranks.close()
    with open(path_out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
