"""
Train a model of any variant with the paper's recipe, in one process or under torchrun:

    python train.py configs/dyn_exo.py configs/tiny.py                     # CPU: a tiny model, a short run
    python train.py configs/dyn_exo.py                                     # 1 GPU (accumulates to 256K tokens)
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py                # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py --init_from=resume   # continue a run

Config files are plain Python assignments (`n_layer = 4`) applied in the order given, a later one
overriding an earlier one (a variant file, then configs/tiny.py to shrink it), then the --key=value
overrides; every key must be one of the keys below. With --init_from=resume or --eval_only the model is
the checkpoint's: model keys may be left out, and any that is given must agree with the checkpoint.
"""
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import help_text, key_comments, read_args, wants_help
from data import DataLoader, atomic_write, val_batches
from model import GPT, GPTConfig, load_checkpoint, trained_doc_mask

# ----------------------------------------------------------------------------- defaults: the paper's 450M run
# One key per line, its meaning in the comment: `python train.py --help` prints them (configurator.key_comments).
# The model fields of GPTConfig are keys too (set them with a configs/ file); their meanings are model.py's.
DEFAULTS = dict(
    # I/O
    data_dir="data/finewebedu10B",  # shards from prepare.py (*_train_*.bin, *_val_*.bin)
    out_dir="out",  # ckpt.pt and log.jsonl
    init_from="scratch",  # 'scratch' or 'resume' (continue from <out_dir>/ckpt.pt)
    eval_only=False,  # evaluate <out_dir>/ckpt.pt on the whole validation shard and exit
    log_interval=10,  # steps between log lines
    eval_interval=500,  # steps between validation losses
    eval_tokens=10_485_760,  # validation tokens per evaluation during training
    ckpt_interval=1000,  # steps between checkpoints (one is also written at the end)
    wandb_log=False,  # also log to Weights & Biases (needs wandb installed)
    wandb_project="exoformer",  # W&B project
    wandb_run_name="run",  # W&B run name
    # batch: 262,144 tokens per step = 8 GPUs x 2 micro-steps x 8 sequences x 2048 tokens (the paper: 16 x 1).
    # 16 sequences of any paper variant keep 64-69 GiB of activations for backward (114 GiB at 1B; bench.py
    # --memory=True): 8 keep at most 35 (57), which fits 80 GB GPUs; gradient accumulation keeps the step.
    batch_size=8,  # sequences per process per micro-step
    block_size=2048,  # sequence length (also the model's longest context)
    total_batch_size=262_144,  # tokens per optimiser step, reached by gradient accumulation
    max_steps=38_147,  # optimiser steps: 10B tokens at 262,144 tokens per step
    # optimisers
    muon_lr=0.01,  # peak learning rate of Muon (the weights of the linear layers inside the network)
    muon_momentum=0.95,  # reached after muon_momentum_steps, left again over the last ones
    muon_momentum_min=0.85,  # Muon momentum at the first and the last step
    muon_momentum_steps=100,  # steps of each momentum ramp
    muon_beta2=0.95,  # NorMuon second-moment decay
    muon_weight_decay=0.1,  # cautious weight decay, Muon only
    adam_lr=0.003,  # peak learning rate of AdamW (embedding, lm_head, norms, biases, λ, the rest)
    adam_beta1=0.9,  # AdamW beta1
    adam_beta2=0.95,  # AdamW beta2
    adam_weight_decay=0.0,  # AdamW weight decay
    warmup_steps=1000,  # linear learning-rate warmup steps
    cooldown_frac=0.2,  # fraction of the run at the end over which the learning rates decay linearly
    final_lr_frac=0.1,  # learning rates at the end of the decay, as a fraction of the peak
    grad_clip=1.0,  # global gradient-norm clip
    z_loss=1e-5,  # weight of mean(logsumexp(logits)²) in the loss
    activation_checkpointing=False,  # recompute each block in the backward pass: 8-12 MiB per layer, ~25% slower steps
    doc_mask=True,  # attention stays inside each document of a window (each <|endoftext|> opens one), as the authors trained
    # system
    device=None,  # None: cuda if available, else cpu
    dtype=None,  # None: bfloat16 autocast on cuda (fp32 master weights), float32 on cpu
    compile=None,  # None: torch.compile on cuda only
    gpu_peak_flops=989e12,  # dense bf16 peak of one GPU (H100/H200), for MFU
    seed=42,  # seed of torch, numpy and random
)
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ALL_DEFAULTS = {**DEFAULTS, **{f.name: f.default for f in fields(GPTConfig)}}  # block_size is in both
# Meanings of the GPTConfig fields that model.py's GPTConfig has no comment for (a test checks that every key
# has exactly one meaning: when model.py gains a comment for one of these, its entry here goes)
MODEL_KEY_MEANINGS = dict(n_layer="transformer blocks (L)", n_head="attention heads (H); n_embd/H must be even",
                          n_embd="model width (C)", rope_theta="RoPE base")


