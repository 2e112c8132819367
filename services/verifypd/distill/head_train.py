"""The head as a trainable module: a dense (unpaged) forward over whole sequences, unrolled over
`steps` chain steps the way it drafts ("training-time test", as EAGLE-3 trains).

Shapes: B sequences of T tokens; F = 3 * Ht captured target features; H the head's hidden.
Step 0, row t: features of position t + embedding of token t + 1, position t; predicts token t + 2.
Step j, row t: the head's own output of step j - 1 at row t - 1 + embedding of token t + 1; its
query attends step-0 keys at positions <= t - j (the anchor, last row with target features) and
step-i keys at row t - j + i for i = 1 .. j (the chain rows drafted after that anchor): exactly
what the paged chain (model.eagle_draft) attends at inference. Rows t < j have no anchor (masked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verifypd.model.eagle_head import EagleConfig, EagleWeights
from verifypd.model.llama import LayerWeights, rms_norm
from verifypd.model.rope import apply_rope, rope_inv_freq


class TrainableHead(nn.Module):
    # Buffers (register_buffer), typed for the readers; lm_head is a Parameter when trained.
    lm_head: torch.Tensor
    embed: torch.Tensor
    draft_to_target: torch.Tensor | None
    inv_freq: torch.Tensor

    def __init__(self, config: EagleConfig, weights: EagleWeights, embed: torch.Tensor, train_lm_head: bool = True):
        """train_lm_head=False: the lm_head (the target's, shared) stays frozen and is not saved."""
        super().__init__()
        self.config = config
        p = lambda t: nn.Parameter(t.detach().clone().float())  # noqa: E731 (fp32 master weights)
        L = weights.layer
        self.fc, self.qkv, self.o, self.gate_up, self.down = p(weights.fc), p(L.qkv), p(L.o), p(L.gate_up), p(L.down)
        self.input_norm, self.hidden_norm, self.post_norm = p(L.input_norm), p(weights.hidden_norm), p(L.post_norm)
        self.final_norm = p(weights.final_norm)
        if train_lm_head:
            self.lm_head = p(weights.lm_head)
        else:
            self.register_buffer("lm_head", weights.lm_head.detach().float(), persistent=False)
        self.register_buffer("embed", embed.detach().float(), persistent=False)  # the target's, frozen
        mapping = weights.draft_to_target
        self.register_buffer("draft_to_target", None if mapping is None else mapping.clone(), persistent=False)
        shape = config.attention_shape()
        self.register_buffer("inv_freq", rope_inv_freq(shape, embed.device), persistent=False)

    def weights(self, dtype: torch.dtype | None = None) -> EagleWeights:
        c = lambda t: t.detach().clone() if dtype is None else t.detach().to(dtype)  # noqa: E731
        layer = LayerWeights(
            qkv=c(self.qkv),
            qkv_bias=None,
            o=c(self.o),
            gate_up=c(self.gate_up),
            down=c(self.down),
            input_norm=c(self.input_norm),
            post_norm=c(self.post_norm),
        )
        return EagleWeights(
            fc=c(self.fc),
            layer=layer,
            hidden_norm=c(self.hidden_norm),
            final_norm=c(self.final_norm),
            lm_head=c(self.lm_head),
            draft_to_target=self.draft_to_target,
        )

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T] (token t + 1 of row t, i.e. the sequence shifted by one), features [B, T, F].
        Returns per step the draft-vocabulary logits [B, T, Vd] of each row."""
        c = self.config
        B, T = tokens.shape
        eps = c.rms_norm_eps
        pos = torch.arange(T, device=tokens.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
        e = rms_norm(self.embed[tokens], self.input_norm, eps)
        hidden = features @ self.fc.t()  # [B, T, H]
        keys, values, out = [], [], []
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for j in range(steps):
            if j:  # row t takes the previous step's output of row t - 1
                hidden = F.pad(hidden[:, :-1], (0, 0, 1, 0))
            qkv = torch.cat((e, rms_norm(hidden, self.hidden_norm, eps)), -1) @ self.qkv.t()
            q = apply_rope(qkv[..., :q_dim].reshape(B, T, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(qkv[..., q_dim : q_dim + kv_dim].reshape(B, T, c.num_kv_heads, c.head_dim), cos, sin)
            v = qkv[..., q_dim + kv_dim :].reshape(B, T, c.num_kv_heads, c.head_dim)
            keys.append(k)
            values.append(v)
            attn = self._attend(q, keys, values, j)  # [B, T, heads * D]
            h = hidden + attn @ self.o.t()
            gate, up = (rms_norm(h, self.post_norm, eps) @ self.gate_up.t()).chunk(2, -1)
            hidden = h + (F.silu(gate) * up) @ self.down.t()
            out.append(rms_norm(hidden, self.final_norm, eps) @ self.lm_head.t())
        return out

    def _attend(self, q, keys, values, j: int) -> torch.Tensor:
        """Step j's attention: step-0 keys causally up to the anchor (t - j), then one key of each
        chain step i at row t - j + i."""
        c = self.config
        B, T, heads, D = q.shape
        group = heads // c.num_kv_heads
        expand = lambda x: x.repeat_interleave(group, dim=2)  # noqa: E731 [B, T, heads, D]
        scale = D**-0.5
        k0, v0 = expand(keys[0]), expand(values[0])
        scores0 = torch.einsum("bthd,bshd->bhts", q, k0) * scale  # [B, heads, T, T]
        t = torch.arange(T, device=q.device)
        scores0 = scores0.masked_fill(~(t[None, :] <= t[:, None] - j), float("-inf"))
        diag_k, diag_v = [], []
        for i in range(1, j + 1):  # key of step i at row t - (j - i)
            shift = j - i
            diag_k.append(F.pad(expand(keys[i])[:, : T - shift], (0, 0, 0, 0, shift, 0)))
            diag_v.append(F.pad(expand(values[i])[:, : T - shift], (0, 0, 0, 0, shift, 0)))
        if diag_k:
            diag = torch.stack([torch.einsum("bthd,bthd->bht", q, k) * scale for k in diag_k], -1)  # [B, h, T, j]
            weights = torch.cat((scores0, diag), -1).softmax(-1)
            out = torch.einsum("bhts,bshd->bthd", weights[..., :T], v0)
            for i, v in enumerate(diag_v):
                out = out + weights[..., T + i].transpose(1, 2)[..., None] * v
        else:
            weights = scores0.softmax(-1)
            weights = torch.nan_to_num(weights)  # no key at all: never, step 0 sees itself
            out = torch.einsum("bhts,bshd->bthd", weights, v0)
        return out.reshape(B, T, heads * D)


def distill_loss(
    head: TrainableHead, logits: list[torch.Tensor], labels: torch.Tensor, valid: torch.Tensor, decay: float = 0.8
) -> tuple[torch.Tensor, list[float]]:
    """Soft cross-entropy of each step against the target's distribution of the same token, restricted
    to the draft vocabulary. labels [B, T, V]: the target's logits for row t's prediction (token t + 2,
    i.e. the target's logits at position t + 1); valid [B, T]: rows that have one. Step j weighted
    decay**j (as EAGLE-3). Returns (loss, top-1 agreement per step)."""
    label = labels.float()
    if head.draft_to_target is not None:
        label = label[..., head.draft_to_target]
    p = label.softmax(-1)  # [B, T, Vd]
    total, agree = label.new_zeros(()), []  # float32, as the terms (0 + x is x exactly)
    for j, lg in enumerate(logits):
        rows = valid.clone()
        rows[:, :j] = False
        n = rows.sum().clamp(min=1)
        ce = -(p * lg.float().log_softmax(-1)).sum(-1)
        total = total + decay**j * (ce * rows).sum() / n
        agree.append(float(((lg.argmax(-1) == p.argmax(-1)) & rows).sum() / n))
    return total, agree


def anchor_acceptance(
    head: TrainableHead, logits: list[torch.Tensor], labels: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Accepted drafts of a greedy k = len(logits) chain anchored at every row, teacher-forced: step j
    of anchor p (row p + j) is accepted while every step up to it chose the target's greedy token and
    row p + j is valid (the chain stops at the sequence's end). [B, T] long."""
    target = labels.argmax(-1)  # [B, T]: the target's greedy token
    run = torch.ones_like(valid)
    accepted = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
    for j, lg in enumerate(logits):
        chosen = lg.argmax(-1)
        if head.draft_to_target is not None:
            chosen = head.draft_to_target[chosen]
        hit = (chosen == target) & valid  # row t of step j
        run = run & F.pad(hit[:, j:], (0, j), value=False)  # anchor p: row p + j
        accepted += run.long()
    return accepted


def accepted_length(
    head: TrainableHead, logits: list[torch.Tensor], labels: torch.Tensor, valid: torch.Tensor
) -> tuple[float, int]:
    """What the engine measures at temperature 0 with k = len(logits) on these sequences: (accepted
    drafts, verify steps). `valid` [B, T]: the rows whose token the target generated greedily (row
    t: token t + 1), a contiguous run per sequence from the prompt's last row. Walked as the engine
    walks: the first anchor is the first answer token's row; a step accepting a drafts moves the
    anchor a + 1 rows on. Not the mean over all anchors: the engine visits every anchor of a badly
    drafted stretch but skips most of a well drafted one, so that mean overstates it (on the
    embedded model's head: 2.43 held-out vs 1.69 measured). Exact on data the target generated
    greedily, where the forced tokens are the drafts the chain would have made."""
    # A draft of row t is token t + 2: the last row's is past the answer, which the engine never
    # drafts (k <= tokens left - 1).
    drafted = valid & F.pad(valid[:, 1:], (0, 1), value=False)
    per_anchor = anchor_acceptance(head, logits, labels, drafted).tolist()
    rows = valid.tolist()
    accepted = steps = 0
    for b, flags in enumerate(rows):
        if True not in flags:
            continue
        p = flags.index(True)  # the pending token: the first answer token (row p)
        last = len(flags) - 1 - flags[::-1].index(True)  # the last row with a label
        while p < last:  # a token is left to generate after the pending one
            a = per_anchor[b][p]
            accepted, steps, p = accepted + a, steps + 1, p + a + 1
    return float(accepted), steps
