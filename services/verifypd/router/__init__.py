"""Floor 3: the router and its bookkeeping, torch-free and unit-tested without a model.

router.py              owns every request's state; `step` picks this step's strategy and runs it
step_context.py        StepContext: what the strategies share (lanes, pools, scheduler, config, step
                       costs, sequences) and the operations that call the lanes or change state (lane
                       calls, commits, streaming, finishing)
lane_items.py          the lane items a step sends (KV handles, grammar masks), read off the context
proposals.py           a step's draft proposals (prompt lookup mixed in); prefill_calls.py: a prefill
                       call run and committed, or started beside a verify call
steps/                 the step strategies, one per module: lock_step, pipelined, baseline, overlapped,
                       speculate_ahead (with draft_after)
scheduler.py           continuous batching: who prefills (chunked), who decodes with which k
step_plan.py           a step's plan (the scheduler's output): prefill chunks, decode work with its k
block_reservations.py  the blocks a plan reserves over the target and draft pools, all or nothing
pipeline_groups.py     pdv pipelining's two groups, the drafting group's k limit
plan_ahead.py          steps planned on the scheduler's state before the step in flight reaches the host
sequence.py            a request's state machine; block_manager.py: paged-KV block bookkeeping
commits.py             lane results into a request's state: drafts taken, verdicts recorded, tokens appended
draft_length.py        the draft-length (k) policy; step_costs.py: measured step costs and acceptance
detokenize.py          incremental detokenization and stop strings
"""