def help_sections():
    """(title, defaults, meanings) of train.py's keys and of the model keys, for configurator.help_text."""
    model_file = sys.modules[GPTConfig.__module__].__file__
    model_defaults = {k: v for k, v in ALL_DEFAULTS.items() if k not in DEFAULTS}
    return [("training keys", DEFAULTS, key_comments(__file__, "DEFAULTS")),
            ("model keys (GPTConfig; the configs/ files set them)", model_defaults,
             {**key_comments(model_file, "GPTConfig"), **MODEL_KEY_MEANINGS})]


# Polar Express coefficients (a, b, c) of the 5 iterations (Amsel et al., 2025, as the authors use them)
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


# ----------------------------------------------------------------------------- Muon

def polar_express(G):
    """Orthogonalise a stack of matrices (..., rows, cols) in bf16: U V^T of their SVD, approximately."""
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices: Nesterov momentum (EMA form), Polar Express, NorMuon second
    moment, shape scaling, cautious weight decay. Under DDP each rank orthogonalises only its share of
    every group of same-shaped matrices and all-gathers the results; the cheap elementwise work runs on
    every rank, so parameters and optimiser state stay identical everywhere (and checkpointable from rank 0)."""

    def __init__(self, params, lr, momentum, beta2, weight_decay, rank=0, world_size=1):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        self.rank, self.world_size = rank, world_size

    def _orthogonalize(self, updates):
        by_shape = {}
        for i, u in enumerate(updates):
            by_shape.setdefault(u.shape, []).append(i)
        out = [None] * len(updates)
        for idx in by_shape.values():
            share = math.ceil(len(idx) / self.world_size)
            mine = [updates[i] for i in idx[self.rank * share:(self.rank + 1) * share]]
            mine += [torch.zeros_like(updates[idx[0]])] * (share - len(mine))  # pad so all ranks gather equal sizes
            result = polar_express(torch.stack(mine))
            if self.world_size > 1:
                parts = [torch.empty_like(result) for _ in range(self.world_size)]
                dist.all_gather(parts, result)
                result = torch.cat(parts)
            for j, i in enumerate(idx):
                out[i] = result[j]
        return out

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            updates = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    rows, cols = p.shape  # NorMuon: one second moment per row if rows >= cols, else per column
                    state["second_moment"] = torch.zeros((rows, 1) if rows >= cols else (1, cols), device=p.device)
                state["momentum"].lerp_(p.grad, 1 - mu)
                updates.append(p.grad.lerp(state["momentum"], mu))  # Nesterov
            for p, u in zip(params, self._orthogonalize(updates)):
                u = u.float()
                v = self.state[p]["second_moment"]
                v.lerp_(u.square().mean(dim=-1 if v.size(1) == 1 else -2, keepdim=True), 1 - group["beta2"])
                normed = u * v.clamp_min(1e-10).rsqrt()
                normed *= u.norm() / normed.norm().clamp_min(1e-10)  # keep the orthogonalised update's norm
                normed *= max(1.0, p.size(0) / p.size(1)) ** 0.5
                # cautious weight decay: only where the update already moves the weight towards zero
                p.sub_(lr * wd * (normed * p >= 0) * p)
                p.sub_(lr * normed)


def muon_params(model):
    """The weights of the nn.Linear layers inside the network: every one but lm_head's."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head}
    return [p for p in model.parameters() if id(p) in linear]  # parameters() lists a shared tensor once


def configure_optimizers(model, cfg, rank=0, world_size=1):
    """Muon for the weights of the nn.Linear layers inside the network (blocks, anchor_proj, dynamic MLPs):
    maps from one hidden vector to another, which is what Muon's orthogonalised update suits. AdamW for
    everything else: the embedding, lm_head (its output is the vocabulary, not a hidden vector), norm
    weights, biases, λ, and any parameter a fork adds outside nn.Linear, whatever its shape."""
    muon = muon_params(model)
    adam = [p for p in model.parameters() if id(p) not in set(map(id, muon))]
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return [Muon(muon, cfg["muon_lr"], cfg["muon_momentum"], cfg["muon_beta2"], cfg["muon_weight_decay"],
                 rank, world_size),
            torch.optim.AdamW(adam, lr=cfg["adam_lr"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]),
                              weight_decay=cfg["adam_weight_decay"], **fused)]


