"""EAGLE-3-style draft heads: config, weights, and the Hugging Face layout they are published in.

A head drafts from the target's own hidden states (the "features"): the residual stream after three
target layers (low, mid, high; `aux_layer_ids`, counted as "output of layer i"), concatenated
[3 * Ht] and fused by `fc` into the head's hidden size H. One decoder layer whose attention input
is concat(input_norm(embed(token)), hidden_norm(g)) [2 * H], its own final norm and an lm_head over
a draft vocabulary (`draft_vocab_size` <= the target's; `d2t[i]` = target id of draft id i minus
i, as published). Without `lm_head.weight` the head uses the target's (draft vocabulary = the
target's); `embed_tokens` is always the target's (H must equal the target's hidden size).

On disk (what `save_eagle_head` writes and `load_eagle_head` reads; the layout SGLang, vLLM and
SpecForge use): `config.json` with architectures ["LlamaForCausalLMEagle3"], and `model.safetensors`
(or `pytorch_model.bin`, as the EAGLE-3 authors publish theirs, read safely) with fc.weight,
midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
[lm_head.weight, d2t, t2d]. A "model." prefix on names is accepted. Without lm_head.weight but with
d2t, the draft vocabulary's rows are the target's own lm_head rows (what `verifypd distill
--draft-vocab N --frozen-lm-head` writes: a smaller file, and drafting computes N logits, not V).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch

from verifypd.model.checkpoint import read_torch_bin
from verifypd.model.llama import LayerWeights, LlamaShape
from verifypd.model.loader import ModelLoadError
from verifypd.model.safetensors_file import SafetensorsFile

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"  # how the EAGLE-3 authors publish their heads


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """Low/mid/high as the anchors pick them (outputs of layers 1, N/2 - 1, N - 4), clamped to the
    target's depth so that tiny test targets work too."""
    top = target_layers - 1
    low, mid, high = (min(max(i, 0), top) for i in (1, target_layers // 2 - 1, target_layers - 4))
    return low, mid, high


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_context: int = 4096
    rope_scaling: dict | None = None

    def attention_shape(self) -> LlamaShape:
        """The shape of the head's one layer (what PagedLlama's attention needs; vocab = draft vocab)."""
        return LlamaShape(
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_context=self.max_context,
            rope_scaling=self.rope_scaling,
        )

    def to_json(self) -> dict:
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_context,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }

    @classmethod
    def from_json(cls, raw: dict, target: LlamaShape, path: str) -> EagleConfig:
        def need(key):
            if key not in raw:
                raise ModelLoadError(f"--draft eagle:{path}: config.json lacks {key!r}")
            return raw[key]

        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelLoadError(
                f"--draft eagle:{path}: only one-layer heads are supported "
                f"(num_hidden_layers = {raw['num_hidden_layers']})"
            )
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = tuple(ids) if ids else default_aux_layers(target.num_layers)
        if len(ids) != 3 or not all(0 <= i < target.num_layers for i in ids):
            raise ModelLoadError(
                f"--draft eagle:{path}: eagle_aux_hidden_state_layer_ids must be 3 layers in "
                f"[0, {target.num_layers}) of the target, got {list(ids)}"
            )
        return cls(
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            vocab_size=raw.get("vocab_size", target.vocab_size),
            draft_vocab_size=raw.get("draft_vocab_size") or raw.get("vocab_size", target.vocab_size),
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            aux_layer_ids=ids,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 10000.0),
            # The head runs at the target's positions: its rope tables follow the target's
            # context, whatever length it was trained on (max_position_embeddings).
            max_context=target.max_context,
            rope_scaling=raw.get("rope_scaling"),
        )


@dataclass
class EagleWeights:
    fc: torch.Tensor  # [H, 3 * Ht]
    layer: LayerWeights  # qkv [(heads + 2 kv_heads) * D, 2H]; input_norm: of the embeddings
    hidden_norm: torch.Tensor  # [H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [draft_vocab, H]
    draft_to_target: torch.Tensor | None  # [draft_vocab] long target ids; None = identity


