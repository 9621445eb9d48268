"""
Train a model of any variant with the paper's recipe, in one process or under torchrun:

    python train.py configs/dyn_exo.py configs/tiny.py                     # CPU: a tiny model, a short run
    python train.py configs/dyn_exo.py                                     # 1 GPU (accumulates to 256K tokens)
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py                # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py --init_from=auto     # starts, or continues, a run

The recipe (the paper's training setup, with the authors' train.py's values), as the loop below runs it:
    a step         the next total_batch_size tokens of the shards (262,144: 128 windows of 2048), in order
    micro-steps    batch_size windows per process at a time: forward (z-loss; attention kept inside each
                   document; bf16 autocast on a GPU), backward; gradients summed, averaged over the processes
    the update     gradient norm clipped to 1; Muon for the weight matrices inside the network, AdamW for the
                   rest (optim.py), both at one learning-rate multiplier
    the schedule   linear warmup, constant, then a linear decay over the last 20% of the steps to a tenth;
                   Muon's momentum from 0.85 to 0.95 over the first steps, and back over the last
    evaluation     the validation loss at step 0, every eval_interval steps and at the end
    checkpoints    every ckpt_interval steps and at the end, resumed bit for bit (checkpoint.py)
parallel.py joins the processes (DDP) and stops them together; runlog.py writes what the run says.

Config files are plain Python assignments (`n_layer = 4`) applied in the order given, a later one
overriding an earlier one (a variant file, then configs/tiny.py to shrink it), then the --key=value
overrides; every key must be one of the keys below. With --init_from=resume or --eval_only the model is
the checkpoint's: model keys may be left out, and any that is given must agree with the checkpoint. So do the
other keys, but those that change only how, when or where a run goes (EXECUTION), such as max_steps.
SIGTERM, SIGINT or SIGUSR1 stop a run after its current step, with a checkpoint, and exit with status 75.
"""
import importlib.util
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import torch.nn as nn

from engine import checkpoint, dryrun, parallel, sharding
from engine.checkpoint import RNG, branch_path, checkpoint_path, is_branch, kept_path, load_resumable, save_weights
from engine.configurator import help_text, key_comments, read_args, wants_help
from engine.data import DataLoader, check_data, ensure_corpus, val_batches
from model import GPT, GPTConfig
from optim import Muon, Optimizers, clip_gradients, clip_norm, muon_params
from engine.parallel import PREEMPTED, STOP_SIGNALS, RunFailed, StopSignals, Worker
from engine.runlog import Log


