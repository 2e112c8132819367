"""The model families exact against transformers on the GPU, through the Triton kernels and CUDA graphs.

Runs tests/model/test_model_families.py (tiny random checkpoints written with transformers' own
config classes, float32: logits of our paged forward on both backends, and greedy decoding through
the engine with no speculation, a self-draft and prompt lookup, against `transformers.generate` on the
CPU) and the kernel tests of the sliding window, soft-capping and q/k norm (tests/model/
test_model_paged_attention.py, test_model_fused_kernels.py) with VERIFYPD_TEST_DEVICE=cuda, and writes
each test's outcome as JSON. Random weights: this checks exactness, not quality. Usage (GPU):

    python bench/correctness/families_cuda.py --out families_cuda.json

--smoke runs the same selection on the CPU (the kernels under the Triton interpreter), reference
logits and kernel tests only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_meta import metadata  # noqa: E402

TESTS = [
    "tests/model/test_model_families.py",
    "tests/model/test_model_paged_attention.py",
    "tests/model/test_model_fused_kernels.py",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON result path")
    parser.add_argument("--smoke", action="store_true", help="CPU: a small selection under the interpreter")
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, d) for d in ("services", "operator", "loadgen")] + [env.get("PYTHONPATH", "")]
    )
    env["VERIFYPD_TEST_DEVICE"] = "cpu" if args.smoke else "cuda"
    select = ["-k", "features or reference or sliding or qk_norm"] if args.smoke else []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        proc = subprocess.run(cmd + select + TESTS, cwd=ROOT, env=env, capture_output=True, text=True)
        cases = ET.parse(report).getroot().iter("testcase")
        outcomes = {}
        for case in cases:
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failure", "error", "skipped")}
    result = {
        **metadata(),
        "what": "model families vs transformers (random weights, float32), Triton kernels and CUDA graphs"
        + (" (SMOKE: CPU, interpreter)" if args.smoke else ""),
        "pytest_exit_code": proc.returncode,
        "counts": counts,
        "tests": outcomes,
        "pytest_tail": proc.stdout[-4000:],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(counts), "->", args.out)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
