"""The draft-length decision of each step's batch (its k, and which requests probe while it is 0),
with the state it carries from step to step: the hysteresis, the k = 0 "off" decisions and their
rechecks, the probes' schedule, the k = 0 hold, and a decision taken ahead (`plan_ahead.plan_after`)
for the plan right after it. Torch-free.

The pure cost and goodput rules live in router/draft_length.py; the scheduler (router/scheduler.py)
asks this module for k and reserves the blocks. Keys of the per-decision dicts: "batch" (lock-step),
("group", g) (a pdv pipelined group), "single" (baseline).
"""

from __future__ import annotations

from collections.abc import Callable

from verifypd.domain.config import RuntimeConfig
from verifypd.router.draft_length import (
    PROBE_K,
    PROBE_MAX_LAG,
    ProbeSchedule,
    StepCostModel,
    batch_bucket,
    choose_batch_k,
    opening_k,
    pipelining_pays,
)
from verifypd.router.sequence import Sequence
from verifypd.router.zero_hold import ZeroHold

# A batch whose k is 0 re-evaluates the draft-length policy at least every this many steps (at
# once when acceptance, the batch or the config changes; see KDecision.batch_k).
RECHECK_OFF_EVERY = 16


class KDecision:
    def __init__(self, never_drafts: bool, pool_less: bool, cap: Callable[[RuntimeConfig, Sequence, int], int]):
        """`never_drafts`: the draft lane proposes nothing (`--draft none`); `pool_less`: it owns no
        KV pool (prompt lookup: nothing to catch up, any request can be probed); `cap`: a request's k
        within its limits (Scheduler.cap: max_k, tokens left, the context)."""
        self.never_drafts, self.pool_less, self.cap = never_drafts, pool_less, cap
        self.probes = ProbeSchedule()
        self.last_k: dict[object, int | None] = {}  # per decision key: the last k decided
        self.drafting: dict[object, int] = {}  # the same keys: the k the hysteresis compares with
        self.off: dict[object, tuple | None] = {}  # the same keys: (signature, steps) of a k = 0 decision
        self.pipelining: bool | None = None  # pdv: last step's choice (pipelined or lock-step)
        # plan_after's k decision when it drafted nothing: (request ids, k, probes), taken by the next
        # `decided_k` of the same requests instead of deciding again (one decision per step).
        self.decided: tuple[frozenset, int, dict] | None = None
        self.hold = ZeroHold()  # the k = 0 hold of the lock-step batch (router.zero_hold)
        self.probe_kv = False  # a prefill planned since the last step wrote draft KV only for a probe

    def draft_kv_reason(self, config: RuntimeConfig, costs: StepCostModel, batch: int) -> str | None:
        """Why a prefill now writes draft KV. "draft": drafting is fixed on (k_initial, or k_min > 0),
        or the policy has no acceptance estimate yet (it drafts k_initial), or a batch or group drafts
        now, or the policy would draft a batch of the running and waiting requests at the engine-wide
        acceptance (a new batch after one that ended at k = 0: an EAGLE head at 35 % acceptance
        resumes at once, and without draft KV its first drafting step would catch up on whole
        prompts). "probe": a probe is due and the budget affords an opening probe (probes draft only
        for requests whose draft KV is up to date: those just prefilled); that KV is then the probes'
        expense. None: no draft KV."""
        if config.k_max == 0:
            return None
        if not config.adaptive or config.k_min > 0:
            return "draft" if max(config.k_min, config.k_initial) > 0 else None
        alpha = costs.acceptance.alpha
        if alpha is None:
            return "draft" if config.k_initial > 0 else None
        if any(k > 0 for k in self.drafting.values()):
            return "draft"
        batch = max(batch, 1)
        if choose_batch_k(config, [alpha], costs, batch, config.k_max) > 0:
            return "draft"
        k_open = max(opening_k(config, costs, batch, config.k_max), PROBE_K)
        if self.probes.due and self.probes.affords(self._probe_extra(costs, batch, k_open)):
            return "probe"
        return None

    def charge_probe_kv(self, costs: StepCostModel, prefill_s: float, batch: int) -> None:
        """After a step: if its prefill wrote draft KV only for a probe (`_draft_kv_reason`), the
        draft's share of that prefill is charged to the probes (ProbeSchedule.charge). The share is
        a k = 1 step's cost above a plain one, in plain steps (about the draft's forward against the
        target's). On the H200 a 12-layer self draft's KV for 16 chat prompts added ~7 plain steps to
        each batch, and nothing charged it: probes cost 2-3 % of plain decoding at acceptance 0."""
        if not self.probe_kv:
            return
        self.probe_kv = False
        batch = max(batch, 1)
        plain = costs.step_s(batch, 0)
        share = min(max(costs.step_s(batch, 1) / plain - 1.0, 0.0), 1.0)
        self.probes.charge(prefill_s * share / plain)

    def pipeline_now(self, config: RuntimeConfig, costs: StepCostModel, decoding: list[Sequence]) -> bool:
        """pdv with pipelining allowed: pipeline this step only where it measures faster than
        lock-step at this many decoding requests (`pipelining_pays`); a lone request overlaps nothing."""
        if len(decoding) < 2:
            return False
        self.pipelining = pipelining_pays(config, self._alphas(costs, decoding), costs, len(decoding), self.pipelining)
        return self.pipelining

    @staticmethod
    def _alphas(costs: StepCostModel, seqs: list[Sequence]) -> list[float | None]:
        prior = costs.acceptance.alpha
        return [prior if s.alpha_estimate is None else s.alpha_estimate for s in seqs]

    def batch_k(
        self,
        config: RuntimeConfig,
        costs: StepCostModel,
        seqs: list[Sequence],
        hi: int,
        key: object,
        decoding: int | None = None,
    ) -> tuple[int, dict[str, int]]:
        """One k for `seqs` (see choose_batch_k), and while that k is 0 the requests to probe, by
        request id with the k each drafts: opening probes (`_opening_probes`) and, when one is due
        (ProbeSchedule), PROBE_K for the requests among `seqs` a probe costs no catch-up for.
        `decoding`: pdv pipelined, `seqs` is one group of that many decoding requests."""
        # Nothing can draft (`--draft none`, k_max 0): k 0 without asking the policy, as plain decoding.
        if not seqs or self.never_drafts or config.k_max == 0:
            if seqs:
                self.last_k[key] = self.drafting[key] = 0
                self.probes.record(0, False)
            return 0, {}
        if self._still_held(config, costs, seqs, hi, key, decoding):
            return 0, {}
        batch, current = decoding or len(seqs), self.drafting.get(key)
        plain_unmeasured = not costs.measured(batch, 0)
        # Off, the decision moves only with acceptance (probe outcomes), the batch or the config, and
        # slowly with the measured costs: recheck those at once, the costs every RECHECK_OFF_EVERY
        # steps. Evaluating it cost ~0.2 ms of host time a step at batch 64 while the GPU waited.
        signature = _off_signature(config, costs, seqs, hi, decoding)
        off = self.off.get(key)
        if off is not None and off[0] == signature and off[1] < RECHECK_OFF_EVERY and not plain_unmeasured:
            k_batch = 0
            self.off[key] = (signature, off[1] + 1)
        else:
            rate = costs.acceptance.proposal_rate
            rates = [rate if s.proposal_rate is None else s.proposal_rate for s in seqs]
            k_batch = choose_batch_k(
                config,
                self._alphas(costs, seqs),
                costs,
                batch,
                hi,
                current=current,
                pipelined=decoding is not None,
                rates=rates,
            )
            decided = config.adaptive and config.k_min == 0 and costs.acceptance.alpha is not None
            self.off[key] = (signature, 0) if k_batch == 0 and decided and not plain_unmeasured else None
        self.last_k[key] = k_batch  # a probe is not the batch's k: pdv groups ignore it
        # The hysteresis state ignores probes, and the one plain step that measures k = 0 at a new
        # batch size (choose_batch_k): a drafting batch stays "drafting" through it.
        if not (k_batch == 0 and plain_unmeasured and current):
            self.drafting[key] = k_batch
        probed: dict[str, int] = {}
        periodic = False
        # Held through the plain steps that measure a new batch size too (the batch shrank into a
        # smaller bucket: k 0 until measured, and still no request a probe could take); not once the
        # decision is no longer "off" for another reason (the config changed).
        held = k_batch == 0 and self.held(key, decoding) and (self.off.get(key) is not None or plain_unmeasured)
        if held:
            self.hold.steps += 1
        fresh = [] if held else [s for s in seqs if not s.opened]  # (most steps: none)
        if k_batch == 0 and config.adaptive and not held:
            if fresh and not plain_unmeasured:  # that step measures plain decoding: the whole batch at k = 0
                probed = self._opening_probes(config, costs, fresh, hi, batch)
            if hi >= PROBE_K and self.probes.due and self.probes.affords(self._probe_extra(costs, batch, PROBE_K)):
                due = {
                    s.request_id: PROBE_K for s in seqs if s.request_id not in probed and self._cheap_probe(config, s)
                }
                if due:
                    self.probes.spend(self._probe_extra(costs, batch, PROBE_K))
                periodic = bool(due)
                probed.update(due)
        self.probes.record(k_batch, periodic)
        if not plain_unmeasured:
            for seq in fresh:  # a request's first decision is its only opening probe (its lag only grows)
                seq.opened = True
        if k_batch or probed:  # drafting (any batch or pdv group) may bring a draft KV up to date
            self.hold.end()
        elif not held and key == "batch" and decoding is None:
            self._begin_hold(config, costs, seqs, hi, key)
        return k_batch, probed

    def _still_held(
        self,
        config: RuntimeConfig,
        costs: StepCostModel,
        seqs: list[Sequence],
        hi: int,
        key: object,
        decoding: int | None,
    ) -> bool:
        """A decision in the k = 0 hold that the last one stands for: the same batch, config and
        acceptance (`_off_signature`), the costs' recheck not due. Recorded as a k = 0 decision and
        nothing else evaluated, so the step costs the host what a plain step does."""
        off = self.off.get(key)
        if off is None or off[1] >= RECHECK_OFF_EVERY or key != "batch" or decoding is not None:
            return False  # (only the lock-step batch is held)
        if not self.hold.active(self.probes):
            return False
        if off[0] != _off_signature(config, costs, seqs, hi, decoding):
            return False
        self.off[key] = (off[0], off[1] + 1)
        self.hold.steps += 1
        self.probes.record(0, False)
        return True

    def held(self, key: object, decoding: int | None) -> bool:
        """The lock-step batch is in its k = 0 hold (router.zero_hold). (`_batch_k` ends it when a
        decision drafts or probes, or is no longer off; plan_follow takes that decision before a
        chained step relies on it.)"""
        return key == "batch" and decoding is None and self.hold.active(self.probes)

    def _begin_hold(
        self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], hi: int, key: object
    ) -> None:
        """After a decision that drafted and probed nothing: does the batch enter the k = 0 hold? Off
        (decided) and no request in its first decode step (an opening probe). With a draft KV to
        catch up, none whose draft a probe could take: held until one joins. Pool-less (prompt
        lookup: any request can be probed), held until a periodic probe may run (a probe due now
        and covered would have run in this decision)."""
        if self.off.get(key) is None or any(not s.opened for s in seqs):
            self.hold.end()
        elif self.pool_less:
            self.hold.begin(self._probe_extra(costs, len(seqs), PROBE_K) if hi >= PROBE_K else None)
        elif any(self._cheap_probe(config, s) for s in seqs):
            self.hold.end()
        else:
            self.hold.begin()

    @staticmethod
    def _probe_extra(costs: StepCostModel, batch: int, k: int) -> float:
        """What a step drafting k costs above a plain step at `batch`, in plain steps (measured, or
        estimated from the ks measured: StepCostModel.step_s); what a probe spends (ProbeSchedule)."""
        plain = costs.step_s(batch, 0)
        return max(costs.step_s(batch, k) / plain - 1.0, 0.0)

    def _opening_probes(
        self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], hi: int, batch: int
    ) -> dict[str, int]:
        """While the batch does not draft, each request in its first decode step drafts anyway
        (`opening_k`: k_initial, or less where the measured costs make that step dear), where
        that costs no catch-up (`_cheap_probe`): its own acceptance is then known
        from its start instead of being the engine-wide estimate, which other requests made (one
        kind of request switching drafting off kept the next kind from ever drafting, and the
        periodic probes, k = 1 and backing off to one per PROBE_MAX steps, rarely corrected it).
        Once per request; a probe of part of the batch is not a cost sample (router). Paid from the
        probes' budget (ProbeSchedule.affords): a request whose first step the budget does not
        cover starts from the engine-wide estimate, as before opening probes."""
        k_open = opening_k(config, costs, batch, hi)
        if k_open <= 0:
            return {}
        probed = {s.request_id: self.cap(config, s, k_open) for s in seqs if self._cheap_probe(config, s)}
        if not probed:
            return {}
        extra = self._probe_extra(costs, batch, k_open)
        if not self.probes.affords(extra):
            return {}
        self.probes.spend(extra)
        return probed

    # -- overlapped scheduling (steps.overlapped; plan_ahead.plan_follow, admit_follow) ---------
    def plain_certain(self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], held: bool) -> bool:
        """`_plan_decode` would give every one of `seqs` k = 0 and probe none, whatever the
        acceptance the step in flight teaches (a k = 0 step teaches none). `held`: in the k = 0 hold."""
        if config.schedule == "baseline" or config.pipelined or config.k_min > 0:
            return False
        if held:  # no request can be probed now; decided off (see _batch_k)
            return True
        if config.k_max == 0 or self.never_drafts or all(s.spec.max_k == 0 for s in seqs):
            return True
        # A due probe runs only for a request whose draft KV is close behind (_cheap_probe); a
        # request not cheap now is not cheap one step on (its lag only grows), so the chain need not
        # wait for a probe none can take (plan_follow checks `_batch_k`'s probes again anyway).
        if config.adaptive and any(self._cheap_probe(config, s) for s in seqs if not s.opened):
            k_open = opening_k(config, costs, len(seqs), config.k_max)
            if k_open > 0 and self.probes.affords(self._probe_extra(costs, len(seqs), k_open)):
                return False  # an opening probe (_opening_probes)
        if (
            config.adaptive
            and self.probes.due
            and config.k_max >= PROBE_K
            and self.probes.affords(self._probe_extra(costs, len(seqs), PROBE_K))
            and any(self._cheap_probe(config, s) for s in seqs)
        ):
            return False
        if not config.adaptive or costs.acceptance.alpha is None:  # choose_batch_k: k_initial
            return config.k_initial == 0
        if not costs.measured(len(seqs), 0):  # plain decoding measured first (PLAIN_SAMPLES steps): k 0
            return True
        # Decided off: plan_follow's _batch_k takes that decision again for this batch as plan
        # would, from the same acceptance (a k = 0 step in flight teaches none), also where plan
        # would re-decide (the batch changed, the periodic recheck of the costs is due); the chain
        # ends only if that decision drafts. Ending it at each of those cost a regular step each
        # time: ngram at batch 16, hardly drafting, ran at 0.91 x plain decoding on the H200.
        return self.off.get("batch") is not None

    def _cheap_probe(self, config: RuntimeConfig, seq: Sequence) -> bool:
        """A probe of `seq` is a normal k = PROBE_K step: its draft input is at most PROBE_MAX_LAG + 1
        tokens (a pool-less draft lane has no KV to catch up), and it can take PROBE_K drafts."""
        lag = seq.pending_pos - seq.draft_computed
        return (self.pool_less or lag <= PROBE_MAX_LAG) and self.cap(config, seq, PROBE_K) == PROBE_K

    def decided_k(
        self, config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], key: str
    ) -> tuple[int, dict]:
        """`_batch_k` for `_plan_decode`, or the decision plan_after already took for these requests."""
        decided, self.decided = self.decided, None
        if decided is not None and key == "batch" and decided[0] == frozenset(s.request_id for s in seqs):
            return decided[1], decided[2]
        return self.batch_k(config, costs, seqs, config.k_max, key)


def _off_signature(
    config: RuntimeConfig, costs: StepCostModel, seqs: list[Sequence], hi: int, decoding: int | None
) -> tuple:
    """What a k = 0 decision depends on besides the measured costs (see KDecision.batch_k): the
    batch (lock-step: its size gives its bucket; a pdv group: the bucket of every decoding request),
    the config and acceptance. (It is computed in every step of the k = 0 hold: kept cheap.)"""
    acceptance = costs.acceptance
    bucket = None if decoding is None else batch_bucket(decoding)
    return (bucket, len(seqs), hi, config, acceptance.observations, acceptance.asked)
