"""
Train a model of any variant with the paper's recipe, in one process or under torchrun:

    python train.py configs/dyn_exo.py configs/tiny.py                     # CPU: a tiny model, a short run
    python train.py configs/dyn_exo.py                                     # 1 GPU (accumulates to 256K tokens)
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py                # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py --init_from=auto     # starts, or continues, a run

Config files are plain Python assignments (`n_layer = 4`) applied in the order given, a later one
overriding an earlier one (a variant file, then configs/tiny.py to shrink it), then the --key=value
overrides; every key must be one of the keys below. With --init_from=resume or --eval_only the model is
the checkpoint's: model keys may be left out, and any that is given must agree with the checkpoint.
SIGTERM, SIGINT or SIGUSR1 stop a run after its current step, with a checkpoint, and exit with status 75.
"""
import contextlib
import errno
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import RESUME, Runtime, load_checkpoint, save_checkpoint, trained_doc_mask, weights_only
from configurator import help_text, key_comments, read_args, wants_help
from data import DataLoader, atomic_write, read_jsonl, val_batches
from model import GPT, GPTConfig, flops_per_token, triton_available


# ----------------------------------------------------------------------------- the keys: the paper's 450M run
@dataclass(frozen=True)
class TrainConfig:
    """train.py's keys, one per line, its meaning in the comment (`python train.py --help` prints them). The model
    keys are GPTConfig's fields (set them with a configs/ file); their meanings are model.py's."""
    # I/O
    data_dir: str = "data/finewebedu10B"  # shards from prepare.py (*_train_*.bin, *_val_*.bin)
    out_dir: str = "out"  # ckpt.pt and log.jsonl
    init_from: str = "scratch"  # 'scratch', 'resume' (continue from <out_dir>/ckpt.pt) or 'auto' (resume if it exists)
    eval_only: bool = False  # evaluate <out_dir>/ckpt.pt on the whole validation shard and exit
    log_interval: int = 10  # steps between log lines
    eval_interval: int = 500  # steps between validation losses
    eval_tokens: int = 10_485_760  # validation tokens per evaluation during training
    ckpt_interval: int = 1000  # steps between checkpoints of <out_dir>/ckpt.pt (one is also written at the end)
    keep_every: int = 0  # also keep a weights-only <out_dir>/ckpt_<step>.pt every this many steps (0: none)
    wandb_log: bool = False  # also log to Weights & Biases (needs wandb installed)
    wandb_project: str = "exoformer"  # W&B project
    wandb_run_name: str = "run"  # W&B run name
    # batch: 262,144 tokens per step = 8 GPUs x 2 micro-steps x 8 sequences x 2048 tokens (the paper: 16 x 1).
    # 16 sequences of any paper variant keep 64-69 GiB of activations for backward (114 GiB at 1B; bench.py
    # --memory=True): 8 keep at most 35 (57), which fits 80 GB GPUs; gradient accumulation keeps the step.
    batch_size: int = 8  # sequences per process per micro-step (their length: the model's block_size)
    total_batch_size: int = 262_144  # tokens per optimiser step, reached by gradient accumulation
    max_steps: int = 38_147  # optimiser steps: 10B tokens at 262,144 tokens per step
    # optimisers: the learning rates, momenta, betas and decays of the authors' train.py
    muon_lr: float = 0.01  # peak learning rate of Muon (the weights of the linear layers inside the network)
    muon_momentum: float = 0.95  # reached after muon_momentum_steps, left again over the last ones
    muon_momentum_min: float = 0.85  # Muon momentum at the first and the last step
    muon_momentum_steps: int = 100  # steps of each momentum ramp
    muon_beta2: float = 0.95  # NorMuon second-moment decay
    muon_weight_decay: float = 0.1  # cautious weight decay, Muon only: p -= lr * wd * p where update * p >= 0
    adam_lr: float = 0.003  # peak learning rate of AdamW (embedding, lm_head, norms, biases, λ, the rest)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 1000  # linear learning-rate warmup steps
    cooldown_frac: float = 0.2  # fraction of the run at the end over which the learning rates decay linearly
    final_lr_frac: float = 0.1  # learning rates at the end of the decay, as a fraction of the peak
    grad_clip: float = 1.0  # global gradient-norm clip
    z_loss: float = 1e-5  # weight of mean(logsumexp(logits)²) in the loss
    activation_checkpointing: bool = False  # recompute each block in the backward pass: 8-12 MiB per layer, ~25% slower steps
    doc_mask: bool = True  # attention stays inside each document of a window (each <|endoftext|> opens one), as the authors trained
    # system
    device: str = None  # None: cuda if available, else cpu
    dtype: str = None  # None: bfloat16 autocast on cuda (fp32 master weights), float32 on cpu
    compile: bool = None  # None: torch.compile on cuda only
    dist_timeout: int = 900  # seconds a collective may wait for the other processes (a dead or hung rank, a slow checkpoint write)
    gpu_peak_flops: float = 989e12  # dense bf16 peak of one GPU (H100/H200), for MFU
    seed: int = 42  # seed of torch, numpy and random


