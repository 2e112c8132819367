"""What `--draft` means: parsing, defaults, and the pool-less draft lanes. Torch-free.

    ngram | ngram:MIN-MAX   prompt lookup (verifypd.spec_decode.ngram): no model, no pool, no device
    none                    no draft at all (plain decoding; what --no-speculation loads)
    self:N                  the target's first N layers + final norm + head (a model draft lane)
    eagle:PATH              an EAGLE-3-style head (HF layout) drafting from the target's hidden
                            states (verifypd.model.eagle_draft; `verifypd distill` trains one)
    eagle+ngram:PATH        the head, and prompt lookup's proposal instead wherever the request's
                            context repeats its last 3+ tokens (verifypd.spec_decode.lookup_mix)
    anything else           a draft model spec (local dir, .gguf, HF cache name), same tokenizer

Adding a draft kind is one `DraftSpec.kind`, one parse rule here, and one builder: pool-less kinds
build their lane in `verifypd.spec_decode.ngram.poolless_draft_lane` (torch-free); model kinds (e.g. a trained draft
head distilled from the target) load their weights in `verifypd.model.build.load_draft_model`
and run in the model draft lane, which owns a draft pool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from verifypd.domain.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, default_draft  # shared with the operator
from verifypd.heads import shipped_head

DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 4  # `ngram` alone: the longest match of 4 down to 2 tokens wins

DRAFT_HELP = (
    "draft: 'ngram' or 'ngram:MIN-MAX' (prompt lookup in the request's own context: no model, no GPU, "
    "no KV pool), 'self:N' (the target's first N layers), 'eagle:PATH' (an EAGLE-3 head drafting from the "
    "target's hidden states, e.g. one written by `verifypd distill`), 'eagle+ngram:PATH' (that head, and prompt "
    "lookup's proposal where the context repeats its last 3+ tokens), 'none', or a draft model spec. "
    "Default: the best draft measured for the target on its device: on a GPU the embedded model's "
    "shipped head (eagle:smollm2); on the CPU, and for any other target, "
    f"{DEFAULT_DRAFT} (prompt lookup; verifypd/domain/defaults.py states the rule and the figures). "
    "--no-speculation loads no draft."
)


class DraftSpecError(ValueError):
    """A --draft value that cannot be used; the message names the flag and the valid forms."""


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "ngram" | "none" | "self" | "eagle" | "model"
    text: str  # as given (what LaneInfo.draft_model reports)
    min_n: int = 0  # ngram
    max_n: int = 0  # ngram
    layers: int = 0  # self
    model: str = ""  # model; eagle: the head's directory
    lookup: bool = False  # eagle+ngram: prompt lookup where the context repeats (engine.lookup_mix)

    @property
    def needs_model(self) -> bool:
        """Whether the draft has weights (and therefore a model draft lane with its own KV pool)."""
        return self.kind in ("self", "eagle", "model")

    def check_layers(self, target_layers: int) -> int:
        """N of a self:N draft, checked against the target's depth."""
        if not (1 <= self.layers <= target_layers):
            raise DraftSpecError(
                f"--draft self:N needs 1 <= N <= {target_layers} (the target has {target_layers} "
                f"layers), got {self.layers}"
            )
        return self.layers


_NGRAM = re.compile(r"ngram(?::(\d+)-(\d+))?")


def parse_draft(text: str) -> DraftSpec:
    text = (text or "").strip()
    if not text:
        raise DraftSpecError(
            "--draft is empty: give ngram, ngram:MIN-MAX, self:N, eagle:PATH, eagle+ngram:PATH, none or a model"
        )
    if text == "none":
        return DraftSpec("none", text)
    if text.startswith("ngram"):
        m = _NGRAM.fullmatch(text)
        if m is None:
            raise DraftSpecError(f"--draft ngram takes the form ngram or ngram:MIN-MAX (e.g. ngram:2-4), got {text!r}")
        lo, hi = (int(m.group(1)), int(m.group(2))) if m.group(1) else (DEFAULT_MIN_N, DEFAULT_MAX_N)
        if not (1 <= lo <= hi <= 32):
            raise DraftSpecError(f"--draft ngram:MIN-MAX needs 1 <= MIN <= MAX <= 32, got {text!r}")
        return DraftSpec("ngram", text, min_n=lo, max_n=hi)
    if text.startswith("self:"):
        try:
            layers = int(text.removeprefix("self:"))
        except ValueError:
            raise DraftSpecError(f"--draft self:N needs an integer N, got {text!r}") from None
        return DraftSpec("self", text, layers=layers)
    for prefix in ("eagle:", "eagle+ngram:"):
        if text.startswith(prefix):
            path = text.removeprefix(prefix).strip()
            path = shipped_head(path) or path  # a head shipped in the package, by name (verifypd.heads)
            if not path:
                raise DraftSpecError(
                    f"--draft {prefix}PATH needs the head's directory (config.json + model.safetensors)"
                )
            return DraftSpec("eagle", text, model=path, lookup=prefix == "eagle+ngram:")
    return DraftSpec("model", text, model=text)


def resolve_draft(
    draft: str | None, no_speculation: bool = False, target: str = DEFAULT_TARGET, gpu: bool = False
) -> str:
    """The --draft to use: none for --no-speculation (nothing to load), the named one, else the
    default for `target` on this device (domain.defaults.default_draft)."""
    if no_speculation:
        return "none"
    return default_draft(target, gpu) if draft is None else draft
