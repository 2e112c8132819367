"""The device half of a tree step, after the draft's catch-up: grow the tree, verify every node in one
target pass (tree attention), walk the verdict, move the accepted path's KV and features into place.
Fixed shapes and no host sync, so on CUDA (Triton attention, greedy) it is one CUDA graph per batch
size, replayed from static buffers; elsewhere (CPU, sampled rows) the same function runs eagerly.
graphs="eager": the graphs' static buffers with the function run directly (tests of the plumbing).
Capturing (and its warm-up run) writes a tree at block 0 of both pools: the decoder never gives
block 0 to a sequence.

Static buffers of a batch of B rows (T = the decoder's block-table width):
    root [B]             the pending tokens (tree roots)
    logp [B, V] float32  the draft's log-probabilities after the root (catch-up)
    hidden [B, H]        the head's root row output (EAGLE heads only)
    draft_base [B], draft_tables [B, T]    the draft's first tree row and block tables
    base [B], tables [B, T]                the target's: the root's position and block tables
Outputs: path_tokens [B, D + 1] (the root, then the accepted drafts), accepted [B], bonus [B].
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verifypd.domain.draft_tree import TreeShape
from verifypd.model.features import FeaturePool
from verifypd.model.graph_runner import EagerReplay, Replayable, capture_graph
from verifypd.model.llama import BatchLayout, PagedLlama
from verifypd.model.tree_kv import accepted_moves, move_kv, move_rows, slots_at
from verifypd.spec_decode.tree import walk
from verifypd.spec_decode.tree_draft import CatchUp, EagleTreeDraft, ModelTreeDraft, grow_from_root

log = logging.getLogger(__name__)

# The target's choice after each node: logits [R, V], the positions the chosen tokens take [R] -> [R].
Choose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepBuffers:
    root: torch.Tensor
    logp: torch.Tensor
    hidden: torch.Tensor | None
    draft_base: torch.Tensor
    draft_tables: torch.Tensor
    base: torch.Tensor
    tables: torch.Tensor
    path_tokens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    bonus: torch.Tensor | None = None


class TreeStep:
    def __init__(
        self,
        target: PagedLlama,
        target_pool: torch.Tensor,
        features: FeaturePool | None,
        drafter: ModelTreeDraft | EagleTreeDraft,
        shape: TreeShape,
        block_size: int,
        width: int,
        graphs: bool | str,
    ):
        self.target, self.pool, self.features, self.drafter = target, target_pool, features, drafter
        self.shape, self.block_size, self.width = shape, block_size, width
        self.graphs = graphs
        self.captured: dict[int, tuple[Replayable, StepBuffers]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if graphs is True else None
        self.capture_seconds = 0.0
        self.graph_error: str | None = None  # why graphs were given up (run eagerly since), if they were

    def run(
        self, root: torch.Tensor, c: CatchUp, base: torch.Tensor, tables: torch.Tensor, choose: Choose | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path_tokens, accepted, bonus) on the device. choose None: greedy (argmax), graphed where
        the step has graphs; a sampled `choose` runs eagerly."""
        if not self.graphs or choose is not None:
            buf = StepBuffers(root, c.logp, c.hidden, c.base, self.pad(c.tables), base, self.pad(tables))
            self.core(buf, choose)
            assert buf.path_tokens is not None and buf.accepted is not None and buf.bonus is not None
            return buf.path_tokens, buf.accepted, buf.bonus
        rows = root.shape[0]
        if rows not in self.captured:
            try:
                self.captured[rows] = self.capture(rows, c)
            except RuntimeError as exc:  # a capture the device refuses: run eagerly from now on, say why
                self.graph_error = f"{type(exc).__name__}: {exc}"
                log.warning("draft-tree step: CUDA graph capture failed, running eagerly: %s", self.graph_error)
                self.graphs = False
                return self.run(root, c, base, tables, choose)
        graph, buf = self.captured[rows]
        buf.root.copy_(root)
        buf.logp.copy_(c.logp)
        if buf.hidden is not None and c.hidden is not None:
            buf.hidden.copy_(c.hidden)
        buf.draft_base.copy_(c.base)
        buf.draft_tables.copy_(self.pad(c.tables))
        buf.base.copy_(base)
        buf.tables.copy_(self.pad(tables))
        graph.replay()
        assert buf.path_tokens is not None and buf.accepted is not None and buf.bonus is not None
        return buf.path_tokens, buf.accepted, buf.bonus

    def pad(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables widened to the step's fixed width (entries past a row's blocks are never read)."""
        if tables.shape[1] == self.width:
            return tables
        out = tables.new_zeros(tables.shape[0], self.width)
        out[:, : tables.shape[1]] = tables
        return out

    def capture(self, rows: int, like: CatchUp) -> tuple[Replayable, StepBuffers]:
        dev = like.logp.device
        zeros = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        buf = StepBuffers(
            root=zeros(rows),
            logp=torch.zeros(rows, like.logp.shape[1], dtype=like.logp.dtype, device=dev),
            hidden=None
            if like.hidden is None
            else torch.zeros(rows, like.hidden.shape[1], dtype=like.hidden.dtype, device=dev),
            # the warm-up run writes through these: a tree at position 1 of block 0 (never a live row's)
            draft_base=torch.ones(rows, dtype=torch.long, device=dev),
            draft_tables=zeros(rows, self.width),
            base=torch.ones(rows, dtype=torch.long, device=dev),
            tables=zeros(rows, self.width),
        )
        t0 = time.perf_counter()
        graph: Replayable
        if self.graphs == "eager":
            self.core(buf, None)  # the warm-up run allocates the outputs, as capture_graph's does
            graph = EagerReplay(lambda: self.core(buf, None))
        else:
            graph = capture_graph(lambda: self.core(buf, None), self.mempool, None)
        self.capture_seconds += time.perf_counter() - t0
        return graph, buf

    def core(self, buf: StepBuffers, choose: Choose | None) -> None:
        """The step's device work from `buf` into its outputs (module doc)."""
        shape, dev = self.shape, buf.root.device
        tree = grow_from_root(
            self.drafter, buf.root, CatchUp(buf.logp, buf.hidden, buf.draft_base, buf.draft_tables), shape
        )
        rows, nodes = tree.tokens.shape
        index = buf.base[:, None] + torch.arange(nodes, device=dev)
        batch = BatchLayout(
            input_ids=tree.tokens.reshape(-1),
            positions=(buf.base[:, None] + tree.depth).reshape(-1),
            slots=slots_at(buf.tables, index, self.block_size).reshape(-1),
            block_tables=buf.tables,
            query_start=torch.arange(rows + 1, device=dev, dtype=torch.int32) * nodes,
            max_query=nodes,
            tree_base=buf.base,
            tree_len=torch.full((rows,), nodes, device=dev, dtype=torch.int32),
            tree_bits=tree.ancestors.reshape(-1),
        )
        logits = self.target.forward(self.pool, batch, torch.arange(rows * nodes, device=dev))
        choice = logits.argmax(-1) if choose is None else choose(logits, batch.positions + 1)
        verdict = walk(tree, choice.view(rows, nodes), max_depth=shape.depth)
        src, dst = accepted_moves(buf.tables, buf.base, verdict.path, verdict.accepted, self.block_size)
        move_kv(self.pool, src, dst)
        if self.features is not None:
            move_rows(self.features.tensor, src, dst)
        path_tokens = tree.tokens.gather(1, verdict.path)
        if buf.path_tokens is None:
            buf.path_tokens, buf.accepted, buf.bonus = path_tokens, verdict.accepted, verdict.bonus
        else:  # a replayed graph's outputs: written in place
            assert buf.accepted is not None and buf.bonus is not None
            buf.path_tokens.copy_(path_tokens)
            buf.accepted.copy_(verdict.accepted)
            buf.bonus.copy_(verdict.bonus)
