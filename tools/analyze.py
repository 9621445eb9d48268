"""
The paper's analyses (Figures 2-8, §4.5) for any number of checkpoints, side by side:

    python -m tools.analyze out/gated/ckpt.pt out/dyn_exo/ckpt.pt --data_dir data/finewebedu10B \\
        --tokens 65536 --out out/analysis

Every checkpoint (written by train.py or convert.py) reads the same validation tokens: the first
--tokens of the val shard(s), in windows of its block_size. One forward pass per batch yields
everything: model.py's inspection hook hands over each layer's q, k, gate logits and dynamic scales,
forward hooks on `wte` and the blocks hand over the hidden states. Each metric is reduced per batch
into running sums, so memory holds one batch's activations (its L+1 hidden states, for the layer
similarity) and a few queries' attention weights at a time, however many tokens are analysed.
Output: OUT/analysis.json, a summary table and, when matplotlib is installed, PNG figures in OUT/.

Definitions. L = n_layer, layers 0..L-1; hidden state 0 is the token embeddings, hidden state i the
residual stream after block i. "Every token" means every position of every window analysed.
  lambda_ratio[s][n]       λ1/λ2 (anchor / own projection) of projection s in layer n, flattened
                           (1, H or H·D values, head-major); null for a layer without λ (layer 0 of
                           internal-anchor models). Read from the parameters, not from data.
  lambda_ratio_effective   dynamic models: mean over every token of (λ1·s1)/(λ2·s2), s1, s2 the
                           token's dynamic scales, i.e. λ1/λ2 · mean(s1/s2).
  gate_mean, gate_sparsity mean of σ(g) and fraction of σ(g) < 0.2 over every (token, head, channel).
  attention_sink           weight a query puts on the first key it can see (position 0; with document
                           masking, its document's first token), averaged over every (window, head, query).
  attention_entropy        -Σ_j p_j log p_j (nats) of a query's attention row, same average.
  top_k_attention[k]       mean of the k largest weights of a query's row (keys it cannot see count as
                           weight 0), same average; k = 1, 2, 3, 10.
  token_similarity (_std)  mean (std) of cos(h_i, h_j) over every pair of positions i < j of a window,
                           all windows' pairs pooled (the collapse of Figure 4c).
  max_activation           max |h| over every token and channel.
  hidden_norm              mean over every token of ‖h_t‖₂.
  pca_dims                 number of principal components of the covariance of h over every token
                           (float64 running sums) that explain 99% of its variance.
  layer_similarity[a][b]   mean over every token of cos(h_a[t], h_b[t]) (Figure 8).
  val_loss                 mean cross-entropy of the windows; val_loss_no_anchor the same with
                           model.drop_anchor = True (§4.5), null for models without anchors.
Attention weights are softmax(q·kᵀ/√D) under attention_mask(), recomputed in float32 from the q, k
that SDPA receives. Models trained with document masking (train.py's doc_mask, the authors' models)
are run with it, attention and losses alike, as they were trained and validated.
"""
import argparse
import json
import math
import os
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.checkpoint import check_checkpoint, check_data_tokenizer, load_model, trained_doc_mask
from engine.data import val_batches
from engine.files import atomic_write
from engine.parallel import Runtime
from engine.runlog import log_path, read_log, val_curve
from model import ANCHOR, EOT, OWN, document_mask

TOP_K = (1, 2, 3, 10)  # the top-k attention weights of Figure 4
GATE_CLOSED = 0.2  # σ(g) below this counts towards gate sparsity (Figure 7b)
PCA_VARIANCE = 0.99  # the share of the variance that the PCA dimension of Figure 4 explains (our choice)
ATTN_CHUNK = 1 << 24  # attention weights formed at once (heads × queries × keys floats, 64 MB)
PROJ_NAMES = {"q": "query", "k": "key", "v": "value", "g": "gate logit"}


