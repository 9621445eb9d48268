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
    logits = lm_head(RMSNorm(h)), loss = cross-entropy + z-loss (lm_loss)
Notation: C = n_embd, H = n_head, D = C/H, L = n_layer. Beside each choice the paper leaves open: whose it is, the
authors' code (their release, whose checkpoints tools/convert.py loads into this model with the same logits) or ours.

The file reads top to bottom as the paper, its initialisation included, down to `logits, loss = model(idx, targets)`.
Below the "Engineering" banner comes what makes it fit and run fast without changing what it computes: the config's
checks, the draws that keep a seed's weights, activation checkpointing, attention kernels and document masks, the
chunked loss, the KV cache and generation, the FLOP count. They stay in this file so that a fork of the model is a
fork of one file. test_model.py's reference_logits is the same model written out on one screen, from the raw
parameters.
"""
import functools
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

PROJECTIONS = "qkvg"  # order of the projections in c_attn and anchor_proj: query, key, value, gate logit (authors')
ANCHOR, OWN = "1", "2"  # λ keys: lam[s + ANCHOR] is λ_{n,1}, the anchor's weight, lam[s + OWN] λ_{n,2}, the layer's
#                         own projection's (Eq. 10): q1, q2, k1, ..., as the authors' lambda_q1, lambda_q2
GRANULARITY_SHAPES = {"scalar": lambda H, D: (), "headwise": lambda H, D: (H, 1, 1),
                      "elementwise": lambda H, D: (H, 1, D)}  # λ shapes (§3.3), broadcast over (B, H, T, D)
LAMBDA_INIT = 0.5  # every λ starts at 0.5 (§3.4) ...
DYNAMIC_LAMBDA_INIT = 1.0  # ... and 1.0 when dynamic (§3.6), times its initial scale sigmoid(0) = 0.5: 0.5 again
DYN_HIDDEN = 16  # width of the dynamic-mixing MLP (§3.6)
INIT_STD = 0.02  # N(0, 0.02) truncated at ±3σ for every Linear and the embedding (the authors' init_std, cutoff 3)
NORM_EPS = 1e-6  # RMSNorm's eps (the authors' rmsnorm_eps)
EOT = 50256  # GPT-2's <|endoftext|>, GPTConfig.eot_token's default: in packed windows each one opens a new document
IGNORE = -1  # a target equal to it adds nothing to the loss or its gradient (nanoGPT's ignore_index)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x²) + eps) * weight, computed in fp32 whatever the activation dtype (as the authors' RMSNorm;
    ours multiplies by the weight in fp32 too, in one op). The weight starts at 1 (GPT.init_weights)."""

    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):  # (..., dim) -> (..., dim)
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def rotary_tables(head_dim, max_seq_len, theta):
    """cos and sin (max_seq_len, D/2) of RoPE's angles, position × frequency."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """RoPE, rotate-half (NeoX) layout (the authors'): dimension i pairs with i + D/2. x (B, H, T, D), cos (T, D/2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DynamicScale(nn.Module):
    """Eq. 12: one per-token scale for each λ of a layer,  s = sigmoid(W2 · GELU(W1 · x) + b2),  where x is
    the layer's attention input, the RMS-normed hidden state (the authors' code). W2 and b2 start at zero (§3.6;
    GPT.init_weights): every s starts at 0.5."""

    def __init__(self, n_embd, names):
        super().__init__()
        self.names = names  # the λ they scale, in the authors' order: q1, q2, k1, k2, ...
        self.fc1 = nn.Linear(n_embd, DYN_HIDDEN, bias=False)
        self.fc2 = nn.Linear(DYN_HIDDEN, len(names), bias=True)

    def forward(self, x):  # (B, T, C) -> {λ name: (B, 1, T, 1)}, broadcast over heads and channels
        s = torch.sigmoid(self.fc2(F.gelu(self.fc1(x))))  # (B, T, n)
        return dict(zip(self.names, s.transpose(1, 2)[..., None].split(1, dim=1)))


def mix_with_anchor(own, anchor, lam1, lam2, s1=None, s2=None):
    """Eq. 10,  Ŝ = λ1 ⊙ N(S_anc) + λ2 ⊙ S,  and Eq. 12,  Ŝ = s1·λ1 ⊙ N(S_anc) + s2·λ2 ⊙ S.
    own S and anchor N(S_anc) (B, H, T, D); anchor None when anchors are removed (§4.5): the λ1 term is gone;
    λ1 (the anchor's weight), λ2 (own's): fp32 parameters, cast so that bf16 activations stay bf16 under autocast
    (as the authors' code); s1, s2 (B, 1, T, 1) the per-token scales, or None."""
    out = lam2.to(own.dtype) * own
    if s2 is not None:
        out = out * s2
    if anchor is not None:
        a = lam1.to(own.dtype) * anchor
        out = out + (a if s1 is None else a * s1)
    return out


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        self.layer, self.n_head, self.head_dim, self.gate = layer, config.n_head, config.head_dim, config.gate
        self.names = PROJECTIONS[:4 if config.gate else 3]
        self.c_attn = nn.Linear(config.n_embd, len(self.names) * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)  # QK-norm over D (authors')
        # The projections this layer mixes with their anchors: exo anchors feed every layer; internal ones come from
        # layer 1, which therefore mixes none (Fig. 1)
        takes_anchors = config.anchor == "exo" or (config.anchor == "internal" and layer > 0)
        self.mixed_here = config.mixed_projections if takes_anchors else ""
        # λ_{n,1} and λ_{n,2} of each (keys s + ANCHOR, s + OWN), shaped by the granularity; values: GPT.init_weights
        names = [s + i for s in self.mixed_here for i in (ANCHOR, OWN)]  # q1, q2, k1, ... (ParameterDict sorts them)
        shape = GRANULARITY_SHAPES[config.granularity](config.n_head, config.head_dim)
        self.lam = nn.ParameterDict({name: nn.Parameter(torch.empty(shape)) for name in names})
        self.dyn = DynamicScale(config.n_embd, names) if (self.mixed_here and config.dynamic) else None
        self.inspect = None  # tools/analyze.py's hook (analysis_hook, below); training never sets it

    def forward(self, x, rope, normed_anchors=None, mask=None, cache=None):
        # x (B, T, C); rope: cos, sin (T, D/2) of x's positions; normed_anchors {s: N(S_anc) (B, H, T, D)}, or None
        # (none yet, or removed: §4.5); mask from document_mask or None; cache: a KVCache (generation) or None
        # -> y (B, T, C), this layer's projections {s: (B, H, T, D)} (mixed, before QK-norm)
        B, T, C = x.shape
        qkvg = self.c_attn(x).view(B, T, len(self.names), self.n_head, self.head_dim)  # (B, T, 3 or 4, H, D)
        proj = dict(zip(self.names, qkvg.transpose(1, 3).unbind(2)))  # each S_n (B, H, T, D)
        scales = self.dyn(x) if self.dyn is not None else {}  # Eq. 12
        for s in self.mixed_here:  # Eq. 10, before QK-norm and RoPE (the authors' code); with per-token scales
            # dynamic_mix: the same values, keeping no (B, H, T, D) product for backward (below the banner)
            anchor = None if normed_anchors is None else normed_anchors[s]
            proj[s] = (dynamic_mix if scales else mix_with_anchor)(
                proj[s], anchor, self.lam[s + ANCHOR], self.lam[s + OWN], scales.get(s + ANCHOR), scales.get(s + OWN))
        q, k, v = rotate(self.q_norm(proj["q"]), *rope), rotate(self.k_norm(proj["k"]), *rope), proj["v"]
        k, v, causal = (k, v, True) if cache is None else cache.extend(self.layer, k, v)  # generation: keys so far
        analysis_hook(self, q=q, k=k, g=proj.get("g"), scales=scales or None)
        y = attention(q, k, v, mask, causal)
        if self.gate:  # Gated Attention (G1): elementwise sigmoid gate on the SDPA output, per head and channel
            y = y * torch.sigmoid(proj["g"])
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C)), proj


