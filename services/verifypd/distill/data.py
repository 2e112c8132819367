"""Self-distillation data: the target writes it. Torch-free except through the engine.

Sources: a prompts file (one text per line, or JSONL with "prompt" or "messages"), answered by the
target; or, with none, the target's own samples (chat models): half of them chat requests, of
which 3/4 come straight from our templates of many request kinds over many subjects and 1/4 are
written by the target (sampled at 0.8, asked for one request of a kind about a topic:
distill.chat_requests; `--own-requests kinds`, the default), and half a task to do on a text the
target wrote itself (rewrite, edit code, extract, fix an email); `--own-requests seeds` is the older
generator (all requests written by the target from 3 seed instructions; the committed embedded head's
data). Models without a chat template get free text. Then the target answers them.
Answers are greedy by default, which makes the held-out estimate of accepted length exact for
temperature 0 (distill.head_train.accepted_length).

Cached as DIR/data.jsonl ({"tokens", "prompt_len", "heldout"}), so a resumed run trains on the same data.
"""

from __future__ import annotations

import json
import pathlib
import random

from verifypd.distill.chat_requests import WRITER_TOPICS, template_requests, writer_asks
from verifypd.domain.requests import RequestSpec, SamplingParams

WRITTEN_ONE_IN = 4  # 1 in 4 chat requests is written by the target (the rest: our templates;
# the 135M target's own requests are noisy: off-topic, meta, half sentences)
WRITER_TEMPERATURE = 0.8

# Work-on-a-text requests: the target writes a text (prose, code, a note with facts), and the prompt
# asks for something done to it, so the head also learns the copy-heavy answers (rewrites, edits,
# extractions) that plain questions never show. Our own wording, unrelated to any evaluation set.
PARAGRAPH_TASKS = (
    "Write a short paragraph about {topic}. Reply with the paragraph only.",
    "{}",
    [
        "Make the following text easier to read.",
        "Shorten the following text.",
        "Correct the following text and give it back in full.",
        "Rewrite this text for a child.",
    ],
)
CODE_TASKS = (
    "Write a short Python function related to {topic}. Reply with the code only.",
    "```python\n{}\n```",
    [
        "Add comments to this code and give back the whole code.",
        "Improve the variable names in this code and return it in full.",
        "Add error handling to this code and return the whole code.",
    ],
)
NOTE_ASK = "Write a short note about {topic} that mentions people, dates and amounts. Reply with the note only."
NOTE_TASKS = [
    "Pull out all people, places, dates and numbers from this text.",
    "Turn this text into JSON with its important fields.",
    "Make a bulleted list of the facts in this text.",
]
TEXT_SEEDS = [
    PARAGRAPH_TASKS,
    CODE_TASKS,
    (NOTE_ASK, "{}", NOTE_TASKS + ["Which dates and amounts appear in this note? Answer as a table."]),
    (
        "Write a short email about {topic}. Reply with the email only.",
        "{}",
        [
            "Make this email more polite and give it back in full.",
            "Fix the spelling and grammar of this email.",
            "Make this email shorter but keep every fact in it.",
        ],
    ),
]

# `--own-requests seeds`: the generator of the shipped head (verifypd/heads/smollm2_eagle, d52173e),
# kept so that its recipe stays reproducible: every question written by the target at temperature 1.0
# from 3 seed instructions x 30 topics, and 3 text kinds.
SEED_TOPICS = [
    "cooking",
    "history",
    "physics",
    "programming in Python",
    "travel",
    "music",
    "health",
    "gardening",
    "mathematics",
    "economics",
    "writing an email",
    "biology",
    "chemistry",
    "sports",
    "movies",
    "animals",
    "space",
    "personal finance",
    "a job interview",
    "learning a language",
    "the weather",
    "cars",
    "databases",
    "poetry",
    "philosophy",
    "geography",
    "electricity",
    "computers",
    "art",
    "sleep",
]
SEED_ASKS = [
    "Write one question a curious person might ask an assistant about {topic}. Reply with the question only.",
    "Write a short instruction asking an assistant to do a task related to {topic}. Reply with the instruction only.",
    "Give one request about {topic} that someone could type into a chatbot. Only the request.",
]
SEED_TEXT_SEEDS = [PARAGRAPH_TASKS, CODE_TASKS, (NOTE_ASK, "{}", NOTE_TASKS)]


