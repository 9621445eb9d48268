"""
ExoFormer and its relatives in one file (arXiv 2601.08131, "Attention Projection Mixing with
Exogenous Anchors"). A variant is a handful of GPTConfig fields, not a class:

    Baseline             gate=False anchor='none'
    Gated Attention      gate=True  anchor='none'
    ResFormer            gate=False anchor='internal' mix='v'    granularity='scalar'
    NuResFormer          gate=True  anchor='internal' mix='qkvg' anchor_norm=True
    ExoFormer            gate=True  anchor='exo'      mix='qkvg' anchor_norm=True
    Dynamic E-ExoFormer  ExoFormer with granularity='elementwise' dynamic=True

A forward pass, in the paper's order (GPT.features):
    H0 = wte(idx)                                   token embeddings
    [Q, K, V, G]_anc = H0 · W_anc                   exogenous anchors, once for all layers (Eq. 9);
                                                    internal anchors are layer 1's own projections instead
    N(S_anc)                                        each anchor RMS-normalised (GPT.normalize)
    per block n (CausalSelfAttention):  [Q, K, V, G]_n = c_attn(RMSNorm(h))
        s = sigmoid(W2 · GELU(W1 · x) + b2)         per-token scales of every λ (Eq. 12, dynamic only)
        Ŝ_n = λ_{n,1} ⊙ N(S_anc) + λ_{n,2} ⊙ S_n      each mixed projection (Eq. 10, function mix)
        QK-norm and RoPE on q and k, causal attention, ⊙ sigmoid(g) (Gated Attention), c_proj; SwiGLU MLP
    logits = lm_head(RMSNorm(h))
Notation: C = n_embd, H = n_head, D = C/H, L = n_layer.
"""
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

PROJECTIONS = "qkvg"  # order of the projections in c_attn and anchor_proj: query, key, value, gate logit
GRANULARITY_SHAPES = {"scalar": lambda H, D: (), "headwise": lambda H, D: (H, 1, 1),
                      "elementwise": lambda H, D: (H, 1, D)}  # λ shapes, broadcast over (B, H, T, D)
DYN_HIDDEN = 16  # width of the dynamic-mixing MLP (paper §3.6)
INIT_STD = 0.02
EOT = 50256  # GPT-2's <|endoftext|>: in the packed training windows, each one opens a new document
LOSS_CHUNK = 2048  # tokens per chunk of lm_head + loss: a chunk's (2048, V) fp32 logits are transient, 0.4 GB


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x²) + eps) * weight, computed in fp32 whatever the activation dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim) -> (..., dim)
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