def describe_optimizers(optimizers):
    """One line: how many tensors and parameters each optimiser updates."""
    def count(opt):
        params = [p for g in opt.param_groups for p in g["params"]]
        return f"{type(opt).__name__} {len(params)} tensors ({sum(p.numel() for p in params):,} parameters)"
    return "optimisers: " + ", ".join(count(opt) for opt in optimizers)


def optimizer_step(model, optimizers, cfg):
    """Clip the global gradient norm, step both optimisers, clear the gradients; return the norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grad_norm.item()


def lr_multiplier(step, cfg):
    """Linear warmup, constant, then linear decay over the last cooldown_frac of the run to final_lr_frac."""
    if step < cfg["warmup_steps"]:
        return (step + 1) / cfg["warmup_steps"]
    decay_start = cfg["max_steps"] * (1 - cfg["cooldown_frac"])
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / (cfg["max_steps"] - decay_start)
    return 1.0 - (1.0 - cfg["final_lr_frac"]) * progress


def muon_momentum(step, cfg):
    """muon_momentum_min -> muon_momentum over the first muon_momentum_steps, and back over the last."""
    ramp = min(1.0, step / cfg["muon_momentum_steps"], (cfg["max_steps"] - step) / cfg["muon_momentum_steps"])
    return cfg["muon_momentum_min"] + (cfg["muon_momentum"] - cfg["muon_momentum_min"]) * ramp


def set_schedule(optimizers, step, cfg):
    muon, adam = optimizers
    mult = lr_multiplier(step, cfg)
    for g in muon.param_groups:
        g["lr"], g["momentum"] = cfg["muon_lr"] * mult, muon_momentum(step, cfg)
    for g in adam.param_groups:
        g["lr"] = cfg["adam_lr"] * mult
    return cfg["muon_lr"] * mult


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(path, state):
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    with atomic_write(path) as f:
        torch.save(state, f)


def rng_state():
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- the run

def setup(cfg):
    """Distributed setup and device choices; returns rank, world_size, device, autocast context, compile flag."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = cfg["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":  # under torchrun, one GPU per local rank
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    dtype = cfg["dtype"] or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" \
        else contextlib.nullcontext()  # bf16 forward, fp32 master weights
    use_compile = device.startswith("cuda") if cfg["compile"] is None else cfg["compile"]
    if not isinstance(use_compile, bool):
        raise ValueError(f"compile={cfg['compile']!r}: expected True, False or None (auto)")
    return rank, world_size, device, autocast, use_compile


def model_config_for(cfg, given, ckpt, ckpt_path):
    """The model to build, written back into cfg's model keys. Without a checkpoint: the configured one.
    With one (resume, eval_only): the checkpoint's (a field it lacks, added to GPTConfig later, takes its
    default); the model keys that config files or overrides set must agree with it."""
    if ckpt is None:
        config = GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    else:
        config = GPTConfig.from_dict(ckpt["model_config"], f"{ckpt_path}: model_config")
        saved = asdict(config)
        conflict = [k for k in MODEL_KEYS if k in given and given[k] != saved[k]]
        if conflict:
            show = lambda d: ", ".join(f"{k}={d[k]!r}" for k in conflict)
            raise ValueError(f"{ckpt_path}: its model has {show(saved)}, the configuration sets {show(given)} "
                             f"(leave the model keys out to take the checkpoint's)")
    cfg.update(asdict(config))
    return config


def check_config(cfg, world_size):
    if cfg["init_from"] not in ("scratch", "resume"):
        raise ValueError(f"init_from={cfg['init_from']!r}: expected 'scratch' or 'resume'")
    for key in ("max_steps", "batch_size", "block_size", "total_batch_size", "log_interval", "eval_interval",
                "ckpt_interval", "warmup_steps", "muon_momentum_steps"):
        if cfg[key] < 1:
            raise ValueError(f"{key}={cfg[key]}: expected a positive integer")
    micro = cfg["batch_size"] * cfg["block_size"] * world_size
    if cfg["total_batch_size"] % micro:
        raise ValueError(f"total_batch_size={cfg['total_batch_size']}: expected a multiple of batch_size x "
                         f"block_size x processes = {micro}")
    return cfg["total_batch_size"] // micro


