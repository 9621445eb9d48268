"""
Time training steps (forward + backward + Muon/AdamW) of several variants side by side, in one process,
interleaved so that they share the machine's ups and downs, and compare with their FLOP ratios:

    python bench.py configs/gated.py configs/exoformer_e.py configs/dyn_exo.py --block_size=256 --batch_size=8
    python bench.py configs/gated.py configs/dyn_exo.py --n_layer=4 --n_embd=128 --n_head=4   # CPU size

Each positional argument is one model: files are not composed as in train.py, so give a size as
--key=value. Every --key=value (any train.py or model key, plus the bench keys) applies to all models;
--compare=KEY times each of them with a True/False key off and on, side by side. The first row is the
reference of the ratio columns. --memory=True measures activation memory instead of time:

    python bench.py configs/gated.py configs/dyn_exo.py --memory=True --dtype=bfloat16
"""
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

from configurator import help_text, key_comments, load_config, wants_help
from model import EOT, GPT, GPTConfig
from train import ALL_DEFAULTS, MODEL_KEYS, configure_optimizers, help_sections, muon_params, optimizer_step, setup

BENCH_DEFAULTS = dict(
    steps=5,  # timed steps per model per round
    rounds=3,  # rounds of interleaving; the median step time over all rounds is reported
    warmup=2,  # untimed steps per model first (compilation, allocator)
    optimizer=True,  # False: time forward + backward only (isolates the model's own cost)
    compare="",  # a True/False key (doc_mask, activation_checkpointing): every model with it off, then on
    doc_len=1000,  # mean document length of the synthetic tokens (an <|endoftext|> opens each document)
    memory=False,  # True: instead of timing, measure the activation memory of one block_size sequence
)
# What a GPU holds besides activations, per parameter: fp32 weights, gradients, DDP's gradient buckets and
# optimiser state (Muon: momentum + small NorMuon moments; AdamW: two moments); bytes per parameter.
STATE_BYTES = {"muon": 4 + 4 + 4 + 4, "adam": 4 + 4 + 4 + 8}
LOGIT_BYTES = 2 + 4 + 4  # a loss chunk's transient logits: bf16, fp32, and their gradient
HEADROOM = 0.9  # of a GPU's memory usable for all this: the rest for CUDA context, workspaces, fragmentation


def peak_memory_reset(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return None  # the CPU allocator keeps no statistics; process RSS mixes in freed, cached memory


def peak_memory(device, base):
    """Bytes allocated at peak since peak_memory_reset, above what was in use then (None on CPU)."""
    return None if base is None else torch.cuda.max_memory_allocated() - base


def main(argv):
    if wants_help(argv):
        print(help_text(__doc__, [("bench keys", BENCH_DEFAULTS, key_comments(__file__, "BENCH_DEFAULTS"))]
                        + help_sections()))
        return None
    files = [a for a in argv if not a.startswith("--")]
    overrides = [a for a in argv if a.startswith("--")]
    if not files:
        sys.exit(__doc__)
    defaults = {**ALL_DEFAULTS, **BENCH_DEFAULTS}
    try:
        runs = []  # (name, cfg) of every row: one per file, or two with compare
        for f in files:
            cfg = load_config([f] + overrides, defaults)
            if cfg["compare"] and not isinstance(ALL_DEFAULTS.get(cfg["compare"]), bool):
                raise ValueError(f"--compare={cfg['compare']}: expected a True/False key such as doc_mask or "
                                 f"activation_checkpointing")
            GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})  # checks every model before any work
            name = os.path.basename(f)[:-3]
            runs += [(name + f"+{cfg['compare']}" * on, {**cfg, cfg["compare"]: on})
                     for on in (False, True)] if cfg["compare"] else [(name, cfg)]
        _, _, device, autocast, use_compile = setup(runs[0][1])
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"bench.py: error: {e}")
    if runs[0][1]["memory"]:
        return memory_table(runs, device, autocast)
    return timing_table(runs, device, autocast, use_compile)


def timing_table(runs, device, autocast, use_compile):
    c0 = runs[0][1]
    B, T = c0["batch_size"], c0["block_size"]
    what = "forward+backward+optimisers" if c0["optimizer"] else "forward+backward"
    print(f"{what}: {device}, {c0['dtype'] or 'auto'} dtype, compile={use_compile}, batch {B} x {T} tokens, "
          f"{c0['rounds']} rounds x {c0['steps']} steps (+{c0['warmup']} warmup)")
    x, y = synthetic_batch(B, T, c0["vocab_size"], c0["doc_len"], device)
    rows = []
    for name, cfg in runs:  # built one after another: peak memory is per model
        base = peak_memory_reset(device)
        torch.manual_seed(cfg["seed"])
        model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})).to(device)
        model.activation_checkpointing = cfg["activation_checkpointing"]
        row = dict(name=name, model=model, cfg=cfg, times=[],
                   optimizers=configure_optimizers(model, cfg) if cfg["optimizer"] else None,
                   fwd=torch.compile(model) if use_compile else model)
        for _ in range(cfg["warmup"]):
            step(row, x, y, autocast, device)
        row["memory"] = peak_memory(device, base)
        rows.append(row)
    for _ in range(c0["rounds"]):
        for row in rows:
            for _ in range(row["cfg"]["steps"]):
                row["times"].append(step(row, x, y, autocast, device))

    ref_ms = statistics.median(rows[0]["times"]) * 1000
    ref_flops = rows[0]["model"].flops_per_token(T)
    print(f"\n{'config':<36}{'params':>14}{'ms/step':>10}{'tok/s':>12}{'peak mem':>11}{'time ratio':>12}"
          f"{'FLOP ratio':>12}")
    for row in rows:
        ms = statistics.median(row["times"]) * 1000
        mem = "-" if row["memory"] is None else f"{row['memory'] / 2**30:.2f} GiB"
        print(f"{row['name']:<36}{row['model'].num_params():>14,}{ms:>10.1f}{B * T / ms * 1000:>12,.0f}"
              f"{mem:>11}{ms / ref_ms:>12.4f}{row['model'].flops_per_token(T) / ref_flops:>12.4f}")
    return rows


