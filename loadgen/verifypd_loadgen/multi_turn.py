"""`--workload multi-turn`: conversations whose every turn resends the conversation so far.

Turn t of a conversation sends: its earlier turns' user messages and replies, then a new user
message (`--input-len` tokens); its `max_tokens` (`--output-len`) is also the length of the reply
the next turn resends. Replies are synthetic token ids of that length, not the server's answer
(the stream of requests is fixed in advance, seeded, as every workload's is), so what a later turn
shares with the earlier ones is everything up to its last user message, less the server's own
reply tokens. This is what a server's prefix cache can serve: compare a run against one with the
server's `--no-prefix-cache` (TTFT, throughput).

Requests go round-robin over `--conversations` conversations: turn 1 of each, then turn 2 of each,
and so on, then the next set of conversations. With at most that many requests in flight, a
conversation's next turn is sent after its previous turn was (closed loop: after it finished, as a
user waits for the reply).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from verifypd_loadgen.workload import Prompt, RequestSpec, Workload

WORKLOADS = ("uniform", "mixed", "multi-turn")  # --workload (mixed: cli.py; multi-turn: here)


@dataclass
class MultiTurnWorkload(Workload):
    turns: int = 4
    conversations: int = 8

    def __post_init__(self) -> None:
        if self.prompts is not None:
            raise ValueError("--workload multi-turn builds synthetic conversations: --dataset must be synthetic")
        if self.turns < 1 or self.conversations < 1:
            raise ValueError("--turns and --conversations must be >= 1")

    def describe(self) -> str:
        return f"synthetic multi-turn (turns={self.turns}, conversations={self.conversations})"

    def requests(self, stream: int = 0) -> Iterator[RequestSpec]:
        rng = np.random.default_rng([self.seed, stream])
        prios = np.array([p for p, _ in self.priority_mix])
        weights = np.array([w for _, w in self.priority_mix])
        lo, hi = self.vocab_range
        output = self.output_len or self.DEFAULT_OUTPUT
        while True:
            history: list[list[int]] = [[] for _ in range(self.conversations)]
            for _turn in range(self.turns):
                for convo in history:
                    convo += [int(t) for t in rng.integers(lo, hi, size=self.input_len.sample(rng))]
                    max_tokens = output.sample(rng)
                    yield RequestSpec(
                        prompt=Prompt(token_ids=list(convo)),
                        max_tokens=max_tokens,
                        priority=int(rng.choice(prios, p=weights)),
                        temperature=self.temperature,
                        seed=int(rng.integers(0, 2**63)),
                        stop_at_eos=False,
                    )
                    convo += [int(t) for t in rng.integers(lo, hi, size=max_tokens)]  # the reply, resent next turn
