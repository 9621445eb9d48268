"""
ExoFormer and its relatives in one file (arXiv 2601.08131, "Attention Projection Mixing with
Exogenous Anchors"). A variant is a handful of GPTConfig fields, not a class:

    Baseline             gate=False anchor='none'
    Gated Attention      gate=True  anchor='none'
    ResFormer            gate=False anchor='internal' mix='v'    granularity='scalar'
    NuResFormer          gate=True  anchor='internal' mix='qkvg' anchor_norm=True
    ExoFormer            gate=True  anchor='exo'      mix='qkvg' anchor_norm=True
    Dynamic E-ExoFormer  ExoFormer with granularity='elementwise' dynamic=True

Every mixed projection S of a mixing layer n is  Ŝ_n = λ_{n,1} ⊙ N(S_anc) + λ_{n,2} ⊙ S_n  (Eq. 10),
where the anchors S_anc come from the first layer (internal) or from one projection of the token
embeddings shared by every layer (exo). Notation: C = n_embd, H = n_head, D = C/H.
"""
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

PROJECTIONS = "qkvg"  # order of the projections in c_attn and anchor_proj: query, key, value, gate logit
GRANULARITY_SHAPES = {"scalar": lambda H, D: (), "headwise": lambda H, D: (H, 1, 1),
                      "elementwise": lambda H, D: (H, 1, D)}  # λ shapes, broadcast over (B, H, T, D)
DYN_HIDDEN = 16  # width of the dynamic-mixing MLP (paper §3.6)
INIT_STD = 0.02
EOT = 50256  # GPT-2's <|endoftext|>: in the packed training windows, each one opens a new document


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

    def forward(self, x):  # (B, H, T, D) -> (B, H, T, D)
        T = x.size(-2)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
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