# ----------------------------------------------------------------------------- the keys: the paper's 450M run
@dataclass(frozen=True)
class TrainConfig:
    """train.py's keys, one per line, its meaning in the comment (`python train.py --help` prints them). The model
    keys are GPTConfig's fields (set them with a configs/ file); their meanings are model.py's."""
    # I/O
    data_dir: str = "data/finewebedu10B"  # shards from prepare.py (*_train_*.bin, *_val_*.bin); one named stdlib
                                          # is built from this Python's library when missing
    verify_data: bool = False  # also check every shard's sha256 against data_dir's manifest.json at start (reads
                               # every byte; the sizes are checked at every start)
    out_dir: str = "out"  # ckpt.pt and log.jsonl
    init_from: str = "scratch"  # 'scratch', 'resume' (continue from <out_dir>/ckpt.pt), 'auto' (resume if it
                                # exists), or a ckpt_<step>_full.pt to branch from
    eval_only: bool = False  # evaluate <out_dir>/ckpt.pt on the whole validation shard and exit
    log_interval: int = 10  # steps between log lines
    eval_interval: int = 500  # steps between validation losses
    eval_tokens: int = 10_485_760  # validation tokens per evaluation during training
    ckpt_interval: int = 1000  # steps between checkpoints of <out_dir>/ckpt.pt (one is also written at the end)
    keep_every: int = 0  # also keep a weights-only <out_dir>/ckpt_<step>.pt every this many steps (0: none)
    keep_full: tuple = ()  # steps at which to also keep a resumable <out_dir>/ckpt_<step>_full.pt, a branch point
    wandb_log: bool = False  # also log to Weights & Biases (needs wandb installed)
    wandb_project: str = "exoformer"  # W&B project
    wandb_run_name: str = "run"  # W&B run name
    # batch: 262,144 tokens per step = 8 GPUs x 2 micro-steps x 8 sequences x 2048 tokens (the paper: 16 x 1).
    # 16 sequences of a 450M variant keep 64-69 GiB of activations for backward: 8 fit an 80 GB GPU (docs/MEMORY.md,
    # bench.py --memory=True); at 1B 7 fit, and the 1B commands set batch_size=4. Accumulation keeps the step.
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
    activation_checkpointing: bool = False  # recompute each block in the backward pass: 8-12 MiB per layer, ~25%
                                            # slower steps
    doc_mask: bool = True  # attention stays inside each document of a window (each <|endoftext|> opens one), as
                           # the authors trained
    fsdp: bool = False  # under torchrun: weights, gradients, optimiser states sharded over the processes (FSDP2),
                        # not DDP
    # the dry run: the launch traced in one process on a CPU, nothing trained (dryrun.py)
    dry_run: bool = False  # print rank 0's peak GPU memory by kind, whether it fits, and every error the launch
                           # would hit; exit status 1 if it does not fit or would fail
    dry_world_size: int = 0  # processes of the launch dry-run (0: torchrun's WORLD_SIZE, or 1)
    gpu_memory: float = 80.0  # GB of memory of each GPU, for the dry run (80: an H100's, the documented commands' size)
    # system
    device: str = None  # None: cuda if available, else cpu
    dtype: str = None  # None: bfloat16 autocast on cuda (fp32 master weights), float32 on cpu
    compile: bool = None  # None: torch.compile on cuda only
    dist_timeout: int = 900  # seconds a collective may wait for the other processes (a dead or hung rank, a slow
                             # checkpoint write)
    gpu_peak_flops: float = 989e12  # dense bf16 peak of one GPU (H100/H200), for MFU
    seed: int = 42  # seed of torch, numpy and random

    def check(self, model_config, world_size):
        """A one-line error for the first key whose value is wrong, with this model and number of processes."""
        for key in POSITIVE:
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: expected a positive integer")
        if self.keep_every < 0:
            raise ValueError(f"keep_every={self.keep_every}: expected 0 (none) or a positive number of steps")
        if not all(type(s) is int and 0 < s < self.max_steps for s in self.keep_full):
            raise ValueError(f"keep_full={self.keep_full}: expected steps between 1 and max_steps-1="
                             f"{self.max_steps - 1}")
        micro = self.batch_size * model_config.block_size * world_size
        if self.total_batch_size % micro:
            raise ValueError(f"total_batch_size={self.total_batch_size}: expected a multiple of batch_size x "
                             f"block_size x processes = {micro}")
        if self.wandb_log and importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb_log=True: wandb is not installed (pip install wandb)")

    def branch_error(self, parent, step):
        """Why a run of this configuration continuing one of `parent` (another max_steps) from its step `step` would
        not end bit for bit as one of this from scratch: schedule() differs before step. None if it would not."""
        t = schedule_differs(parent, self, step)
        return None if t is None else (f"the schedules of max_steps={parent.max_steps} and max_steps={self.max_steps} "
                                       f"differ from step {t}: a branch point s needs the same schedule at every step "
                                       f"before s (here s <= {t})")


POSITIVE = ("max_steps", "batch_size", "total_batch_size", "log_interval", "eval_interval", "ckpt_interval",
            "warmup_steps", "muon_momentum_steps", "dist_timeout")