class MLP(nn.Module):
    """SwiGLU, C -> 4C -> its two halves gated -> C (the authors' mlp_ratio 4 and halves)."""

    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.fc2 = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(b) * a)  # SwiGLU


class Block(nn.Module):

    def __init__(self, config, layer):
        super().__init__()
        self.ln_1, self.ln_2 = RMSNorm(config.n_embd), RMSNorm(config.n_embd)  # pre-norm (the authors' norm_pos)
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)

    def forward(self, h, rope, normed_anchors=None, mask=None, cache=None):  # (B, T, C) -> (B, T, C), projections
        a, proj = self.attn(self.ln_1(h), rope, normed_anchors, mask, cache)
        h = h + a
        return h + self.mlp(self.ln_2(h)), proj


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 2048  # sequence length: the model's longest context, and the training windows' (the paper's)
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128 (ours: the authors' 57601 is a loader bug)
    eot_token: int = EOT  # the id of <|endoftext|>, which opens each document of a packed window (document_mask):
                          # the tokenizer's; train.py takes it from its data's
    n_layer: int = 32  # transformer blocks (L); n_layer, n_head, n_embd: the paper's 450M models (§4.1)
    n_head: int = 16  # attention heads (H); n_embd/H must be even
    n_embd: int = 1024  # model width (C)
    rope_theta: float = 500000.0  # the authors' ModelConfig
    gate: bool = False  # Gated Attention: sigmoid gate on the attention output
    anchor: str = "none"  # where anchors come from: 'none', 'internal' (layer 1) or 'exo' (the embeddings)
    mix: str = ""  # which projections are mixed with their anchor: letters of 'qkvg', any order (mixed_projections)
    granularity: str = "scalar"  # shape of each λ: 'scalar' (), 'headwise' (H,), 'elementwise' (H, D)
    anchor_norm: bool = False  # RMS-normalise anchors before mixing
    dynamic: bool = False  # per-token scaling of every λ by a small MLP (Eq. 12)
    anchor_frozen: bool = False  # exo: anchor_proj keeps its random init (no gradient): the review's falsifier (ours)

    def __post_init__(self):
        check_config(self)  # a one-line error for a config that is no model (below the banner)

    @classmethod
    def from_dict(cls, d, source="model_config"):  # the config a checkpoint holds, an older one's too
        return cls(**known_fields(cls, d, source))

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mixed_projections(self):
        """`mix` in canonical order ('gvq' -> 'qvg'): the order of anchor_proj's rows and of every layer's λ."""
        return "".join(s for s in PROJECTIONS if s in self.mix)

    @property
    def name(self):
        """The paper's name of the variant ('Dynamic E-ExoFormer'), for tables, titles and legends."""
        if self.anchor == "none":
            return "Gated Attention" if self.gate else "Baseline"
        mixed = self.mixed_projections
        if self.anchor == "internal" and mixed == "v" and not (self.gate or self.anchor_norm or self.dynamic):
            return "ResFormer" if self.granularity == "scalar" else f"ResFormer ({self.granularity})"
        name = self.granularity[0].upper() + ("-ExoFormer" if self.anchor == "exo" else "-NuResFormer")
        flags = (("no gate", not self.gate), (f"mix {mixed}", mixed not in ("qkv", "qkvg")),
                 ("no anchor norm", not self.anchor_norm), ("frozen anchors", self.anchor_frozen))
        notes = [n for n, on in flags if on]
        return ("Dynamic " if self.dynamic else "") + name + (f" ({', '.join(notes)})" if notes else "")


def lm_loss(logits, targets, z_loss=0.0):
    """The training objective, cross-entropy + z-loss (the authors' criterion.py): the mean cross-entropy over the
    targets that are not IGNORE, plus z_loss · the mean of logsumexp(logits)² over them. (N, V) fp32, (N,) -> ()."""
    lse, kept = torch.logsumexp(logits, dim=-1), targets != IGNORE  # a mask, not a selection: shapes stay static
    return F.cross_entropy(logits, targets, ignore_index=IGNORE) + z_loss * (lse.square() * kept).sum() / kept.sum()


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.drop_anchor = False  # anchor removal at inference (§4.5, in features): every λ_{n,1} term becomes 0
        # engineering, below the banner: activation checkpointing (checkpointed), document masks' kernel (True:
        # FlexAttention, False: a dense SDPA mask, None: FlexAttention on CUDA), tokens per chunk of the loss
        self.activation_checkpointing, self.flex, self.loss_chunk = False, None, LOSS_CHUNK
        C, D, mixed = config.n_embd, config.head_dim, config.mixed_projections
        device = torch.get_default_device()  # where GPT(config) is built; "meta" (train.py, check_state): no values
        with torch.device("meta"):  # the modules without values, which init_weights gives them
            self.wte = nn.Embedding(config.vocab_size, C)
            self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
            self.ln_f = RMSNorm(C)
            self.lm_head = nn.Linear(C, config.vocab_size, bias=False)  # untied from wte (the authors' code)
            self.anchor_proj = nn.Linear(C, len(mixed) * C, bias=False) if config.anchor == "exo" else None  # W_anc
            # Anchors with their own RMSNorm(D), N(·) of Eq. 10: all exo anchors; internal v and g (see normalize)
            normed = ""
            if config.anchor_norm:
                normed = mixed if config.anchor == "exo" else mixed.replace("q", "").replace("k", "")
            self.anchor_norms = nn.ModuleDict({s: RMSNorm(D) for s in normed})
            for name in ("rope_cos", "rope_sin"):  # RoPE's tables, once for every layer: from the config, not saved
                self.register_buffer(name, torch.empty(config.block_size, D // 2, dtype=torch.float32),
                                     persistent=False)
        if config.anchor_frozen:  # a fixed random projection of the embeddings: trained by nothing
            self.anchor_proj.weight.requires_grad_(False)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, write=None):
        """Every parameter's initial value, given here only (by GPT(config); by train.py after a meta-device build):
        each Linear's weight and the embedding N(0, 0.02) truncated at ±3σ (INIT_STD), then zero-initialised output
        layers, lm_head and each block's c_proj and fc2 (the authors' ZeroInitLinear: each block starts as the
        identity, the logits at 0), and the dynamic scales' fc2 (§3.6: every s starts at 0.5; the authors' code draws
        it); 1 for every norm; each λ at its init (§3.4, §3.6). write(param, value) stores a value made whole on the
        CPU, one at a time (default: all of it; under FSDP this process's rows, sharding.write_part)."""
        write, c = write or (lambda param, value: param.copy_(value)), self.config
        replay_construction_draws(self)  # engineering: a seed gives the weights it has always given
        zero_initialised = [self.lm_head] + [m for b in self.blocks for m in (b.attn.c_proj, b.mlp.fc2)] + \
                           [b.attn.dyn.fc2 for b in self.blocks if b.attn.dyn is not None]
        lam = DYNAMIC_LAMBDA_INIT if c.dynamic else LAMBDA_INIT
        for name, p in self.named_parameters():  # module by module: the draws in the order they always had
            owner, kind = self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            value = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            if isinstance(owner, (nn.Linear, nn.Embedding)) and kind == "weight":
                nn.init.trunc_normal_(value, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)
                if owner in zero_initialised:  # drawn, then zeroed: the later draws stay where they were
                    value.zero_()
            elif isinstance(owner, nn.Linear):  # a bias: only the dynamic scales' fc2 has one
                value.zero_()
            elif isinstance(owner, RMSNorm):
                value.fill_(1.0)
            elif isinstance(owner, nn.ParameterDict) and name.split(".")[-2] == "lam":  # every λ
                value.fill_(lam)
            else:
                raise ValueError(f"GPT.init_weights: no initial value for the parameter {name}: give it one there")
            write(p, value)
        tables = dict(zip(("rope_cos", "rope_sin"), rotary_tables(c.head_dim, c.block_size, c.rope_theta)))
        for name, buffer in self.named_buffers():  # RoPE's tables, the only buffers
            if name not in tables:
                raise ValueError(f"GPT.init_weights: no initial value for the buffer {name}: give it one there")
            buffer.copy_(tables[name])

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def normalize(self, anchors):
        """N(·) of Eq. 10, with anchor_norm: every exo anchor and the internal v and g anchors through an RMSNorm(D)
        of their own (the authors' anchor_{s}_norm, v_res_norm, g_res_norm); internal q and k anchors through layer
        1's QK-norm, what layer 1 attends with before RoPE, instead: the authors' code (their q_residual, k_residual),
        which the paper's N(·) leaves open."""
        norms = dict(self.anchor_norms.items())
        if self.config.anchor == "internal" and self.config.anchor_norm:
            norms.update(q=self.blocks[0].attn.q_norm, k=self.blocks[0].attn.k_norm)
        return {s: norms[s](a) if s in norms else a for s, a in anchors.items()}

    def features(self, idx, doc_mask=False, mask=None, cache=None):
        """idx (B, T) int64 -> final hidden states (B, T, C), what lm_head turns into logits (a scorer that needs a
        few positions only, eval.py, applies lm_head to those). doc_mask: attention stays inside the documents of
        idx (document_mask); mask: one document_mask made already, instead; cache: a KVCache (generation)."""
        B, T = idx.shape
        start = first_position(cache, T, self.config.block_size)  # of idx: 0, or after the cached positions
        rope = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        if mask is None and doc_mask:
            mask = document_mask(idx, self.flex, self.config.eot_token)
        h = self.wte(idx)  # H0
        normed_anchors = None  # {s: N(S_anc) (B, H, T, D)} of every mixed projection s
        if self.anchor_proj is not None:  # Eq. 9: exogenous anchors, computed once from H0, shared by all layers
            H, D = self.config.n_head, self.config.head_dim
            parts = self.anchor_proj(h).view(B, T, -1, H, D).transpose(1, 3).unbind(2)  # each (B, H, T, D)
            normed_anchors = self.normalize(dict(zip(self.config.mixed_projections, parts)))
        for i, block in enumerate(self.blocks):
            given = None if self.drop_anchor else normed_anchors  # §4.5: anchor removal, no λ_{n,1} term anywhere
            h, proj = checkpointed(block, h, rope, given, mask, cache, when=self.activation_checkpointing)
            if i == 0 and self.config.anchor == "internal":  # layer 1's projections anchor layers 2..L, their
                # gradient flowing back to it (not detached: the authors' code)
                normed_anchors = self.normalize({s: proj[s] for s in self.config.mixed_projections})
        return self.ln_f(h)

    def forward(self, idx, targets=None, *, z_loss=0.0, doc_mask=False, mask=None):
        # idx (B, T) int64 -> logits (B, T, V), None. With targets (B, T): None, lm_loss(logits, targets, z_loss),
        # the same loss chunk by chunk without making the logits (chunked_loss, below the banner)
        h = self.features(idx, doc_mask, mask)
        if targets is None:
            return self.lm_head(h), None
        return None, chunked_loss(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), z_loss, self.loss_chunk)