def read_prompts(path: str) -> list[list[dict] | str]:
    """Texts (str) or chat conversations (lists of messages)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts: no such file {path}")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--prompts {path}:{n}: not JSON ({exc.msg})") from None
            value = row.get("messages") or row.get("prompt")
            if not value:
                raise ValueError(f'--prompts {path}:{n}: a JSON line needs "prompt" or "messages"')
            out.append(value)
        else:
            out.append(line)
    if not out:
        raise ValueError(f"--prompts {path}: no prompts in it")
    return out


def encode(codec, prompt) -> list[int]:
    """Chat models get their template (a plain text becomes one user message)."""
    if codec.has_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return codec.encode_chat(messages)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return codec.encode(text)


def generate(
    engine, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int, stop_at_eos: bool = True
) -> list[list[int]]:
    specs = [
        RequestSpec(
            tuple(p),
            max_tokens=max_tokens,
            stop_at_eos=stop_at_eos,
            request_id=f"d{i}",
            sampling=SamplingParams(temperature=temperature, seed=seed + i),
        )
        for i, p in enumerate(prompts)
    ]
    done = engine.generate(specs)
    return [done[f"d{i}"].token_ids for i in range(len(prompts))]


def own_prompts(engine, codec, count: int, seed: int, requests: str = "kinds") -> list[list[int]]:
    """The target's own samples as prompts (see module doc); requests "seeds": the older generator."""
    rng = random.Random(seed)
    if not codec.has_chat_template or codec.tokenizer is None:
        bos_id = getattr(codec.tokenizer, "bos_token_id", None)
        bos = [1 if bos_id is None else bos_id]
        starts = [bos + [rng.randrange(3, 64)] for _ in range(count)]
        texts = generate(engine, starts, 24, 1.0, seed, stop_at_eos=False)
        return [s + t for s, t in zip(starts, texts)]
    questions = count - count // 2
    if requests == "seeds":
        prompts, asks = (
            [],
            [encode(codec, rng.choice(SEED_ASKS).format(topic=rng.choice(SEED_TOPICS))) for _ in range(questions)],
        )
        temperature, text_seeds, topics = 1.0, SEED_TEXT_SEEDS, SEED_TOPICS
    else:
        written = questions // WRITTEN_ONE_IN
        prompts = [encode(codec, text) for _, text in template_requests(questions - written, seed)]
        asks = [encode(codec, ask) for ask in writer_asks(written, seed)]
        temperature, text_seeds, topics = WRITER_TEMPERATURE, TEXT_SEEDS, WRITER_TOPICS
    for ids in generate(engine, asks, 48, temperature, seed) if asks else []:
        text = codec.decode(ids).strip().split("\n")[0].strip()
        text = text.strip('"').strip() if requests != "seeds" else text
        if len(text) >= 8:
            prompts.append(encode(codec, text))
    kinds = [rng.choice(text_seeds) for _ in range(count // 2)]
    asks = [encode(codec, ask.format(topic=rng.choice(topics))) for ask, _, _ in kinds]
    texts = generate(engine, asks, 160, 0.8, seed + 1) if asks else []
    for (_, wrap, tasks), ids in zip(kinds, texts):
        text = codec.decode(ids).strip().removeprefix("```python").removesuffix("```").strip()
        if len(text) >= 40:
            prompts.append(encode(codec, f"{rng.choice(tasks)}\n\n{wrap.format(text)}"))
    return prompts


def make_data(
    engine,
    codec,
    out: pathlib.Path,
    *,
    prompts_file: str | None,
    samples: int,
    gen_tokens: int,
    temperature: float,
    heldout_fraction: float,
    max_len: int,
    seed: int,
    own_requests: str = "kinds",
) -> list[dict]:
    cache = out / "data.jsonl"
    if cache.is_file():
        return [json.loads(line) for line in cache.read_text().splitlines() if line]
    if prompts_file:
        prompts = [encode(codec, p) for p in read_prompts(prompts_file)]
    else:
        prompts = own_prompts(engine, codec, samples, seed, own_requests)
    prompts = [p[-(max_len // 2) :] for p in prompts]  # long prompts keep their end: room for the answer
    answers = generate(engine, prompts, min(gen_tokens, max_len - max(map(len, prompts))), temperature, seed + 10**6)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    heldout = set(order[: max(1, round(heldout_fraction * len(order)))]) if heldout_fraction > 0 else set()
    # A held-out prompt is held out in every copy: a repeated request (template requests repeat) would
    # otherwise train on the very sequence the held-out estimate then measures. No copies: no change.
    held_prompts = {tuple(prompts[i]) for i in heldout}
    heldout |= {i for i, p in enumerate(prompts) if tuple(p) in held_prompts}
    rows = [
        {"tokens": p + a, "prompt_len": len(p), "heldout": i in heldout}
        for i, (p, a) in enumerate(zip(prompts, answers))
        if len(p) + len(a) >= 3
    ]
    out.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