def check_against_target(config: EagleConfig, target: LlamaShape, path: str) -> None:
    if config.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"--draft eagle:{path}: head vocabulary {config.vocab_size} differs from the "
            f"target's {target.vocab_size} (a head is trained for one target)"
        )
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"--draft eagle:{path}: head hidden sizes (config.json hidden_size {config.hidden_size}, "
            f"target_hidden_size {config.target_hidden_size}) must equal the target's hidden size "
            f"{target.hidden_size}"
        )


def read_head_weights(root: pathlib.Path, path: str) -> dict[str, torch.Tensor]:
    """The head's tensors: its .safetensors files (views of their mappings), else pytorch_model.bin
    (read without running code from the file: model.checkpoint.read_torch_bin)."""
    try:
        files = sorted(root.glob("*.safetensors"))
        if files:
            sd = {}
            for f in files:
                st = SafetensorsFile(f)
                sd.update({name: st.view(name) for name in st.entries})
            return sd
        if (root / TORCH_FILE).is_file():
            return read_torch_bin(root / TORCH_FILE)
    except ModelLoadError as exc:
        raise ModelLoadError(f"--draft eagle:{path}: {exc}") from None
    raise ModelLoadError(f"--draft eagle:{path}: no weights ({WEIGHTS_FILE} or {TORCH_FILE})")


def load_eagle_head(
    path: str, target: LlamaShape, target_lm_head: torch.Tensor, device, dtype
) -> tuple[EagleConfig, EagleWeights]:
    root = pathlib.Path(path)
    if not (root / "config.json").is_file():
        raise ModelLoadError(
            f"--draft eagle:{path}: no config.json there (a head directory holds config.json and {WEIGHTS_FILE})"
        )
    config = EagleConfig.from_json(json.loads((root / "config.json").read_text()), target, path)
    check_against_target(config, target, path)
    sd = {k.removeprefix("model."): v for k, v in read_head_weights(root, path).items()}

    def get(name):
        if name not in sd:
            raise ModelLoadError(f"--draft eagle:{path}: weights lack {name!r}")
        return sd[name].to(device=device, dtype=dtype, copy=True)  # owned: never a view of the file

    m = "midlayer."
    layer = LayerWeights(
        qkv=torch.cat([get(f"{m}self_attn.{p}_proj.weight") for p in "qkv"]),
        qkv_bias=None,
        o=get(f"{m}self_attn.o_proj.weight"),
        gate_up=torch.cat([get(f"{m}mlp.gate_proj.weight"), get(f"{m}mlp.up_proj.weight")]),
        down=get(f"{m}mlp.down_proj.weight"),
        input_norm=get(f"{m}input_layernorm.weight"),
        post_norm=get(f"{m}post_attention_layernorm.weight"),
    )
    mapping = None
    if "d2t" in sd:
        offsets = sd["d2t"]
        mapping = (offsets.long() + torch.arange(offsets.numel())).to(device)
        if int(mapping.min()) < 0 or int(mapping.max()) >= target.vocab_size:
            raise ModelLoadError(f"--draft eagle:{path}: d2t maps outside the target vocabulary")
    if "lm_head.weight" in sd:
        lm_head = get("lm_head.weight")
    elif mapping is not None:  # a draft vocabulary over the target's own (frozen) lm_head rows
        lm_head = target_lm_head[mapping].to(dtype)
    else:  # the target's head: the draft vocabulary is the target's
        lm_head = target_lm_head
    if lm_head.shape[0] != (target.vocab_size if mapping is None else mapping.numel()):
        raise ModelLoadError(
            f"--draft eagle:{path}: a {lm_head.shape[0]}-token draft vocabulary needs a d2t map of as many entries"
        )
    config.draft_vocab_size = lm_head.shape[0]
    return config, EagleWeights(
        fc=get("fc.weight"),
        layer=layer,
        hidden_norm=get(f"{m}hidden_norm.weight"),
        final_norm=get("norm.weight"),
        lm_head=lm_head,
        draft_to_target=mapping,
    )


