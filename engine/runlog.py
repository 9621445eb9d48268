"""
A training run's log: what train.py says as it trains, as lines on rank 0's stdout and as the same entries in
<out_dir>/log.jsonl (and W&B), and the one reader of that file (sweep.py's report, analyze.py's loss curves).

log.jsonl holds one JSON object per line, in step order:
    {"step", "config"}                   at every (re)start: train.py's whole configuration, flat
    {"step": 0, "val_loss"}              the validation loss the run starts from
    {"step", "<name>_lr" of each optimiser (muon_lr, adam_lr), "train_loss", "grad_norm", "step_ms", "tok_per_s"}
                                         every log_interval steps, with "val_loss" at evaluations, "epoch" when
                                         the data wraps around, "mfu" on a GPU
A resumed run first drops what came after its checkpoint's step, so the log reads as if it had never stopped.
"""
import json
import os

import torch.distributed as dist

from engine.checkpoint import is_branch, tensors
from engine.data import describe_tokenizer
from engine.files import atomic_write, read_jsonl
from model import flops_per_token
from optim import describe_optimizers, state_floats

# what the console line says in its own words, with each optimiser's <name>_lr; any other number of an entry (a
# fork's metric) follows the validation loss, as `name value`
SAID = {"step", "train_loss", "val_loss", "grad_norm", "step_ms", "tok_per_s", "mfu", "epoch"}


def log_path(out_dir):
    return os.path.join(out_dir, "log.jsonl")


def read_log(out_dir):
    """The entries of a run's log.jsonl (a last line cut by a crash is skipped); a one-line error without one."""
    path = log_path(out_dir)
    if not os.path.isfile(path):
        raise ValueError(f"{out_dir}: no log.jsonl (not a train.py run directory)")
    return list(read_jsonl(path))


def val_curve(entries, up_to=None):
    """[(step, val_loss)] of every evaluation among a log's entries (step 0 included), up to step up_to."""
    return [(e["step"], e["val_loss"]) for e in entries if isinstance(e, dict)
            and isinstance(e.get("val_loss"), (int, float)) and (up_to is None or e.get("step", 0) <= up_to)]