def synthetic_batch(B, T, vocab_size, doc_len, device):
    """Random tokens (B, T) and their targets, with an <|endoftext|> opening a document every doc_len tokens
    on average when the vocabulary has it."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, min(vocab_size, EOT), (B, T + 1), generator=g)
    if vocab_size > EOT:
        data[torch.rand(B, T + 1, generator=g) < 1 / doc_len] = EOT
    return data[:, :-1].to(device), data[:, 1:].to(device)


def is_weight(t, params):
    """A parameter, or a cast or view of one (autocast's bf16 weight copies, matmuls' transposes): autograd
    leads from it, through casts and views only, to the gradient accumulator of one of params."""
    fn = t.grad_fn
    while fn is not None and fn.name() in ("ToCopyBackward0", "TBackward0", "ViewBackward0", "PermuteBackward0",
                                           "TransposeBackward0", "ExpandBackward0", "UnsqueezeBackward0"):
        fn = fn.next_functions[0][0]
    leaf = t if fn is None else getattr(fn, "variable", None)  # AccumulateGrad nodes hold their parameter
    return leaf is not None and id(leaf) in params


def saved_bytes(model, x, y, autocast, doc_mask):
    """Bytes of the tensors autograd saves for the backward pass during one forward: every storage counted
    once; weights (parameters, their casts and views) left out, and (B, H, T, T) attention matrices and masks
    too (flash attention keeps none)."""
    T, saved, params = x.size(1), {}, {id(p) for p in model.parameters()}

    def pack(t):  # keeps the storage (so that no other one reuses its address), not the tensor: no backward
        if not is_weight(t, params) and not (t.dim() == 4 and tuple(t.shape[-2:]) == (T, T)):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage()
        # None, not t: a saved output returned as it is would hold its own graph node, a cycle gc cannot free

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, y, doc_mask=doc_mask)
    return sum(s.nbytes() for s in saved.values())


def layer_split(config, cfg, x, y, autocast, device, checkpointing):
    """(per-layer, fixed) bytes saved for backward, from 2- and 3-layer copies of the model (internal
    anchors make layer 1 unlike the others)."""
    measured = []
    for n_layer in (2, 3):
        torch.manual_seed(cfg["seed"])
        model = GPT(replace(config, n_layer=n_layer)).to(device)
        model.activation_checkpointing = checkpointing
        measured.append(saved_bytes(model, x, y, autocast, cfg["doc_mask"]))
    return measured[1] - measured[0], measured[0] - 2 * (measured[1] - measured[0])


def memory_table(runs, device, autocast):
    """Activation memory of one block_size sequence per model: the per-layer and fixed parts autograd saves,
    their total at full depth (with activation checkpointing, plus the one block that backward recomputes
    at a time), and the micro-batch that fits 40, 80 and 141 GB GPUs next to the weights, gradients,
    optimiser states and the loss's transient logits."""
    c0 = runs[0][1]
    T = c0["block_size"]
    x, y = synthetic_batch(1, T, c0["vocab_size"], c0["doc_len"], device)
    print(f"activation memory of one sequence of {T} tokens: {device}, {c0['dtype'] or 'auto'} dtype, eager")
    print(f"\n{'config':<36}{'params':>14}{'per layer':>12}{'fixed':>10}{'GiB/seq':>9}"
          f"{'B @ 40GB':>10}{'B @ 80GB':>10}{'B @ 141GB':>11}")
    rows = []
    for name, cfg in runs:
        config = GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
        per_layer, fixed = layer_split(config, cfg, x, y, autocast, device, cfg["activation_checkpointing"])
        recompute = layer_split(config, cfg, x, y, autocast, device, False)[0] \
            if cfg["activation_checkpointing"] else 0
        total = fixed + config.n_layer * per_layer + recompute
        with torch.device("meta"):
            full = GPT(config)
        n_muon = sum(p.numel() for p in muon_params(full))
        state = n_muon * STATE_BYTES["muon"] + (full.num_params() - n_muon) * STATE_BYTES["adam"] + \
            full.loss_chunk * config.vocab_size * LOGIT_BYTES
        fits = [max(0, int((gb * 1e9 * HEADROOM - state) // total)) for gb in (40, 80, 141)]
        rows.append(dict(name=name, params=full.num_params(), per_layer=per_layer, fixed=fixed, total=total,
                         fits=fits))
        print(f"{name:<36}{full.num_params():>14,}{per_layer / 2**20:>8.1f} MiB{fixed / 2**20:>6.0f} MiB"
              f"{total / 2**30:>9.2f}{fits[0]:>10}{fits[1]:>10}{fits[2]:>11}")
    return rows


def step(row, x, y, autocast, device):
    """One training step (as in train.py without accumulation); returns its wall time in seconds."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast:
        _, loss = row["fwd"](x, y, z_loss=row["cfg"]["z_loss"], doc_mask=row["cfg"]["doc_mask"])
    loss.backward()
    if row["cfg"]["optimizer"]:
        optimizer_step(row["model"], row["optimizers"], row["cfg"])
    else:
        row["model"].zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main(sys.argv[1:])