DEFAULTS = asdict(TrainConfig())
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ALL_DEFAULTS = {**DEFAULTS, **{f.name: f.default for f in fields(GPTConfig)}}
# Meanings of the GPTConfig fields that model.py's GPTConfig has no comment for (a test checks that every key
# has exactly one meaning: when model.py gains a comment for one of these, its entry here goes)
MODEL_KEY_MEANINGS = dict(block_size="sequence length: the model's longest context, and the training windows'",
                          n_layer="transformer blocks (L)", n_head="attention heads (H); n_embd/H must be even",
                          n_embd="model width (C)")
POSITIVE = ("max_steps", "batch_size", "total_batch_size", "log_interval", "eval_interval", "ckpt_interval",
            "warmup_steps", "muon_momentum_steps", "dist_timeout")


def help_sections():
    """(title, defaults, meanings) of train.py's keys and of the model keys, for configurator.help_text."""
    model_file = sys.modules[GPTConfig.__module__].__file__
    model_defaults = {k: v for k, v in ALL_DEFAULTS.items() if k not in DEFAULTS}
    return [("training keys", DEFAULTS, key_comments(__file__, "TrainConfig")),
            ("model keys (GPTConfig; the configs/ files set them)", model_defaults,
             {**key_comments(model_file, "GPTConfig"), **MODEL_KEY_MEANINGS})]


def split_config(flat):
    """(TrainConfig, GPTConfig) of a flat {key: value} of both (what files and overrides set, logs record)."""
    return TrainConfig(**{k: v for k, v in flat.items() if k in DEFAULTS}), \
        GPTConfig(**{k: v for k, v in flat.items() if k in MODEL_KEYS})


# ----------------------------------------------------------------------------- Muon

# Polar Express coefficients (a, b, c) of the 5 iterations (Amsel et al., 2025, as the authors' train.py uses them)
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
POLAR_SAFETY = 1.02  # dividing by the Frobenius norm (>= the spectral one) puts the singular values in [0, 1];
POLAR_EPS = 1e-6  # 2% more keeps them there through bf16 rounding, and eps guards a zero matrix (both: the
#                   authors' train.py, after Amsel et al., 2025)
NORMUON_EPS = 1e-10  # ours: a row (or column) whose update is all zero is divided by this, not by 0


def polar_express(G):
    """Orthogonalise a stack of matrices (..., rows, cols) in bf16: U V^T of their SVD, approximately."""
    X = G.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * POLAR_SAFETY + POLAR_EPS)
    for a, b, c in POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """Muon for the weight matrices: Nesterov momentum (EMA form), Polar Express, NorMuon second
    moment, shape scaling, cautious weight decay. The matrices of one shape are updated as one stack
    (k, rows, cols), with foreach ops for the momentum: the same ops whatever k, so that a step of the 450M
    dyn_exo layout dispatches 779 aten ops, not 4,664 (one set per matrix: tiny kernels a GPU waits to launch).
    Under DDP each rank orthogonalises only its share of every stack and all-gathers the results; the cheap
    elementwise work runs on every rank, so parameters and optimiser state stay identical everywhere (and
    checkpointable from rank 0). The weight decay is lr · wd, as in the authors' train.py (modded-nanogpt
    scales its own by lr² instead)."""

    def __init__(self, params, lr, momentum, beta2, weight_decay, rank=0, world_size=1):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay))
        self.rank, self.world_size = rank, world_size

    def _orthogonalize(self, updates):
        """Polar Express of same-shaped matrices, as one stack (k, rows, cols), each rank doing its share."""
        share = math.ceil(len(updates) / self.world_size)
        mine = list(updates[self.rank * share:(self.rank + 1) * share])
        mine += [torch.zeros_like(updates[0])] * (share - len(mine))  # pad so all ranks gather equal sizes
        result = polar_express(torch.stack(mine))
        if self.world_size > 1:
            parts = [torch.empty_like(result) for _ in range(self.world_size)]
            dist.all_gather(parts, result)
            result = torch.cat(parts)[:len(updates)]
        return result

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for params in by_shape.values():
                self._step_stack(params, group)

    def _step_stack(self, params, group):
        """One step of same-shaped matrices; the state stays per matrix (the checkpoint format)."""
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        rows, cols = params[0].shape  # NorMuon: one second moment per row if rows >= cols, else per column
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["momentum"] = torch.zeros_like(p)
                state["second_moment"] = torch.zeros((rows, 1) if rows >= cols else (1, cols), device=p.device)
        grads, momenta = [p.grad for p in params], [s["momentum"] for s in states]
        torch._foreach_lerp_(momenta, grads, 1 - mu)
        u = self._orthogonalize(torch._foreach_lerp(grads, momenta, mu)).float()  # Nesterov
        v = torch.stack([s["second_moment"] for s in states])  # (k, rows, 1) or (k, 1, cols)
        v.lerp_(u.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - group["beta2"])
        normed = u * v.clamp_min(NORMUON_EPS).rsqrt()
        norm = lambda x: x.norm(dim=(-2, -1), keepdim=True)  # of each matrix
        normed *= norm(u) / norm(normed).clamp_min(NORMUON_EPS)  # keep each orthogonalised update's norm
        normed *= max(1.0, rows / cols) ** 0.5
        p = torch.stack(params)
        # cautious weight decay: only where the update already moves the weight towards zero
        p.sub_(lr * wd * (normed * p >= 0) * p)
        p.sub_(lr * normed)
        torch._foreach_copy_(params, p.unbind(0))
        torch._foreach_copy_([s["second_moment"] for s in states], v.unbind(0))