def attention_mask(idx, doc_mask=False, eot=EOT):
    """idx (B, T) -> (B, T, T) bool, True where query t may attend to key s: the mask model.py applies
    (causal; with doc_mask, causal inside each document, each opened by eot, the model's eot_token, as well)."""
    B, T = idx.shape
    if doc_mask:
        return document_mask(idx, flex=False, eot=eot)[:, 0]
    return torch.ones(T, T, dtype=torch.bool, device=idx.device).tril().expand(B, T, T)


# ----------------------------------------------------------------------------- per-batch reductions

def add_to(sums, new):
    """Running sums, {name: float64 tensor}: sums += new, name by name."""
    for name, value in new.items():
        sums[name] += value


def attention_sums(q, k, mask):
    """q, k (B, H, T, D) as SDPA gets them, mask (B, T, T) -> float64 sums over every (window, head, query):
    {sink, entropy, top_1, top_2, top_3, top_10 (the mean of a query's k largest weights), queries}. The weights
    are formed for a few queries at a time, never all B×H×T×T of them."""
    B, H, T, D = q.shape
    q, k = q.float(), k.float()
    zero = lambda: torch.zeros((), dtype=torch.float64, device=q.device)
    sums = {"sink": zero(), "entropy": zero(), **{f"top_{j}": zero() for j in TOP_K}, "queries": zero()}
    rows = max(1, ATTN_CHUNK // (H * T))
    kmax = min(max(TOP_K), T)
    for b in range(B):
        for t0 in range(0, T, rows):
            scores = q[b, :, t0:t0 + rows] @ k[b].mT / math.sqrt(D)  # (H, rows, T)
            p = scores.masked_fill(~mask[b, t0:t0 + rows], float("-inf")).softmax(dim=-1)
            top = p.topk(kmax, dim=-1).values.cumsum(dim=-1)  # (H, rows, kmax): sum of the j largest
            first = mask[b, t0:t0 + rows].int().argmax(-1)  # the first key a query sees: 0, or its document's start
            sums["sink"] += p.gather(-1, first[None, :, None].expand(p.size(0), -1, 1)).sum()
            sums["entropy"] -= torch.special.xlogy(p, p).sum()  # 0·log 0 = 0 for the keys it cannot see
            for j in TOP_K:
                sums[f"top_{j}"] += top[..., min(j, T) - 1].sum() / j
            sums["queries"] += p.shape[0] * p.shape[1]
    return sums


def gate_sums(g):
    """Gate logits (any shape) -> float64 {sigmoid: Σ σ(g), closed: number of σ(g) < GATE_CLOSED, count}."""
    s = torch.sigmoid(g.float())
    return {"sigmoid": s.sum().double(), "closed": (s < GATE_CLOSED).sum().double(),
            "count": torch.tensor(s.numel(), dtype=torch.float64, device=s.device)}


def token_similarity_sums(h):
    """h (B, T, C) -> float64 {cos: Σ cos, cos2: Σ cos², pairs} over the pairs i < j of each window.
    Σ_ij cos_ij = ‖Σ_i x̂_i‖² and Σ_ij cos_ij² = ‖X̂X̂ᵀ‖_F² = ‖X̂ᵀX̂‖_F²:
    no T×T matrix is needed when C < T."""
    B, T, C = h.shape
    x = F.normalize(h.float(), dim=-1)
    diag = x.square().sum(-1)  # cos_ii: 1 (0 for an all-zero state)
    total = x.sum(1).double().square().sum() - diag.double().sum()
    squares = sum(((xb @ xb.mT) if T <= C else (xb.mT @ xb)).double().square().sum() for xb in x)
    squares = squares - diag.double().square().sum()
    return {"cos": total / 2, "cos2": squares / 2,
            "pairs": torch.tensor(B * T * (T - 1) / 2, dtype=torch.float64, device=h.device)}


def pca_dims(sum_x, sum_xx, n, fraction=PCA_VARIANCE):
    """Principal components explaining `fraction` of the variance, from Σx (C,) and Σxxᵀ (C, C) over n vectors."""
    mean = sum_x / n
    eig = torch.linalg.eigvalsh(sum_xx / n - torch.outer(mean, mean)).flip(0).clamp_min(0)
    if eig.sum() <= 0:
        return 0
    explained = eig.cumsum(0) / eig.sum()
    return int((explained < fraction - 1e-12).sum()) + 1


def lambda_ratios(model):
    """{s: one row per layer, λ1/λ2 flattened, or None for a layer without λ} for every mixed projection."""
    return {s: [(b.attn.lam[s + ANCHOR] / b.attn.lam[s + OWN]).detach().float().flatten().tolist()
                if s + ANCHOR in b.attn.lam else None for b in model.blocks] for s in model.config.mixed_projections}


class Recorder:
    """Hooks that reduce every forward pass of `model` into running sums (module docstring). Call
    begin(idx) before each forward; `active = False` makes a forward pass invisible; remove() at the end."""

    def __init__(self, model):
        cfg, self.model = model.config, model
        L, C, dev, f64 = cfg.n_layer, cfg.n_embd, next(model.parameters()).device, torch.float64
        self.active, self.mask, self.batch_states = True, None, []
        zeros = lambda *names: {n: torch.zeros((), dtype=f64, device=dev) for n in names}
        self.attn = [zeros("sink", "entropy", *(f"top_{j}" for j in TOP_K), "queries") for _ in range(L)]
        self.gate = [zeros("sigmoid", "closed", "count") for _ in range(L)] if cfg.gate else None
        self.scale_ratio = torch.zeros(L, len(cfg.mixed_projections), dtype=f64, device=dev)  # Σ s1/s2 over tokens
        self.scale_tokens = torch.zeros(L, dtype=f64, device=dev)
        S = L + 1
        self.tok_sim = [zeros("cos", "cos2", "pairs") for _ in range(S)]  # per hidden state
        self.max_abs = torch.zeros(S, device=dev)
        self.norm_sum = torch.zeros(S, dtype=f64, device=dev)
        self.sum_x = torch.zeros(S, C, dtype=f64, device=dev)
        self.sum_xx = torch.zeros(S, C, C, dtype=f64, device=dev)
        self.layer_sim = torch.zeros(S, S, dtype=f64, device=dev)  # upper triangle: Σ over tokens of cos
        self.tokens = 0
        self.handles = [model.wte.register_forward_hook(self._state_hook(0))]
        for i, block in enumerate(model.blocks):
            self.handles.append(block.register_forward_hook(self._state_hook(i + 1)))
            block.attn.inspect = self._attention_hook(i)

    def begin(self, idx, doc_mask=False):
        self.mask, self.batch_states = attention_mask(idx, doc_mask, self.model.config.eot_token), []
        self.tokens += idx.numel()

    def remove(self):
        for h in self.handles:
            h.remove()
        for block in self.model.blocks:
            block.attn.inspect = None
        self.batch_states = []

    def _state_hook(self, i):
        def hook(module, inputs, output):
            h = output[0] if isinstance(output, tuple) else output
            if self.active:
                with torch.autocast(h.device.type, enabled=False):  # the metrics' matmuls stay float32
                    self._hidden(i, h)
        return hook

    def _attention_hook(self, i):
        def inspect(q, k, g, scales):
            if self.active:
                with torch.autocast(q.device.type, enabled=False):
                    self._attention(i, q, k, g, scales)
        return inspect

    def _attention(self, i, q, k, g, scales):  # q, k, g (B, H, T, D) of layer i
        add_to(self.attn[i], attention_sums(q, k, self.mask))
        if g is not None:
            add_to(self.gate[i], gate_sums(g))
        if scales is not None:  # {λ name: (B, 1, T, 1)}
            mixed = self.model.config.mixed_projections
            ratio = torch.stack([scales[s + ANCHOR] / scales[s + OWN] for s in mixed]).float()
            self.scale_ratio[i] += ratio.flatten(1).double().sum(1)
            self.scale_tokens[i] += ratio[0].numel()

    def _hidden(self, i, h):  # h (B, T, C), hidden state i; states arrive in order 0..L
        h = h.float()
        x = h.flatten(0, 1)
        add_to(self.tok_sim[i], token_similarity_sums(h))
        self.max_abs[i] = torch.maximum(self.max_abs[i], x.abs().max())
        self.norm_sum[i] += x.norm(dim=-1).double().sum()
        self.sum_x[i] += x.double().sum(0)
        self.sum_xx[i] += x.double().mT @ x.double()
        xn = F.normalize(x, dim=-1)
        for j, prev in enumerate(self.batch_states + [xn]):
            self.layer_sim[j, i] += (prev * xn).sum().double()
        self.batch_states.append(xn)

    def results(self):
        """The metrics of the module docstring, as plain lists (NaN where a metric does not exist)."""
        L = self.model.config.n_layer
        per_query = lambda name: [(a[name] / a["queries"]).item() for a in self.attn]
        out = {"attention_sink": per_query("sink"), "attention_entropy": per_query("entropy"),
               "top_k_attention": {str(k): per_query(f"top_{k}") for k in TOP_K}}
        per_gate = lambda name: None if self.gate is None else [(g[name] / g["count"]).item() for g in self.gate]
        out["gate_mean"], out["gate_sparsity"] = per_gate("sigmoid"), per_gate("closed")
        mean = [(t["cos"] / t["pairs"]).item() for t in self.tok_sim]
        out["token_similarity"] = mean
        out["token_similarity_std"] = [math.sqrt(max(0.0, (t["cos2"] / t["pairs"]).item() - m ** 2))
                                       for t, m in zip(self.tok_sim, mean)]
        out["max_activation"] = self.max_abs.tolist()
        out["hidden_norm"] = (self.norm_sum / self.tokens).tolist()
        out["pca_dims"] = [pca_dims(self.sum_x[i], self.sum_xx[i], self.tokens) for i in range(L + 1)]
        sim = self.layer_sim.triu() / self.tokens
        out["layer_similarity"] = (sim + sim.triu(1).T).tolist()
        ratios = lambda_ratios(self.model)
        out["lambda_ratio"] = ratios
        out["lambda_ratio_effective"] = None
        if self.model.config.dynamic:
            scale = (self.scale_ratio / self.scale_tokens[:, None]).tolist()
            out["lambda_ratio_effective"] = {s: [None if row is None else [r * scale[n][j] for r in row]
                                                 for n, row in enumerate(rows)]
                                             for j, (s, rows) in enumerate(ratios.items())}
        return out


# ----------------------------------------------------------------------------- one checkpoint

def read_curve(ckpt_path, step=None):
    """[step, val_loss] pairs from the log.jsonl that train.py writes next to its checkpoints, up to `step`
    (a ckpt_<step>.pt of the run's history sees the curve up to itself), or None without a log."""
    run_dir = os.path.dirname(ckpt_path)
    if not os.path.isfile(log_path(run_dir)):
        return None
    return [list(point) for point in val_curve(read_log(run_dir), step)]


def windows(data_dir, tokens, batch_size, cfg):
    """The validation batches of a model: the first tokens // block_size windows of the val shard(s),
    batch_size at a time (the last batch may be smaller): the same tokens whatever the batch size."""
    T = cfg.block_size
    if tokens < T:
        raise ValueError(f"--tokens {tokens} is less than one window of block_size={T} tokens")
    rows = list(val_batches(data_dir, 1, T, tokens, vocab_size=cfg.vocab_size))
    return [tuple(torch.cat(part) for part in zip(*rows[i:i + batch_size])) for i in range(0, len(rows), batch_size)]


@torch.no_grad()
def analyze(path, data_dir, tokens, batch_size=8, runtime=Runtime("cpu", torch.float32), desc=None):
    """Every metric of the module docstring for one checkpoint: a JSON-ready dict."""
    model, ckpt = load_model(path, runtime.device)
    cfg, doc_mask = model.config, trained_doc_mask(ckpt)
    batches = windows(data_dir, tokens, batch_size, cfg)
    n_windows = sum(len(x) for x, _ in batches)
    device, amp = runtime.device, runtime.autocast
    rec = Recorder(model)
    losses, losses_no_anchor = [], []
    try:
        for x, y in tqdm(batches, desc=desc, unit="batch", disable=desc is None):
            x, y = x.to(device), y.to(device)
            rec.begin(x, doc_mask)
            with amp():
                losses.append(model(x, y, doc_mask=doc_mask)[1].item() * len(x))
            if cfg.anchor != "none":  # §4.5: the same windows with every anchor term removed
                rec.active, model.drop_anchor = False, True
                with amp():
                    losses_no_anchor.append(model(x, y, doc_mask=doc_mask)[1].item() * len(x))
                rec.active, model.drop_anchor = True, False
        metrics = rec.results()
    finally:
        rec.remove()
    return {"variant": cfg.name, "config": asdict(cfg), "step": ckpt.get("step"),
            "source": ckpt.get("source"), "params": model.num_params(), "data_dir": data_dir,
            "tokens": rec.tokens, "windows": n_windows, "dtype": str(runtime.dtype).removeprefix("torch."),
            "doc_mask": doc_mask,
            "val_loss": sum(losses) / n_windows,
            "val_loss_no_anchor": sum(losses_no_anchor) / n_windows if losses_no_anchor else None,
            "curve": read_curve(path, ckpt.get("step")), **metrics}


# ----------------------------------------------------------------------------- output

def finite(obj):
    """obj with every NaN or ±inf float replaced by None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def to_json(results):
    """One line per metric, so that the file reads well and stays valid strict JSON."""
    models = []
    for path, entry in results.items():
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, allow_nan=False)}" for k, v in finite(entry).items())
        models.append(f" {json.dumps(path)}: {{\n{body}\n }}")
    return "{\n" + ",\n".join(models) + "\n}\n"


def labels(results):
    """Variant names, made unique with the path where two checkpoints share one."""
    names = [e["variant"] for e in results.values()]
    return {p: e["variant"] if names.count(e["variant"]) == 1 else f"{e['variant']} ({p})"
            for p, e in results.items()}


def mean(xs):
    xs = [x for x in xs or [] if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def print_table(results):
    fmt = lambda v, f: "-" if v is None else format(v, f)
    cols = ("model", "step", "val loss", "no anchor", "sink", "entropy", "gate", "gate<0.2", "tok sim", "PCA dims")
    rows = [(labels(results)[p], fmt(e["step"], "d"), fmt(e["val_loss"], ".4f"), fmt(e["val_loss_no_anchor"], ".4f"),
             fmt(mean(e["attention_sink"]), ".3f"), fmt(mean(e["attention_entropy"]), ".3f"),
             fmt(mean(e["gate_mean"]), ".3f"), fmt(mean(e["gate_sparsity"]), ".3f"),
             fmt(e["token_similarity"][-1], ".3f"), fmt(e["pca_dims"][-1], "d")) for p, e in results.items()]
    widths = [max(len(str(r[i])) for r in rows + [cols]) for i in range(len(cols))]
    for r in [cols] + rows:
        print("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    print("sink, entropy, gate: means over layers; tok sim, PCA dims: last hidden state "
          f"(of {len(next(iter(results.values()))['pca_dims'])} states, 0 = embeddings)")


# ----------------------------------------------------------------------------- figures

class Figures:
    """What every figure needs: pyplot, the output folder, the models' labels, and the files written so far."""

    def __init__(self, plt, results, out):
        self.plt, self.results, self.out, self.name, self.files = plt, results, out, labels(results), []

    def save(self, fig, filename):
        path = os.path.join(self.out, filename)
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
        self.plt.close(fig)
        self.files.append(path)

    def panels(self, n, size=(4.6, 3.6)):
        """A figure of n panels, 2 by 2 for four, else up to 3 a row; the unused ones hidden."""
        cols = 2 if n == 4 else min(3, n)
        rows = math.ceil(n / cols)
        fig, axes = self.plt.subplots(rows, cols, figsize=(max(6.4, size[0] * cols), size[1] * rows),
                                      squeeze=False, layout="constrained")
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, list(axes.flat[:n])

    @staticmethod
    def integer_ticks(*axes):  # layers and hidden states are whole numbers
        from matplotlib.ticker import MaxNLocator
        for axis in axes:
            axis.set_major_locator(MaxNLocator(integer=True))


def nan_row(row, width=0):
    """A list of numbers for plotting: None -> NaN (a missing row: width NaNs)."""
    return [math.nan] * width if row is None else [math.nan if v is None else v for v in row]


def mixed_ratios(e, s):
    """λ1/λ2 rows of projection s as the model really mixes: with the dynamic scales when it has them."""
    return (e["lambda_ratio_effective"] or e["lambda_ratio"])[s]


def plot_lambda_heatmaps(figs):
    """Figures 3 and 5: λ1/λ2 heatmaps, layers × channels, one panel per model, one figure per projection."""
    for s in PROJ_NAMES:
        having = [p for p, e in figs.results.items() if s in e["lambda_ratio"]]
        if not having:
            continue
        mats = {}
        for p in having:
            rows = mixed_ratios(figs.results[p], s)
            width = max(len(r) for r in rows if r is not None)
            mats[p] = np.array([nan_row(r, width) for r in rows], dtype=float)
        values = np.concatenate([m[np.isfinite(m)] for m in mats.values()])
        lo, hi = np.percentile(values, [1, 99]) if values.size else (0, 1)
        fig, axes = figs.panels(len(having))
        for ax, p in zip(axes, having):
            e = figs.results[p]
            im = ax.imshow(np.ma.masked_invalid(mats[p]), aspect="auto", origin="lower", vmin=lo, vmax=hi,
                           cmap="viridis", interpolation="nearest")
            ax.set_title(figs.name[p] + (" (with dynamic scales)" if e["lambda_ratio_effective"] else ""), fontsize=9)
            width = mats[p].shape[1]
            ax.set_xlabel("(scalar)" if width == 1 else "head" if width == e["config"]["n_head"] else
                          "channel (head-major)")
            ax.set_ylabel("layer")
            figs.integer_ticks(ax.xaxis, ax.yaxis)
            fig.colorbar(im, ax=ax)
        fig.suptitle(f"{PROJ_NAMES[s]}: λ1/λ2, anchor vs the layer's own projection")
        figs.save(fig, f"lambda_ratio_{s}.png")


def plot_lambda_layers(figs):
    """Figure 6: λ1/λ2 per layer (mean over channels), every mixed projection, the models together."""
    mixed = [s for s in PROJ_NAMES if any(s in e["lambda_ratio"] for e in figs.results.values())]
    if not mixed:
        return
    fig, axes = figs.panels(len(mixed), (4.6, 3.4))
    for ax, s in zip(axes, mixed):
        for p, e in figs.results.items():
            if s in e["lambda_ratio"]:
                rows = mixed_ratios(e, s)
                ax.plot(range(len(rows)), [math.nan if r is None else float(np.mean(r)) for r in rows], marker="o",
                        ms=3, label=figs.name[p] + (" (effective)" if e["lambda_ratio_effective"] else ""))
        ax.axhline(1, color="gray", ls="--", lw=0.8)
        ax.set(title=f"{PROJ_NAMES[s]}: mean λ1/λ2", xlabel="layer", ylabel="λ1/λ2")
        figs.integer_ticks(ax.xaxis)
    axes[0].legend(fontsize=8)
    figs.save(fig, "lambda_ratio_layers.png")


STATE_AXIS = "hidden state (0 = embeddings, i = after block i)"
LINE_PLOTS = [  # Figures 4 and 7: (metric, title, x axis, log scale)
    ("attention_sink", "attention on the first key a query sees (sink)", "layer", False),
    ("attention_entropy", "attention entropy (nats)", "layer", False),
    ("gate_mean", "mean gate σ(g)", "layer", False),
    ("gate_sparsity", f"gate sparsity (fraction of σ(g) < {GATE_CLOSED})", "layer", False),
    ("token_similarity", "mean cosine similarity between positions", STATE_AXIS, False),
    ("token_similarity_std", "std of the cosine similarity between positions", STATE_AXIS, False),
    ("max_activation", "max |h|", STATE_AXIS, True),
    ("hidden_norm", "mean ‖h‖₂", STATE_AXIS, True),
    ("pca_dims", f"principal components for {PCA_VARIANCE:.0%} of the variance", STATE_AXIS, False)]


def plot_line_metrics(figs):
    """Figures 4 and 7: one line per model for every per-layer metric, a figure each."""
    for key, title, xlabel, log in LINE_PLOTS:
        having = [p for p, e in figs.results.items() if e[key] is not None]
        if not having:
            continue
        fig, ax = figs.plt.subplots(figsize=(6.4, 4), layout="constrained")
        for p in having:
            ax.plot(nan_row(figs.results[p][key]), marker="o", ms=3, label=figs.name[p])
        ax.set(title=title, xlabel=xlabel, yscale="log" if log else "linear")
        figs.integer_ticks(ax.xaxis)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        figs.save(fig, f"{key}.png")


def plot_top_k(figs):
    """Figure 4: the mean of a query's k largest attention weights per layer, one panel per k."""
    fig, axes = figs.panels(len(TOP_K), (4.2, 3.2))
    for ax, k in zip(axes, TOP_K):
        for p, e in figs.results.items():
            ax.plot(e["top_k_attention"][str(k)], marker="o", ms=3, label=figs.name[p])
        ax.set(title=f"mean of the top-{k} attention weight{'s' if k > 1 else ''}", xlabel="layer")
        figs.integer_ticks(ax.xaxis)
    axes[0].legend(fontsize=8)
    figs.save(fig, "top_k_attention.png")


def plot_layer_similarity(figs):
    """Figure 8: layer-to-layer similarity of the hidden states, one panel per model."""
    fig, axes = figs.panels(len(figs.results), (4.4, 3.8))
    lo = min(min(map(min, e["layer_similarity"])) for e in figs.results.values())
    for ax, (p, e) in zip(axes, figs.results.items()):
        im = ax.imshow(np.array(e["layer_similarity"]), vmin=lo, vmax=1, cmap="magma")
        ax.set(title=figs.name[p], xlabel="hidden state", ylabel="hidden state")
        figs.integer_ticks(ax.xaxis, ax.yaxis)
        fig.colorbar(im, ax=ax)
    fig.suptitle("cosine similarity of two layers' hidden states (0 = embeddings)")
    figs.save(fig, "layer_similarity.png")


def plot_val_curves(figs):
    """Figure 2: validation loss over training, from each checkpoint's log.jsonl."""
    having = [p for p, e in figs.results.items() if e["curve"]]
    if not having:
        return
    fig, ax = figs.plt.subplots(figsize=(6.4, 4), layout="constrained")
    for p in having:
        steps, losses = zip(*figs.results[p]["curve"])
        ax.plot(steps, losses, marker=".", label=figs.name[p])
    # the untrained model's loss at step 0 would squash the rest of the curves: clip it
    later = [v for p in having for _, v in figs.results[p]["curve"][1:]]
    if later:
        spread = max(later) - min(later) or 1.0
        ax.set_ylim(min(later) - 0.05 * spread, max(later) + 0.1 * spread)
    ax.set(title="validation loss during training (log.jsonl)", xlabel="step", ylabel="val loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    figs.save(fig, "val_loss_curves.png")


def plot_anchor_removal(figs):
    """§4.5: validation loss with and without the anchors, side by side per model."""
    results = figs.results
    fig, ax = figs.plt.subplots(figsize=(max(4.0, 1.8 * len(results)), 4), layout="constrained")
    x = np.arange(len(results))
    for offset, key, label in ((-0.2, "val_loss", "with anchors"), (0.2, "val_loss_no_anchor", "anchors removed")):
        vals = [e[key] if e[key] is not None else math.nan for e in results.values()]
        bars = ax.bar(x + offset, vals, 0.4, label=label)
        ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.2f}" for v in vals], fontsize=8)
    ax.set_xticks(x, [figs.name[p] for p in results], rotation=15, ha="right", fontsize=8)
    ax.set(title="anchor removal at inference (§4.5)", ylabel="val loss")
    ax.set_ylim(top=1.25 * ax.get_ylim()[1])  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    figs.save(fig, "anchor_removal.png")


def plot(results, out):
    """PNG figures of `results` in `out`; the list of files written, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figs = Figures(plt, results, out)
    for figure in (plot_lambda_heatmaps, plot_lambda_layers, plot_line_metrics, plot_top_k, plot_layer_similarity,
                   plot_val_curves, plot_anchor_removal):
        figure(figs)
    return figs.files


# ----------------------------------------------------------------------------- command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The paper's analyses (Figures 2-8, §4.5) for checkpoints, side by side")
    p.add_argument("ckpts", nargs="+", help="checkpoints written by train.py or convert.py, model folders "
                                             "(convert.py --to_hf) or Hub repositories OWNER/NAME holding one")
    p.add_argument("--data_dir", default="data/finewebedu10B", help="directory of the *_val_*.bin shard(s)")
    p.add_argument("--tokens", type=int, default=65536, help="validation tokens analysed (the first ones)")
    p.add_argument("--batch_size", type=int, default=8, help="windows of block_size tokens per forward pass")
    p.add_argument("--out", default="out/analysis", help="directory for analysis.json and the figures")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype of the forward pass (default: bfloat16 on cuda, float32 on cpu); "
                        "the metrics are computed in float32")
    args = p.parse_args(argv)
    for key in ("tokens", "batch_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key} {getattr(args, key)}: expected a positive integer")
    twice = sorted({c for c in args.ckpts if args.ckpts.count(c) > 1})
    if twice:
        p.error(f"checkpoint {twice[0]} given twice")
    return args


def main(argv=None):
    args = parse_args(argv)
    runtime = Runtime.pick(args.device, args.dtype)
    try:  # every input is checked before the first model is analysed
        for path in args.ckpts:
            ckpt, config = check_checkpoint(path, mmap=True)  # no model built, no weight read: analyze loads it
            check_data_tokenizer(ckpt, args.data_dir, path)  # the tokenizer the model was trained with
            windows(args.data_dir, args.tokens, args.batch_size, config)
        os.makedirs(args.out, exist_ok=True)
    except (ValueError, OSError, ImportError) as e:  # ImportError: the Hugging Face format's packages
        raise SystemExit(f"analyze.py: error: {e}")
    results = {}
    for path in args.ckpts:
        results[path] = analyze(path, args.data_dir, args.tokens, args.batch_size, runtime, desc=path)
    json_path = os.path.join(args.out, "analysis.json")
    with atomic_write(json_path, "w") as f:
        f.write(to_json(results))
    print_table(results)
    print(f"wrote {json_path}")
    files = plot(results, args.out)
    if files is None:
        print("matplotlib is not installed: plots skipped (pip install matplotlib)")
    else:
        print(f"wrote {len(files)} figures in {args.out}: {', '.join(os.path.basename(f) for f in files)}")
    return results


if __name__ == "__main__":
    main()