DEFAULTS = asdict(TrainConfig())
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ALL_DEFAULTS = {**DEFAULTS, **{f.name: f.default for f in fields(GPTConfig)}}
# The keys in two kinds. Execution keys change how, when, where or how long a run goes, never what a step computes
# (batch_size: at the same total_batch_size; data_dir: the same corpus, moved): a resume may change them. Every other
# key (a fork's new one too) and every model key is a recipe key: a resume takes it from the checkpoint, unchanged.
EXECUTION = {"data_dir", "verify_data", "out_dir", "init_from", "eval_only", "log_interval", "eval_interval",
             "eval_tokens", "ckpt_interval", "keep_every", "keep_full", "wandb_log", "wandb_project", "wandb_run_name",
             "batch_size", "max_steps", "activation_checkpointing", "fsdp", "device", "compile", "dist_timeout",
             "gpu_peak_flops", "dry_run", "dry_world_size", "gpu_memory"}
# Execution keys that change no result nor logged value, bit for bit: a branch's own, and no variant's in sweep.py
BRANCH_FREE = EXECUTION - {"data_dir", "eval_tokens", "batch_size", "activation_checkpointing", "fsdp", "device",
                           "compile"}
PER_START = {"out_dir", "init_from", "eval_only", "fsdp"}  # each start's own, as its processes: never a checkpoint's


def split_config(flat):
    """(TrainConfig, GPTConfig) of a flat {key: value} of both, as logs and checkpoints record it (a key it lacks at
    its default, one they do not know left out)."""
    return TrainConfig(**{k: tuple(v) if isinstance(DEFAULTS[k], tuple) else v for k, v in flat.items()
                          if k in DEFAULTS}), GPTConfig(**{k: v for k, v in flat.items() if k in MODEL_KEYS})


def given_model_config(given):
    """The GPTConfig of the given keys ({key: value}), each one left out at its default."""
    return GPTConfig(**{k: v for k, v in {**ALL_DEFAULTS, **given}.items() if k in MODEL_KEYS})


def help_sections():
    """(title, defaults, meanings) of train.py's keys and of the model keys, for configurator.help_text."""
    return [("training keys", DEFAULTS, key_comments(__file__, "TrainConfig")),
            ("model keys (GPTConfig; the configs/ files set them)", {k: ALL_DEFAULTS[k] for k in MODEL_KEYS},
             key_comments(sys.modules[GPTConfig.__module__].__file__, "GPTConfig"))]


# ----------------------------------------------------------------------------- the optimisers and their schedule

def build_optimizers(model, cfg):
    """The recipe's optimisers, by name (schedule() gives each its <name>_lr): Muon for the weights of the nn.Linear
    layers inside the network, maps from one hidden vector to another, which its orthogonalised update suits; AdamW
    for every other trained parameter (embedding, lm_head, norms, biases, λ, a fork's); a frozen one in neither."""
    muon = muon_params(model)
    adam = [p for p in model.parameters() if id(p) not in set(map(id, muon)) and p.requires_grad]
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    # where Muon's steps 2 and 3 find whole matrices: at their owners (FSDP), or on every rank, a share each (DDP)
    exchange = sharding.Exchange if any(map(sharding.is_sharded, muon)) else parallel.Exchange
    return Optimizers(muon=Muon(muon, cfg.muon_lr, cfg.muon_momentum, cfg.muon_beta2, cfg.muon_weight_decay, exchange),
                      adam=torch.optim.AdamW(adam, lr=cfg.adam_lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                             weight_decay=cfg.adam_weight_decay, **fused))