def muon_params(model):
    """The trained weights of the nn.Linear layers inside the network: every one but lm_head's."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head}
    return [p for p in model.parameters() if id(p) in linear and p.requires_grad]  # a shared tensor is listed once


def configure_optimizers(model, cfg, rank=0, world_size=1):
    """Muon for the weights of the nn.Linear layers inside the network (blocks, anchor_proj, dynamic MLPs):
    maps from one hidden vector to another, which is what Muon's orthogonalised update suits. AdamW for
    everything else: the embedding, lm_head (its output is the vocabulary, not a hidden vector), norm
    weights, biases, λ, and any parameter a fork adds outside nn.Linear, whatever its shape. A frozen
    parameter (requires_grad=False: anchor_frozen) is in neither."""
    muon = muon_params(model)
    adam = [p for p in model.parameters() if id(p) not in set(map(id, muon)) and p.requires_grad]
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return [Muon(muon, cfg.muon_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.muon_weight_decay, rank, world_size),
            torch.optim.AdamW(adam, lr=cfg.adam_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                              weight_decay=cfg.adam_weight_decay, **fused)]


def describe_optimizers(optimizers, model=None):
    """One line: how many tensors and parameters each optimiser updates, and which ones none does (frozen)."""
    def count(opt):
        params = [p for g in opt.param_groups for p in g["params"]]
        return f"{type(opt).__name__} {len(params)} tensors ({sum(p.numel() for p in params):,} parameters)"
    frozen = [(n, p.numel()) for n, p in model.named_parameters() if not p.requires_grad] if model else []
    return "optimisers: " + ", ".join(count(opt) for opt in optimizers) + "".join(
        f"; frozen at its random initialisation (no gradient, in no optimiser): {n} ({k:,} parameters)"
        for n, k in frozen)


def lr_multiplier(step, cfg):
    """Linear warmup, constant, then linear decay over the last cooldown_frac of the run to final_lr_frac."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_start = cfg.max_steps * (1 - cfg.cooldown_frac)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / (cfg.max_steps - decay_start)
    return 1.0 - (1.0 - cfg.final_lr_frac) * progress


def muon_momentum(step, cfg):
    """muon_momentum_min -> muon_momentum over the first muon_momentum_steps, and back over the last."""
    ramp = min(1.0, step / cfg.muon_momentum_steps, (cfg.max_steps - step) / cfg.muon_momentum_steps)
    return cfg.muon_momentum_min + (cfg.muon_momentum - cfg.muon_momentum_min) * ramp


def set_schedule(optimizers, step, cfg):
    """Both optimisers' learning rates (one multiplier) and Muon's momentum for this step: {muon_lr, adam_lr}."""
    muon, adam = optimizers
    mult = lr_multiplier(step, cfg)
    for g in muon.param_groups:
        g["lr"], g["momentum"] = cfg.muon_lr * mult, muon_momentum(step, cfg)
    for g in adam.param_groups:
        g["lr"] = cfg.adam_lr * mult
    return {"muon_lr": cfg.muon_lr * mult, "adam_lr": cfg.adam_lr * mult}


def optimizer_step(model, optimizers, grad_clip):
    """Clip the global gradient norm, step both optimisers, clear the gradients; return the norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grad_norm.item()


# ----------------------------------------------------------------------------- where the run runs

def attempt_store(world_size, timeout):
    """The process group's rendezvous keys, under a prefix of this torchrun attempt; None outside torchrun (then
    init_process_group's env:// as usual). torchrun keeps one store for all the restarts of --max-restarts, and a
    restarted worker could read the dead attempt's addresses and hang, or fail, connecting to them (gloo's
    "connectFullMesh failed ... Connection refused", seen here after a kill -9)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"train.py/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


