"""
Time training steps (forward + backward + Muon/AdamW) of several variants side by side, in one process,
interleaved so that they share the machine's ups and downs, and compare with their FLOP ratios:

    python bench.py configs/gated.py configs/exoformer_e.py configs/dyn_exo.py --block_size=256 --batch_size=8
    python bench.py configs/gated.py configs/dyn_exo.py --n_layer=4 --n_embd=128 --n_head=4   # CPU size

Each positional argument is one model: files are not composed as in train.py, so give a size as
--key=value. Every --key=value (any train.py or model key, plus the bench keys) applies to all models.
The first model is the reference of the ratio columns.
"""
import os
import statistics
import sys
import time

import torch

from configurator import help_text, key_comments, load_config, wants_help
from model import EOT, GPT, GPTConfig
from train import ALL_DEFAULTS, MODEL_KEYS, configure_optimizers, help_sections, optimizer_step, setup

BENCH_DEFAULTS = dict(
    steps=5,  # timed steps per model per round
    rounds=3,  # rounds of interleaving; the median step time over all rounds is reported
    warmup=2,  # untimed steps per model first (compilation, allocator)
    optimizer=True,  # False: time forward + backward only (isolates the model's own cost)
    doc_mask=False,  # True: time every model twice, with plain causal and with document-masked attention
    doc_len=1000,  # mean document length of the synthetic tokens (an <|endoftext|> opens each document)
)


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
        cfgs = [load_config([f] + overrides, defaults) for f in files]
        _, _, device, autocast, use_compile = setup(cfgs[0])
        models = [GPT(GPTConfig(**{k: c[k] for k in MODEL_KEYS})) for c in cfgs]  # checks every config first
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"bench.py: error: {e}")
    c0 = cfgs[0]
    B, T = c0["batch_size"], c0["block_size"]
    what = "forward+backward+optimisers" if c0["optimizer"] else "forward+backward"
    print(f"{what}: {device}, {c0['dtype'] or 'auto'} dtype, compile={use_compile}, batch {B} x {T} tokens, "
          f"{c0['rounds']} rounds x {c0['steps']} steps (+{c0['warmup']} warmup)")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, EOT, (B, T + 1), generator=g)
    data[torch.rand(B, T + 1, generator=g) < 1 / c0["doc_len"]] = EOT  # documents of doc_len tokens on average
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)

    runs = []
    for f, cfg, model in zip(files, cfgs, models):  # built one after another: peak memory is per model
        for doc_mask in (False, True) if cfg["doc_mask"] else (False,):
            base = peak_memory_reset(device)
            torch.manual_seed(cfg["seed"])
            model = model.to(device)
            optimizers = configure_optimizers(model, cfg) if cfg["optimizer"] else None
            run = dict(name=os.path.basename(f)[:-3] + ("+doc_mask" if doc_mask else ""), model=model, cfg=cfg,
                       optimizers=optimizers, times=[], doc_mask=doc_mask,
                       fwd=torch.compile(model) if use_compile else model)
            for _ in range(cfg["warmup"]):
                step(run, x, y, autocast, device)
            run["memory"] = peak_memory(device, base)
            runs.append(run)
    for _ in range(c0["rounds"]):
        for run in runs:
            for _ in range(run["cfg"]["steps"]):
                run["times"].append(step(run, x, y, autocast, device))

    ref = runs[0]
    ref_ms = statistics.median(ref["times"]) * 1000
    ref_flops = ref["model"].flops_per_token(T)
    print(f"\n{'config':<22}{'params':>14}{'ms/step':>10}{'tok/s':>12}{'peak mem':>11}{'time ratio':>12}"
          f"{'FLOP ratio':>12}")
    for run in runs:
        ms = statistics.median(run["times"]) * 1000
        mem = "-" if run["memory"] is None else f"{run['memory'] / 2**30:.2f} GiB"
        print(f"{run['name']:<22}{run['model'].num_params():>14,}{ms:>10.1f}{B * T / ms * 1000:>12,.0f}"
              f"{mem:>11}{ms / ref_ms:>12.4f}{run['model'].flops_per_token(T) / ref_flops:>12.4f}")
    return runs


def step(run, x, y, autocast, device):
    """One training step (as in train.py without accumulation); returns its wall time in seconds."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast:
        _, loss, z = run["fwd"](x, y, with_z=True, doc_mask=run["doc_mask"])
    (loss + run["cfg"]["z_loss"] * z).backward()
    if run["cfg"]["optimizer"]:
        optimizer_step(run["model"], run["optimizers"], run["cfg"])
    else:
        run["model"].zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main(sys.argv[1:])
