"""
Train a model of any variant with the paper's recipe, in one process or under torchrun:

    python train.py configs/dyn_exo.py configs/tiny.py                     # CPU: a tiny model, a short run
    python train.py configs/dyn_exo.py                                     # 1 GPU (accumulates to 256K tokens)
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py                # 8 GPUs, DDP
    torchrun --nproc_per_node=8 train.py configs/dyn_exo.py --init_from=auto     # starts, or continues, a run

The recipe (the paper's training setup, with the authors' train.py's values), top to bottom: its keys
(TrainConfig; the model's are model.GPTConfig's), the optimisers and their schedule (Muon for the matrices inside the
network, optim.py; AdamW for the rest), one step (train_step), the loop, the build. Below it, what a reader of the
paper may skip: continuing a checkpoint, saving one, the dry run; engine/ does the rest.

Config files (plain Python: `n_layer = 4`) are applied in the order given, then the --key=value overrides. A run
that continues a checkpoint (--init_from=resume or auto, a branch point, --eval_only) takes each key left out from
it, and refuses one given with another value but those that change only how, when or where a run goes (EXECUTION).
SIGTERM, SIGINT or SIGUSR1 stop a run after its current step, with a checkpoint, and exit with status 75.
"""
import importlib.util
import math
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn as nn

from engine import checkpoint, dryrun, parallel, sharding
from engine.checkpoint import RNG, branch_path, checkpoint_path, kept_path, load_resumable, save_weights
from engine.configurator import help_text, key_comments, read_args, wants_help
from engine.data import DataLoader, check_data, data_tokenizer, ensure_corpus, val_batches
from engine.parallel import PREEMPTED, STOP_SIGNALS, RunFailed, StopSignals, Worker
from engine.runlog import Log
from model import GPT, GPTConfig
from optim import Muon, Optimizers, clip_norm, muon_params


# ----------------------------------------------------------------------------- the keys: the paper's 450M run
@dataclass(frozen=True)
class TrainConfig:
    """train.py's keys, one per line, its meaning in the comment (`python train.py --help` prints them). The model
    keys are GPTConfig's fields (set them with a configs/ file); their meanings are model.py's."""
    # I/O
    data_dir: str = "data/finewebedu10B"  # prepare.py's shards; a folder named stdlib (or stdlib_*) is built if missing
    verify_data: bool = False  # also check every shard's sha256 against its manifest at start (sizes: always)
    out_dir: str = "out"  # ckpt.pt and log.jsonl
    init_from: str = "scratch"  # 'scratch', 'resume' (<out_dir>/ckpt.pt), 'auto' (resume if there is one), or a
                                # ckpt_<step>_full.pt to branch from
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
    # batch: 262,144 tokens per step = 8 GPUs x 2 micro-steps x 8 sequences x 2048 tokens (the paper: 16 x 1); 8
    # sequences of a 450M variant fit an 80 GB GPU, 4 at 1B (docs/MEMORY.md). Accumulation keeps the step.
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
    activation_checkpointing: bool = False  # recompute each block in backward: 8-12 MiB a layer, ~25% slower steps
    doc_mask: bool = True  # attention stays inside each document of a window (<|endoftext|> opens one), as trained
    fsdp: bool = False  # under torchrun: weights, gradients, optimiser states sharded over the processes (FSDP2)
    # the dry run: the launch traced in one process on a CPU, nothing trained (engine/dryrun.py)
    dry_run: bool = False  # print rank 0's peak GPU memory, whether it fits, and every error the launch would hit;
                           # exit status 1 if it does not fit or would fail
    dry_world_size: int = 0  # processes of the launch dry-run (0: torchrun's WORLD_SIZE, or 1)
    gpu_memory: float = 80.0  # GB of memory of each GPU, for the dry run (80: an H100's, the documented commands' size)
    # system
    device: str = None  # None: cuda if available, else cpu
    dtype: str = None  # None: bfloat16 autocast on cuda (fp32 master weights), float32 on cpu
    compile: bool = None  # None: torch.compile on cuda only
    dist_timeout: int = 900  # seconds a collective waits for the others (a dead or hung rank, a slow checkpoint)
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
            raise ValueError(f"keep_full={self.keep_full}: expected steps from 1 to max_steps-1={self.max_steps - 1}")
        micro = self.batch_size * model_config.block_size * world_size
        if self.total_batch_size % micro:
            raise ValueError(f"total_batch_size={self.total_batch_size}: expected a multiple of batch_size x "
                             f"block_size x processes = {micro}")
        if self.wandb_log and importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb_log=True: wandb is not installed (pip install wandb)")