@dataclass
class Env:
    """This process: its rank among world_size, its device, precision (autocast), whether it compiles, and whether
    it is in a process group (under torchrun, with one process too: nanoGPT's rule, and one GPU runs NCCL and DDP
    as eight do)."""
    rank: int
    world_size: int
    runtime: Runtime
    compile: bool
    distributed: bool = False

    @property
    def device(self):
        return self.runtime.device

    @property
    def master(self):
        return self.rank == 0

    @classmethod
    def setup(cls, cfg):
        """Join the process group under torchrun (one GPU per local rank); the device, dtype and compile choice."""
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        distributed = "RANK" in os.environ  # torchrun's
        if cfg.dtype not in (None, "float32", "bfloat16"):  # float16 would need a gradient scaler
            raise ValueError(f"dtype={cfg.dtype!r}: expected 'float32' or 'bfloat16'")
        runtime = Runtime.pick(cfg.device, cfg.dtype, quiet=rank > 0)
        if runtime.device == "cuda":
            runtime = replace(runtime, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        if runtime.device.startswith("cuda"):
            torch.cuda.set_device(runtime.device)
        use_compile = runtime.device.startswith("cuda") if cfg.compile is None else cfg.compile
        if not isinstance(use_compile, bool):
            raise ValueError(f"compile={cfg.compile!r}: expected True, False or None (auto)")
        if use_compile and runtime.device.startswith("cuda") and not triton_available():  # inductor's GPU kernels
            if rank == 0:
                print(f"note: no Triton for {torch.cuda.get_device_name()} (not installed, or a GPU older than sm70): "
                      f"compile=False, and document masks are dense SDPA masks", file=sys.stderr, flush=True)
            use_compile = False
        if distributed:
            cuda, timeout = runtime.device.startswith("cuda"), timedelta(seconds=cfg.dist_timeout)
            store = attempt_store(world_size, timeout)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                    device_id=torch.device(runtime.device) if cuda else None,
                                    **({} if store is None else dict(store=store, rank=rank, world_size=world_size)))
        return cls(rank, world_size, runtime, use_compile, distributed)

    def say(self, *args):
        if self.master:
            print(*args, flush=True)

    def teardown(self, run=None):
        """End the process group. DDP's reducer is freed first (run.train_model, its last reference, dropped), and
        every rank's gloo/NCCL work finishes, while the group still exists: a group destroyed from the reducer's
        deallocation at exit can deadlock."""
        if self.distributed:
            if run is not None:
                run.train_model = None
            dist.barrier()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- phase 1: the input, checked

def check_args(argv):
    """The configuration that argv gives a new run, checked as train.py checks it before running one process:
    keys, types, the model and the batch layout; no file is read but the config files. For sweep.py."""
    cfg, model_config = split_config({**ALL_DEFAULTS, **read_args(argv, ALL_DEFAULTS)})
    check_config(cfg, model_config, 1)
    return cfg, model_config


def check_config(cfg, model_config, world_size):
    """The keys' values, one line for the first that is wrong; returns the micro-steps per optimiser step."""
    if cfg.init_from not in ("scratch", "resume", "auto"):
        raise ValueError(f"init_from={cfg.init_from!r}: expected 'scratch', 'resume' or 'auto'")
    for key in POSITIVE:
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key}={getattr(cfg, key)}: expected a positive integer")
    if cfg.keep_every < 0:
        raise ValueError(f"keep_every={cfg.keep_every}: expected 0 (none) or a positive number of steps")
    micro = cfg.batch_size * model_config.block_size * world_size
    if cfg.total_batch_size % micro:
        raise ValueError(f"total_batch_size={cfg.total_batch_size}: expected a multiple of batch_size x "
                         f"block_size x processes = {micro}")
    return cfg.total_batch_size // micro


def read_resume_checkpoint(cfg, path):
    """The checkpoint this run starts from (loaded to the CPU: RNG states must stay CPU tensors), or None for a
    new run. auto: the one in out_dir if there is one; a file there that is not a resumable checkpoint is an
    error, never overwritten."""
    if cfg.eval_only:
        return load_checkpoint(path, ("model", "model_config", "step"))
    if cfg.init_from == "resume" or (cfg.init_from == "auto" and os.path.exists(path)):
        try:
            return load_checkpoint(path, RESUME)
        except ValueError as e:
            raise ValueError(f"{e}; a run resumes from train.py's own <out_dir>/ckpt.pt, not a weights-only "
                             f"copy") from None
    return None


def model_config_for(given, ckpt, path):
    """The model to build. Without a checkpoint: the configured one. With one (resume, eval_only): the
    checkpoint's (a field it lacks, added to GPTConfig later, takes its default); the model keys that
    config files or overrides set must agree with it."""
    if ckpt is None:
        return GPTConfig(**{k: v for k, v in {**ALL_DEFAULTS, **given}.items() if k in MODEL_KEYS})
    config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
    saved = asdict(config)
    conflict = [k for k in MODEL_KEYS if k in given and given[k] != saved[k]]
    if conflict:
        show = lambda d: ", ".join(f"{k}={d[k]!r}" for k in conflict)
        raise ValueError(f"{path}: its model has {show(saved)}, the configuration sets {show(given)} "
                         f"(leave the model keys out to take the checkpoint's)")
    return config


