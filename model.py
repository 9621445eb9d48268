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
        Ŝ_n = λ_{n,1} ⊙ N(S_anc) + λ_{n,2} ⊙ S_n      each mixed projection (Eq. 10, mix_with_anchor)
        QK-norm and RoPE on q and k, causal attention, ⊙ sigmoid(g) (Gated Attention), c_proj; SwiGLU MLP
    logits = lm_head(RMSNorm(h))
Notation: C = n_embd, H = n_head, D = C/H, L = n_layer.

The file reads top to bottom as the paper, down to `logits, loss = model(idx, targets)`. Below the
"Engineering" banner comes what makes it fit and run fast without changing what it computes: the attention
kernels and document masks, the chunked loss, the KV cache and generation, the FLOP count. They stay in this
file so that a fork of the model is a fork of one file. test_model.py's reference_logits is the same model
written out on one screen, from the raw parameters.
"""
import functools
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

PROJECTIONS = "qkvg"  # order of the projections in c_attn and anchor_proj: query, key, value, gate logit
GRANULARITY_SHAPES = {"scalar": lambda H, D: (), "headwise": lambda H, D: (H, 1, 1),
                      "elementwise": lambda H, D: (H, 1, D)}  # λ shapes (§3.3), broadcast over (B, H, T, D)
LAMBDA_INIT = 0.5  # every λ starts at 0.5 (§3.4) ...
DYNAMIC_LAMBDA_INIT = 1.0  # ... and 1.0 when dynamic (§3.6), times its initial scale sigmoid(0) = 0.5: 0.5 again
DYN_HIDDEN = 16  # width of the dynamic-mixing MLP (§3.6)
INIT_STD = 0.02  # N(0, 0.02) truncated at ±3σ for every Linear and the embedding (the authors' model.py)
NORM_EPS = 1e-6  # RMSNorm's eps (the authors' rmsnorm_eps)
EOT = 50256  # GPT-2's <|endoftext|>: in the packed training windows, each one opens a new document
IGNORE = -1  # a target equal to it adds nothing to the loss or its gradient (nanoGPT's ignore_index)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x²) + eps) * weight, computed in fp32 whatever the activation dtype."""

    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim) -> (..., dim)
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def rotary_tables(head_dim, max_seq_len, theta):
    """cos and sin (max_seq_len, D/2) of RoPE's angles, position × frequency."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """RoPE, rotate-half (NeoX) layout: dimension i pairs with i + D/2. x (B, H, T, D), cos/sin (T, D/2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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


def mix_with_anchor(own, anchor, lam1, lam2, s1=None, s2=None):
    """Eq. 10,  Ŝ = λ1 ⊙ N(S_anc) + λ2 ⊙ S,  and Eq. 12,  Ŝ = s1·λ1 ⊙ N(S_anc) + s2·λ2 ⊙ S.
    own S and anchor N(S_anc) (B, H, T, D); anchor None when anchors are removed (§4.5); λ fp32 parameters,
    cast so that bf16 activations stay bf16 under autocast; s1, s2 (B, 1, T, 1) the per-token scales, or None."""
    out = lam2.to(own.dtype) * own
    if s2 is not None:
        out = out * s2
    if anchor is not None:
        a = lam1.to(own.dtype) * anchor
        out = out + (a if s1 is None else a * s1)
    return out


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer, mixes):
        super().__init__()
        self.layer, self.n_head, self.head_dim, self.gate = layer, config.n_head, config.head_dim, config.gate
        self.names = PROJECTIONS[:4 if config.gate else 3]
        self.c_attn = nn.Linear(config.n_embd, len(self.names) * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)  # QK-norm, shared by heads
        # λ_{n,1} (anchor) and λ_{n,2} (own projection) of every projection this layer mixes, built in one loop
        self.mixed = config.mixed if mixes else ""
        shape = GRANULARITY_SHAPES[config.granularity](config.n_head, config.head_dim)
        init = DYNAMIC_LAMBDA_INIT if config.dynamic else LAMBDA_INIT
        names = [f"{s}{i}" for s in self.mixed for i in "12"]  # q1, q2, k1, ... (ParameterDict sorts its keys)
        self.lam = nn.ParameterDict({name: nn.Parameter(torch.full(shape, init)) for name in names})
        self.dyn = DynamicScale(config.n_embd, names) if (self.mixed and config.dynamic) else None
        # Inspection hook for analysis (analyze.py); training never sets it. Called once per forward as
        # inspect(q=, k=, g=, scales=): q, k (B, H, T, D) as they enter attention (mixed, QK-normed, RoPE),
        # g the mixed gate logits (B, H, T, D) or None, scales DynamicScale's {λ name: (B, 1, T, 1)} or None.
        self.inspect = None

    def forward(self, x, rope, anchors=None, mask=None, cache=None):
        # x (B, T, C); rope: cos, sin (T, D/2) of x's positions; anchors {s: (B, H, T, D)}, normalised, or None;
        # mask from document_mask or None; cache: a KVCache (generation) or None
        # -> y (B, T, C), this layer's projections {s: (B, H, T, D)} (mixed, before QK-norm)
        B, T, C = x.shape
        qkvg = self.c_attn(x).view(B, T, len(self.names), self.n_head, self.head_dim)  # (B, T, 3 or 4, H, D)
        proj = dict(zip(self.names, qkvg.transpose(1, 3).unbind(2)))  # each (B, H, T, D)
        scales = self.dyn(x) if self.dyn is not None else {}  # Eq. 12
        for s in self.mixed:  # Eq. 10
            args = (proj[s], None if anchors is None else anchors[s], self.lam[s + "1"], self.lam[s + "2"],
                    scales.get(s + "1"), scales.get(s + "2"))
            # per-token scales: recompute the products in backward rather than keep a (B, H, T, D) per λ
            proj[s] = checkpoint(mix_with_anchor, *args, use_reentrant=False) \
                if scales and torch.is_grad_enabled() else mix_with_anchor(*args)
        q, k, v = rotate(self.q_norm(proj["q"]), *rope), rotate(self.k_norm(proj["k"]), *rope), proj["v"]
        decoding = cache is not None and cache.holds(self.layer)  # one new token, which sees every cached one
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
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

    def __init__(self, config, layer, mixes):
        super().__init__()
        self.ln_1, self.ln_2 = RMSNorm(config.n_embd), RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer, mixes)
        self.mlp = MLP(config)

    def forward(self, h, rope, anchors=None, mask=None, cache=None):  # (B, T, C) -> (B, T, C), its projections
        a, proj = self.attn(self.ln_1(h), rope, anchors, mask, cache)
        h = h + a
        return h + self.mlp(self.ln_2(h)), proj


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 2048  # sequence length: the model's longest context, and the training windows'
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    n_layer: int = 32  # transformer blocks (L)
    n_head: int = 16  # attention heads (H); n_embd/H must be even
    n_embd: int = 1024  # model width (C)
    rope_theta: float = 500000.0  # the authors' ModelConfig
    gate: bool = False  # Gated Attention: sigmoid gate on the attention output
    anchor: str = "none"  # where anchors come from: 'none', 'internal' (layer 1) or 'exo' (the embeddings)
    mix: str = ""  # which projections are mixed with their anchor: a subset of 'qkvg'
    granularity: str = "scalar"  # shape of each λ: 'scalar' (), 'headwise' (H,), 'elementwise' (H, D)
    anchor_norm: bool = False  # RMS-normalise anchors before mixing
    dynamic: bool = False  # per-token scaling of every λ by a small MLP (Eq. 12)
    anchor_frozen: bool = False  # exo: anchor_proj stays at its random init (no gradient): the review's falsifier

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)}: expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head}: expected a divisor of n_embd={self.n_embd}")
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig.n_head={self.n_head}: head dimension n_embd/n_head="
                             f"{self.head_dim} must be even for RoPE")
        for name, allowed in (("anchor", ("none", "internal", "exo")), ("granularity", tuple(GRANULARITY_SHAPES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}: expected one of "
                                 f"{', '.join(map(repr, allowed))}")
        if set(self.mix) - set(PROJECTIONS) or len(set(self.mix)) != len(self.mix):
            raise ValueError(f"GPTConfig.mix={self.mix!r}: expected distinct letters from 'qkvg'")
        if "g" in self.mix and not self.gate:
            raise ValueError(f"GPTConfig.mix={self.mix!r}: mixing 'g' needs gate=True")
        if self.anchor == "none" and (self.mix or self.anchor_norm or self.dynamic):
            raise ValueError("GPTConfig.anchor='none': expected mix='', anchor_norm=False and dynamic=False")
        if self.anchor != "none" and not self.mix:
            raise ValueError(f"GPTConfig.mix='': anchor={self.anchor!r} expected a subset of 'qkvg'")
        if self.anchor_frozen and self.anchor != "exo":
            raise ValueError(f"GPTConfig.anchor_frozen=True: only exogenous anchors (anchor='exo') have "
                             f"a projection to freeze, not anchor={self.anchor!r}")

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
        flags = (("no gate", not self.gate), (f"mix {self.mixed}", self.mixed not in ("qkv", "qkvg")),
                 ("no anchor norm", not self.anchor_norm), ("frozen anchors", self.anchor_frozen))
        notes = [n for n, on in flags if on]
        return ("Dynamic " if self.dynamic else "") + name + (f" ({', '.join(notes)})" if notes else "")


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.drop_anchor = False  # anchor removal at inference (§4.5): every λ1 term becomes 0
        self.activation_checkpointing = False  # training: keep only each block's input, recompute the rest in backward
        self.flex = None  # document masks: FlexAttention (True), a dense SDPA mask (False), None: FlexAttention on CUDA
        self.loss_chunk = LOSS_CHUNK
        C, D = config.n_embd, config.head_dim
        # internal anchors come from layer 1, which therefore does not mix; exo anchors feed every layer
        mixes = [config.anchor == "exo" or (config.anchor == "internal" and i > 0) for i in range(config.n_layer)]
        self.wte = nn.Embedding(config.vocab_size, C)
        self.blocks = nn.ModuleList(Block(config, i, m) for i, m in enumerate(mixes))
        self.ln_f = RMSNorm(C)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)  # untied from wte
        self.anchor_proj = nn.Linear(C, len(config.mixed) * C, bias=False) if config.anchor == "exo" else None
        # Anchors with their own RMSNorm(D), N(·) of Eq. 10: all exo anchors; internal v and g (see normalize)
        normed = ""
        if config.anchor_norm:
            normed = config.mixed if config.anchor == "exo" else config.mixed.replace("q", "").replace("k", "")
        self.anchor_norms = nn.ModuleDict({s: RMSNorm(D) for s in normed})
        cos, sin = rotary_tables(D, config.block_size, config.rope_theta)  # once for every layer
        self.register_buffer("rope_cos", cos, persistent=False)  # derived from the config: not in the state dict
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # zero-initialised output layers (the authors' model.py, as modded-nanogpt): each block starts as the
        # identity, the logits at 0; the dynamic scales start at sigmoid(0) = 0.5 (§3.6)
        for m in self.zero_initialised():
            nn.init.zeros_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        if config.anchor_frozen:  # a fixed random projection of the embeddings: trained by nothing
            self.anchor_proj.weight.requires_grad_(False)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def zero_initialised(self):
        """The output layers that start at zero: lm_head, each block's c_proj and fc2, the dynamic scales' fc2."""
        return [self.lm_head] + [m for b in self.blocks for m in (b.attn.c_proj, b.mlp.fc2)] + \
               [b.attn.dyn.fc2 for b in self.blocks if b.attn.dyn is not None]

    @torch.no_grad()
    def init_weights(self, write=None):
        """Give a GPT built on the meta device, then given storage (to_empty; sharded or not), exactly the values
        that GPT(config) on the CPU starts with from the same state of the global generator, and leave the generator
        where GPT(config) leaves it: the draws of each Linear's and the embedding's construction (their
        reset_parameters, discarded), then __init__'s own, in the same order. Each parameter is made whole on the CPU,
        one at a time, and write(param, whole) stores the part of it that param holds (default: all of it; a shard's
        rows under FSDP, sharding.write_part): a process holds one parameter in host memory, never the model."""
        write = write or (lambda param, whole: param.copy_(whole))
        drawn = [m for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))]  # construction's order
        for m in drawn:  # each built again on the CPU, as __init__ built it: the same draws
            if isinstance(m, nn.Linear):
                nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            else:
                nn.Embedding(m.num_embeddings, m.embedding_dim)
        zero, done = set(map(id, self.zero_initialised())), set()
        for m in drawn:  # self.apply(self._init_weights) visits them in the same order
            whole = torch.empty(m.weight.shape, dtype=m.weight.dtype)
            nn.init.trunc_normal_(whole, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)  # as _init_weights
            write(m.weight, whole.zero_() if id(m) in zero else whole)
            if getattr(m, "bias", None) is not None:
                write(m.bias, torch.zeros(m.bias.shape, dtype=m.bias.dtype))
            done |= {id(p) for p in m.parameters(recurse=False)}
        lam = DYNAMIC_LAMBDA_INIT if self.config.dynamic else LAMBDA_INIT
        for name, p in self.named_parameters():
            if id(p) in done:
                continue
            owner = self.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, RMSNorm):
                write(p, torch.ones(p.shape, dtype=p.dtype))
            elif isinstance(owner, nn.ParameterDict) and name.split(".")[-2] == "lam":  # every λ
                write(p, torch.full(p.shape, lam, dtype=p.dtype))
            else:
                raise ValueError(f"GPT.init_weights: no initial value for the parameter {name}: give it the one "
                                 f"GPT.__init__ gives it")
        other = [n for n, _ in self.named_buffers() if n not in ("rope_cos", "rope_sin")]
        if other:
            raise ValueError(f"GPT.init_weights: no initial value for the buffer {other[0]}: give it the one "
                             f"GPT.__init__ gives it")
        for buffer, value in zip((self.rope_cos, self.rope_sin), rotary_tables(
                self.config.head_dim, self.config.block_size, self.config.rope_theta)):
            buffer.copy_(value)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def normalize(self, anchors):
        """N(·) of Eq. 10: with anchor_norm, every exo anchor and the internal v and g anchors through their own
        RMSNorm(D); internal q and k anchors through layer 1's QK-norm (what layer 1 attends with, before RoPE)."""
        norms = dict(self.anchor_norms.items())
        if self.config.anchor == "internal" and self.config.anchor_norm:
            norms.update(q=self.blocks[0].attn.q_norm, k=self.blocks[0].attn.k_norm)
        return {s: norms[s](a) if s in norms else a for s, a in anchors.items()}

    def features(self, idx, doc_mask=False, mask=None, cache=None):
        """idx (B, T) int64 -> final hidden states (B, T, C), what lm_head turns into logits (a scorer that
        needs a few positions only, eval.py, applies lm_head to those). doc_mask: attention stays inside the
        documents of idx (document_mask); mask: one document_mask made already, instead; cache: a KVCache."""
        B, T = idx.shape
        start = len(cache) if cache is not None else 0  # positions before idx's
        if start + T > self.config.block_size or (start and T > 1):
            raise ValueError(f"{T} new positions after {start} cached ones: expected at most block_size="
                             f"{self.config.block_size} in all, and one at a time after the first")
        if mask is None and doc_mask:
            mask = document_mask(idx, self.flex)
        rope = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        h = self.wte(idx)
        anchors = None
        if self.anchor_proj is not None:  # Eq. 9: exogenous anchors, computed once from H0, shared by all layers
            H, D = self.config.n_head, self.config.head_dim
            parts = self.anchor_proj(h).view(B, T, -1, H, D).transpose(1, 3).unbind(2)  # each (B, H, T, D)
            anchors = self.normalize(dict(zip(self.config.mixed, parts)))
        for i, block in enumerate(self.blocks):
            args = (h, rope, None if self.drop_anchor else anchors, mask, cache)
            if self.activation_checkpointing and torch.is_grad_enabled():
                h, proj = checkpoint(block, *args, use_reentrant=False)  # keeps h, recomputes the block
            else:
                h, proj = block(*args)
            if i == 0 and self.config.anchor == "internal":  # layer 1's projections anchor layers 2..L
                anchors = self.normalize({s: proj[s] for s in self.config.mixed})
        return self.ln_f(h)

    def forward(self, idx, targets=None, *, z_loss=0.0, doc_mask=False, mask=None):
        # idx (B, T) int64 -> logits (B, T, V), None. With targets (B, T): None, the loss: mean cross-entropy over
        # the targets that are not IGNORE, plus z_loss · mean(logsumexp(logits)²), made chunk by chunk (no logits)
        h = self.features(idx, doc_mask, mask)
        if targets is None:
            return self.lm_head(h), None
        return None, chunked_loss(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), z_loss, self.loss_chunk)