def head_state_dict(config: EagleConfig, weights: EagleWeights, *, with_lm_head: bool = True) -> dict:
    """The published names (q/k/v and gate/up split again), contiguous CPU tensors."""
    L, s = weights.layer, config
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    gate_up, down = L.dense_mlp()
    # A head's layer is loaded in the model dtype, never fp8 (model.fp8 is for the target's layers).
    assert isinstance(L.qkv, torch.Tensor) and isinstance(gate_up, torch.Tensor)
    q, k, v = L.qkv.split([q_dim, kv_dim, kv_dim])
    gate, up = gate_up.chunk(2)
    m = "midlayer."
    sd = {
        "fc.weight": weights.fc,
        f"{m}self_attn.q_proj.weight": q,
        f"{m}self_attn.k_proj.weight": k,
        f"{m}self_attn.v_proj.weight": v,
        f"{m}self_attn.o_proj.weight": L.o,
        f"{m}mlp.gate_proj.weight": gate,
        f"{m}mlp.up_proj.weight": up,
        f"{m}mlp.down_proj.weight": down,
        f"{m}input_layernorm.weight": L.input_norm,
        f"{m}hidden_norm.weight": weights.hidden_norm,
        f"{m}post_attention_layernorm.weight": L.post_norm,
        "norm.weight": weights.final_norm,
    }
    if with_lm_head:
        sd["lm_head.weight"] = weights.lm_head
    if weights.draft_to_target is not None:
        ids = weights.draft_to_target.long().cpu()
        sd["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_eagle_head(
    path, config: EagleConfig, weights: EagleWeights, *, with_lm_head: bool = True, dtype: torch.dtype | None = None
) -> pathlib.Path:
    """Writes config.json + model.safetensors (`with_lm_head=False`: the head uses the target's)."""
    from safetensors.torch import save_file

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    sd = head_state_dict(config, weights, with_lm_head=with_lm_head)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    save_file(sd, str(root / WEIGHTS_FILE))
    (root / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return root


def random_eagle_head(
    target: LlamaShape,
    *,
    seed: int = 0,
    draft_vocab: int | None = None,
    intermediate_size: int | None = None,
    device="cpu",
    dtype=torch.float32,
    std: float = 0.02,
) -> tuple[EagleConfig, EagleWeights]:
    """A head with random weights for `target` (tests, benchmarks, the start of training).
    `draft_vocab` < the target's: the first draft_vocab target ids."""
    gen = torch.Generator().manual_seed(seed)
    H, D = target.hidden_size, target.head_dim
    vocab = draft_vocab or target.vocab_size
    config = EagleConfig(
        hidden_size=H,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=D,
        vocab_size=target.vocab_size,
        draft_vocab_size=vocab,
        target_hidden_size=H,
        aux_layer_ids=default_aux_layers(target.num_layers),
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        max_context=target.max_context,
        rope_scaling=target.rope_scaling,
    )

    def rand(*size):
        return (torch.randn(*size, generator=gen) * std).to(device=device, dtype=dtype)

    def ones():
        return torch.ones(H, device=device, dtype=dtype)

    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * D
    inter = config.intermediate_size
    layer = LayerWeights(
        qkv=rand(qkv_rows, 2 * H),
        qkv_bias=None,
        o=rand(H, config.num_heads * D),
        gate_up=rand(2 * inter, H),
        down=rand(H, inter),
        input_norm=ones(),
        post_norm=ones(),
    )
    mapping = torch.arange(vocab, device=device) if vocab != target.vocab_size else None
    return config, EagleWeights(
        fc=rand(H, 3 * H),
        layer=layer,
        hidden_norm=ones(),
        final_norm=ones(),
        lm_head=rand(vocab, H),
        draft_to_target=mapping,
    )