def configure(argv):
    """Everything about the input that can be wrong, checked before any work: the keys and their types, the
    process group, the checkpoint to start from, the model (the checkpoint's, when there is one), the batch
    layout. Returns (cfg, model_config, env, ckpt or None, micro-steps per step)."""
    given = read_args(argv, ALL_DEFAULTS)
    cfg, _ = split_config({**ALL_DEFAULTS, **{k: v for k, v in given.items() if k in DEFAULTS}})
    env = Env.setup(cfg)
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = read_resume_checkpoint(cfg, path)
    model_config = model_config_for(given, ckpt, path)
    if ckpt is not None and "doc_mask" not in given:  # resume, eval_only: as trained, unless overridden
        cfg = replace(cfg, doc_mask=trained_doc_mask(ckpt))
    return cfg, model_config, env, ckpt, check_config(cfg, model_config, env.world_size)


# ----------------------------------------------------------------------------- phase 2: the run, built

@dataclass
class Run:
    """Everything a training run holds: what it trains, with what, on what data, and how far it got."""
    cfg: TrainConfig
    model_config: GPTConfig
    env: Env
    accum: int  # micro-steps per optimiser step
    raw_model: GPT  # what is saved (never the compiled or DDP wrapper)
    model: nn.Module  # what evaluates: raw_model, compiled or not
    train_model: nn.Module  # what trains: model, in DDP when there are several processes
    optimizers: list
    loader: DataLoader
    step: int = 0
    train_loss: float = None  # of the last step
    pending_log: dict = None  # a stop at an evaluation step: its log entry, evaluated and logged on resume

    @property
    def ckpt_path(self):
        return os.path.join(self.cfg.out_dir, "ckpt.pt")

    def flat_config(self):
        """The whole configuration as one flat dict: what log.jsonl and checkpoints record."""
        return {**asdict(self.cfg), **asdict(self.model_config)}


def build(cfg, model_config, env, accum):
    """The data readers (every shard checked now, the val shard too), the model (seeded), its optimisers."""
    T, V, rank, world = model_config.block_size, model_config.vocab_size, env.rank, env.world_size
    # one window of total_batch_size tokens per step, split into micro-steps: the same tokens whatever the mix
    # of processes and accumulation (and at shard ends, too)
    loader = None if cfg.eval_only else DataLoader(cfg.data_dir, accum * cfg.batch_size, T, rank, world, V)
    next(val_batches(cfg.data_dir, cfg.batch_size, T, cfg.eval_tokens, rank, world, V), None)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw_model = GPT(model_config).to(env.device)
    raw_model.activation_checkpointing = cfg.activation_checkpointing
    model = torch.compile(raw_model) if env.compile else raw_model
    train_model = data_parallel(model, env) if env.distributed else model
    optimizers = configure_optimizers(raw_model, cfg, rank, world)
    return Run(cfg, model_config, env, accum, raw_model, model, train_model, optimizers, loader)


# DDP's gradient buckets. Compiled, DDP also splits the graph at bucket boundaries (dynamo's DDPOptimizer), so that
# each bucket's all-reduce overlaps the rest of backward: 25 MiB (the default) cuts the 450M models (1.7 GB of fp32
# gradients) into ~41 graphs and the 1B ones into ~67; 100 MiB gives 14 and 28 (about 2 layers each, counted
# with dist._compute_bucket_assignment_by_size), which keeps most fusion and still overlaps. Ours, not measured.
DDP_BUCKET_MB = 100


def data_parallel(model, env, bucket_mb=DDP_BUCKET_MB):
    """model in DDP. Gradients are views of the buckets (no second copy: 1.7 GB at 450M), and buffers are not
    broadcast before each forward: the only ones, RoPE's tables, are computed from the config on every rank."""
    cuda = env.device.startswith("cuda")
    # torch 2.13 names it forward_sync_buffers and deprecates broadcast_buffers; older ones know only the latter
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    return DDP(model, device_ids=[torch.device(env.device).index] if cuda else None, bucket_cap_mb=bucket_mb,
               gradient_as_bucket_view=True, **{"forward_sync_buffers" if new_name else "broadcast_buffers": False})


def restore(run, ckpt):
    """Continue from a checkpoint: the weights, and for training the optimisers, data position, RNG and step."""
    run.raw_model.load_state_dict(ckpt["model"])
    run.step = ckpt["step"]
    if run.cfg.eval_only:
        return
    for opt, state in zip(run.optimizers, ckpt["optimizers"]):
        opt.load_state_dict(state)
    run.loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"])
    run.pending_log = ckpt.get("pending_log")


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


# ----------------------------------------------------------------------------- phase 3: the loop

@torch.no_grad()
def evaluate(run, max_tokens):
    """Mean validation cross-entropy over a fixed slice of the val shard(s) (None: all of it), averaged over ranks."""
    cfg, env, T = run.cfg, run.env, run.model_config.block_size
    run.model.eval()
    total, n = torch.zeros((), device=env.device), torch.zeros((), device=env.device)
    for x, y in val_batches(cfg.data_dir, cfg.batch_size, T, max_tokens, env.rank, env.world_size,
                            run.model_config.vocab_size):
        with env.runtime.autocast():
            _, loss = run.model(x.to(env.device), y.to(env.device), doc_mask=cfg.doc_mask)
        total += loss.float()
        n += 1
    if env.distributed:
        for t in (total, n):
            dist.all_reduce(t)
    run.model.train()
    return (total / n).item()