def attention(q, k, v, mask):
    """Causal attention (B, H, T, D) -> (B, H, T, D); mask: None (plain causal: flash SDPA on CUDA), a
    BlockMask (FlexAttention) or a dense bool mask (SDPA), both from document_mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, BlockMask):
        return (compiled_flex_attention if q.is_cuda else flex_attention)(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DynamicScale(nn.Module):
    """Per-token scales of the mixing coefficients (Eq. 12), one per λ: order q1, q2, k1, k2, ..."""

    def __init__(self, n_embd, n_lambda):
        super().__init__()
        self.fc1 = nn.Linear(n_embd, DYN_HIDDEN, bias=False)
        self.fc2 = nn.Linear(DYN_HIDDEN, n_lambda, bias=True)

    def forward(self, x):  # (B, T, C) -> (n_lambda, B, 1, T, 1)
        s = torch.sigmoid(self.fc2(F.gelu(self.fc1(x))))
        return s.permute(2, 0, 1)[:, :, None, :, None]


class CausalSelfAttention(nn.Module):

    def __init__(self, config, mixing):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.gate, self.anchor_norm = config.gate, config.anchor_norm
        self.names = PROJECTIONS[:4 if config.gate else 3]
        self.c_attn = nn.Linear(config.n_embd, len(self.names) * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)  # QK-norm, shared by heads
        self.rotary = Rotary(self.head_dim, config.block_size, config.rope_theta)
        # Mixing coefficients λ_{n,1} (anchor) and λ_{n,2} (own projection) for every mixed projection
        self.mix = config.mixed if mixing else ""
        shape = GRANULARITY_SHAPES[config.granularity](config.n_head, config.head_dim)
        init = 1.0 if config.dynamic else 0.5  # dynamic: sigmoid(0) = 0.5 at init brings it back to 0.5
        self.lam = nn.ParameterDict({f"{s}{i}": nn.Parameter(torch.full(shape, init))
                                     for s in self.mix for i in "12"})
        self.dyn = DynamicScale(config.n_embd, 2 * len(self.mix)) if (self.mix and config.dynamic) else None
        # Inspection hook for analysis (analyze.py); training never sets it. Called once per forward as
        # inspect(q=, k=, g=, scales=): q, k (B, H, T, D) as they enter attention (mixed, QK-normed, RoPE),
        # g the mixed gate logits (B, H, T, D) or None, scales the dynamic scales (2|mix|, B, 1, T, 1) or None.
        self.inspect = None

    def forward(self, x, anchors, mask=None):
        # x (B, T, C), anchors {name: (B, H, T, D)} or None, mask from document_mask or None
        # -> y (B, T, C), projections {name: (B, H, T, D)}
        B, T, C = x.shape
        parts = self.c_attn(x).view(B, T, len(self.names), self.n_head, self.head_dim).transpose(1, 3)
        proj = dict(zip(self.names, parts.unbind(2)))  # each (B, H, T, D)
        dyn = self.dyn(x) if self.dyn is not None else None
        scales = iter(dyn) if dyn is not None else None
        for s in self.mix:
            lam1, lam2 = self.lam[s + "1"], self.lam[s + "2"]
            if scales is not None:  # Eq. 12: per-token scaling of both coefficients
                lam1, lam2 = lam1 * next(scales), lam2 * next(scales)
            dtype = proj[s].dtype  # fp32 λ must not promote bf16 activations under autocast
            mixed = lam2.to(dtype) * proj[s]
            if anchors is not None:  # anchors is None when they are removed at inference (SPEC §3.6)
                mixed = mixed + lam1.to(dtype) * anchors[s]  # Eq. 10
            proj[s] = mixed
        q, k = self.q_norm(proj["q"]), self.k_norm(proj["k"])
        if self.anchor_norm:  # internal anchors for q and k are the first layer's QK-normed q and k
            proj.update(q=q, k=k)
        q, k = self.rotary(q), self.rotary(k)
        if self.inspect is not None:
            self.inspect(q=q, k=k, g=proj.get("g"), scales=dyn)
        y = attention(q, k, proj["v"], mask)
        if self.gate:  # Gated Attention (G1): elementwise sigmoid gate on the SDPA output
            y = y * torch.sigmoid(proj["g"])
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y), proj


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

    def forward(self, h, anchors, mask=None):  # (B, T, C) -> (B, T, C), this layer's projections
        a, proj = self.attn(self.ln_1(h), anchors, mask)
        h = h + a
        return h + self.mlp(self.ln_2(h)), proj


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


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.drop_anchor = False  # anchor removal at inference (SPEC §3.6): every λ1 term becomes 0
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
        # Anchors with their own RMSNorm(D): all exo anchors; internal v and g (q, k reuse layer 1's QK-norm)
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

    def _norm_anchors(self, anchors):  # RMS-normalise the anchors that have their own norm
        return {s: self.anchor_norms[s](a) if s in self.anchor_norms else a for s, a in anchors.items()}

    def features(self, idx, doc_mask=False):
        """idx (B, T) int64 -> final hidden states (B, T, C), what lm_head turns into logits. A scorer
        that needs a few positions only (eval.py) applies lm_head to those and saves the rest.
        doc_mask: False (plain causal attention), True (attention stays inside the documents of idx, see
        document_mask), or a mask document_mask built already (train.py builds it outside torch.compile)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        mask = document_mask(idx) if doc_mask is True else (doc_mask if doc_mask is not False else None)
        h = self.wte(idx)
        anchors = None
        if self.anchor_proj is not None:  # Eq. 9: exogenous anchors, computed once from H0, shared by all layers
            C, H, D = self.config.n_embd, self.config.n_head, self.config.head_dim
            parts = self.anchor_proj(h).view(B, T, -1, H, D).transpose(1, 3).unbind(2)
            anchors = self._norm_anchors(dict(zip(self.config.mixed, parts)))
        for i, block in enumerate(self.blocks):
            h, proj = block(h, None if self.drop_anchor else anchors, mask)
            if i == 0 and self.config.anchor == "internal":  # layer 1's projections anchor layers 2..L
                anchors = self._norm_anchors({s: proj[s] for s in self.config.mixed})
        return self.ln_f(h)

    def forward(self, idx, targets=None, with_z=False, doc_mask=False):
        # idx (B, T) int64 -> logits (B, T, V), loss: mean cross-entropy or None
        # with_z=True adds a third value, mean(logsumexp(logits)²), for the z-loss (SPEC §2)
        logits = self.lm_head(self.features(idx, doc_mask))
        if targets is None:
            return (logits, None, None) if with_z else (logits, None)
        logits32 = logits.float()
        lse = torch.logsumexp(logits32, dim=-1)  # one logsumexp serves both losses
        loss = (lse - logits32.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()
        return (logits, loss, lse.square().mean()) if with_z else (logits, loss)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample continuations of idx (B, T): (B, T + max_new_tokens). No KV cache: tutorial speed."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float()
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
        raise ValueError(f"{path}: not a checkpoint of this code (no {' or '.join(missing)})")
    return ckpt


def load_state(model, state_dict, source):
    """model.load_state_dict with a one-line error naming the first missing, unexpected or misshapen tensor."""
    own = model.state_dict()
    for problem, names in (("missing", [k for k in own if k not in state_dict]),
                           ("unexpected", [k for k in state_dict if k not in own])):
        if names:
            raise ValueError(f"{source}: {problem} tensor(s) {', '.join(names[:3])}"
                             f"{' ...' if len(names) > 3 else ''} for this model config")
    for k, v in state_dict.items():
        if v.shape != own[k].shape:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    model.load_state_dict(state_dict)


def load_model(path, device="cpu"):
    """The model of a checkpoint, in eval mode, and the checkpoint itself: what every tool calls."""
    ckpt = load_checkpoint(path)
    model = GPT(GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config"))
    load_state(model, ckpt["model"], path)
    return model.to(device).eval(), ckpt
