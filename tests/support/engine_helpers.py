"""Helpers of the engine tests: tiny random Llama checkpoints written to a temp dir (no hub), engines
over them, and transformers' greedy reference. Fixtures are in conftest.py (which test modules
never import by name: several test directories have one)."""

from __future__ import annotations

import os
import pathlib
import sys

import torch

VOCAB = 96
# Set VERIFYPD_TEST_DEVICE=cuda to run the engine tests on a GPU (float32, so exact comparisons
# with transformers on the CPU still hold).
DEVICE = os.environ.get("VERIFYPD_TEST_DEVICE", "cpu")


def write_tiny_llama(
    path: pathlib.Path,
    *,
    seed: int,
    layers: int,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = VOCAB,
    model_type: str = "llama",
    head_dim: int | None = None,
    noise: float = 0.0,
    noise_seed: int = 0,
) -> pathlib.Path:
    """`noise` > 0 perturbs every weight by that fraction of its std: same seed + noise gives a
    draft that agrees with the target often but not always (so tests see accepts and rejects).
    model_type "gemma": tied embeddings, GeGLU, (1 + w) norms with random w, `head_dim` as given."""
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "gemma":
        # Tied head: sharpening it would also blow up the embeddings, and with them every token's
        # own logit (greedy would just repeat the prompt's last token). Instead: weights of std
        # 1/sqrt(hidden), sublayer outputs x8 so they outweigh the scaled embeddings, a sharp final norm.
        common["tie_word_embeddings"] = True
        model = GemmaForCausalLM(
            GemmaConfig(hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, initializer_range=hidden**-0.5, **common)
        )
        with torch.no_grad():  # norm weights start at 0 (a plain RMSNorm): make the (1 + w) matter
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.5)
            model.model.norm.weight.add_(7.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(8.0)
                layer.mlp.down_proj.weight.mul_(8.0)
    else:
        model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **common))
    # Sharpen the output layer so greedy choices are well separated (no float near-ties).
    with torch.no_grad():
        if model_type != "gemma":
            model.lm_head.weight.mul_(8.0)
        if noise:
            gen = torch.Generator().manual_seed(noise_seed)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * noise)
    model.save_pretrained(path)
    write_tokenizer(path, vocab)
    return path


