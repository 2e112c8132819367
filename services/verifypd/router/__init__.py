"""Floor 3: the router and its bookkeeping, torch-free and unit-tested without a model.

router.py        owns every request's state; `step` runs one step of the speculative loop
scheduler.py     continuous batching: who prefills (chunked), who decodes; scheduler_follow.py plans ahead
sequence.py      a request's state machine; block_manager.py: paged-KV block bookkeeping
draft_length.py  the draft-length (k) policy; step_costs.py: measured step costs and acceptance
overlap.py, spec_ahead.py, draft_after.py   steps launched before the one before them has reached the host
detokenize.py    incremental detokenization and stop strings
"""
