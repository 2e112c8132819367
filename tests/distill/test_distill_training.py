"""`verifypd distill` on a tiny random target (CPU smoke): it trains, checkpoints, resumes, writes a
head that `--draft eagle:` loads, and the engine's acceptance with that head is exactly what the
dense training forward predicts step by step (features of accepted positions reach the draft)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import make_engine, write_tiny_llama

from verifypd.cli import main
from verifypd.distill.capture import TargetCapture
from verifypd.distill.head_train import TrainableHead, accepted_length
from verifypd.domain.requests import RequestSpec
from verifypd.model.eagle_head import load_eagle_head
from verifypd.model.loader import load_model
from verifypd.router.router import EngineObserver

CPU = torch.device("cpu")
SMALL = [
    "--samples",
    "80",
    "--gen-tokens",
    "24",
    "--batch-tokens",
    "1024",
    "--lr",
    "3e-3",
    "--warmup",
    "10",
    "--device",
    "cpu",
    "--no-progress",
    "--draft-vocab",
    "80",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = str(write_tiny_llama(root / "target", seed=1, layers=4))
    out = root / "head"
    assert (
        main(
            [
                "distill",
                "--target",
                target,
                "--out",
                str(out),
                "--steps",
                "60",
                "--eval-every",
                "30",
                "--checkpoint-every",
                "30",
                *SMALL,
            ]
        )
        == 0
    )
    return target, out


@pytest.mark.slow
def test_distill_reports_heldout_acceptance(trained):
    _, out = trained
    summary = json.loads((out / "distill.json").read_text())
    assert summary["finished"] and summary["step"] == 60
    # A random head accepts next to nothing (1.0 tokens per step); the trained one clearly more. The
    # figure walks the answers as the engine does (9130383), which reads lower than the old mean over
    # every anchor did: 1.47 here, where the old estimate passed 1.5.
    assert summary["heldout"]["tokens_per_verify_step"] > 1.3, summary["heldout"]
    assert [h["step"] for h in summary["history"]] == [30, 60]


@pytest.mark.slow
def test_checkpoint_and_resume(trained, tmp_path, capsys):
    target, _ = trained
    out = tmp_path / "head"
    args = ["distill", "--target", target, "--out", str(out), "--steps", "5", "--checkpoint-every", "100", *SMALL]
    assert main(args + ["--max-minutes", "0"]) == 0  # stops after one step, with a checkpoint
    first = json.loads((out / "distill.json").read_text())
    assert not first["finished"] and first["step"] == 1
    assert (out / "checkpoints" / "step-1" / "optimizer.pt").is_file()
    assert main(args) == 2  # checkpoints there: needs --resume
    assert "--resume" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    assert "step-1 at step 1" in capsys.readouterr().err  # continued, not restarted
    second = json.loads((out / "distill.json").read_text())
    assert second["finished"] and second["step"] == 5


@pytest.mark.slow
def test_resumed_run_trains_what_an_uninterrupted_run_trains(trained, tmp_path):
    """Stopped twice (after one step each time, --max-minutes 0) and resumed: the same weights, bit for
    bit, as one uninterrupted run: the optimizer state, the learning-rate schedule (the checkpoint's end,
    not the resumed command's --steps) and the place in the data (mid-epoch, over epoch ends) carry on."""
    import shutil

    from safetensors.torch import load_file

    target, trained_out = trained
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for out in (whole, parts):  # the fixture's data (same settings and seed): no generation here
        out.mkdir()
        shutil.copy(trained_out / "data.jsonl", out / "data.jsonl")
    base = ["distill", "--target", target, "--checkpoint-every", "100", *SMALL]
    assert main(base + ["--out", str(whole), "--steps", "10"]) == 0
    assert main(base + ["--out", str(parts), "--steps", "10", "--max-minutes", "0"]) == 0
    assert main(base + ["--out", str(parts), "--steps", "10", "--max-minutes", "0", "--resume"]) == 0
    assert json.loads((parts / "distill.json").read_text())["step"] == 2
    assert main(base + ["--out", str(parts), "--steps", "30", "--resume"]) == 0  # --steps: not the schedule
    summary = json.loads((parts / "distill.json").read_text())
    assert summary["finished"] and summary["step"] == summary["steps"] == 10
    rows = [json.loads(line) for line in (parts / "data.jsonl").read_text().splitlines()]
    from verifypd.distill.trainer import batches

    assert len(batches([r for r in rows if not r["heldout"]], 1024, 0, 0)) < 10  # the run crosses epochs
    a = load_file(str(whole / "checkpoints" / "step-10" / "model.safetensors"))
    b = load_file(str(parts / "checkpoints" / "step-10" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_engine_acceptance_equals_dense_replay(trained):
    target_path, out = trained
    steps: list[tuple[int, int]] = []

    class Record(EngineObserver):
        def on_verify(self, k, accepted):
            steps.append((k, accepted))

    k = 4
    engine = make_engine(target_path, f"eagle:{out}", k=k, block_size=4, num_blocks=256)
    engine.router.observer = Record()
    prompt = [1, 17, 40, 8]
    output = engine.generate([RequestSpec(tuple(prompt), max_tokens=40, stop_at_eos=False, request_id="r")])[
        "r"
    ].token_ids
    plain = (
        make_engine(target_path, "none", k=0)
        .generate([RequestSpec(tuple(prompt), max_tokens=40, stop_at_eos=False, request_id="r")])["r"]
        .token_ids
    )
    assert output == plain
    # Dense prediction of every verify step: the chain anchored at the pending token's row.
    target = load_model(target_path, CPU, torch.float32)
    config, weights = load_eagle_head(str(out), target.shape, target.weights.lm_head, CPU, torch.float32)
    seq = prompt + output
    batch = TargetCapture(target, config.aux_layer_ids, CPU, 256)([seq], [len(prompt)])
    with torch.no_grad():
        logits = TrainableHead(config, weights, target.weights.embed)(batch.tokens, batch.features, steps=k)
    chosen = [weights.draft_to_target[lg[0].argmax(-1)].tolist() for lg in logits]  # [step][row]
    n = len(prompt)  # the pending token's position (the first output token)
    predicted = []
    for kk, _ in steps:
        m = 0
        while m < kk and n - 1 + m < len(seq) - 1 and chosen[m][n - 1 + m] == seq[n + 1 + m]:
            m += 1
        predicted.append((kk, m))
        n += m + 1
    assert steps == predicted
    assert sum(m for _, m in steps) >= len(steps) // 4, steps  # the head is often right: the check has power
    # distill's held-out figure on this very sequence is the engine's: (accepted drafts, verify steps)
    head = TrainableHead(config, weights, target.weights.embed)
    assert accepted_length(head, logits, batch.labels, batch.greedy) == (sum(m for _, m in steps), len(steps))


def test_heldout_acceptance_walks_like_the_engine():
    """Rows 0-7 drafted right at every chain step, rows 8-12 wrong (k = 2): the engine's walk accepts
    2, 2, 2 (anchors 0, 3, 6) then 0, 0, 0 (9, 10, 11; the pending token at row 12 is the last):
    6 drafts in 6 steps. The mean over all 12 anchors (15 / 12) would say 2.25 tokens per step."""
    from types import SimpleNamespace

    T, V = 13, 5
    target = torch.arange(T) % V  # the target's token per row
    labels = torch.nn.functional.one_hot(target, V).float()[None] * 10  # [1, T, V]
    right = torch.nn.functional.one_hot(target, V).float()
    wrong = torch.nn.functional.one_hot((target + 1) % V, V).float()
    rows = torch.arange(T)[:, None] < 8
    logits = [torch.where(rows, right, wrong)[None]] * 2
    valid = torch.ones(1, T, dtype=torch.bool)
    head = SimpleNamespace(draft_to_target=None)
    assert accepted_length(head, logits, labels, valid) == (6.0, 6)
    late = valid.clone()
    late[0, :3] = False  # the answer starts at row 3: anchors 3, 6, 9 ..
    assert accepted_length(head, logits, labels, late) == (4.0, 5)


def test_own_prompts_mix_template_requests_written_requests_and_tasks_on_the_targets_texts():
    """Without --prompts a chat target gets half chat requests (3/4 straight from our templates, 1/4
    written by the target at temperature 0.8) and half a task on a text it wrote (so copy-heavy
    answers are trained too; the text is inside the task's prompt); the same seed, the same prompts."""
    from types import SimpleNamespace

    from verifypd.distill.chat_requests import template_requests
    from verifypd.distill.data import SEED_TEXT_SEEDS, TEXT_SEEDS, own_prompts

    class Codec:  # one character per token
        has_chat_template, tokenizer = True, object()

        def encode(self, text):
            return [ord(c) for c in text]

        def encode_chat(self, messages):
            return self.encode("<user>" + messages[-1]["content"])

        def decode(self, ids):
            return "".join(map(chr, ids))

    class Engine:
        def __init__(self):
            self.calls = []

        def generate(self, specs):
            self.calls.append((len(specs), specs[0].max_tokens, specs[0].sampling.temperature))
            return {
                s.request_id: SimpleNamespace(
                    token_ids=Codec().encode(f"Text number {s.request_id} here, long enough for a text.")
                )
                for s in specs
            }

    engine = Engine()
    prompts = [Codec().decode(p).removeprefix("<user>") for p in own_prompts(engine, Codec(), 100, seed=0)]
    assert engine.calls == [(12, 48, 0.8), (50, 160, 0.8)]  # written requests, then texts
    assert len(prompts) == 100
    assert prompts[:38] == [text for _, text in template_requests(38, seed=0)]
    assert all(p.startswith("Text number d") for p in prompts[38:50])  # the target's requests
    tasks = {t for _, _, ts in TEXT_SEEDS for t in ts}
    worked = prompts[50:]
    assert all(p.split("\n\n")[0] in tasks and "Text number d" in p.split("\n\n", 1)[1] for p in worked)
    assert len({p.split("\n\n")[0] for p in worked}) > 5  # several task wordings
    again = [Codec().decode(p).removeprefix("<user>") for p in own_prompts(Engine(), Codec(), 100, seed=0)]
    assert again == prompts
    # --own-requests seeds (the committed head's data): every question written by the target at 1.0, 3 text kinds
    engine = Engine()
    seeded = [Codec().decode(p).removeprefix("<user>") for p in own_prompts(engine, Codec(), 100, 0, "seeds")]
    assert engine.calls == [(50, 48, 1.0), (50, 160, 0.8)] and len(seeded) == 100
    assert all(p.startswith("Text number d") for p in seeded[:50])
    assert {p.split("\n\n")[0] for p in seeded[50:]} <= {t for _, _, ts in SEED_TEXT_SEEDS for t in ts}


def test_a_held_out_prompt_is_held_out_in_every_copy(tmp_path):
    """Own template requests repeat; a prompt in the held-out split must not also train (with its
    greedy answer, the same sequence), or the held-out estimate measures training data."""
    from types import SimpleNamespace

    from verifypd.distill.data import make_data

    class Codec:
        has_chat_template = False

        def encode(self, text):
            return [ord(c) for c in text]

    class Engine:
        def generate(self, specs):
            return {s.request_id: SimpleNamespace(token_ids=[7, 8, 9]) for s in specs}

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"request {i % 10}\n" for i in range(100)))  # 10 prompts, 10 copies each
    rows = make_data(
        Engine(),
        Codec(),
        tmp_path / "out",
        prompts_file=str(prompts),
        samples=1,
        gen_tokens=3,
        temperature=0.0,
        heldout_fraction=0.05,
        max_len=64,
        seed=0,
    )
    held = {tuple(r["tokens"]) for r in rows if r["heldout"]}
    trained = {tuple(r["tokens"]) for r in rows if not r["heldout"]}
    assert held and trained and not held & trained
    assert len(rows) == 100 and sum(r["heldout"] for r in rows) % 10 == 0


def test_fit_steps_ends_the_schedule_inside_max_minutes(monkeypatch):
    """At step 20, 20 steps took 2 s (0.1 s each) and 10 s of the 60 are gone: 500 more steps fit,
    minus the held-out evaluations' share; --steps is lowered to that, never raised."""
    from types import SimpleNamespace

    from verifypd.distill import trainer as trainer_module
    from verifypd.distill.trainer import Trainer, TrainSettings

    now = 1000.0  # the trainer's clock stands still: the fit depends on the given times only
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(monotonic=lambda: now))

    def fitted(steps, heldout):
        trainer = SimpleNamespace(
            step=20, log=lambda m: None, s=TrainSettings(steps=steps, max_minutes=1.0, eval_every=100, batch_tokens=64)
        )
        Trainer._fit_steps(trainer, (0, now - 2.0), now - 10.0, heldout)
        return trainer.s.steps

    assert 515 <= fitted(3000, []) <= 520
    rows = [{"tokens": list(range(32)), "prompt_len": 4}] * 8  # 4 batches of 64 tokens per evaluation
    # 6 evaluations x 4 batches x half a step = 12 steps' time
    assert 505 <= fitted(3000, rows) <= 509
    assert fitted(300, []) == 300