def lr_multiplier(step, cfg):
    """Linear warmup, constant, then linear decay over the last cooldown_frac of the run to final_lr_frac."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_start = cfg.max_steps * (1 - cfg.cooldown_frac)
    progress = max(0.0, (step - decay_start) / (cfg.max_steps - decay_start))  # 0 until the decay starts
    return 1.0 - (1.0 - cfg.final_lr_frac) * progress


def muon_momentum(step, cfg):
    """muon_momentum_min -> muon_momentum over the first muon_momentum_steps, and back over the last."""
    ramp = min(1.0, step / cfg.muon_momentum_steps, (cfg.max_steps - step) / cfg.muon_momentum_steps)
    return cfg.muon_momentum_min + (cfg.muon_momentum - cfg.muon_momentum_min) * ramp


def schedule(step, cfg):
    """Every quantity the recipe schedules at a step, by name: each optimiser's learning rate (<name>_lr: its peak from
    the config times one multiplier), Muon's momentum, and whatever a fork schedules (a loss weight the loop reads
    here, say). Optimizers.set_schedule applies it; whether a branch or a resume is exact is read from it alone."""
    mult = lr_multiplier(step, cfg)
    return {"muon_lr": cfg.muon_lr * mult, "adam_lr": cfg.adam_lr * mult, "muon_momentum": muon_momentum(step, cfg)}


def schedule_differs(a, b, steps):
    """The first step before `steps` at which configurations a and b schedule anything differently; None if none."""
    return next((t for t in range(steps) if schedule(t, a) != schedule(t, b)), None)


# ----------------------------------------------------------------------------- main: configure, build, restore, loop

def main(argv):
    """Train as argv says: configure, build, restore, then the loop (or one evaluation). Returns the last train loss
    (eval_only: the validation loss); a one-line error exits with status 1, a stop by a signal with 75."""
    if wants_help(argv):
        print(help_text(__doc__, help_sections()))
        return None
    with StopSignals() as stop:  # until the very end: a signal during the teardown is only noted
        try:
            given = read_args(argv, ALL_DEFAULTS)
            cfg = TrainConfig(**{k: v for k, v in given.items() if k in DEFAULTS})
        except (ValueError, OSError) as e:
            sys.exit(f"train.py: error: {e}")
        if cfg.dry_run:  # one process, whatever the launch, in a fake process group; no corpus is read
            if not dry_run(given, cfg):
                sys.exit("train.py: dry run: the launch would not fit, or would fail (above)")
            return None
        try:
            ensure_corpus(cfg.data_dir)  # the built-in corpus (a data_dir named stdlib), before any thread or GPU
            worker = parallel.join(cfg)
        except (ValueError, OSError) as e:
            sys.exit(f"train.py: error: {e}")
        with worker:  # the process group ends after the run, once nothing holds DDP any more
            try:
                cfg, model_config, ckpt, path = configure(given, cfg, worker)
                if ckpt is not None and not cfg.eval_only and ckpt["step"] >= cfg.max_steps:
                    worker.say(f"{path}: this run is finished (step {ckpt['step']} of max_steps={cfg.max_steps}); "
                               f"nothing to do")
                    return None
                run = build(cfg, model_config, worker)
                if ckpt is not None:
                    restore(run, ckpt, path)
            except (ValueError, OSError) as e:
                sys.exit(f"train.py: error: {e}")
            if cfg.eval_only:
                result, stopped_by = evaluate(run, None), None
                worker.say(f"step {run.step}: val loss {result:.4f} on the whole validation set")
            else:
                try:
                    with parallel.collectives_fail_in_one_line(worker, cfg.dist_timeout, run.ckpt_path), \
                            Log(run, ALL_DEFAULTS) as log:
                        stopped_by = train(run, log, stop)
                except RunFailed as e:
                    sys.exit(f"train.py: error: {e}")
                result = run.train_loss
            del run  # before the process group ends with this block: no DDP wrapper may outlive it (parallel.Worker)
    if stopped_by:
        sys.exit(PREEMPTED)
    return result


def configure(given, cfg, worker):
    """Everything about the input that can be wrong, checked before any work: the checkpoint to start from, the keys
    and their values. Returns (cfg, model_config, the checkpoint, its path)."""
    ckpt, path = load_resumable(cfg.out_dir, cfg.init_from, cfg.eval_only, cfg.fsdp)  # either kind: DDP <-> FSDP
    if ckpt is None:
        model_config = given_model_config(given)
    else:  # each key left out is the checkpoint's, but PER_START's (and a branch's BRANCH_FREE keys: its own)
        model_config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
        branch = is_branch(path, cfg.out_dir) and cfg.init_from != "auto"  # auto: out_dir's own, maybe a kept one
        changeable, why = ((BRANCH_FREE, "a branch changes max_steps only") if branch else (set(DEFAULTS), "the "
                           "model is the checkpoint's") if cfg.eval_only else (EXECUTION, "a run continues with the "
                                                                                "recipe it was saved with"))
        saved, flat = checkpoint.continued_keys(ckpt, given, path, ALL_DEFAULTS, changeable, why,
                                                PER_START | (BRANCH_FREE if branch else set()))
        cfg, parent = split_config(flat)[0], split_config(saved)[0]
        error = cfg.branch_error(parent, ckpt["step"]) if branch else None  # Hagele et al., 2024: exact or refused
        if error:
            raise ValueError(f"{path}: cannot branch from it: {error}")
        if not (branch or cfg.eval_only) and cfg.max_steps != parent.max_steps:
            t = schedule_differs(parent, cfg, max(cfg.max_steps, parent.max_steps))
            worker.say(f"max_steps={cfg.max_steps}, the run's was {parent.max_steps}: the two schedules "
                       + ("agree at every step" if t is None else f"differ from step {t} on"))
    cfg.check(model_config, worker.world_size)
    return cfg, model_config, ckpt, path


@dataclass
class Run:
    """What a training run holds: its keys, the model in its three roles, the optimisers, the data, how far it got."""
    cfg: TrainConfig
    worker: Worker  # this process: rank, device, precision
    accum: int  # micro-steps per optimiser step
    model: GPT  # what is saved (never the compiled or DDP wrapper)
    eval_model: nn.Module  # what evaluates: model, compiled or not
    train_model: nn.Module  # what trains: eval_model, in DDP when there are several processes
    optimizers: Optimizers  # by name: muon, adam
    loader: DataLoader  # the train data and its position (None for eval_only)
    parts: dict  # {name: object with state_dict() and load_state_dict()}: model, optimizers, loader, rng, ...
    step: int = 0
    train_loss: float = None  # of the last step
    pending_log: dict = None  # a stop at an evaluation step: its log entry, evaluated and logged on resume
    started_from: str = None  # the checkpoint it (re)started from: its log begins with that run's, up to step

    @property
    def ckpt_path(self):
        return checkpoint_path(self.cfg.out_dir, self.cfg.fsdp)

    def flat_config(self):
        """The whole configuration as one flat dict: what log.jsonl and checkpoints record."""
        return {**asdict(self.cfg), **asdict(self.model.config)}


def build(cfg, model_config, worker):
    """The data readers (every shard checked now, the val shard too), the model (seeded), its optimisers, and the
    resumable parts: what a checkpoint saves, by name (a fork's own part is registered here)."""
    T, V, rank, world = model_config.block_size, model_config.vocab_size, worker.rank, worker.world_size
    unlisted = check_data(cfg.data_dir, hashes=cfg.verify_data)  # against its manifest: sizes; sha256 if asked
    if unlisted and cfg.verify_data:
        worker.say(f"note: {cfg.data_dir}: {len(unlisted)} shard(s) not in a manifest.json, not verified "
                   f"({unlisted[0]}{', ...' * (len(unlisted) > 1)})")
    accum = cfg.total_batch_size // (cfg.batch_size * T * world)  # micro-steps per step (check: a whole number)
    # one window of total_batch_size tokens per step, split into micro-steps: the same tokens whatever the mix
    # of processes and accumulation (and at shard ends, too)
    loader = None if cfg.eval_only else DataLoader(cfg.data_dir, accum * cfg.batch_size, T, rank, world, V)
    next(val_batches(cfg.data_dir, cfg.batch_size, T, cfg.eval_tokens, rank, world, V), None)
    model, eval_model, train_model, optimizers = build_model(cfg, model_config, worker)
    parts = {"model": model, "optimizers": optimizers, "loader": loader, "rng": RNG()}
    return Run(cfg, worker, accum, model, eval_model, train_model, optimizers, loader, parts)


def build_model(cfg, model_config, worker, storage=None):
    """The model (seeded), in its three roles, and its optimisers: (model, eval_model, train_model, optimizers). It is
    built on the meta device and sharded there (FSDP), then each process gives storage on its device to what it holds
    (its shards, or its replica) and initialises it, one whole parameter at a time, to the values GPT(config) gives
    (GPT.init_weights): no process holds the whole model in host memory. storage: the context the tensors are made
    in instead (the dry run's FakeTensorMode), with no values."""
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(cfg.seed)
    with torch.device("meta"):
        model = GPT(model_config)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.fsdp:  # DDP or FSDP: sharded in place, compiled per block
        model = sharding.fully_shard_model(model, worker)
    if storage is None:
        model.to_empty(device=worker.device)
        model.init_weights(sharding.write_part)
    else:  # fake tensors hold no values
        with storage:
            model.to_empty(device=worker.device)
    if cfg.fsdp:
        eval_model = train_model = model
    else:
        eval_model = torch.compile(model) if worker.compile else model
        train_model = parallel.data_parallel(eval_model, worker)
    optimizers = build_optimizers(model, cfg)
    optimizers.check_params(model)  # before any step: each trained parameter in exactly one optimiser
    if cfg.fsdp:  # before any step: each optimiser's state must fit the sharded checkpoint
        sharding.check_optimizers(model, optimizers)
    return model, eval_model, train_model, optimizers


def restore(run, ckpt, path):
    """Every resumable part (eval_only: the weights) from either kind of checkpoint, into either kind of model."""
    training = not run.cfg.eval_only
    run.pending_log = checkpoint.restore(ckpt, run.parts if training else {"model": run.model}, path, training)
    run.step, run.started_from = ckpt["step"], path


# ----------------------------------------------------------------------------- the loop

def train(run, log, stop):
    """The loop, from the checkpoint's step (or 0) to max_steps. Returns what stopped it early (a signal), or None."""
    cfg, worker = run.cfg, run.worker
    if run.step == 0 or run.pending_log:  # the loss the run starts from, or the evaluation a stop left to do
        log.write(log_entry(run, run.pending_log or {}, evaluating=True))
    while run.step < cfg.max_steps:
        # one optimiser step: forward and backward over the micro-batches, the gradients summed, then clip and step
        t0, epoch = time.perf_counter(), run.loader.epoch
        measured = run.optimizers.set_schedule(schedule(run.step, cfg))  # the learning rates: <name>_lr
        loss_sum = accumulate(run, micro_batches(run))
        measured["train_loss"] = run.train_loss = worker.sum(loss_sum).item() / (run.accum * worker.world_size)
        measured["grad_norm"] = clip_gradients(run.model, cfg.grad_clip)  # the global norm, before clipping it
        stop_unless_finite(run, measured)  # before the step: no checkpoint may hold what it would do
        update(run)
        run.step += 1
        log.times.append(time.perf_counter() - t0)
        # what is due after the step: an evaluation, a log line, checkpoints, a stop
        measured.update(log.timing())
        stopping = run.step < cfg.max_steps and stop.agreed(worker)  # a signal to any rank: all stop after this step
        if run.loader.epoch != epoch:  # this step's batch began the data again from the first shard
            measured["epoch"] = run.loader.epoch
        evaluating = due(run.step, cfg.eval_interval, cfg)
        pending = stopping and run.step % cfg.eval_interval == 0  # that evaluation is left to the resumed run
        if not pending and (due(run.step, cfg.log_interval, cfg) or evaluating or "epoch" in measured):
            log.write(log_entry(run, measured, evaluating))
        for path in [run.ckpt_path] * (due(run.step, cfg.ckpt_interval, cfg) or stopping) + \
                [branch_path(cfg.out_dir, run.step, cfg.fsdp)] * (run.step in cfg.keep_full):  # a branch point
            save(run, path, pending_log={"step": run.step, **measured} if pending else None)
        if cfg.keep_every and run.step % cfg.keep_every == 0:  # weights only: the history analyze.py reads
            save_weights(kept_path(cfg.out_dir, run.step), run.model, run.flat_config(), run.step,
                         f"train.py, step {run.step} of {cfg.out_dir}", worker.master)
        if stopping:
            return stop.stopped(worker, run.step, run.ckpt_path)  # each rank says so: what stopped it
    return None


def accumulate(run, batches):
    """Every micro-step's forward and backward of one optimiser step, over batches ((x, y, last) each): the gradients
    summed in the parameters' .grad. Returns the summed loss, on the device (no sync)."""
    cfg, worker = run.cfg, run.worker
    loss_sum = torch.zeros((), device=worker.device)
    for x, y, last in batches:
        with parallel.gradient_sync(run.train_model, last):  # DDP all-reduces on the last micro-step only
            with worker.runtime.autocast():
                _, loss = run.train_model(x, y, z_loss=cfg.z_loss, doc_mask=cfg.doc_mask)
            (loss / run.accum).backward()
        loss_sum += loss.detach()
    return loss_sum


def update(run):
    """Every optimiser's step (Muon's update: optim.Muon.update), then the gradients dropped."""
    for opt in run.optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)