# =============================================================================================================
# Engineering: what makes the model above fit and run fast. None of it changes what the model computes;
# test_model.py checks each piece against the plain computation.

# ----------------------------------------------------------------------------- attention kernels, document masks

def document_mask(idx, flex=None):
    """Document-causal mask for packed windows idx (B, T): a query sees the keys at or before it in its own
    document, where each EOT opens a new one (the tokens before the first EOT are a document too).
    flex (None: on CUDA with Triton) gives a FlexAttention BlockMask, whose kernel skips the blocks that cross
    documents; otherwise a dense bool mask (B, 1, T, T) for SDPA (FlexAttention has no CPU backward)."""
    B, T = idx.shape
    doc = (idx == EOT).cumsum(-1)  # (B, T): document number of every token
    if (idx.is_cuda and triton_available()) if flex is None else flex:
        # traced with the model when it is compiled; eagerly, the compiled mask build (its device given: the
        # default is the current accelerator, whatever idx's device is)
        build = create_block_mask if torch.compiler.is_compiling() else compiled(create_block_mask)
        return build(lambda b, h, q, k: (q >= k) & (doc[b, q] == doc[b, k]), B, None, T, T, device=idx.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def triton_available():
    """Whether FlexAttention's kernels can be built: Triton installed and a GPU it supports, sm70+ (torch's own
    check, the one inductor makes). Without it, document masks on CUDA are dense SDPA masks."""
    from torch.utils._triton import has_triton
    return has_triton()


# Asked once while tracing, a constant of the graph: no graph break. This is the mark that
# @torch.compiler.assume_constant_result sets, set here without the decorator, which imports dynamo: 0.5 CPU-s
# at every `import model` (test_model.py checks both)
triton_available._dynamo_marked_constant = True


# FlexAttention and its mask build are fast only when compiled (eager, they materialise the (T, T) scores and
# mask): inside a compiled model dynamo traces and fuses the plain functions; called eagerly, these compiled
# copies run instead, compiled once and reused per batch. Made on first use: torch.compile imports dynamo and
# inductor, 1.2 CPU-s that every process without a BlockMask would pay at import
@functools.cache  # one compiled copy of each function (and options), made on its first call
def compiled(fn, **options):
    return torch.compile(fn, **options)


def attention(q, k, v, mask, causal=True):
    """Causal attention (B, H, Tq, D), (B, H, Tk, D) -> (B, H, Tq, D); mask: None (plain causal: flash SDPA on
    CUDA), or from document_mask. causal=False: the newest token of generation, which sees every cached key."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if isinstance(mask, BlockMask):
        eager_cuda = q.is_cuda and not torch.compiler.is_compiling()
        return (compiled(flex_attention, dynamic=False) if eager_cuda else flex_attention)(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ----------------------------------------------------------------------------- the loss, in chunks

LOSS_CHUNK = 2048  # tokens per chunk of lm_head + loss: a chunk's (2048, V) fp32 logits are transient, 0.4 GB


def loss_sum(logits, lse, targets, z_loss):
    """(N, V) fp32, their logsumexp (N,), targets (N,) -> Σ over the kept targets of cross-entropy + z_loss · lse²"""
    keep = targets != IGNORE
    picked = logits.gather(-1, targets.clamp_min(0)[:, None]).squeeze(-1)
    return ((lse - picked + z_loss * lse.square()) * keep).sum()


def chunk_logits(h, weight, targets, chunk):
    """lm_head chunk by chunk: (rows, tokens' targets, fp32 logits, logsumexp) of each chunk of h (N, C)."""
    for i in range(0, len(targets), chunk):
        logits = F.linear(h[i:i + chunk], weight).float()
        yield slice(i, i + chunk), targets[i:i + chunk], logits, torch.logsumexp(logits, dim=-1)


def chunked_loss(h, weight, targets, z_loss, chunk):
    """The loss of GPT.forward from the final hidden states h (N, C) and lm_head's weight (V, C), chunk by chunk.
    N counts the kept targets (at least 1, so a batch of only IGNORE gives 0, not NaN), on the device: no sync."""
    n = (targets != IGNORE).sum().clamp_min(1)
    if torch.is_grad_enabled():
        return LMHeadLoss.apply(h, weight, targets, z_loss, chunk, n)
    return sum(loss_sum(logits, lse, t, z_loss) for _, t, logits, lse in chunk_logits(h, weight, targets, chunk)) / n


class LMHeadLoss(torch.autograd.Function):
    """chunked_loss, differentiated chunk by chunk during the forward pass: no (N, V) logits are kept for backward,
    and none are recomputed there (torch has no fused linear + cross-entropy). Backward only scales the gradients
    found here."""

    @staticmethod
    def forward(ctx, h, weight, targets, z_loss, chunk, n):  # (N, C), (V, C), (N,), kept count () -> scalar
        total, grad_h, grad_w = 0.0, torch.empty_like(h), None
        for rows, t, logits, lse in chunk_logits(h, weight, targets, chunk):
            total = total + loss_sum(logits, lse, t, z_loss)
            # d loss / d logits = (softmax · (1 + 2 z_loss lse) - onehot(target)) / n on kept rows, 0 on the others;
            # the matmuls run in the autocast dtype, as autograd's would
            keep = t != IGNORE
            d = torch.softmax(logits, dim=-1).mul_(((1 + 2 * z_loss * lse) / n * keep)[:, None])
            d[torch.arange(len(t), device=t.device), t.clamp_min(0)] -= (keep.double() / n).float()
            grad_h[rows] = d @ weight
            g = (d.t() @ h[rows]).float()
            grad_w = g if grad_w is None else grad_w.add_(g)
        ctx.save_for_backward(grad_h)  # activation-sized
        ctx.grad_w = grad_w  # weight-sized: the memory lm_head's .grad takes in backward anyway
        return total / n

    @staticmethod
    def backward(ctx, grad):
        grad_w, ctx.grad_w = ctx.grad_w, None  # scaled in place, so once
        if grad_w is None:
            raise RuntimeError("LMHeadLoss: a second backward through the same loss (retain_graph) is not supported")
        return ctx.saved_tensors[0] * grad, grad_w.mul_(grad), None, None, None, None


# ----------------------------------------------------------------------------- generation

class KVCache:
    """Generation's keys and values, per layer, of the positions run so far. Nothing else needs caching: a new
    token's anchors come from itself (exo: its own embedding; internal: its own layer-1 projections)."""

    def __init__(self, n_layer):
        self.keys, self.values = [None] * n_layer, [None] * n_layer

    def __len__(self):  # positions cached
        return 0 if self.keys[0] is None else self.keys[0].size(2)

    def holds(self, layer):
        return self.keys[layer] is not None

    def append(self, layer, k, v):
        """Add the new positions' k, v (B, H, T, D) of a layer; return the layer's keys and values so far."""
        if self.keys[layer] is not None:
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None, use_cache=True, stop=None):
    """Sample continuations of idx (B, T): (B, T + max_new_tokens); temperature 0 is greedy. vocab: sample only ids
    below it (the authors' models have more rows than GPT-2 has tokens). With the KV cache each new token runs one
    position through the model. Past block_size tokens the window slides and is run from position 0 again, as
    without the cache. stop: a function of the ids so far, called after each new token; True ends generation
    there (eval.py's stop sequences)."""
    block_size, cache = model.config.block_size, None
    for _ in range(max_new_tokens):
        window = idx[:, -block_size:]
        if not use_cache:
            h = model.features(window)
        elif cache is None or idx.size(1) > block_size:  # (re)start on the whole window
            cache = KVCache(model.config.n_layer)
            h = model.features(window, cache=cache)
        else:
            h = model.features(idx[:, -1:], cache=cache)
        logits = model.lm_head(h[:, -1]).float()
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
        if stop is not None and stop(idx):
            break
    return idx


# ----------------------------------------------------------------------------- FLOPs

def flops_per_token(model, seq_len):
    """Training FLOPs per token: 6 per matmul weight (forward + backward) plus attention as computed under the causal
    mask, half of PaLM's 12·L·C·T (document masks skip more, by an amount each batch decides). Embedding lookups and
    elementwise work (norms, mixing, gates) are left out."""
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and n != "wte.weight")
    return 6 * matmul + 6 * model.config.n_layer * model.config.n_embd * seq_len


# ----------------------------------------------------------------------------- a state dict for a config

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
