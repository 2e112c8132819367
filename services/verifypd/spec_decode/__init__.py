"""Proposers: where draft tokens come from, behind the draft-lane interface (domain.lanes.DraftLane).

ngram.py       prompt lookup (no model, no pool) and the no-draft lane
lookup_mix.py  a feature draft mixed with prompt lookup
tree.py, tree_draft.py, tree_step.py, tree_decode.py   draft trees (EAGLE-2), offline (`--draft-tree`)
Model drafts (a smaller model, `self:N`) and EAGLE heads run on the model room's forward
(model.draft_loop, model.eagle_draft) through the in-process lanes.
"""