def write_tokenizer(path: pathlib.Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` tokens (<unk> <s> </s> w3 w4 ...) beside a checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.save_pretrained(path)


def write_target_and_draft(root: pathlib.Path) -> tuple[str, str]:
    """A tiny random Llama target and a noisy copy of it as draft (accepts and rejects both occur)."""
    target = write_tiny_llama(root / "target", seed=1, layers=3)
    draft = write_tiny_llama(root / "draft", seed=1, layers=3, noise=0.2, noise_seed=7)
    return str(target), str(draft)


def make_engine(
    target: str,
    draft: str,
    *,
    k: int = 4,
    adaptive: bool = False,
    num_blocks: int = 128,
    block_size: int = 4,
    k_max: int = 8,
    **options,
):
    from verifypd.domain.config import RuntimeConfig
    from verifypd.engine import Engine, EngineOptions

    config = RuntimeConfig(k_min=0, k_max=max(k, k_max), k_initial=k, adaptive=adaptive)
    options.setdefault("device", DEVICE)
    return Engine(
        EngineOptions(
            target=target,
            draft=draft,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype="float32",
            config=config,
            **options,
        )
    )


def eager_and_graphed(target: str, head: str, k: int = 3):
    """Two engines drafting with `head`: one through the eager path, one through the graphs' path (on the
    CPU the graphs' functions over their static buffers; on CUDA the engine's captured graphs).
    Returns (eager, graphed, graphed's draft runner)."""
    from verifypd.model.eagle_chain import EagleGraphs

    eager, graphed = (make_engine(target, head, k=k) for _ in range(2))
    eager.draft_lane.runner.graphs = None
    runner = graphed.draft_lane.runner
    if DEVICE == "cpu":
        runner.graphs = EagleGraphs(
            runner.model,
            runner.pool.tensor,
            runner.features,
            runner.block_size,
            runner.staging,
            buckets=(1, 2, 4, 8),
            replay="eager",
        )
    return eager, graphed, runner


def run_and_cancel_once(router, specs, pick) -> tuple[dict[str, list[int]], str | None]:
    """Steps `router` over `specs` until it has no work; after a step, the first time `pick(router)` names
    a request id, that request is cancelled. Returns (tokens streamed by request id, the cancelled id)."""
    tokens = {router.add_request(s): [] for s in specs}
    cancelled = None
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        if cancelled is None:
            cancelled = pick(router)
            if cancelled is not None:
                assert router.abort(cancelled) is not None
    return tokens, cancelled


def assert_others_plain_and_blocks_free(router, tokens: dict[str, list[int]], cancelled: str, plain) -> None:
    """Every request but the cancelled one streamed plain decoding's tokens; every block is back."""
    for rid, streamed in tokens.items():
        if rid != cancelled:
            assert streamed == plain[rid].token_ids, rid
    assert not router.scheduler.running and router.target_blocks.num_free == router.target_blocks.num_blocks
    assert router.draft_blocks.num_free == router.draft_blocks.num_blocks


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def observe_plain(costs, batch: int, seconds: float) -> None:
    """Plain decoding measured at `batch` (StepCostModel.measured wants PLAIN_SAMPLES steps of it)."""
    from verifypd.router.step_costs import PLAIN_SAMPLES

    for _ in range(PLAIN_SAMPLES):
        costs.observe_step(batch, 0, seconds)


# A character-level tokenizer (printable ASCII and newline, one token each) over a tiny model of
# CHAR_VOCAB ids: JSON, regexes and tool-call tags are all spellable, as structured output needs.
CHAR_VOCAB = 128


def write_char_tokenizer(path: pathlib.Path, chat_template: str | None = None) -> pathlib.Path:
    """Replaces the tokenizer of a tiny checkpoint (written with vocab=CHAR_VOCAB) by a char-level one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE without merges (the grammar engine reads byte-level vocabularies): GPT-2's
    # byte -> printable-character map spells each byte's token.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shown = {b: chr(b) for b in printable}
    shown.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in shown)})
    chars = [shown[c] for c in [*range(32, 127), 10]]
    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + n for n, ch in enumerate(chars)}}
    vocab_map.update({f"<x{i}>": i for i in range(len(vocab_map), CHAR_VOCAB)})
    tok = Tokenizer(models.BPE(vocab_map, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


def write_char_models(root: pathlib.Path, chat_template: str | None = None) -> tuple[str, str]:
    """A char-level tiny target and a noisy draft of it (write_target_and_draft's pair, CHAR_VOCAB ids)."""
    target = write_tiny_llama(root / "target", seed=1, layers=3, vocab=CHAR_VOCAB)
    draft = write_tiny_llama(root / "draft", seed=1, layers=3, vocab=CHAR_VOCAB, noise=0.2, noise_seed=7)
    for path in (target, draft):
        write_char_tokenizer(path, chat_template)
    return str(target), str(draft)


def costed_clock(router, verify_s=0.010, per_draft_s=0.002, draft_s=0.003, prefill_s=0.005) -> None:
    """Gives the router a virtual clock that stands still except in lane calls, each of which moves
    it by a fixed cost (per verify call plus per draft token, per draft token proposed, per prefill
    call): the step costs the adaptive policy decides on no longer follow the load on the machine."""
    now = [0.0]
    router.context.clock = lambda: now[0]

    def costed(lane, name, cost):
        call = getattr(lane, name)

        def timed(items, *args, **kwargs):
            now[0] += cost(items)
            return call(items, *args, **kwargs)

        setattr(lane, name, timed)

    def verify_cost(items):
        return verify_s + per_draft_s * sum(len(i.draft_tokens) for i in items)

    costed(router.verify_lane, "verify", verify_cost)
    costed(router.verify_lane, "verify_start", verify_cost)
    costed(router.draft_lane, "draft", lambda items: draft_s * max((i.k for i in items), default=0))
    costed(router.prefill_lane, "prefill", lambda items: prefill_s)
    costed(router.prefill_lane, "prefill_start", lambda items: prefill_s)


def count_calls(router, steps: int, names) -> dict[str, int]:
    """Runs `steps` router steps, counting calls of the functions named in `names` (by name) in them."""
    counts: dict[str, int] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in names:
            counts[frame.f_code.co_name] = counts.get(frame.f_code.co_name, 0) + 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            router.step()
    finally:
        sys.setprofile(None)
    return counts