POSITIVE = ("max_steps", "batch_size", "total_batch_size", "log_interval", "eval_interval", "ckpt_interval",
            "warmup_steps", "muon_momentum_steps", "dist_timeout")
DEFAULTS = asdict(TrainConfig())
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
ALL_DEFAULTS = {**DEFAULTS, **{f.name: f.default for f in fields(GPTConfig)}}


# ----------------------------------------------------------------------------- the optimisers and their schedule

def build_optimizers(model, cfg):
    """The recipe's optimisers, by name (schedule() gives each its <name>_lr): Muon for the weights of the nn.Linear
    layers inside the network (anchor_proj's and the dynamic MLP's too, as the authors' optimizer.py has it); AdamW
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


# ----------------------------------------------------------------------------- one step

def train_step(run, batches):
    """One optimiser step of the recipe over batches, the step's micro-batches ((x, y, last) each: micro_batches):
    every micro-batch's forward and backward, the gradients summed; the clip; every optimiser's step. Returns what it
    measured: the learning rates (<name>_lr), and train_loss and grad_norm left on the device (no sync)."""
    cfg, worker = run.cfg, run.worker
    measured = run.optimizers.set_schedule(schedule(run.step, cfg))  # this step's learning rates and momentum
    loss_sum = torch.zeros((), device=worker.device)
    for x, y, last in batches:
        with parallel.gradient_sync(run.train_model, last):  # DDP all-reduces on the last micro-step only
            with worker.runtime.autocast():
                _, loss = run.train_model(x, y, z_loss=cfg.z_loss, doc_mask=cfg.doc_mask)
            (loss / run.accum).backward()
        loss_sum += loss.detach()
        measure_micro_batch(run, x, y, loss, measured)
    # the mean over every micro-batch of every process (in float64, as a Python float divides)
    measured["train_loss"] = worker.sum(loss_sum).double() / (run.accum * worker.world_size)
    measured["grad_norm"] = sharding.full_value(clip_norm(run.model, cfg.grad_clip))  # the norm before clipping
    for opt in run.optimizers.values():  # Muon's update: optim.muon_update
        opt.step()
        opt.zero_grad(set_to_none=True)
    run.step += 1
    return measured


def measure_micro_batch(run, x, y, loss, measured):
    """A fork's measure of a micro-batch (x, y, its loss), into the step's log entry measured (on the device)."""


def micro_batches(run):
    """(x, y, last) of each micro-step of this step: batch_size windows of the step's batch, on the device."""
    (xs, ys), device, n = run.loader.next_batch(), run.worker.device, run.cfg.batch_size
    for i, (x, y) in enumerate(zip(xs.split(n), ys.split(n))):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True), i == run.accum - 1


# ----------------------------------------------------------------------------- the loop