class Rotary(nn.Module):
    """RoPE, rotate-half (NeoX) layout: dimension i pairs with i + D/2."""

    def __init__(self, head_dim, max_seq_len, theta):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        # non-persistent: derived from the config, so not part of the state dict
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, start=0):  # (B, H, T, D) at positions start.. -> (B, H, T, D)
        T = x.size(-2)
        cos, sin = self.cos[start:start + T].to(x.dtype), self.sin[start:start + T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def document_mask(idx, flex=None):
    """Document-causal mask for packed windows idx (B, T): a query sees the keys at or before it in its own
    document, where each EOT opens a new one (the tokens before the first EOT are a document too).
    flex (default: on CUDA) gives a FlexAttention BlockMask, whose kernel skips the blocks that cross
    documents; otherwise a dense bool mask (B, 1, T, T) for SDPA (FlexAttention has no CPU backward)."""
    B, T = idx.shape
    doc = (idx == EOT).cumsum(-1)  # (B, T): document number of every token
    if idx.is_cuda if flex is None else flex:
        return create_block_mask(lambda b, h, q, k: (q >= k) & (doc[b, q] == doc[b, k]), B, None, T, T,
                                 device=idx.device, _compile=idx.is_cuda)
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


# FlexAttention is fast only when compiled (eager it materialises the scores): compiled once, reused per batch
compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


def attention(q, k, v, mask, causal=True):
    """Causal attention (B, H, Tq, D), (B, H, Tk, D) -> (B, H, Tq, D); mask: None (plain causal: flash SDPA on
    CUDA), or from document_mask. causal=False: the newest token of generation, which sees every cached key."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if isinstance(mask, BlockMask):
        return (compiled_flex_attention if q.is_cuda else flex_attention)(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DynamicScale(nn.Module):
    """Eq. 12: one per-token scale for each λ of a layer,  s = sigmoid(W2 · GELU(W1 · x) + b2),  where x is
    the layer's attention input (the RMS-normed hidden state). W2 and b2 start at zero: every s starts at 0.5."""

    def __init__(self, n_embd, names):
        super().__init__()
        self.names = names  # the λ they scale: q1, q2, k1, k2, ...
        self.fc1 = nn.Linear(n_embd, DYN_HIDDEN, bias=False)
        self.fc2 = nn.Linear(DYN_HIDDEN, len(names), bias=True)

    def forward(self, x):  # (B, T, C) -> {λ name: (B, 1, T, 1)}, broadcast over heads and channels
        s = torch.sigmoid(self.fc2(F.gelu(self.fc1(x))))  # (B, T, n)
        return dict(zip(self.names, s.transpose(1, 2)[..., None].split(1, dim=1)))


def mix(own, anchor, lam1, lam2, s1=None, s2=None):
    """Eq. 10,  Ŝ = λ1 ⊙ N(S_anc) + λ2 ⊙ S,  and Eq. 12,  Ŝ = s1·λ1 ⊙ N(S_anc) + s2·λ2 ⊙ S.  own S and anchor
    N(S_anc) (B, H, T, D); anchor None when anchors are removed (§4.5); λ fp32 parameters, cast so that bf16
    activations stay bf16 under autocast; s1, s2 (B, 1, T, 1) the per-token scales, or None."""
    out = lam2.to(own.dtype) * own
    if s2 is not None:
        out = out * s2
    if anchor is not None:
        a = lam1.to(own.dtype) * anchor
        out = out + (a if s1 is None else a * s1)
    return out


class CausalSelfAttention(nn.Module):

    def __init__(self, config, mixing):
        super().__init__()
        self.n_head, self.head_dim, self.gate = config.n_head, config.head_dim, config.gate
        self.names = PROJECTIONS[:4 if config.gate else 3]
        self.c_attn = nn.Linear(config.n_embd, len(self.names) * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)  # QK-norm, shared by heads
        self.rotary = Rotary(self.head_dim, config.block_size, config.rope_theta)
        # λ_{n,1} (anchor) and λ_{n,2} (own projection) of every mixed projection, all built in one loop
        self.mix = config.mixed if mixing else ""
        shape = GRANULARITY_SHAPES[config.granularity](config.n_head, config.head_dim)
        init = 1.0 if config.dynamic else 0.5  # dynamic: times the initial scale 0.5, λ is 0.5 again
        names = [f"{s}{i}" for s in self.mix for i in "12"]  # q1, q2, k1, ... (ParameterDict sorts its keys)
        self.lam = nn.ParameterDict({name: nn.Parameter(torch.full(shape, init)) for name in names})
        self.dyn = DynamicScale(config.n_embd, names) if (self.mix and config.dynamic) else None
        # Inspection hook for analysis (analyze.py); training never sets it. Called once per forward as
        # inspect(q=, k=, g=, scales=): q, k (B, H, T, D) as they enter attention (mixed, QK-normed, RoPE),
        # g the mixed gate logits (B, H, T, D) or None, scales DynamicScale's {λ name: (B, 1, T, 1)} or None.
        self.inspect = None

    def forward(self, x, anchors=None, mask=None, cache=None):
        # x (B, T, C); anchors {s: (B, H, T, D)}, normalised, or None; mask from document_mask or None;
        # cache: generation's keys and values of the earlier positions ({} at first), or None
        # -> y (B, T, C), this layer's projections {s: (B, H, T, D)} (mixed, before QK-norm)
        B, T, C = x.shape
        qkvg = self.c_attn(x).view(B, T, len(self.names), self.n_head, self.head_dim)  # (B, T, 3 or 4, H, D)
        proj = dict(zip(self.names, qkvg.transpose(1, 3).unbind(2)))  # each (B, H, T, D)
        scales = self.dyn(x) if self.dyn is not None else {}  # Eq. 12
        for s in self.mix:  # Eq. 10
            args = (proj[s], None if anchors is None else anchors[s], self.lam[s + "1"], self.lam[s + "2"],
                    scales.get(s + "1"), scales.get(s + "2"))
            # per-token scales: recompute the products in backward rather than keep a (B, H, T, D) per λ
            proj[s] = checkpoint(mix, *args, use_reentrant=False) if scales and torch.is_grad_enabled() \
                else mix(*args)
        decoding = bool(cache)  # one new token after cached ones (generation), which sees them all
        start = cache["k"].size(2) if decoding else 0  # position of x's first token
        q, k, v = self.rotary(self.q_norm(proj["q"]), start), self.rotary(self.k_norm(proj["k"]), start), proj["v"]
        if cache is not None:
            if decoding:
                k, v = torch.cat((cache["k"], k), dim=2), torch.cat((cache["v"], v), dim=2)
            cache.update(k=k, v=v)
        if self.inspect is not None:
            self.inspect(q=q, k=k, g=proj.get("g"), scales=scales or None)
        y = attention(q, k, v, mask, causal=not decoding)
        if self.gate:  # Gated Attention (G1): elementwise sigmoid gate on the SDPA output
            y = y * torch.sigmoid(proj["g"])
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C)), proj


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.fc2 = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(b) * a)  # SwiGLU