class Log:
    """What the run says: lines on rank 0's stdout, the same as JSON lines in <out_dir>/log.jsonl, and W&B."""

    def __init__(self, run, defaults):
        self.run, self.say, self.times, self.file, self.wandb = run, run.worker.say, [], None, None
        self.defaults = defaults  # train.py's keys: the start-up lines say which differ
        self.flops_per_step = flops_per_token(run.model, run.model.config.block_size) * run.cfg.total_batch_size
        if not run.worker.master:
            return
        cfg, path = run.cfg, log_path(run.cfg.out_dir)
        os.makedirs(cfg.out_dir, exist_ok=True)
        # a resumed run's log reads as if it had never stopped: drop what came after the checkpoint (a branch's
        # begins with its parent's, up to the branch point)
        history = log_path(os.path.dirname(run.started_from)) if run.started_from else None
        kept = [e for e in read_jsonl(history) if e["step"] <= run.step] if history and os.path.exists(history) else []
        with atomic_write(path, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in kept)
            f.write(json.dumps({"step": run.step, "config": run.flat_config()}) + "\n")  # every (re)start's config
        self.file = open(path, "a")
        if cfg.wandb_log:  # TrainConfig.check: it is installed
            import wandb
            self.wandb = wandb
            wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=run.flat_config())

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()
        self.run = None  # a closed log holds nothing of the run (its DDP wrapper must not outlive the process group)

    def record(self, entry):
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
            if self.wandb is not None:
                self.wandb.log(entry, step=entry["step"])

    def timing(self):
        """The step time of the log: the mean of the last log_interval steps, its tokens per second, and on a GPU its
        model FLOPs utilisation."""
        cfg, dt = self.run.cfg, step_seconds(self.times, self.run.cfg.log_interval)
        mfu = self.flops_per_step / dt / self.run.worker.world_size / cfg.gpu_peak_flops
        return {"step_ms": 1000 * dt, "tok_per_s": cfg.total_batch_size / dt,
                **({"mfu": mfu} if self.run.worker.device.startswith("cuda") else {})}

    def write(self, entry):
        """Print and record a log entry (train.log_entry's): a step's, or the validation loss the run starts from."""
        cfg, run = self.run.cfg, self.run
        if "epoch" in entry:  # this step's batch began the data again from the first shard
            self.say(f"step {entry['step']}: end of the train data, wrapping around to its start: epoch "
                     f"{entry['epoch']} begins")
        said = SAID | {f"{name}_lr" for name in run.optimizers}  # a fork's numbers follow the validation loss
        val = " | ".join(([f"val {entry['val_loss']:.4f}"] if "val_loss" in entry else []) + [
            f"{k} {v:.4g}" for k, v in entry.items() if k not in said and isinstance(v, (int, float))])
        if "train_loss" not in entry:  # step 0
            self.say(f"step {entry['step']}: {val.replace('val', 'val loss', 1)}")
        else:
            first, *others = [(name, entry[f"{name}_lr"]) for name in run.optimizers]
            lrs = f"lr {first[1]:.2e}" + (f" ({', '.join(f'{n} {lr:.2e}' for n, lr in others)})" if others else "")
            times = "" if "step_ms" not in entry else (  # a stop's entry of before, logged on resume, has none
                f" | {entry['step_ms']:.0f} ms | {entry['tok_per_s']:,.0f} tok/s" +
                (f" | mfu {100 * entry['mfu']:.1f}%" if "mfu" in entry else "") +
                f" | eta {entry['step_ms'] * (cfg.max_steps - entry['step']) / 60_000:.1f} min")
            self.say(f"step {entry['step']}/{cfg.max_steps} | loss {entry['train_loss']:.4f}{' | ' * bool(val)}{val} | "
                     f"{lrs} | grad norm {entry['grad_norm']:.3f}{times}")
        self.record(entry)

    def start(self):
        """The start-up lines: the configuration (where it differs from the defaults), the optimisers, the layout,
        the data and the disk the checkpoints will take."""
        run, cfg, worker = self.run, self.run.cfg, self.run.worker
        changed = {k: v for k, v in run.flat_config().items() if v != self.defaults[k]}
        self.say("config, where it differs from the defaults (log.jsonl has all of it): " +
                 (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "none"))
        never_trained = ["anchor_proj.weight"] if run.model.config.anchor_frozen else []  # GPTConfig.anchor_frozen's
        self.say(describe_optimizers(run.optimizers, run.model, never_trained))
        if run.step:
            branch = f" (a branch, into {cfg.out_dir})" if is_branch(run.started_from, cfg.out_dir) else ""
            self.say(f"resuming from {run.started_from} at step {run.step}{branch}")
        self.say(f"{run.model.num_params():,} parameters, {worker.world_size} process(es) x {run.accum} micro-step(s) "
                 f"x {cfg.batch_size} x {run.model.config.block_size} tokens, {worker.device}, compile={worker.compile}"
                 + (f", {dist.get_backend()} process group, {'FSDP' if cfg.fsdp else 'DDP'}" if worker.distributed
                    else ""))
        if worker.device.startswith("cuda"):
            self.say(f"mfu: {self.flops_per_step / cfg.total_batch_size:.3g} FLOPs per token (6 per matmul weight, "
                     f"causal attention: half of 12·L·C·T; model.flops_per_token) against gpu_peak_flops="
                     f"{cfg.gpu_peak_flops:.3g}; step times leave out each start's first step (compilation)")
        # the loader wraps around at the end of the data: say up front how often the run will see it
        planned, available = cfg.max_steps * cfg.total_batch_size, run.loader.tokens_per_epoch
        self.say(f"data: {cfg.max_steps:,} steps x {cfg.total_batch_size:,} tokens = {planned:,} tokens planned; "
                 f"{cfg.data_dir} has {available:,} usable train tokens: {planned / available:.2f} epochs"
                 + (" (the data repeats)" if planned > available else "")
                 + f"; its tokenizer: {describe_tokenizer(run.tokenizer)}" + unused_rows(run))
        if worker.master:
            kept = (cfg.max_steps // cfg.keep_every - run.step // cfg.keep_every) if cfg.keep_every else 0
            full = sum(s > run.step for s in cfg.keep_full)
            self.say(disk_plan(run.ckpt_path, run.parts, cfg.ckpt_interval, kept, cfg.keep_every, full))


def unused_rows(run):
    """", N of the model's vocab_size=V rows no token of the data's tokenizer uses" where they are more than padding
    to a multiple of 128 leaves (GPTConfig.vocab_size's, for GPT-2's tokens): a vocabulary sized for another tokenizer;
    else nothing."""
    vocab = run.model.config.vocab_size
    unused = vocab - run.tokenizer["n_vocab"] if run.tokenizer else 0
    return f", {unused:,} of the model's vocab_size={vocab:,} rows no token of it uses" if unused >= 128 else ""


def step_seconds(times, n):
    """Mean time of the last n steps of times (this process's, in order). The first is left out, unless it is all
    there is: it holds torch.compile's compilation (and the allocator's warm-up), which is not a step's cost."""
    window = (times[1:] or times)[-n:]
    return sum(window) / len(window)


def disk_plan(path, parts, ckpt_interval, kept=0, keep_every=0, full=0):
    """One line: what a run's checkpoints will take on disk (the resume one, path, of every resumable part, every
    ckpt_interval steps; `kept` weights-only ones every keep_every, `full` resumable ones of keep_full), and what the
    disk has free there. The optimisers' states are estimated (optim.state_floats: they are empty before the first
    step); any other part's are its tensors now."""
    weights = sum(p.numel() * p.element_size() for p in parts["model"].parameters())
    resume = weights
    for part in (p for p in parts.values() if p is not parts["model"] and p is not None):
        if isinstance(part, dict):  # the optimisers, by name
            resume += sum(4 * state_floats(opt) * p.numel() for opt in part.values() for g in opt.param_groups
                          for p in g["params"])
        else:
            resume += sum(t.numel() * t.element_size() for t in tensors(part.state_dict()))
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    stat = os.statvfs(out_dir)
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    return (f"checkpoints: {path} ~{gb(resume)}, every {ckpt_interval} steps" +
            (f"; {kept} weights-only ckpt_<step>.pt of ~{gb(weights)} (every {keep_every} steps): "
             f"{gb(kept * weights)} more" if keep_every else "") +
            (f"; {full} resumable ckpt_<step>_full{os.path.splitext(path)[1]} (keep_full): {gb(full * resume)} more"
             if full else "") +
            f"; {gb(stat.f_bavail * stat.f_frsize)} free there")