def log_entry(run, measured, evaluating):
    """The log entry of run.step: what its step measured (the learning rates, losses, times; nothing at step 0) and,
    when evaluating, the validation loss. The loop, step 0 and the evaluation a stop left to the resumed run all
    build theirs here, so a metric added here is in each."""
    entry = {"step": run.step, **measured}
    if evaluating:
        entry["val_loss"] = evaluate(run, run.cfg.eval_tokens)
    return entry


def micro_batches(run):
    """(x, y, last) of each micro-step of this step: batch_size windows of the step's batch, on the device."""
    xs, ys = run.loader.next_batch()
    device, n = run.worker.device, run.cfg.batch_size
    for i, (x, y) in enumerate(zip(xs.split(n), ys.split(n))):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True), i == run.accum - 1


def due(step, interval, cfg):
    """Whether step is one of every `interval` steps, or the last."""
    return step % interval == 0 or step == cfg.max_steps


def stop_unless_finite(run, measured):
    """A non-finite loss or gradient norm (broken gradients: a miscompiled kernel, say) stops the run."""
    for key, what in (("train_loss", "loss"), ("grad_norm", "gradient norm")):
        if not math.isfinite(measured[key]):
            raise RunFailed(f"non-finite {what} ({measured[key]}) at step {run.step + 1}; the last good checkpoint, "
                            f"if any, is {run.ckpt_path}")


