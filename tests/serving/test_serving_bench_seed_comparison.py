"""bench/seed_study/seed_comparison.py (the GPU serving sweep) on the CPU with tiny checkpoints: it starts real
`verifypd serve` subprocesses, drives them with the loadgen library, records sane per-point rows,
records a server that cannot start as errors and goes on, writes the report with its targets section,
and merges partial runs (--report-only). The target checks are also tested on made-up rows."""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from services_helpers import BLOCK_SIZE

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "seed_study" / "seed_comparison.py"


def load_harness():
    spec = importlib.util.spec_from_file_location("seed_comparison", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_harness(*argv: str, timeout: float = 150) -> subprocess.CompletedProcess:
    from verifypd.lanes.processes import child_env

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_sweep_on_tiny_models(tiny_models, tmp_path):
    target, draft = tiny_models
    # `bad` passes a flag serve does not know: that server cannot start, and the sweep goes on.
    # --no-schedule-flag: k0 and pdv run without `--schedule` (serve's default schedule).
    proc = run_harness(
        "--pairs",
        f"{draft}->{target}",
        "--modes",
        "k0,bad,pdv",
        "--mode-args",
        "bad=--no-such-flag",
        "--no-schedule-flag",
        "--concurrency",
        "1,3",
        "--seconds-per-point",
        "0.7",
        "--prompt-tokens",
        "8",
        "--max-tokens",
        "10",
        "--warmup-requests",
        "0",
        "--device",
        "cpu",
        "--vocab-range",
        "3:96",
        "--serve-args",
        f"--num-blocks 64 --block-size {BLOCK_SIZE} --k-initial 3",
        "--out",
        str(tmp_path),
        "--tag",
        "smoke",
    )
    doc = json.loads((tmp_path / "seed_comparison_cpu_smoke.json").read_text())
    assert doc["device"] == "cpu" and doc["git_revision"] and doc["date"] and "seed_comparison.py" in doc["command"]
    assert doc["nvml"] != "ok" or doc["device"] != "cpu"
    rows = {(r["mode"], r["concurrency"]): r for r in doc["rows"]}
    assert set(rows) == {(m, c) for m in ("k0", "bad", "pdv") for c in (1, 3)}
    for mode in ("k0", "pdv"):
        for c in (1, 3):
            r = rows[mode, c]
            assert r["status"] == "ok", r
            assert r["output_tok_s"] > 0 and r["requests_completed"] >= c and r["requests_failed"] == 0
            assert r["summary"]["tokens"]["output_total"] == 10 * r["requests_completed"]
            assert r["e2e_p99_ms"] >= r["e2e_p95_ms"] >= r["ttft_p95_ms"] > 0 and r["e2e_mean_ms"] > 0
            assert r["itl_p95_ms"] > 0
            assert r["gpu_util_mean_pct"] is None  # no NVML on the CPU: recorded as null
    assert all(rows["k0", c]["acceptance_rate"] is None and rows["k0", c]["mean_applied_k"] == 0 for c in (1, 3))
    assert all(
        rows["pdv", c]["simulated_acceptance"] == 0.7 and rows["pdv", c]["label"] == "simulated acceptance α=0.7"
        for c in (1, 3)
    )
    assert all(0 <= (rows["pdv", c]["acceptance_rate"] or 0) <= 1 for c in (1, 3))
    assert all(rows["bad", c]["status"] == "error" and "failed to start" in rows["bad", c]["error"] for c in (1, 3))
    servers = {s["mode"]: s for s in doc["servers"]}
    assert servers["bad"]["status"] == "error" and any("--no-such-flag" in ln for ln in servers["bad"]["log_tail"])
    assert "--simulated-acceptance 0.7" in servers["pdv"]["command"] and "--draft none" in servers["k0"]["command"]
    assert "--schedule" not in servers["pdv"]["command"]

    report = (tmp_path / "seed_comparison_cpu_smoke.md").read_text()
    assert "simulated acceptance α=0.7" in report and "## Targets summary" in report
    assert "PDV throughput ≥ 1.3 × k0 at concurrency 1" in report and ("PASS" in report or "MISS" in report)
    assert "server failed to start" in report
    assert "PASS" in proc.stdout or "MISS" in proc.stdout
    pngs = list(tmp_path.glob("seed_comparison_cpu_smoke_*.png"))
    assert len(pngs) == 3 and all(p.stat().st_size > 1000 for p in pngs)

    # Partial runs (one per pair) merge into one report.
    other = copy.deepcopy(doc)
    for r in other["rows"]:
        r["pair"] = "other->pair"
    other["skipped"] = [{"pair": "tinyllama-1.1b->codellama-34b", "note": "skipped: needs >= 120 GB"}]
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        load_harness().main(
            [
                "--report-only",
                str(tmp_path / "seed_comparison_cpu_smoke.json"),
                str(tmp_path / "other.json"),
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    merged = json.loads((tmp_path / "merged" / "seed_comparison_cpu.json").read_text())
    assert len(merged["rows"]) == 12 and len(merged["sources"]) == 2
    text = (tmp_path / "merged" / "seed_comparison_cpu.md").read_text()
    assert "other → pair" in text and "codellama-34b — skipped" in text


def row(mode: str, c: int, tput: float, p95: float) -> dict:
    return {
        "pair": "tinyllama-1.1b->llama-2-7b",
        "mode": mode,
        "concurrency": c,
        "status": "ok",
        "output_tok_s": tput,
        "e2e_p95_ms": p95,
        "e2e_mean_ms": p95 / 2,
        "e2e_p99_ms": p95,
        "ttft_p95_ms": 1.0,
        "itl_p95_ms": 1.0,
        "acceptance_rate": 0.7,
        "mean_applied_k": 2.0,
        "label": "simulated acceptance α=0.7",
    }


@pytest.mark.parametrize(
    "pdv_c1, pdv_p95_c8, expect",
    [
        (140.0, 90.0, ["PASS", "PASS", "PASS", "PASS"]),
        (120.0, 90.0, ["PASS", "PASS", "PASS", "MISS"]),  # 1.2 x k0 at c=1
        (140.0, 130.0, ["PASS", "MISS", "PASS", "PASS"]),  # PDV P95 above PD's at c=8
    ],
)
def test_targets_and_their_figures(pdv_c1, pdv_p95_c8, expect):
    h = load_harness()
    rows = [
        row("k0", 1, 100, 50),
        row("baseline", 1, 110, 50),
        row("pd", 1, 120, 50),
        row("pdv", 1, pdv_c1, 40),
        row("k0", 8, 400, 100),
        row("baseline", 8, 410, 120),
        row("pd", 8, 420, 110),
        row("pdv", 8, 430, pdv_p95_c8),
        row("k0", 2, 150, 60),
        row("baseline", 2, 1.0, 60),
        row("pd", 2, 2.0, 60),
        row("pdv", 2, 160, 60),
    ]
    doc = {"device": "test", "label": "simulated acceptance α=0.7", "parameters": {}, "rows": rows}
    text, checks = h.render_report(doc, {})
    assert [c["status"] for c in checks["tinyllama-1.1b->llama-2-7b"]] == expect  # c=2 (< 8) is not held to order
    assert "THEIRS" in text and "13.12 (c=16)" in text and "12.75 (c=64)" in text and "235,652" in text
    assert "≈" in text  # c=5 lies between our c=2 and c=8: interpolated and marked
    no_pd = [r for r in rows if r["mode"] != "pd"]
    _, checks = h.render_report(dict(doc, rows=no_pd), {})
    assert [c["status"] for c in checks["tinyllama-1.1b->llama-2-7b"]][:2] == ["N/A", "N/A"]


def test_split_rows_are_their_own_series_and_baseline_is_optional_above_8(tmp_path):
    """A run whose pdv server used the split topology merges as mode "pdv-split" (beside, not over,
    the one-process pdv rows) and gets its own target checks; where Baseline did not run (c > 8)
    the order check still holds PDV against PD."""
    h = load_harness()
    one = {
        "device": "test",
        "device_slug": "t",
        "label": "simulated acceptance α=0.7",
        "parameters": {},
        "servers": [{"pair": "tinyllama-1.1b->llama-2-7b", "mode": "pdv", "server_info": {"topology": "colocated"}}],
        "rows": [
            row("k0", 1, 100, 50),
            row("pd", 1, 120, 50),
            row("pdv", 1, 140, 40),
            row("k0", 16, 400, 100),
            row("pd", 16, 420, 110),
            row("pdv", 16, 410, 100),
        ],
    }
    split = {
        "device": "test",
        "device_slug": "t",
        "label": "simulated acceptance α=0.7",
        "parameters": {},
        "servers": [{"pair": "tinyllama-1.1b->llama-2-7b", "mode": "pdv", "server_info": {"topology": "split"}}],
        "rows": [row("pdv", 1, 150, 45), row("pdv", 16, 500, 90)],
    }
    merged = h.merge([one, split])
    modes = sorted((r["mode"], r["concurrency"]) for r in merged["rows"])
    assert ("pdv", 16) in modes and ("pdv-split", 16) in modes and len(modes) == 8
    text, checks = h.render_report(merged, {})
    statuses = {c["target"]: c["status"] for c in checks["tinyllama-1.1b->llama-2-7b"]}
    assert statuses["PDV ≥ PD ≥ Baseline throughput at every concurrency ≥ 8"] == "MISS"  # 410 < 420 at c=16
    split_order = [t for t in statuses if t.startswith("PDV split") and "≥ PD ≥ Baseline" in t]
    assert split_order and statuses[split_order[0]] == "PASS"  # 500 >= 420; Baseline not run at 16
    assert "PDV split" in text