@torch.no_grad()
def evaluate(model, cfg, autocast, device, rank, world_size, max_tokens):
    """Mean validation cross-entropy over a fixed slice of the val shard(s), averaged over ranks."""
    model.eval()
    total, n = torch.zeros((), device=device), torch.zeros((), device=device)
    for x, y in val_batches(cfg["data_dir"], cfg["batch_size"], cfg["block_size"], max_tokens, rank, world_size,
                            cfg["vocab_size"]):
        with autocast:
            _, loss = model(x.to(device), y.to(device), doc_mask=cfg["doc_mask"])
        total += loss.float()
        n += 1
    if world_size > 1:
        for t in (total, n):
            dist.all_reduce(t)
    model.train()
    return (total / n).item()


def main(argv):
    # --- everything that can be wrong with the input is checked before any training
    if wants_help(argv):
        print(help_text(__doc__, help_sections()))
        return None
    try:
        given = read_args(argv, ALL_DEFAULTS)
        cfg = {**ALL_DEFAULTS, **given}
        rank, world_size, device, autocast, use_compile = setup(cfg)
        ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
        # loaded to the CPU: load_state_dict copies to the device, and RNG states must stay CPU tensors
        resume = cfg["init_from"] == "resume" and not cfg["eval_only"]  # needs more than the weights
        keys = ("model", "model_config", "step") + (("optimizers", "loader", "rng") if resume else ())
        ckpt = load_checkpoint(ckpt_path, keys) if (resume or cfg["eval_only"]) else None
        model_config = model_config_for(cfg, given, ckpt, ckpt_path)  # before the checks: block_size may change
        if ckpt is not None and "doc_mask" not in given:  # resume, eval_only: as trained, unless overridden
            cfg["doc_mask"] = trained_doc_mask(ckpt)
        accum = check_config(cfg, world_size)
        # one window of total_batch_size tokens per step, split into micro-steps below: the same tokens
        # whatever the mix of processes and accumulation (and at shard ends, too)
        loader = None if cfg["eval_only"] else DataLoader(
            cfg["data_dir"], accum * cfg["batch_size"], cfg["block_size"], rank, world_size, cfg["vocab_size"])
        next(val_batches(cfg["data_dir"], cfg["batch_size"], cfg["block_size"], cfg["eval_tokens"], rank,
                         world_size, cfg["vocab_size"]), None)  # the val shard is checked now, not at step 500
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: error: {e}")
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    changed = {k: v for k, v in cfg.items() if v != ALL_DEFAULTS[k]}
    log("config, where it differs from the defaults (log.jsonl has all of it): " +
        (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "none"))

    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    raw_model = GPT(model_config).to(device)
    raw_model.activation_checkpointing = cfg["activation_checkpointing"]
    optimizers = configure_optimizers(raw_model, cfg, rank, world_size)
    log(describe_optimizers(optimizers))
    step = 0
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
    if cfg["eval_only"]:
        val_loss = evaluate(raw_model, cfg, autocast, device, rank, world_size, None)
        log(f"step {ckpt['step']}: val loss {val_loss:.4f} on the whole validation set")
        return val_loss
    if ckpt is not None:
        for opt, state in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(state)
        loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        step = ckpt["step"]
        log(f"resuming from {ckpt_path} at step {step}")
    model = torch.compile(raw_model) if use_compile else raw_model
    train_model = DDP(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None) \
        if world_size > 1 else model
    if master:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        log_path = os.path.join(cfg["out_dir"], "log.jsonl")
        # a resumed run's log reads as if it had never stopped: drop what came after the checkpoint
        kept = [line for line in open(log_path)] if step > 0 and os.path.exists(log_path) else []
        with atomic_write(log_path, "w") as f:
            f.writelines(line for line in kept if json.loads(line)["step"] <= step)
            f.write(json.dumps({"step": step, "config": cfg}) + "\n")  # every (re)start records its config
        log_file = open(log_path, "a")
        log_file.flush()
        wandb = None
        if cfg["wandb_log"]:
            try:
                import wandb
            except ImportError:
                sys.exit("train.py: error: wandb_log=True but wandb is not installed (pip install wandb)")
            wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"], config=cfg)
    flops_per_step = raw_model.flops_per_token(cfg["block_size"]) * cfg["total_batch_size"]
    log(f"{raw_model.num_params():,} parameters, {world_size} process(es) x {accum} micro-step(s) x "
        f"{cfg['batch_size']} x {cfg['block_size']} tokens, {device}, compile={use_compile}")
    # the loader wraps around at the end of the data: say up front how often the run will see it
    planned, available = cfg["max_steps"] * cfg["total_batch_size"], loader.tokens_per_epoch
    log(f"data: {cfg['max_steps']:,} steps x {cfg['total_batch_size']:,} tokens = {planned:,} tokens planned; "
        f"{cfg['data_dir']} has {available:,} usable train tokens: {planned / available:.2f} epochs"
        + (" (the data repeats)" if planned > available else ""))

    def record(entry):
        if master:
            log_file.write(json.dumps(entry) + "\n")
            log_file.flush()
            if wandb is not None:
                wandb.log(entry, step=entry["step"])

    if step == 0:
        val_loss = evaluate(model, cfg, autocast, device, rank, world_size, cfg["eval_tokens"])
        log(f"step 0: val loss {val_loss:.4f}")
        record({"step": 0, "val_loss": val_loss})
    step_times, train_loss = [], None
    while step < cfg["max_steps"]:
        t0 = time.perf_counter()
        lr = set_schedule(optimizers, step, cfg)
        loss_sum = torch.zeros((), device=device)
        epoch = loader.epoch
        xs, ys = loader.next_batch()
        for micro, (x, y) in enumerate(zip(xs.split(cfg["batch_size"]), ys.split(cfg["batch_size"]))):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces gradients only on the last micro-step
            sync = contextlib.nullcontext() if (world_size == 1 or micro == accum - 1) else train_model.no_sync()
            with sync:
                with autocast:
                    _, loss = train_model(x, y, z_loss=cfg["z_loss"], doc_mask=cfg["doc_mask"])
                (loss / accum).backward()
            loss_sum += loss.detach()
        if world_size > 1:
            dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (accum * world_size)
        if not math.isfinite(train_loss):
            sys.exit(f"train.py: error: non-finite loss ({train_loss}) at step {step + 1}; "
                     f"the last good checkpoint, if any, is {ckpt_path}")
        grad_norm = optimizer_step(raw_model, optimizers, cfg)
        step += 1
        step_times.append(time.perf_counter() - t0)

        entry = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm}
        if loader.epoch != epoch:  # this step's batch began the data again from the first shard
            entry["epoch"] = loader.epoch
            log(f"step {step}: end of the train data, wrapping around to its start: epoch {loader.epoch} begins")
        if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
            entry["val_loss"] = evaluate(model, cfg, autocast, device, rank, world_size, cfg["eval_tokens"])
        if step % cfg["log_interval"] == 0 or "val_loss" in entry or "epoch" in entry:
            dt = sum(step_times[-cfg["log_interval"]:]) / len(step_times[-cfg["log_interval"]:])
            entry.update(step_ms=1000 * dt, tok_per_s=cfg["total_batch_size"] / dt)
            mfu = ""
            if device.startswith("cuda"):
                entry["mfu"] = flops_per_step / dt / world_size / cfg["gpu_peak_flops"]
                mfu = f" | mfu {100 * entry['mfu']:.1f}%"
            eta = dt * (cfg["max_steps"] - step)
            val = f" | val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
            log(f"step {step}/{cfg['max_steps']} | loss {train_loss:.4f}{val} | lr {lr:.2e} | grad norm "
                f"{grad_norm:.3f} | {1000 * dt:.0f} ms | {entry['tok_per_s']:,.0f} tok/s{mfu} | "
                f"eta {eta / 60:.1f} min")
            record(entry)
        if master and (step % cfg["ckpt_interval"] == 0 or step == cfg["max_steps"]):
            save_checkpoint(ckpt_path, {
                "model": raw_model.state_dict(), "model_config": asdict(model_config), "config": cfg,
                "step": step, "optimizers": [opt.state_dict() for opt in optimizers],
                "loader": loader.state_dict(), "rng": rng_state()})
    if world_size > 1:
        # Free DDP's reducer, and let every rank's gloo/NCCL work finish, while the group still exists:
        # a group destroyed from the reducer's deallocation at exit can deadlock on the GIL with its workers
        del train_model
        dist.barrier()
        dist.destroy_process_group()
    return train_loss


if __name__ == "__main__":
    main(sys.argv[1:])