@torch.no_grad()
def evaluate(run, max_tokens):
    """Mean validation cross-entropy over a fixed slice of the val shard(s) (None: all of it), averaged over ranks."""
    cfg, worker, config = run.cfg, run.worker, run.model.config
    run.eval_model.eval()
    total, n = torch.zeros((), device=worker.device), torch.zeros((), device=worker.device)
    for x, y in val_batches(cfg.data_dir, cfg.batch_size, config.block_size, max_tokens, worker.rank,
                            worker.world_size, config.vocab_size):
        with worker.runtime.autocast():
            _, loss = run.eval_model(x.to(worker.device), y.to(worker.device), doc_mask=cfg.doc_mask)
        total += loss.float()
        n += 1
    run.eval_model.train()
    return (worker.sum(total) / worker.sum(n)).item()


# ----------------------------------------------------------------------------- checkpoints

def save(run, path, pending_log=None):
    """A resume checkpoint of every part; a rank that cannot write it (a full disk) stops every rank, in one line."""
    header = {"model_config": asdict(run.model.config), "config": run.flat_config(), "step": run.step,
              **({"pending_log": pending_log} if pending_log else {})}
    try:
        checkpoint.save_resumable(path, run.parts, header, run.worker)
    except OSError as e:
        raise RunFailed(f"step {run.step}: {e}; the previous checkpoint, if any, is intact, and --init_from=auto "
                        f"resumes from it") from None


# ----------------------------------------------------------------------------- the dry run (dryrun.py)

def dry_run(given, cfg):
    """--dry_run=True: the launch of these keys at dry_world_size processes (or torchrun's), traced in this process on
    a CPU (dryrun.py): configured and built as the launch does, the model on the meta device, then as rank 0 of a
    fake process group two whole optimiser steps over fake tensors, in bf16 autocast. Prints rank 0's peak GPU memory
    by kind against gpu_memory, whether it fits, and each error the launch would hit, one line each. Returns whether
    it fits with no error."""
    world = cfg.dry_world_size or int(os.environ.get("WORLD_SIZE", 1))
    if world < 1 or cfg.gpu_memory <= 0:
        print(f"train.py: dry run: error: dry_world_size={cfg.dry_world_size}, gpu_memory={cfg.gpu_memory}: expected "
              f"a number of processes (0: torchrun's) and a positive number of GB")
        return False
    errors, worker = [], dryrun.fake_worker(world)
    try:
        try:
            cfg, model_config, _, _ = configure(given, cfg, worker)
        except ValueError as e:  # the first wrong key: the launch stops there, but the model can still be traced
            errors.append(str(e))
            model_config = given_model_config(given)
        T, V = model_config.block_size, model_config.vocab_size
        try:  # the data: where the launch runs, not necessarily here
            DataLoader(cfg.data_dir, cfg.batch_size, T, 0, world, V)
        except (ValueError, OSError) as e:
            worker.say(f"dry run: note: {e} (the launch's machines need it; not checked further here)")
        accum = max(1, cfg.total_batch_size // (cfg.batch_size * T * world))
        fake = dryrun.fake_tensors()
        model, eval_model, train_model, optimizers = build_model(cfg, model_config, worker, storage=fake)
        # causal attention: the memory of FlexAttention's document masks on a GPU (no T x T scores), dryrun.py
        run = Run(replace(cfg, doc_mask=False), worker, accum, model, eval_model, train_model, optimizers, None, {})
        peaks, stepped = traced_steps(run, fake, T, V)
        where = "an optimiser step" if stepped else "forward and backward"
        owned = dryrun.muon_owners(optimizers, world) if cfg.fsdp else None
        lines, fits = dryrun.report(peaks, world, cfg.gpu_memory, where, cfg.fsdp, owned)
        for line in lines:
            worker.say(line)
    except Exception as e:  # what the launch would hit in its first step, said in one line
        errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        fits = False
    finally:
        dryrun.end(worker)
    for e in errors:
        worker.say(f"dry run: error: {e}")
    return fits and not errors


def traced_steps(run, fake, T, V):
    """Two whole optimiser steps of run over fake tokens, in fake (the fake tensors' mode), their memory tracked:
    (the peak by kind, dryrun.by_kind's; whether the peak grew last in an optimiser step)."""
    cfg, model, b = run.cfg, run.model, run.cfg.batch_size
    with fake:  # the clip and the optimisers once, untracked: DTensor runs each new op's sharding propagation on
        for p in model.parameters():  # whole-size fake tensors once, which a tracker would count as held
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        clip_norm(model, cfg.grad_clip)
        update(run)
    tracker = dryrun.tracker(model, run.optimizers, cfg.fsdp)
    with fake, tracker:
        def batches():  # fake tokens; the tracker takes each micro-step's forward as a new one
            for i in range(run.accum):
                tracker.reset_mod_stats()
                yield torch.randint(V, (b, T)), torch.randint(V, (b, T)), i == run.accum - 1

        stepped, top = False, 0  # whether the peak grew last in an optimiser step; the peak so far
        for _ in range(2):  # every micro-step of a step, twice
            accumulate(run, batches())
            clip_norm(model, cfg.grad_clip)
            before = dryrun.by_kind(tracker.get_tracker_snapshot("peak"))[1]
            update(run)
            now = dryrun.by_kind(tracker.get_tracker_snapshot("peak"))[1]
            stepped, top = now > before or (stepped and before == top), now
    return dryrun.by_kind(tracker.get_tracker_snapshot("peak")), stepped


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # a stop signal that comes as the run ends (a scheduler's time-limit warning) must not kill it then
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