def test_distill_flag_pairs_are_checked(tmp_path, capsys):
    base = ["distill", "--target", "random:tinyllama-1.1b", "--out", str(tmp_path / "h")]
    assert main(base + ["--fit-steps"]) == 2
    assert "--max-minutes" in capsys.readouterr().err
    assert main(base + ["--frozen-lm-head"]) == 2
    assert "--draft-vocab" in capsys.readouterr().err


def test_loss_rows_answers_leaves_the_prompt_rows_out(monkeypatch):
    """--loss-rows answers: the loss counts the rows whose next token the target generated (the
    batch's greedy rows), not the prompt's; --loss-rows all counts every real row."""
    from types import SimpleNamespace

    from verifypd.distill import trainer as trainer_module
    from verifypd.distill.capture import Batch
    from verifypd.distill.trainer import Trainer, TrainSettings
    from verifypd.model.eagle_head import random_eagle_head
    from verifypd.model.llama import LlamaShape

    shape = LlamaShape(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_context=64,
    )
    torch.manual_seed(0)
    config, weights = random_eagle_head(shape, seed=0)
    head = TrainableHead(config, weights, torch.randn(32, 16))
    B, T = 1, 12
    greedy = torch.zeros(B, T, dtype=torch.bool)
    greedy[:, 5:] = True  # rows 0-4: the prompt's
    valid = torch.ones(B, T, dtype=torch.bool)
    batch = Batch(torch.randint(0, 32, (B, T)), torch.randn(B, T, 48), torch.randn(B, T, 32), valid, greedy)
    counted = []
    real_loss = trainer_module.distill_loss

    def spy(head, logits, labels, rows):
        counted.append(rows.clone())
        return real_loss(head, logits, labels, rows)

    monkeypatch.setattr(trainer_module, "distill_loss", spy)
    for rows in ("answers", "all"):
        trainer = SimpleNamespace(
            s=TrainSettings(chain_steps=2, loss_rows=rows),
            step=0,
            head=head,
            capture=lambda *_: batch,
            optimizer=torch.optim.SGD(head.parameters(), lr=0.0),
        )
        Trainer.train_step(trainer, [{"tokens": [0] * (T + 1), "prompt_len": 6}])
    assert torch.equal(counted[0], greedy) and torch.equal(counted[1], valid)
