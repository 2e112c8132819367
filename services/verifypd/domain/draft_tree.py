"""`--draft-tree topk=K,budget=N,depth=D`: the shape of EAGLE-2-style draft trees (spec_decode.tree).
Torch-free, so the command line checks it before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

from verifypd.domain.requests import InvalidRequest

MAX_TREE_NODES = 64  # the ancestor bitmask is one int64 per node


@dataclass(frozen=True)
class TreeShape:
    """`--draft-tree topk=K,budget=N,depth=D`: each expansion keeps the `topk` best children of the
    `topk` best frontier nodes, `depth` expansions, then the tree is cut to `budget` drafted nodes."""

    topk: int = 4
    budget: int = 32
    depth: int = 6

    def validate(self) -> None:
        """InvalidRequest (a ValueError) naming the field."""
        if not 1 <= self.topk <= 16:
            raise InvalidRequest(f"draft tree topk must be in [1, 16], got {self.topk}")
        if not 1 <= self.depth <= 16:
            raise InvalidRequest(f"draft tree depth must be in [1, 16], got {self.depth}")
        if not 1 <= self.budget <= MAX_TREE_NODES - 1:
            raise InvalidRequest(f"draft tree budget must be in [1, {MAX_TREE_NODES - 1}], got {self.budget}")
        if self.budget > self.candidates:
            raise InvalidRequest(
                f"draft tree budget {self.budget} exceeds the {self.candidates} candidates of "
                f"topk={self.topk}, depth={self.depth}"
            )

    @property
    def candidates(self) -> int:
        """Candidate nodes drafted: topk at depth 1, topk * topk at every later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def nodes(self) -> int:
        return 1 + self.budget


def parse_tree_shape(text: str) -> TreeShape:
    """ "topk=4,budget=32,depth=6" (any subset; the rest default). InvalidRequest naming the field."""
    fields = {"topk": 4, "budget": 32, "depth": 6}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise InvalidRequest(f"--draft-tree: expected topk=K,budget=N,depth=D, got {part!r}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise InvalidRequest(f"--draft-tree: {key} must be an integer, got {value.strip()!r}") from None
    shape = TreeShape(**fields)
    try:
        shape.validate()
    except InvalidRequest as e:
        raise InvalidRequest(f"--draft-tree: {e}") from None
    return shape