def train(run, log, stop):
    """The loop, from the checkpoint's step (or 0) to max_steps: a step, then what is due after it. Returns what
    stopped it early (a signal), or None."""
    cfg, worker = run.cfg, run.worker
    due = lambda interval: run.step % interval == 0 or run.step == cfg.max_steps  # one of every interval steps, or last
    if run.step == 0 or run.pending_log:  # the loss the run starts from, or the evaluation a stop left to do
        log.write(log_entry(run, run.pending_log or {}, evaluating=True))
    while run.step < cfg.max_steps:
        t0, epoch = time.perf_counter(), run.loader.epoch
        measured = {k: v.item() if torch.is_tensor(v) else v for k, v in train_step(run, micro_batches(run)).items()}
        run.train_loss = measured["train_loss"]
        for key, what in (("train_loss", "loss"), ("grad_norm", "gradient norm")):  # broken gradients (a miscompiled
            if not math.isfinite(measured[key]):  # kernel, say): stopped before any checkpoint holds them
                raise RunFailed(f"non-finite {what} ({measured[key]}) at step {run.step}; the last good checkpoint, "
                                f"if any, is {run.ckpt_path}")
        log.times.append(time.perf_counter() - t0)
        measured.update(log.timing())  # then what is due after the step: an evaluation, a log line, checkpoints, a stop
        stopping = run.step < cfg.max_steps and stop.agreed(worker)  # a signal to any rank: all stop after this step
        if run.loader.epoch != epoch:  # this step's batch began the data again from the first shard
            measured["epoch"] = run.loader.epoch
        evaluating = due(cfg.eval_interval)
        pending = stopping and run.step % cfg.eval_interval == 0  # that evaluation is left to the resumed run
        if not pending and (due(cfg.log_interval) or evaluating or "epoch" in measured):
            log.write(log_entry(run, measured, evaluating))
        for path in [run.ckpt_path] * (due(cfg.ckpt_interval) or stopping) + \
                [branch_path(cfg.out_dir, run.step, cfg.fsdp)] * (run.step in cfg.keep_full):  # a branch point
            save(run, path, pending_log={"step": run.step, **measured} if pending else None)
        if cfg.keep_every and run.step % cfg.keep_every == 0:  # weights only: the history analyze.py reads
            save_weights(kept_path(cfg.out_dir, run.step), run.model, run.flat_config(), run.step,
                         f"train.py, step {run.step} of {cfg.out_dir}", worker.master, run.tokenizer)
        if stopping:
            return stop.stopped(worker, run.step, run.ckpt_path)  # each rank says so: what stopped it
    return None


def log_entry(run, measured, evaluating):
    """The log entry of run.step: what its step measured (nothing at step 0), and the validation loss if evaluating.
    The loop, step 0 and the evaluation a stop left to a resumed run build theirs here: a metric added here is in all.
    """
    entry = {"step": run.step, **measured}
    if evaluating:
        entry["val_loss"] = evaluate(run, run.cfg.eval_tokens)
    return entry


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


# ----------------------------------------------------------------------------- the build

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
    parts: dict  # {name: object with state_dict() and load_state_dict()}: what a checkpoint saves, by name
    step: int = 0
    train_loss: float = None  # of the last step
    pending_log: dict = None  # a stop at an evaluation step: its log entry, evaluated and logged on resume
    started_from: str = None  # the checkpoint it (re)started from: its log begins with that run's, up to step
    tokenizer: dict = None  # what made its data, data.read_tokenizer's record (None: not recorded): checkpoints keep it

    @property
    def ckpt_path(self):
        return checkpoint_path(self.cfg.out_dir, self.cfg.fsdp)

    def flat_config(self):
        """The whole configuration as one flat dict: what log.jsonl and checkpoints record."""
        return {**asdict(self.cfg), **asdict(self.model.config)}


