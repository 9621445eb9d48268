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
the checkpoint's: model keys may be left out, and any that is given must agree with the checkpoint.
SIGTERM, SIGINT or SIGUSR1 stop a run after its current step, with a checkpoint, and exit with status 75.
"""
import errno
import math
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import torch.nn as nn

import checkpoint
import parallel
import sharding
from checkpoint import (branch_path, checkpoint_path, kept_path, load_resumable, save_resumable, save_weights,
                        trained_doc_mask)
from configurator import help_text, key_comments, read_args, wants_help
from data import DataLoader, ensure_corpus, val_batches
from model import GPT, GPTConfig
from optim import build_optimizers, clip_gradients
from parallel import PREEMPTED, STOP_SIGNALS, StopSignals, Worker, tell
from runlog import Log


# ----------------------------------------------------------------------------- the keys: the paper's 450M run
@dataclass(frozen=True)
class TrainConfig:
    """train.py's keys, one per line, its meaning in the comment (`python train.py --help` prints them). The model
    keys are GPTConfig's fields (set them with a configs/ file); their meanings are model.py's."""
    # I/O
    data_dir: str = "data/finewebedu10B"  # shards from prepare.py (*_train_*.bin, *_val_*.bin); one named stdlib is built from this Python's library when missing
    out_dir: str = "out"  # ckpt.pt and log.jsonl
    init_from: str = "scratch"  # 'scratch', 'resume' (continue from <out_dir>/ckpt.pt), 'auto' (resume if it exists), or a ckpt_<step>_full.pt to branch from
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
    fsdp: bool = False  # under torchrun: weights, gradients, optimiser states sharded over the processes (FSDP2), not DDP
    # system
    device: str = None  # None: cuda if available, else cpu
    dtype: str = None  # None: bfloat16 autocast on cuda (fp32 master weights), float32 on cpu
    compile: bool = None  # None: torch.compile on cuda only
    dist_timeout: int = 900  # seconds a collective may wait for the other processes (a dead or hung rank, a slow checkpoint write)
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
            raise ValueError(f"keep_full={self.keep_full}: expected steps between 1 and max_steps-1={self.max_steps - 1}")
        micro = self.batch_size * model_config.block_size * world_size
        if self.total_batch_size % micro:
            raise ValueError(f"total_batch_size={self.total_batch_size}: expected a multiple of batch_size x "
                             f"block_size x processes = {micro}")

    def micro_steps(self, model_config, world_size):
        """The micro-steps per optimiser step (gradient accumulation): total_batch_size in batches of batch_size
        windows per process."""
        return self.total_batch_size // (self.batch_size * model_config.block_size * world_size)

    def branch_error(self, parent, step):
        """Why continuing a run of configuration `parent` (flat, as its checkpoint records it) from its step `step`
        with this configuration would not end bit for bit as a run of this one from scratch; None if it would.
        Both must agree on every key that changes what steps 0..step-1 compute, and their schedules must too:
        each step before the branch point comes before either run's learning-rate decay and momentum ramp-down."""
        changed = [k for k in DEFAULTS if k not in BRANCH_FREE and k in parent and parent[k] != getattr(self, k)]
        if changed:
            return (f"its run has {', '.join(f'{k}={parent[k]!r}' for k in changed)}, this one "
                    f"{', '.join(f'{k}={getattr(self, k)!r}' for k in changed)}: a branch changes max_steps only")
        for m in (parent["max_steps"], self.max_steps):
            if step - 1 > (1 - self.cooldown_frac) * m:
                return (f"step {step} lies inside the learning-rate decay of a run of max_steps={m}: a branch point "
                        f"s needs s - 1 <= (1 - cooldown_frac) x max_steps = {(1 - self.cooldown_frac) * m:g} in both runs")
            if step - 1 > m - self.muon_momentum_steps:
                return (f"step {step} lies inside the Muon momentum ramp-down of a run of max_steps={m}: a branch "
                        f"point s needs s - 1 <= max_steps - muon_momentum_steps = {m - self.muon_momentum_steps} in "
                        f"both runs")
        return None


POSITIVE = ("max_steps", "batch_size", "total_batch_size", "log_interval", "eval_interval", "ckpt_interval",
            "warmup_steps", "muon_momentum_steps", "dist_timeout")