def train_step(run):
    """One optimiser step over total_batch_size tokens (accumulated micro-steps, DDP all-reducing on the last):
    its log entry {step, train_loss, muon_lr, adam_lr, grad_norm}."""
    cfg, env = run.cfg, run.env
    entry = {"step": run.step + 1, **set_schedule(run.optimizers, run.step, cfg)}
    loss_sum = torch.zeros((), device=env.device)
    xs, ys = run.loader.next_batch()
    for micro, (x, y) in enumerate(zip(xs.split(cfg.batch_size), ys.split(cfg.batch_size))):
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        last = not env.distributed or micro == run.accum - 1
        with contextlib.nullcontext() if last else run.train_model.no_sync():
            with env.runtime.autocast():
                _, loss = run.train_model(x, y, z_loss=cfg.z_loss, doc_mask=cfg.doc_mask)
            (loss / run.accum).backward()
        loss_sum += loss.detach()
    if env.distributed:
        dist.all_reduce(loss_sum)
    entry["train_loss"] = run.train_loss = loss_sum.item() / (run.accum * env.world_size)
    stop_unless_finite(entry, "train_loss", run)
    entry["grad_norm"] = optimizer_step(run.raw_model, run.optimizers, cfg.grad_clip)
    stop_unless_finite(entry, "grad_norm", run)  # a finite loss with broken gradients (a miscompiled kernel, say)
    run.step += 1
    return entry


def stop_unless_finite(entry, key, run):
    """A non-finite loss or gradient norm stops the run before any checkpoint holds what it did to the weights."""
    if not math.isfinite(entry[key]):
        what = {"train_loss": "loss", "grad_norm": "gradient norm"}[key]
        raise SystemExit(f"train.py: error: non-finite {what} ({entry[key]}) at step {entry['step']}; the last good "
                         f"checkpoint, if any, is {run.ckpt_path}")


def due(step, interval, cfg):
    return step % interval == 0 or step == cfg.max_steps


def train(run, log, stop):
    """The loop: a step, then what is due after it: an evaluation, a log line, checkpoints, a stop."""
    cfg = run.cfg
    while run.step < cfg.max_steps:
        t0, epoch = time.perf_counter(), run.loader.epoch
        entry = train_step(run)
        log.time_step(time.perf_counter() - t0)
        # a signal on any rank: every rank stops after this step (the last one finishes as usual)
        stopping = run.step < cfg.max_steps and stop.agreed(run.env)
        if run.loader.epoch != epoch:  # this step's batch began the data again from the first shard
            entry["epoch"] = run.loader.epoch
            log.say(f"step {run.step}: end of the train data, wrapping around to its start: epoch "
                    f"{run.loader.epoch} begins")
        # stopping at an evaluation step: the evaluation is left to the resumed run, which logs this entry
        pending = stopping and run.step % cfg.eval_interval == 0
        if due(run.step, cfg.eval_interval, cfg) and not pending:
            entry["val_loss"] = evaluate(run, cfg.eval_tokens)
        if not pending and (due(run.step, cfg.log_interval, cfg) or "val_loss" in entry or "epoch" in entry):
            log.step(entry)
        if due(run.step, cfg.ckpt_interval, cfg) or stopping:
            save(run, pending_log=entry if pending else None)
        if cfg.keep_every and run.step % cfg.keep_every == 0:
            keep(run)
        if stopping:
            return stop.received or "a signal to another rank"
    return None


# ----------------------------------------------------------------------------- checkpoints

def save(run, pending_log=None):
    """The rolling resume checkpoint: rank 0 writes it; every rank learns whether that worked (a full disk stops
    the run with one line, the previous checkpoint intact: data.atomic_write)."""
    error = None
    if run.env.master:
        try:
            save_checkpoint(run.ckpt_path, {
                "model": run.raw_model.state_dict(), "model_config": asdict(run.model_config),
                "config": run.flat_config(), "step": run.step,
                "optimizers": [opt.state_dict() for opt in run.optimizers], "loader": run.loader.state_dict(),
                "rng": rng_state(), **({"pending_log": pending_log} if pending_log else {})})
        except OSError as e:
            error = e
    failed = torch.tensor(float(error is not None), device=run.env.device)
    if run.env.distributed:
        dist.broadcast(failed, 0)
    if failed.item():
        why = f"{error.strerror or error}" if error else "rank 0 could not write it"
        full = " (the disk is full)" if error and error.errno == errno.ENOSPC else ""
        raise SystemExit(f"train.py: error: step {run.step}: {run.ckpt_path}: {why}{full}; the previous "
                         f"checkpoint, if any, is intact, and --init_from=auto resumes from it")


def keep(run):
    """A weights-only checkpoint of this step beside the rolling one (checkpoint.weights_only): the history
    that analyze.py, eval.py and sample.py read as they are."""
    if run.env.master:
        path = os.path.join(run.cfg.out_dir, f"ckpt_{run.step:06d}.pt")
        save_checkpoint(path, weights_only({"model": run.raw_model.state_dict(), "config": run.flat_config(),
                                            "model_config": asdict(run.model_config), "step": run.step,
                                            "source": f"train.py, step {run.step} of {run.cfg.out_dir}"}))