class Block(nn.Module):

    def __init__(self, config, mixing):
        super().__init__()
        self.ln_1, self.ln_2 = RMSNorm(config.n_embd), RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, mixing)
        self.mlp = MLP(config)

    def forward(self, h, anchors=None, mask=None, cache=None):  # (B, T, C) -> (B, T, C), this layer's projections
        a, proj = self.attn(self.ln_1(h), anchors, mask, cache)
        h = h + a
        return h + self.mlp(self.ln_2(h)), proj


def loss_sum(logits, lse, targets, z_loss):  # (N, V) fp32, (N,), (N,) -> Σ cross-entropy + z_loss · Σ lse²
    return (lse - logits.gather(-1, targets[:, None]).squeeze(-1) + z_loss * lse.square()).sum()


def chunk_logits(h, weight, targets, chunk):
    """lm_head chunk by chunk: (rows, tokens' targets, fp32 logits, logsumexp) of each chunk of h (N, C)."""
    for i in range(0, len(targets), chunk):
        logits = F.linear(h[i:i + chunk], weight).float()
        yield slice(i, i + chunk), targets[i:i + chunk], logits, torch.logsumexp(logits, dim=-1)


class LMHeadLoss(torch.autograd.Function):
    """Mean cross-entropy + z_loss · mean(logsumexp²) of lm_head's logits, differentiated chunk by chunk during
    the forward pass: no (N, V) logits are kept for backward, and none are recomputed there (torch has no
    fused linear + cross-entropy). Backward only scales the gradients found here."""

    @staticmethod
    def forward(ctx, h, weight, targets, z_loss, chunk):  # (N, C), (V, C), (N,) -> scalar
        N = len(targets)
        total, grad_h, grad_w = 0.0, torch.empty_like(h), None
        for rows, t, logits, lse in chunk_logits(h, weight, targets, chunk):
            total = total + loss_sum(logits, lse, t, z_loss)
            # d loss / d logits = (softmax · (1 + 2 z_loss lse) - onehot(target)) / N; the matmuls run in the
            # autocast dtype, as autograd's would
            d = torch.softmax(logits, dim=-1).mul_(((1 + 2 * z_loss * lse) / N)[:, None])
            d[torch.arange(len(t), device=t.device), t] -= 1 / N
            grad_h[rows] = d @ weight
            g = (d.t() @ h[rows]).float()
            grad_w = g if grad_w is None else grad_w.add_(g)
        ctx.save_for_backward(grad_h)  # activation-sized
        ctx.grad_w = grad_w  # weight-sized: the memory lm_head's .grad takes in backward anyway
        return total / N

    @staticmethod
    def backward(ctx, grad):
        grad_w, ctx.grad_w = ctx.grad_w, None  # scaled in place, so once
        if grad_w is None:
            raise RuntimeError("LMHeadLoss: a second backward through the same loss (retain_graph) is not supported")
        return ctx.saved_tensors[0] * grad, grad_w.mul_(grad), None, None, None


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"GPTConfig.{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 2048
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    n_layer: int = 32
    n_head: int = 16
    n_embd: int = 1024
    rope_theta: float = 500000.0
    gate: bool = False  # Gated Attention: sigmoid gate on the attention output
    anchor: str = "none"  # where anchors come from: 'none', 'internal' (layer 1) or 'exo' (the embeddings)
    mix: str = ""  # which projections are mixed with their anchor: a subset of 'qkvg'
    granularity: str = "scalar"  # shape of each λ: 'scalar' (), 'headwise' (H,), 'elementwise' (H, D)
    anchor_norm: bool = False  # RMS-normalise anchors before mixing
    dynamic: bool = False  # per-token scaling of every λ by a small MLP (Eq. 12)

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)}: expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head}: expected a divisor of n_embd={self.n_embd}")
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig.n_head={self.n_head}: head dimension n_embd/n_head="
                             f"{self.head_dim} must be even for RoPE")
        _choice("anchor", self.anchor, ("none", "internal", "exo"))
        _choice("granularity", self.granularity, tuple(GRANULARITY_SHAPES))
        if set(self.mix) - set(PROJECTIONS) or len(set(self.mix)) != len(self.mix):
            raise ValueError(f"GPTConfig.mix={self.mix!r}: expected distinct letters from 'qkvg'")
        if "g" in self.mix and not self.gate:
            raise ValueError(f"GPTConfig.mix={self.mix!r}: mixing 'g' needs gate=True")
        if self.anchor == "none" and (self.mix or self.anchor_norm or self.dynamic):
            raise ValueError("GPTConfig.anchor='none': expected mix='', anchor_norm=False and dynamic=False")
        if self.anchor != "none" and not self.mix:
            raise ValueError(f"GPTConfig.mix='': anchor={self.anchor!r} expected a subset of 'qkvg'")

    @classmethod
    def from_dict(cls, d, source="model_config"):
        """The config saved in a checkpoint. A field it lacks (added to GPTConfig after the checkpoint was
        written) takes its default, so a new field's default must reproduce the old behaviour."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{source}: unknown model field(s) {', '.join(unknown)} (written by another "
                             f"version of model.py?); known: {', '.join(f.name for f in fields(cls))}")
        return cls(**d)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mixed(self):
        """The mixed projections in canonical order ('gvq' -> 'qvg')."""
        return "".join(s for s in PROJECTIONS if s in self.mix)

    @property
    def name(self):
        """The paper's name of the variant ('Dynamic E-ExoFormer'), for tables, titles and legends."""
        if self.anchor == "none":
            return "Gated Attention" if self.gate else "Baseline"
        if self.anchor == "internal" and self.mixed == "v" and not (self.gate or self.anchor_norm or self.dynamic):
            return "ResFormer" if self.granularity == "scalar" else f"ResFormer ({self.granularity})"
        name = self.granularity[0].upper() + ("-ExoFormer" if self.anchor == "exo" else "-NuResFormer")
        notes = [n for n, off in (("no gate", not self.gate), (f"mix {self.mixed}", self.mixed not in ("qkv", "qkvg")),
                                  ("no anchor norm", not self.anchor_norm)) if off]
        return ("Dynamic " if self.dynamic else "") + name + (f" ({', '.join(notes)})" if notes else "")


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.drop_anchor = False  # anchor removal at inference (paper §4.5): every λ1 term becomes 0
        self.activation_checkpointing = False  # training: keep only each block's input, recompute the rest in backward
        self.loss_chunk = LOSS_CHUNK
        C, D = config.n_embd, config.head_dim
        # internal anchors come from layer 1, which therefore does not mix; exo anchors feed every layer
        mixing = [config.anchor == "exo" or (config.anchor == "internal" and i > 0)
                  for i in range(config.n_layer)]
        self.wte = nn.Embedding(config.vocab_size, C)
        self.blocks = nn.ModuleList(Block(config, m) for m in mixing)
        self.ln_f = RMSNorm(C)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)  # untied from wte
        mix = config.mixed
        self.anchor_proj = nn.Linear(C, len(mix) * C, bias=False) if config.anchor == "exo" else None
        # Anchors with their own RMSNorm(D), N(·) of Eq. 10: all exo anchors; internal v and g (see normalize)
        normed = ""
        if config.anchor_norm:
            normed = mix if config.anchor == "exo" else mix.replace("q", "").replace("k", "")
        self.anchor_norms = nn.ModuleDict({s: RMSNorm(D) for s in normed})
        self.apply(self._init_weights)
        zero = [self.lm_head] + [m for b in self.blocks for m in (b.attn.c_proj, b.mlp.fc2)] + \
               [b.attn.dyn.fc2 for b in self.blocks if b.attn.dyn is not None]
        for m in zero:
            nn.init.zeros_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6 per matmul weight (forward + backward) plus attention scores
        (12·L·C·T, PaLM's convention, no causal discount). Embedding lookups and elementwise work
        (norms, mixing, gates) are left out."""
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.ndim == 2 and n != "wte.weight")
        return 6 * matmul + 12 * self.config.n_layer * self.config.n_embd * seq_len

    def normalize(self, anchors):
        """N(·) of Eq. 10: with anchor_norm, every exo anchor and the internal v and g anchors through their own
        RMSNorm(D); internal q and k anchors through layer 1's QK-norm (what layer 1 attends with, before RoPE)."""
        norms = dict(self.anchor_norms.items())
        if self.config.anchor == "internal" and self.config.anchor_norm:
            norms.update(q=self.blocks[0].attn.q_norm, k=self.blocks[0].attn.k_norm)
        return {s: norms[s](a) if s in norms else a for s, a in anchors.items()}

    def features(self, idx, doc_mask=False, cache=None):
        """idx (B, T) int64 -> final hidden states (B, T, C), what lm_head turns into logits. A scorer
        that needs a few positions only (eval.py) applies lm_head to those and saves the rest.
        doc_mask: False (plain causal attention), True (attention stays inside the documents of idx, see
        document_mask), or a mask document_mask made. cache: per layer, generation's keys and values."""
        B, T = idx.shape
        start = cache[0]["k"].size(2) if cache and cache[0] else 0
        if start + T > self.config.block_size or (start and T > 1):
            raise ValueError(f"{T} new positions after {start} cached ones: expected at most block_size="
                             f"{self.config.block_size} in all, and one at a time after the first")
        mask = document_mask(idx) if doc_mask is True else (doc_mask if doc_mask is not False else None)
        h = self.wte(idx)
        anchors = None
        if self.anchor_proj is not None:  # Eq. 9: exogenous anchors, computed once from H0, shared by all layers
            H, D = self.config.n_head, self.config.head_dim
            parts = self.anchor_proj(h).view(B, T, -1, H, D).transpose(1, 3).unbind(2)  # each (B, H, T, D)
            anchors = self.normalize(dict(zip(self.config.mixed, parts)))
        for i, block in enumerate(self.blocks):
            args = (h, None if self.drop_anchor else anchors, mask, cache[i] if cache else None)
            if self.activation_checkpointing and torch.is_grad_enabled():
                h, proj = checkpoint(block, *args, use_reentrant=False)  # keeps h, recomputes the block
            else:
                h, proj = block(*args)
            if i == 0 and self.config.anchor == "internal":  # layer 1's projections anchor layers 2..L
                anchors = self.normalize({s: proj[s] for s in self.config.mixed})
        return self.ln_f(h)

    def forward(self, idx, targets=None, z_loss=0.0, doc_mask=False, cache=None):
        # idx (B, T) int64 -> logits (B, T, V), None; with targets (B, T): None, loss. The loss is the mean
        # cross-entropy plus z_loss · mean(logsumexp(logits)²), made chunk by chunk: no (B, T, V) logits at all.
        h = self.features(idx, doc_mask, cache)
        if targets is None:
            return self.lm_head(h), None
        h, targets = h.flatten(0, 1), targets.flatten()
        if torch.is_grad_enabled():
            return None, LMHeadLoss.apply(h, self.lm_head.weight, targets, z_loss, self.loss_chunk)
        total = sum(loss_sum(logits, lse, t, z_loss)  # evaluation: the same sums, without the gradients
                    for _, t, logits, lse in chunk_logits(h, self.lm_head.weight, targets, self.loss_chunk))
        return None, total / len(targets)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None, use_cache=True):
        """Sample continuations of idx (B, T): (B, T + max_new_tokens); temperature 0 is greedy. vocab: sample
        only ids below it (the authors' models have more rows than GPT-2 has tokens). With the KV cache each new
        token runs one position through the model; its anchors need nothing earlier (exo: its own embedding;
        internal: its own layer-1 projections), so keys and values per layer are all there is to cache. Past
        block_size tokens the window slides and is run from position 0 again, as without the cache."""
        cache = None
        for _ in range(max_new_tokens):
            window = idx[:, -self.config.block_size:]
            if not use_cache:
                h = self.features(window)
            elif cache is None or idx.size(1) > self.config.block_size:  # (re)start on the whole window
                cache = [{} for _ in self.blocks]
                h = self.features(window, cache=cache)
            else:
                h = self.features(idx[:, -1:], cache=cache)
            logits = self.lm_head(h[:, -1]).float()
            if vocab is not None:
                logits[:, vocab:] = -float("inf")
            if temperature == 0:  # greedy
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