DEFAULTS = asdict(TrainConfig())
# Keys a branch may set as it likes (they change no step's computation or logged value), beside max_steps
BRANCH_FREE = {"max_steps", "out_dir", "init_from", "log_interval", "eval_interval", "ckpt_interval", "keep_every",
               "keep_full", "wandb_log", "wandb_project", "wandb_run_name", "dist_timeout", "gpu_peak_flops"}
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ALL_DEFAULTS = {**DEFAULTS, **{f.name: f.default for f in fields(GPTConfig)}}


def split_config(flat):
    """(TrainConfig, GPTConfig) of a flat {key: value} of both (what files and overrides set, logs record)."""
    return TrainConfig(**{k: v for k, v in flat.items() if k in DEFAULTS}), \
        GPTConfig(**{k: v for k, v in flat.items() if k in MODEL_KEYS})


def help_sections():
    """(title, defaults, meanings) of train.py's keys and of the model keys, for configurator.help_text."""
    return [("training keys", DEFAULTS, key_comments(__file__, "TrainConfig")),
            ("model keys (GPTConfig; the configs/ files set them)", {k: ALL_DEFAULTS[k] for k in MODEL_KEYS},
             key_comments(sys.modules[GPTConfig.__module__].__file__, "GPTConfig"))]


# ----------------------------------------------------------------------------- the schedule

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


# ----------------------------------------------------------------------------- main: configure, build, restore, loop

def main(argv):
    """Train as argv says: configure, build, restore, then the loop (or one evaluation). Returns the last train loss
    (eval_only: the validation loss); a stop by a signal exits with status 75."""
    if wants_help(argv):
        print(help_text(__doc__, help_sections()))
        return None
    with StopSignals() as stop:  # until the very end: a signal during the teardown is only noted
        try:
            given = read_args(argv, ALL_DEFAULTS)
            cfg = TrainConfig(**{k: v for k, v in given.items() if k in DEFAULTS})
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
            except (ValueError, FileNotFoundError) as e:
                sys.exit(f"train.py: error: {e}")
            if ckpt is not None:
                restore(run, ckpt, path)
            stopped_by = None
            if cfg.eval_only:
                result = evaluate(run, None)
                worker.say(f"step {run.step}: val loss {result:.4f} on the whole validation set")
            else:
                resume_hint = f"--init_from=auto resumes from {run.ckpt_path}"
                with parallel.collectives_fail_in_one_line(worker, cfg.dist_timeout, resume_hint), Log(run) as log:
                    log.start(ALL_DEFAULTS)
                    stopped_by = train(run, log, stop)
                if stopped_by:
                    tell(f"train.py: rank {worker.rank}: stopped after step {run.step} ({stopped_by}); {run.ckpt_path} "
                         f"holds it: the same command with --init_from=auto continues the run (exit status {PREEMPTED})")
                result = run.train_loss
            del run  # before the process group ends with this block: no DDP wrapper may outlive it (parallel.Worker)
    if stopped_by:
        sys.exit(PREEMPTED)
    return result


def configure(given, cfg, worker):
    """Everything about the input that can be wrong, checked before any work: the checkpoint to start from, the
    model (the checkpoint's, when there is one: the model keys given must agree with it), the keys' values.
    Returns (cfg, model_config, the checkpoint and its path, or None and None)."""
    ckpt, path = load_resumable(cfg.out_dir, cfg.init_from, cfg.eval_only, cfg.fsdp)  # either kind: DDP <-> FSDP
    if ckpt is None:
        model_config = GPTConfig(**{k: v for k, v in {**ALL_DEFAULTS, **given}.items() if k in MODEL_KEYS})
    else:
        model_config = checkpoint_model(ckpt, given, path)
        if "doc_mask" not in given:  # resume, eval_only: as trained, unless overridden
            cfg = replace(cfg, doc_mask=trained_doc_mask(ckpt))
    cfg.check(model_config, worker.world_size)
    if path is not None and is_branch(path, cfg.out_dir):  # a branch (Hagele et al., 2024): exact, or refused
        error = cfg.branch_error(ckpt["config"], ckpt["step"])
        if error:
            raise ValueError(f"{path}: cannot branch from it: {error}")
    return cfg, model_config, ckpt, path


def checkpoint_model(ckpt, given, path):
    """The GPTConfig of a checkpoint that a run continues or evaluates (a field it lacks, added to GPTConfig
    later, takes its default); the model keys that config files or overrides set (given) must agree with it."""
    config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
    saved = asdict(config)
    conflict = [k for k in saved if k in given and given[k] != saved[k]]
    if conflict:
        show = lambda d: ", ".join(f"{k}={d[k]!r}" for k in conflict)
        raise ValueError(f"{path}: its model has {show(saved)}, the configuration sets {show(given)} "
                         f"(leave the model keys out to take the checkpoint's)")
    return config


def is_branch(path, out_dir):
    """Whether a run in out_dir starting from the checkpoint path starts from another run's (a branch point of
    keep_full), not from its own, of either kind."""
    return path not in (checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True))


@dataclass
class Run:
    """What a training run holds: its keys, the model in its three roles, the optimisers, the data, how far it got."""
    cfg: TrainConfig
    worker: Worker  # this process: rank, device, precision
    accum: int  # micro-steps per optimiser step
    model: GPT  # what is saved (never the compiled or DDP wrapper)
    eval_model: nn.Module  # what evaluates: model, compiled or not
    train_model: nn.Module  # what trains: eval_model, in DDP when there are several processes
    optimizers: list  # [Muon, AdamW]
    loader: DataLoader  # the train data and its position (None for eval_only)
    step: int = 0
    train_loss: float = None  # of the last step
    pending_log: dict = None  # a stop at an evaluation step: its log entry, evaluated and logged on resume
    started_from: str = None  # the checkpoint it (re)started from: its log begins with that run's, up to step
    branched: bool = False  # started_from is another run's branch point (keep_full)

    @property
    def ckpt_path(self):
        return checkpoint_path(self.cfg.out_dir, self.cfg.fsdp)

    def flat_config(self):
        """The whole configuration as one flat dict: what log.jsonl and checkpoints record."""
        return {**asdict(self.cfg), **asdict(self.model.config)}


def build(cfg, model_config, worker):
    """The data readers (every shard checked now, the val shard too), the model (seeded), its optimisers."""
    T, V, rank, world = model_config.block_size, model_config.vocab_size, worker.rank, worker.world_size
    accum = cfg.micro_steps(model_config, world)
    # one window of total_batch_size tokens per step, split into micro-steps: the same tokens whatever the mix
    # of processes and accumulation (and at shard ends, too)
    loader = None if cfg.eval_only else DataLoader(cfg.data_dir, accum * cfg.batch_size, T, rank, world, V)
    next(val_batches(cfg.data_dir, cfg.batch_size, T, cfg.eval_tokens, rank, world, V), None)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model = GPT(model_config)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.fsdp:  # DDP or FSDP: sharded in place, each unit moved to the device as it is sharded, compiled per block
        eval_model = train_model = model = sharding.fully_shard_model(model, worker)
    else:
        model = model.to(worker.device)
        eval_model = torch.compile(model) if worker.compile else model
        train_model = parallel.data_parallel(eval_model, worker)
    optimizers = build_optimizers(model, cfg, rank, world)
    return Run(cfg, worker, accum, model, eval_model, train_model, optimizers, loader)


def restore(run, ckpt, path):
    """Continue from a checkpoint: the weights, and for training the optimisers, data position, RNG and step."""
    training = not run.cfg.eval_only
    run.pending_log = checkpoint.restore(ckpt, run.model, run.optimizers if training else None,
                                         run.loader if training else None)  # either kind into either kind of model
    run.step, run.started_from, run.branched = ckpt["step"], path, is_branch(path, run.cfg.out_dir)


# ----------------------------------------------------------------------------- the loop