def disk_plan(run):
    """One line: what the checkpoints will take on disk, and what the disk has free."""
    model, cfg = run.raw_model, run.cfg
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    muon = sum(p.numel() for p in muon_params(model))
    adam = sum(p.numel() for p in model.parameters() if p.requires_grad) - muon
    resume = weights + 4 * muon + 8 * adam  # + Muon's momentum, AdamW's two moments (fp32)
    kept = (cfg.max_steps // cfg.keep_every - run.step // cfg.keep_every) if cfg.keep_every else 0
    os.makedirs(cfg.out_dir, exist_ok=True)
    stat = os.statvfs(cfg.out_dir)
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    return (f"checkpoints: {run.ckpt_path} ~{gb(resume)}, every {cfg.ckpt_interval} steps" +
            (f"; {kept} weights-only ckpt_<step>.pt of ~{gb(weights)} (every {cfg.keep_every} steps): "
             f"{gb(kept * weights)} more" if cfg.keep_every else "") +
            f"; {gb(stat.f_bavail * stat.f_frsize)} free there")


# ----------------------------------------------------------------------------- the log

class Log:
    """What the run says: lines on rank 0's stdout, the same as JSON lines in <out_dir>/log.jsonl, and W&B."""

    def __init__(self, run):
        self.run, self.env, self.times, self.file, self.wandb = run, run.env, [], None, None
        self.flops_per_step = flops_per_token(run.raw_model, run.model_config.block_size) * run.cfg.total_batch_size
        if not self.env.master:
            return
        cfg, path = run.cfg, os.path.join(run.cfg.out_dir, "log.jsonl")
        os.makedirs(cfg.out_dir, exist_ok=True)
        # a resumed run's log reads as if it had never stopped: drop what came after the checkpoint
        kept = [e for e in read_jsonl(path) if e["step"] <= run.step] if run.step > 0 and os.path.exists(path) else []
        with atomic_write(path, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in kept)
            f.write(json.dumps({"step": run.step, "config": run.flat_config()}) + "\n")  # every (re)start's config
        self.file = open(path, "a")
        if cfg.wandb_log:
            try:
                import wandb
            except ImportError:
                raise SystemExit("train.py: error: wandb_log=True but wandb is not installed (pip install wandb)")
            self.wandb = wandb
            wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=run.flat_config())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()

    def say(self, *args):
        self.env.say(*args)

    def record(self, entry):
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
            if self.wandb is not None:
                self.wandb.log(entry, step=entry["step"])

    def time_step(self, seconds):
        self.times.append(seconds)

    def step(self, entry):
        """Print and record a step's entry, with the mean step time of the last log_interval steps."""
        cfg, run = self.run.cfg, self.run
        dt = step_seconds(self.times, cfg.log_interval)
        entry.update(step_ms=1000 * dt, tok_per_s=cfg.total_batch_size / dt)
        mfu = ""
        if self.env.device.startswith("cuda"):
            entry["mfu"] = self.flops_per_step / dt / self.env.world_size / cfg.gpu_peak_flops
            mfu = f" | mfu {100 * entry['mfu']:.1f}%"
        val = f" | val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
        self.say(f"step {run.step}/{cfg.max_steps} | loss {entry['train_loss']:.4f}{val} | lr {entry['muon_lr']:.2e} "
                 f"(adam {entry['adam_lr']:.2e}) | grad norm {entry['grad_norm']:.3f} | {1000 * dt:.0f} ms | "
                 f"{entry['tok_per_s']:,.0f} tok/s{mfu} | eta {dt * (cfg.max_steps - run.step) / 60:.1f} min")
        self.record(entry)

    def start(self):
        """The start-up lines, and the validation loss the run starts from (or the one a stop left to do)."""
        run, cfg = self.run, self.run.cfg
        changed = {k: v for k, v in run.flat_config().items() if v != ALL_DEFAULTS[k]}
        self.say("config, where it differs from the defaults (log.jsonl has all of it): " +
                 (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "none"))
        self.say(describe_optimizers(run.optimizers, run.raw_model))
        if run.step:
            self.say(f"resuming from {run.ckpt_path} at step {run.step}")
        self.say(f"{run.raw_model.num_params():,} parameters, {self.env.world_size} process(es) x {run.accum} "
                 f"micro-step(s) x {cfg.batch_size} x {run.model_config.block_size} tokens, {self.env.device}, "
                 f"compile={self.env.compile}" + (f", {dist.get_backend()} process group" if self.env.distributed
                                                   else ""))
        if self.env.device.startswith("cuda"):
            self.say(f"mfu: {self.flops_per_step / cfg.total_batch_size:.3g} FLOPs per token (6 per matmul weight, "
                     f"causal attention: half of 12·L·C·T; model.flops_per_token) against gpu_peak_flops="
                     f"{cfg.gpu_peak_flops:.3g}; step times leave out each start's first step (compilation)")
        # the loader wraps around at the end of the data: say up front how often the run will see it
        planned, available = cfg.max_steps * cfg.total_batch_size, run.loader.tokens_per_epoch
        self.say(f"data: {cfg.max_steps:,} steps x {cfg.total_batch_size:,} tokens = {planned:,} tokens planned; "
                 f"{cfg.data_dir} has {available:,} usable train tokens: {planned / available:.2f} epochs"
                 + (" (the data repeats)" if planned > available else ""))
        if self.env.master:
            self.say(disk_plan(run))
        if run.step == 0:
            entry = {"step": 0, "val_loss": evaluate(run, cfg.eval_tokens)}
            self.say(f"step 0: val loss {entry['val_loss']:.4f}")
            self.record(entry)
        elif run.pending_log:  # stopped at an evaluation step: its evaluation, then its log entry
            entry = {**run.pending_log, "val_loss": evaluate(run, cfg.eval_tokens)}
            self.say(f"step {run.step}: val loss {entry['val_loss']:.4f} (the evaluation left by the stop)")
            self.record(entry)