# ----------------------------------------------------------------------------- checkpoints

def load_checkpoint(path, keys=("model", "model_config"), mmap=False):
    """The dict saved by train.py (or convert.py) on the CPU, read with torch.load(weights_only=True):
    tensors and plain types only, so a checkpoint can never run code. keys: what it must hold.
    mmap: map the tensors instead of reading them (those never used are never read from disk)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint there")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises UnpicklingError for forbidden globals, others for corrupt files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True) ({first_line})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return ckpt


def check_state(config, state_dict, source):
    """A one-line error naming the first missing, unexpected or misshapen tensor of state_dict for a GPT of
    config; returns that GPT built on the meta device (no memory, no init: 13 s saved at 450M on a CPU)."""
    with torch.device("meta"):
        model = GPT(config)
    own = model.state_dict()
    for problem, names in (("missing", [k for k in own if k not in state_dict]),
                           ("unexpected", [k for k in state_dict if k not in own])):
        if names:
            raise ValueError(f"{source}: {problem} tensor(s) {', '.join(names[:3])}"
                             f"{' ...' if len(names) > 3 else ''} for this model config")
    for k, v in state_dict.items():
        if v.shape != own[k].shape:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    return model


def trained_doc_mask(ckpt):
    """Whether a checkpoint's model was trained (and validated) with document masking: as its training
    config says; checkpoints from before that option were not; files without a training config, the
    authors' models converted by convert.py, were."""
    return ckpt["config"].get("doc_mask", False) if "config" in ckpt else True


def check_checkpoint(path, mmap=False):
    """A checkpoint of a model and its GPTConfig, its tensors checked against the config without building
    the model: what load_model needs, or a one-line error. mmap: no tensor is read (a cheap check)."""
    ckpt = load_checkpoint(path, mmap=mmap)
    config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
    check_state(config, ckpt["model"], path)
    return ckpt, config


def load_model(path, device="cpu"):
    """The model of a checkpoint, in eval mode, and the checkpoint itself: what every tool calls."""
    ckpt, config = check_checkpoint(path)
    model = GPT(config)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt
