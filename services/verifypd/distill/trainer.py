"""The training loop of `verifypd distill`: batches by tokens, AdamW with warm-up + cosine decay,
checkpoints (DIR/checkpoints/step-N: the head in its published layout + optimizer state + progress),
resume from the newest, a held-out estimate of accepted length, and the final head in DIR.

Checkpoint files are local (torch.save of the optimizer's tensors, loaded with weights_only=True);
nothing here travels over a network.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import shutil
import time
from dataclasses import dataclass

import torch

from verifypd.distill.capture import TargetCapture
from verifypd.distill.head_train import TrainableHead, accepted_length, distill_loss
from verifypd.model.eagle_head import EagleConfig, load_eagle_head, save_eagle_head


@dataclass
class TrainSettings:
    steps: int = 2000
    batch_tokens: int = 8192
    lr: float = 5e-4
    warmup: int = 100
    chain_steps: int = 4  # unrolled chain steps (the k the head learns to draft)
    # Rows the loss counts: "all" (prompts too) or "answers" (rows whose next token the target
    # generated: what the engine drafts; as the EAGLE/SpecForge loss masks keep assistant turns).
    # The prompt rows' features reach the head either way, as attention keys. One H200 run with
    # "answers" (and the whole vocabulary) measured no better (docs/eagle_results.md, the recipes before it).
    loss_rows: str = "all"
    checkpoint_every: int = 200
    eval_every: int = 500
    max_minutes: float | None = None  # of the whole run (data generation included), from `started`
    fit_steps: bool = False  # with max_minutes: lower `steps` so the schedule ends in time
    seed: int = 0
    keep_checkpoints: int = 2


def batches(rows: list[dict], batch_tokens: int, seed: int, epoch: int) -> list[list[dict]]:
    """Shuffled batches of sequences, each at most batch_tokens tokens (padded length x count)."""
    order = rows[:]
    random.Random(seed * 1000 + epoch).shuffle(order)
    out: list[list[dict]] = []
    current: list[dict] = []
    longest = 0
    for row in order:
        longest_next = max(longest, len(row["tokens"]))
        if current and longest_next * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, longest_next = [], len(row["tokens"])
        current.append(row)
        longest = longest_next
    if current:
        out.append(current)
    return out


def data_position(rows: list[dict], batch_tokens: int, seed: int, step: int) -> tuple[int, int]:
    """(epoch, batch index in it) of training step `step`: where an uninterrupted run would be, so a
    resumed run takes the batches it would have taken (epochs hold different batch counts)."""
    epoch = 0
    while True:
        count = len(batches(rows, batch_tokens, seed, epoch))
        if step < count:
            return epoch, step
        step, epoch = step - count, epoch + 1


def learning_rate(settings: TrainSettings, step: int) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def latest_checkpoint(out: pathlib.Path) -> pathlib.Path | None:
    found = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))
    return found[-1] if found else None


class Trainer:
    def __init__(
        self,
        target,
        config: EagleConfig,
        weights,
        out: pathlib.Path,
        settings: TrainSettings,
        train_lm_head: bool,
        device: torch.device,
        log=print,
    ):
        self.target, self.config, self.out, self.s = target, config, out, settings
        self.device, self.log, self.train_lm_head = device, log, train_lm_head
        self.head = TrainableHead(config, weights, target.weights.embed, train_lm_head=train_lm_head).to(device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.head.parameters() if p.requires_grad], lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.step = 0
        self.history: list[dict] = []

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: pathlib.Path, dtype: torch.dtype | None = None) -> None:
        """The head in its published layout (checkpoints: fp32 master weights, dtype None)."""
        save_eagle_head(path, self.config, self.head.weights(), with_lm_head=self.train_lm_head, dtype=dtype)

    def checkpoint(self) -> pathlib.Path:
        path = self.out / "checkpoints" / f"step-{self.step}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.save(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        progress = {"step": self.step, "schedule_steps": self.s.steps, "history": self.history}
        (tmp / "progress.json").write_text(json.dumps(progress) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # a checkpoint is complete or absent
        for old in sorted((self.out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))[
            : -self.s.keep_checkpoints
        ]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def resume(self, path: pathlib.Path) -> None:
        _, weights = load_eagle_head(
            str(path), self.target.shape, self.target.weights.lm_head, self.device, torch.float32
        )
        fresh = TrainableHead(self.config, weights, self.target.weights.embed, train_lm_head=self.train_lm_head)
        self.head.load_state_dict(fresh.state_dict())
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True))
        progress = json.loads((path / "progress.json").read_text())
        self.step, self.history = progress["step"], progress["history"]
        # The learning-rate schedule is the checkpoint's: its end (--steps, or what --fit-steps lowered it
        # to) stays where it was, whatever --steps says now; --fit-steps in this run may lower it again.
        schedule = progress.get("schedule_steps", self.s.steps)
        if schedule != self.s.steps:
            self.log(
                f"resumed run: the schedule ends at step {schedule}, as the checkpoint's did "
                f"(--steps {self.s.steps} is not used on resume)"
            )
        self.s.steps = schedule
        self.log(f"resumed from {path} at step {self.step}")

    # -- training ----------------------------------------------------------------------------
    def train(
        self, train_rows: list[dict], heldout_rows: list[dict], progress_bar: bool = True, started: float | None = None
    ) -> bool:
        """Trains up to settings.steps (or max_minutes after `started`, a time.monotonic() value; default
        now); returns True when all steps are done."""
        from tqdm import tqdm

        longest = max(len(r["tokens"]) for r in train_rows + heldout_rows)
        self.capture = TargetCapture(
            self.target, self.config.aux_layer_ids, self.device, max(self.s.batch_tokens, longest)
        )
        t0 = time.monotonic() if started is None else started
        fit_at, fit_from = self.step + 20, (self.step, time.monotonic())
        bar = tqdm(total=self.s.steps, initial=self.step, disable=not progress_bar, desc="distill", unit="step")
        epoch, skip = data_position(train_rows, self.s.batch_tokens, self.s.seed, self.step)
        while self.step < self.s.steps:
            for group in batches(train_rows, self.s.batch_tokens, self.s.seed, epoch)[skip:]:
                if self.step >= self.s.steps:
                    break
                loss, agree = self.train_step(group)
                self.step += 1
                bar.update(1)
                if self.s.fit_steps and self.s.max_minutes is not None and self.step == fit_at:
                    self._fit_steps(fit_from, t0, heldout_rows)
                bar.set_postfix(loss=f"{loss:.3f}", top1=f"{agree[0]:.2f}")
                if self.step % self.s.checkpoint_every == 0:
                    self.checkpoint()
                if heldout_rows and self.step % self.s.eval_every == 0:
                    self.record_eval(heldout_rows)
                if self.s.max_minutes is not None and time.monotonic() - t0 > 60 * self.s.max_minutes:
                    bar.close()
                    self.checkpoint()
                    self.log(f"stopped at step {self.step} after {self.s.max_minutes} min: run again with --resume")
                    return False
            epoch, skip = epoch + 1, 0
        bar.close()
        if self.step % self.s.checkpoint_every:  # a resumed run starts where this one ended
            self.checkpoint()
        return True

    def _fit_steps(self, since: tuple[int, float], t0: float, heldout_rows: list[dict]) -> None:
        """Lowers settings.steps to what the time left allows at the rate of the steps since `since`,
        held-out evaluations (every eval_every steps and a final one) counted at half a step per batch."""
        max_minutes = self.s.max_minutes
        if max_minutes is None:
            raise ValueError("fitting the steps to --max-minutes needs --max-minutes")
        step0, when = since
        per_step = (time.monotonic() - when) / max(self.step - step0, 1)
        left = 60 * max_minutes - (time.monotonic() - t0)
        evals = int(left / per_step) // self.s.eval_every + 1 if heldout_rows else 0
        eval_seconds = evals * len(batches(heldout_rows, self.s.batch_tokens, 0, 0)) * per_step / 2
        fit = self.step + int((left - eval_seconds) / per_step)
        if fit < self.s.steps:
            self.log(
                f"{per_step * 1000:.0f} ms per step: {fit} steps fit in --max-minutes {self.s.max_minutes} "
                f"(of --steps {self.s.steps}); the schedule now ends there"
            )
            self.s.steps = max(fit, self.step + 1)

    def train_step(self, group: list[dict]) -> tuple[float, list[float]]:
        for g in self.optimizer.param_groups:
            g["lr"] = learning_rate(self.s, self.step)
        b = self.capture([r["tokens"] for r in group], [r["prompt_len"] for r in group])
        logits = self.head(b.tokens, b.features.float(), self.s.chain_steps)
        loss, agree = distill_loss(self.head, logits, b.labels, b.greedy if self.s.loss_rows == "answers" else b.valid)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        return loss.item(), agree

    @torch.no_grad()
    def evaluate(self, rows: list[dict]) -> dict:
        """Held-out: loss, and the mean tokens per verify step (accepted drafts + 1) the engine would
        measure with a k = chain_steps greedy chain on the target's greedy answers (accepted_length)."""
        accepted: float = 0
        verify_steps = 0
        losses = []
        for group in batches(rows, self.s.batch_tokens, 0, 0):
            b = self.capture([r["tokens"] for r in group], [r["prompt_len"] for r in group])
            logits = self.head(b.tokens, b.features.float(), self.s.chain_steps)
            losses.append(float(distill_loss(self.head, logits, b.labels, b.valid)[0]))
            acc, n = accepted_length(self.head, logits, b.labels, b.greedy)
            accepted, verify_steps = accepted + acc, verify_steps + n
        mean_accepted = accepted / max(verify_steps, 1)
        return {
            "step": self.step,
            "loss": sum(losses) / max(len(losses), 1),
            "verify_steps": verify_steps,
            "k": self.s.chain_steps,
            "mean_accepted": mean_accepted,
            "tokens_per_verify_step": mean_accepted + 1,
        }

    def record_eval(self, rows: list[dict]) -> dict:
        result = self.evaluate(rows)
        self.history.append(result)
        self.log(
            f"held-out at step {result['step']}: loss {result['loss']:.3f}, tokens per verify step "
            f"{result['tokens_per_verify_step']:.2f} (k = {result['k']}, {result['verify_steps']} verify steps)"
        )
        return result