def step_seconds(times, n):
    """Mean time of the last n steps of times (this process's, in order). The first is left out, unless it is all
    there is: it holds torch.compile's compilation (and the allocator's warm-up), which is not a step's cost."""
    window = (times[1:] or times)[-n:]
    return sum(window) / len(window)


# ----------------------------------------------------------------------------- stopping on a signal

PREEMPTED = 75  # exit status of a run stopped by a signal after its checkpoint (sysexits' EX_TEMPFAIL: try again)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # schedulers' preemption, Ctrl-C, SLURM's --signal


def tell(message):
    """One line to stderr in one write: print() writes the text and its newline separately, and the lines of
    ranks sharing one stderr (torchrun) then run into each other."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


class StopSignals:
    """While active, SIGTERM, SIGINT and SIGUSR1 ask the run to stop at the next step boundary instead of killing
    it; the previous handlers come back on exit. A signal during the checkpoint write only says it is noted."""

    def __init__(self):
        self.received = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        first, self.received = self.received is None, self.received or signal.Signals(signum).name
        tell(f"train.py: {signal.Signals(signum).name}: " + ("stopping after this step, with a checkpoint" if first
             else f"already stopping ({self.received})"))

    def agreed(self, env):
        """Whether any rank received a signal: the same answer on every rank, so all stop after the same step."""
        if not env.distributed:
            return self.received is not None
        flag = torch.tensor(float(self.received is not None), device=env.device)
        dist.all_reduce(flag)
        return flag.item() > 0


# ----------------------------------------------------------------------------- main

COLLECTIVE_ERRORS = ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset")  # their messages


def collective_failure(e, world_size):
    """The first line of e, without gloo's source location, when it is a failed collective; else None."""
    text = str(e).strip()
    if world_size == 1 or not (isinstance(e, dist.DistError) or any(w in text for w in COLLECTIVE_ERRORS)):
        return None
    return re.sub(r"^\[[^]]*\]\s*", "", text.splitlines()[0]) if text else type(e).__name__

def main(argv):
    """configure, build, restore, the loop: returns the last train loss (eval_only: the validation loss)."""
    if wants_help(argv):
        print(help_text(__doc__, help_sections()))
        return None
    try:
        cfg, model_config, env, ckpt, accum = configure(argv)
        if ckpt is not None and not cfg.eval_only and ckpt["step"] >= cfg.max_steps:
            env.say(f"{os.path.join(cfg.out_dir, 'ckpt.pt')}: this run is finished (step {ckpt['step']} of "
                    f"max_steps={cfg.max_steps}); nothing to do")
            env.teardown()
            return None
        run = build(cfg, model_config, env, accum)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"train.py: error: {e}")
    if ckpt is not None:
        restore(run, ckpt)
    if cfg.eval_only:
        val_loss = evaluate(run, None)
        env.say(f"step {run.step}: val loss {val_loss:.4f} on the whole validation set")
        env.teardown(run)
        return val_loss
    with StopSignals() as stop:  # until the very end: a second signal during the teardown is only noted
        try:
            with Log(run) as log:
                log.start()
                stopped_by = train(run, log, stop)
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (or its subclass DistError) when a peer is gone
            why = collective_failure(e, env.world_size)
            if why is None:
                raise
            sys.exit(f"train.py: error: rank {env.rank}: a collective failed ({why}): another process died or "
                     f"stopped answering (dist_timeout={cfg.dist_timeout} s); --init_from=auto resumes from "
                     f"{run.ckpt_path}")
        if stopped_by:
            tell(f"train.py: rank {env.rank}: stopped after step {run.step} ({stopped_by}); {run.ckpt_path} holds "
                 f"it: the same command with --init_from=auto continues the run (exit status {PREEMPTED})")
        env.teardown(run)
    if stopped_by:
        sys.exit(PREEMPTED)
    return run.train_loss


if __name__ == "__main__":
    main(sys.argv[1:])