def train(run, log, stop):
    """The loop, from the checkpoint's step (or 0) to max_steps. Returns what stopped it early (a signal), or None."""
    cfg, worker = run.cfg, run.worker
    if run.step == 0 or run.pending_log:  # the loss the run starts from, or the evaluation a stop left to do
        log.evaluation(run.pending_log or {"step": 0}, evaluate(run, cfg.eval_tokens))
    while run.step < cfg.max_steps:
        # one optimiser step: forward and backward over the micro-batches, the gradients summed, then clip and step
        t0, epoch = time.perf_counter(), run.loader.epoch
        entry = {"step": run.step + 1, **set_schedule(run.optimizers, run.step, cfg)}
        loss_sum = torch.zeros((), device=worker.device)
        for x, y, last in micro_batches(run):
            with parallel.gradient_sync(run.train_model, last):  # DDP all-reduces on the last micro-step only
                with worker.runtime.autocast():
                    _, loss = run.train_model(x, y, z_loss=cfg.z_loss, doc_mask=cfg.doc_mask)
                (loss / run.accum).backward()
            loss_sum += loss.detach()
        entry["train_loss"] = run.train_loss = worker.sum(loss_sum).item() / (run.accum * worker.world_size)
        stop_unless_finite(run, entry, "train_loss")
        entry["grad_norm"] = clip_gradients(run.model, cfg.grad_clip)  # the global norm, before clipping it
        stop_unless_finite(run, entry, "grad_norm")  # a finite loss with broken gradients (a miscompiled kernel, say)
        for opt in run.optimizers:  # Muon's update: optim.Muon.update
            opt.step()
            opt.zero_grad(set_to_none=True)
        run.step += 1
        log.times.append(time.perf_counter() - t0)
        # what is due after the step: an evaluation, a log line, checkpoints, a stop
        stopping = run.step < cfg.max_steps and stop.agreed(worker)  # a signal to any rank: all stop after this step
        if run.loader.epoch != epoch:  # this step's batch began the data again from the first shard
            entry["epoch"] = run.loader.epoch
            log.say(f"step {run.step}: end of the train data, wrapping around to its start: epoch "
                    f"{entry['epoch']} begins")
        pending = stopping and run.step % cfg.eval_interval == 0  # that evaluation is left to the resumed run
        if due(run.step, cfg.eval_interval, cfg) and not pending:
            entry["val_loss"] = evaluate(run, cfg.eval_tokens)
        if not pending and (due(run.step, cfg.log_interval, cfg) or "val_loss" in entry or "epoch" in entry):
            log.step(entry)
        for path in checkpoints_due(run, stopping):
            save(run, path, pending_log=entry if pending else None)
        if cfg.keep_every and run.step % cfg.keep_every == 0:
            keep_weights(run)
        if stopping:
            return stop.received or "a signal to another rank"
    return None


def micro_batches(run):
    """(x, y, last) of each micro-step of this step: batch_size windows of the step's batch, on the device."""
    xs, ys = run.loader.next_batch()
    device, n = run.worker.device, run.cfg.batch_size
    for i, (x, y) in enumerate(zip(xs.split(n), ys.split(n))):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True), i == run.accum - 1


def checkpoints_due(run, stopping):
    """The resume checkpoints of this step: the rolling one every ckpt_interval steps, at the end and at a stop; a
    branch point of keep_full."""
    rolling = due(run.step, run.cfg.ckpt_interval, run.cfg) or stopping
    branch = branch_path(run.cfg.out_dir, run.step, run.cfg.fsdp)
    return [run.ckpt_path] * rolling + [branch] * (run.step in run.cfg.keep_full)


def due(step, interval, cfg):
    """Whether step is one of every `interval` steps, or the last."""
    return step % interval == 0 or step == cfg.max_steps


def stop_unless_finite(run, entry, key):
    """A non-finite loss or gradient norm stops the run before any checkpoint holds what it did to the weights."""
    if not math.isfinite(entry[key]):
        what = {"train_loss": "loss", "grad_norm": "gradient norm"}[key]
        raise SystemExit(f"train.py: error: non-finite {what} ({entry[key]}) at step {entry['step']}; the last good "
                         f"checkpoint, if any, is {run.ckpt_path}")


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
    """A resume checkpoint: rank 0 writes it (every rank its shards, under FSDP), and every rank learns whether that
    worked (a full disk stops the run with one line, the previous checkpoint intact)."""
    error = None
    try:
        save_resumable(path, run.model, run.optimizers, run.loader, run.flat_config(), run.step, pending_log,
                       run.worker.master)
    except OSError as e:
        error = e
    if run.worker.any(error is not None):
        why = f"{error.strerror or error}" if error else "rank 0 could not write it"
        full = " (the disk is full)" if error and error.errno == errno.ENOSPC else ""
        raise SystemExit(f"train.py: error: step {run.step}: {path}: {why}{full}; the previous "
                         f"checkpoint, if any, is intact, and --init_from=auto resumes from it")


def keep_weights(run):
    """A weights-only checkpoint of this step beside the resume one: the history that analyze.py, eval.py and
    sample.py read as they are."""
    save_weights(kept_path(run.cfg.out_dir, run.step), run.model, run.flat_config(), run.step,
                 f"train.py, step {run.step} of {run.cfg.out_dir}", run.worker.master)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # a stop signal that comes as the run ends (a scheduler's time-limit warning) must not kill it then
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