def build(cfg, model_config, worker, storage=None):
    """The data readers (every shard checked now, the val shard too), the model (seeded), its optimisers, and the
    resumable parts: what a checkpoint saves, by name (a fork's own part, and each file it reads, is registered here).
    The dry run builds the launch here too (storage: its fake tensors' mode), a fork's models and checks with it."""
    T, V, rank, world = model_config.block_size, model_config.vocab_size, worker.rank, worker.world_size
    check_data(cfg.data_dir, cfg.verify_data, worker.say, worker)  # its manifest's sizes; sha256s if asked, shared
    tokenizer = data_tokenizer(cfg.data_dir)  # what made the shards (configure checked it), for every checkpoint
    accum = cfg.total_batch_size // (cfg.batch_size * T * world)  # micro-steps per step (check: a whole number)
    # a step's window of total_batch_size tokens, split into micro-steps: the same tokens at any mix of processes
    loader = None if cfg.eval_only else DataLoader(cfg.data_dir, accum * cfg.batch_size, T, rank, world, V)
    next(val_batches(cfg.data_dir, cfg.batch_size, T, cfg.eval_tokens, rank, world, V), None)
    model, eval_model, train_model, optimizers = build_model(cfg, model_config, worker, storage)
    parts = {"model": model, "optimizers": optimizers, "loader": loader, "rng": RNG()}
    run = Run(cfg, worker, accum, model, eval_model, train_model, optimizers, loader, parts, tokenizer=tokenizer)
    return checkpoint.check_parts(run)  # state a resume would start again, held outside run.parts: refused


def build_model(cfg, model_config, worker, storage=None):
    """The model (seeded) in its three roles, and its optimisers: (model, eval_model, train_model, optimizers). Built
    on the meta device, then placed (engine/parallel.py: sharded or not, compiled, in DDP) and initialised where each
    process holds it, to the values GPT(config) gives. storage: the dry run's fake tensors' mode (no values)."""
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(cfg.seed)
    with torch.device("meta"):
        model = GPT(model_config)
    model.activation_checkpointing = cfg.activation_checkpointing
    model, eval_model, train_model = parallel.place_model(model, worker, cfg.fsdp, storage)
    optimizers = build_optimizers(model, cfg)
    optimizers.check_params(model, schedule(0, cfg))  # before any step: each parameter in one optimiser, and more
    if cfg.fsdp:  # before any step: each optimiser's state must fit the sharded checkpoint
        sharding.check_optimizers(model, optimizers)
    return model, eval_model, train_model, optimizers


# ----------------------------------------------------------------------------- main: configure, build, restore, loop

def main(argv):
    """Train as argv says: configure, build, restore, then the loop (or one evaluation). Returns the last train loss
    (eval_only: the validation loss); a one-line error exits with status 1, a stop by a signal with 75."""
    if wants_help(argv):
        return print(help_text(__doc__, help_sections()))
    with StopSignals() as stop:  # until the very end: a signal during the teardown is only noted
        try:
            given = read_args(argv, ALL_DEFAULTS)
            cfg = TrainConfig(**{k: v for k, v in given.items() if k in DEFAULTS})
            if cfg.dry_run:  # the launch traced in one process, on fake tensors; no corpus is built (engine/dryrun.py)
                fits = dryrun.launch(sys.modules[__name__], given, cfg)
                return None if fits else sys.exit("train.py: dry run: the launch would not fit, or would fail (above)")
            ensure_corpus(cfg.data_dir)  # the built-in corpus (a data_dir named stdlib...), before any thread or GPU
            worker = parallel.join(cfg)
        except (ValueError, OSError) as e:
            sys.exit(f"train.py: error: {e}")
        with worker:  # the process group ends after the run, once nothing holds DDP any more
            try:
                run = start(given, cfg, worker)
            except (ValueError, OSError) as e:
                sys.exit(f"train.py: error: {e}")
            if run is None:  # finished already
                return None
            if run.cfg.eval_only:
                result, stopped_by = evaluate(run, None), None
                worker.say(f"step {run.step}: val loss {result:.4f} on the whole validation set")
            else:
                try:
                    with parallel.collectives_fail_in_one_line(worker, run.cfg.dist_timeout, run.ckpt_path), \
                            Log(run, ALL_DEFAULTS) as log:
                        stopped_by, result = train(run, log, stop), run.train_loss
                except RunFailed as e:
                    sys.exit(f"train.py: error: {e}")
            del run  # before the process group ends with this block: no DDP wrapper may outlive it (parallel.Worker)
    if stopped_by:
        sys.exit(PREEMPTED)
    return result


def start(given, cfg, worker):
    """The run these keys start or continue (configured, built, restored from its checkpoint); None if it is done."""
    cfg, model_config, ckpt, path = configure(given, cfg, worker)
    if ckpt is not None and not cfg.eval_only and ckpt["step"] >= cfg.max_steps:
        worker.say(f"{path}: this run is finished (step {ckpt['step']} of max_steps={cfg.max_steps}); nothing to do")
        return None
    run = build(cfg, model_config, worker)
    if ckpt is not None:
        restore(run, ckpt, path)
    return run


def configure(given, cfg, worker):
    """Everything about the input that can be wrong, checked before any work: the checkpoint to start from, the keys
    and their values. Returns (cfg, model_config, the checkpoint, its path)."""
    ckpt, path = load_resumable(cfg.out_dir, cfg.init_from, cfg.eval_only, cfg.fsdp, worker)  # either kind
    if ckpt is None:  # each key left out at its default
        model_config = split_config({**ALL_DEFAULTS, **given})[1]
    else:  # each key left out is the checkpoint's; which keys a resume or a branch may change: engine/checkpoint.py
        cfg, model_config = checkpoint.continued_config(sys.modules[__name__], given, cfg, ckpt, path, worker.say)
    model_config = checkpoint.with_data_tokenizer(model_config, cfg.data_dir, given, ckpt, path)  # eot_token, checked
    cfg.check(model_config, worker.world_size)
    return cfg, model_config, ckpt, path


def restore(run, ckpt, path):
    """Every resumable part (eval_only: the weights) from either kind of checkpoint, into either kind of model."""
    training = not run.cfg.eval_only
    run.pending_log = checkpoint.restore(ckpt, run.parts if training else {"model": run.model}, path, training)
    run.step, run.started_from = ckpt["step"], path


# =============================================================================================================
# Below the recipe: what a reader of the paper may skip. Continuing a checkpoint (engine/checkpoint.py's
# continued_config applies these rules), saving one; none of it changes what a step computes.

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


def schedule_differs(a, b, steps):
    """The first step before `steps` at which configurations a and b schedule anything differently; None if none."""
    return next((t for t in range(steps) if schedule(t, a) != schedule(t, b)), None)


def split_config(flat):
    """(TrainConfig, GPTConfig) of a flat {key: value} of both, as logs and checkpoints record it (a key it lacks at
    its default, one they do not know left out)."""
    return TrainConfig(**{k: tuple(v) if isinstance(DEFAULTS[k], tuple) else v for k, v in flat.items()
                          if k in DEFAULTS}), GPTConfig(**{k: v for k, v in flat.items() if k in MODEL_KEYS})


def save(run, path, pending_log=None):
    """A resume checkpoint of every part (engine/checkpoint.py says what it holds); a rank that cannot write it (a
    full disk) stops every rank, in one line."""
    try:
        checkpoint.save_resumable(path, run.parts, run.step, run.flat_config(), run.worker, pending_log,
                                  run.tokenizer)
    except OSError as e:
        raise RunFailed(f"step {run.step}: {e}; the previous checkpoint, if any, is intact, and --init_from=auto "
                        f"resumes from it") from None


def help_sections():
    """(title, defaults, meanings) of train.py's keys and of the model keys, for configurator.help_text."""
    return [("training keys", DEFAULTS, key_comments(__file__, "TrainConfig")),
            ("model keys (GPTConfig; the configs/ files set them)", {k: ALL_DEFAULTS[k] for k in MODEL_KEYS},
             key_comments(sys.modules[GPTConfig.__module__].__file__, "GPTConfig"))]


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:  # a stop signal that comes as the run ends (a scheduler's time-limit warning) must not kill it then
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