# =============================================================================================================
# Engineering: what makes the model above fit and run fast. None of it changes what the model computes;
# test_model.py checks each piece against the plain computation.

# ----------------------------------------------------------------------------- the config's checks, a seed's draws

def check_config(c):
    """A one-line error for a GPTConfig that describes no model of this file (GPTConfig.__post_init__)."""
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        if getattr(c, name) < 1:
            raise ValueError(f"GPTConfig.{name}={getattr(c, name)}: expected a positive integer")
    if c.eot_token < 0:  # one the vocabulary lacks (GPT-2's, for another data's model) opens no document
        raise ValueError(f"GPTConfig.eot_token={c.eot_token}: expected a token id (0 or more)")
    if c.n_embd % c.n_head:
        raise ValueError(f"GPTConfig.n_head={c.n_head}: expected a divisor of n_embd={c.n_embd}")
    if c.head_dim % 2:
        raise ValueError(f"GPTConfig.n_head={c.n_head}: head dimension n_embd/n_head={c.head_dim} must be even "
                         f"for RoPE")
    for name, allowed in (("anchor", ("none", "internal", "exo")), ("granularity", tuple(GRANULARITY_SHAPES))):
        if getattr(c, name) not in allowed:
            raise ValueError(f"GPTConfig.{name}={getattr(c, name)!r}: expected one of {', '.join(map(repr, allowed))}")
    if set(c.mix) - set(PROJECTIONS) or len(set(c.mix)) != len(c.mix):
        raise ValueError(f"GPTConfig.mix={c.mix!r}: expected distinct letters from 'qkvg'")
    if "g" in c.mix and not c.gate:
        raise ValueError(f"GPTConfig.mix={c.mix!r}: mixing 'g' needs gate=True")
    if c.anchor == "none" and (c.mix or c.anchor_norm or c.dynamic):
        raise ValueError("GPTConfig.anchor='none': expected mix='', anchor_norm=False and dynamic=False")
    if c.anchor != "none" and not c.mix:
        raise ValueError(f"GPTConfig.mix='': anchor={c.anchor!r} expected a subset of 'qkvg'")
    if c.anchor_frozen and c.anchor != "exo":
        raise ValueError(f"GPTConfig.anchor_frozen=True: only exogenous anchors (anchor='exo') have a projection to "
                         f"freeze, not anchor={c.anchor!r}")


def known_fields(cls, d, source):
    """d, a checkpoint's config, once each of its fields is one of cls's (GPTConfig.from_dict). A field it lacks
    (added after the checkpoint was written) takes its default: a new field's default keeps the old behaviour."""
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{source}: unknown model field(s) {', '.join(unknown)} (written by another "
                         f"version of model.py?); known: {', '.join(f.name for f in fields(cls))}")
    return d


def replay_construction_draws(model):
    """The random draws of building each nn.Linear and nn.Embedding of model on the CPU (reset_parameters), made
    again in order and thrown away: GPT builds on the meta device, which draws nothing, and GPT.init_weights makes
    these first, so that a seed gives the weights, and leaves the generator, as when GPT built on the CPU."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="cpu")
        elif isinstance(m, nn.Embedding):
            nn.Embedding(m.num_embeddings, m.embedding_dim, device="cpu")


# ----------------------------------------------------------------------------- checkpointing, the mix's backward

def checkpointed(fn, *args, when=True):
    """fn(*args), under torch.utils.checkpoint `when` gradients are taken (a block: GPT.activation_checkpointing):
    only args are kept for backward, which runs fn again."""
    if when and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def dynamic_mix(own, anchor, lam1, lam2, s1, s2):
    """mix_with_anchor with scales (Eq. 12), keeping only its inputs for backward, not autograd's products λ·x:
    eagerly DynamicMix (autograd's gradients, bit for bit); compiled, a checkpoint, whose recompute inductor fuses."""
    if anchor is None or not torch.is_grad_enabled():  # inference, anchor removal (§4.5): nothing to keep
        return mix_with_anchor(own, anchor, lam1, lam2, s1, s2)
    if torch.compiler.is_compiling():  # without the checkpoint, inductor keeps more
        return checkpoint(mix_with_anchor, own, anchor, lam1, lam2, s1, s2, use_reentrant=False)
    return DynamicMix.apply(own, anchor, lam1.to(own.dtype), lam2.to(own.dtype), s1, s2)


class DynamicMix(torch.autograd.Function):
    """(λ2·S)·s2 + (λ1·N(S_anc))·s1, keeping its inputs for backward, not the two products λ·x that autograd
    keeps (32 MiB a layer per 2048-token sequence at 450M, bf16). Backward recomputes those two only, where a
    checkpoint reran the mix, and forms autograd's products in its order; in place where autograd allocates (on a
    CPU a new tensor costs about what the product written into it does)."""

    @staticmethod
    def forward(ctx, own, anchor, lam1, lam2, s1, s2):  # mix_with_anchor's arguments, λ cast
        ctx.save_for_backward(own, anchor, lam1, lam2, s1, s2)
        return (lam2 * own).mul_(s2).add_((lam1 * anchor).mul_(s1))

    @staticmethod
    def backward(ctx, grad):
        own, anchor, lam1, lam2, s1, s2 = ctx.saved_tensors
        scratch, grads = torch.empty_like(grad), []
        for x, lam, s in ((anchor, lam1, s1), (own, lam2, s2)):  # each term (λ·x)·s
            grad_product = grad * s  # of λ·x
            grad_lam = torch.mul(grad_product, x, out=scratch).sum_to_size(lam.shape)
            grad_s = torch.mul(lam, x, out=scratch).mul_(grad).sum_to_size(s.shape)  # λ·x recomputed
            grads += [grad_product.mul_(lam), grad_lam, grad_s]  # of x, λ, s
        grad_anchor, grad_lam1, grad_s1, grad_own, grad_lam2, grad_s2 = grads
        return grad_own, grad_anchor, grad_lam1, grad_lam2, grad_s1, grad_s2


# ----------------------------------------------------------------------------- attention kernels, masks, the hook

def document_mask(idx, flex=None, eot=EOT):
    """Document-causal mask for packed windows idx (B, T): a query sees the keys at or before it in its own
    document, where each eot (the tokenizer's <|endoftext|>) opens a new one (the tokens before the first are a
    document too).
    flex (None: on CUDA with Triton) gives a FlexAttention BlockMask, whose kernel skips the blocks that cross
    documents; otherwise a dense bool mask (B, 1, T, T) for SDPA (FlexAttention has no CPU backward)."""
    B, T = idx.shape
    doc = (idx == eot).cumsum(-1)  # (B, T): document number of every token
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


def analysis_hook(attn, q, k, g, scales):
    """attn.inspect(q=, k=, g=, scales=), once per forward, if tools/analyze.py set it (training never does): q, k
    (B, H, T, D) as they enter attention (mixed, QK-normed, RoPE; k with the cached positions), g the mixed gate
    logits (B, H, T, D) or None, scales DynamicScale's {λ name: (B, 1, T, 1)} or None."""
    if attn.inspect is not None:
        attn.inspect(q=q, k=k, g=g, scales=scales)


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
    """lm_loss(h · weightᵀ, targets, z_loss), GPT.forward's, from the final hidden states h (N, C) and lm_head's
    weight (V, C), chunk by chunk. n counts the kept targets (at least 1, so a batch of only IGNORE gives 0, not
    NaN), on the device: no sync."""
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

    def extend(self, layer, k, v):
        """Add the new positions' k, v (B, H, T, D) of a layer: (its keys and values so far, whether attention is
        causal: not for one new token after cached ones, which sees every one of them)."""
        causal = self.keys[layer] is None
        if not causal:
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v, causal


def first_position(cache, T, block_size):
    """The position of the first of T new tokens (GPT.features): 0, or after those cache holds. A one-line error for
    more than block_size positions in all, or more than one new token after cached ones."""
    start = len(cache) if cache is not None else 0
    if start + T > block_size or (start and T > 1):
        raise ValueError(f"{T} new positions after {start} cached ones: expected at most block_size={block_size} "
                         f"in all, and one at a time after the first")
    return start


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
