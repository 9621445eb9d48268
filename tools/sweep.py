"""
Variants x seeds, each an ordinary train.py run in its own directory, and the report that compares them with
intervals: the instrument for the paper's open questions (seeds, token-matched data efficiency, controls).

    python -m tools.sweep configs/gated.py+configs/tiny.py configs/dyn_exo.py+configs/tiny.py --seeds=0,1,2,3,4 \\
        --out_dir=out/sweep --parallel=2                                  # runs, then the report
    python -m tools.sweep ... --print                                        # one shell command per run, nothing run
    python -m tools.sweep ... --slurm --sbatch="--gpus-per-node=1 --time=4:00:00"     # one Slurm job per run
    python -m tools.sweep --report out/sweep/* [--reference=LABEL] [--out=FILE]

Each CONFIG is one variant: a config file, or several joined by '+' (applied in that order, as train.py
applies them). Every other --key=value is a train.py key and goes to every run. Run directories are
<out_dir>/<variant>_s<seed> (with --budgets, <variant>_b<fraction>_s<seed> for the shorter budgets). Every
run is started with --init_from=auto: a finished run is skipped, an unfinished one resumes from its last
checkpoint, so the same command continues a sweep that was stopped (Ctrl-C, kill, a lost machine).

With --slurm every run is a job of train.sbatch (requeued when it stops with status 75), a branch after its full
run's job (a Slurm dependency); the same command again submits what is neither finished nor queued, and once every
run has finished, writes the report.
"""
import argparse
import contextlib
import ctypes
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from engine.checkpoint import branch_path, checkpoint_path, load_checkpoint
from engine.configurator import read_args
from engine.data import find_shards, is_corpus
from engine.files import atomic_write
from engine.parallel import PREEMPTED
from engine.runlog import log_path, read_log, val_curve
from model import GPTConfig
from train import ALL_DEFAULTS, BRANCH_FREE, MODEL_KEYS, schedule_differs, split_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
POLL = 0.2  # seconds between looks at the running processes
# A shorter budget branches from its full run only where that saves at least this share of its steps (ours: below it,
# the wait for the full run's branch point costs more than it saves); the recipe's schedule saves 1 - cooldown_frac
MIN_BRANCH_SHARE = 0.5
SBATCH = os.path.join(ROOT, "tools", "train.sbatch")  # the job of every run under --slurm
JOB_FILE = "slurm_job"  # in a run's directory: the id of the last job submitted for it


# ----------------------------------------------------------------------------- the runs

class Run:
    """One train.py process of the sweep: a variant at one seed and budget. A shorter budget branched from its full
    run (parent) starts from the full run's checkpoint of step `point` (its keep_full) and runs only its cooldown."""

    def __init__(self, variant, files, seed, budget, max_steps, overrides, out_dir, keep_full=(), parent=None,
                 point=None):
        self.variant, self.files, self.seed, self.budget, self.max_steps = variant, files, seed, budget, max_steps
        self.name = f"{variant}{'' if budget == 1 else f'_b{budget:g}'}_s{seed}"
        self.dir = os.path.join(out_dir, self.name)
        self.parent, self.waits_for = parent, parent and branch_path(parent.dir, point)
        if budget != 1:  # its own max_steps, in place of any given
            overrides = [a for a in overrides if not a.startswith("--max_steps=")] + [f"--max_steps={max_steps}"]
        keep = [f"--keep_full={','.join(map(str, keep_full))}"] if keep_full else []
        self.args = [*files, *overrides, *keep, f"--seed={seed}", f"--out_dir={self.dir}",
                     f"--init_from={self.waits_for or 'auto'}"]
        self.proc = self.started = self.cpu = None

    def poll(self):
        """The run's exit status once it has ended, else None; then its CPU time (user + system) is in self.cpu."""
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return None
        self.cpu, self.proc.returncode = usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)
        return self.proc.returncode

    def on_its_own(self):
        """A branch whose full run finished without its branch point (a sweep of other budgets ran it): from scratch.
        Returns the line that says so."""
        line = f"{self.name}: {self.parent.name} finished without its branch point {self.waits_for}: from scratch"
        self.waits_for, self.args[-1] = None, "--init_from=auto"
        return line + " instead"

    def ready(self):
        """Whether the run can start now: a branch once its branch point exists."""
        return self.waits_for is None or os.path.exists(self.waits_for)

    def finished(self):
        """Whether the run already holds its last step's checkpoint (a cheap read: nothing is loaded)."""
        try:
            return load_checkpoint(checkpoint_path(self.dir), ("step",), mmap=True)["step"] >= self.max_steps
        except (FileNotFoundError, ValueError):
            return False

    def command(self, env=None):
        """The shell command of the run (its environment first)."""
        prefix = [f"{k}={v}" for k, v in (env or {}).items()]
        return shlex.join(prefix + [sys.executable, os.path.relpath(os.path.join(ROOT, "train.py")), *self.args])

    def start(self, env):
        os.makedirs(self.dir, exist_ok=True)
        out = open(os.path.join(self.dir, "train.out"), "a")  # train.py's own output, for a look when it fails
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *self.args], stdout=out,
                                     stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     preexec_fn=_stop_with_parent, start_new_session=True)
        out.close()
        self.started = time.time()


def _stop_with_parent():
    """In the child: SIGTERM when the sweep dies, even by SIGKILL (Linux), so the run checkpoints and stops."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: a killed sweep leaves its runs going, and they finish on their own
        pass


def plan(configs, seeds, budgets, overrides, out_dir, branch=True):
    """Every run, seed after seed (so that an early look at a sweep sees every variant), each checked as
    train.py checks it before running: a bad config or key fails here, before anything starts. branch: each
    shorter budget is a branch of the same seed's full run (which keeps its branch point), else a run of its own."""
    variants = []
    for config in configs:
        files = config.split("+")
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{config}: no config file {missing[0]}")
        cfg = check_run(files + overrides)  # raises ValueError naming the key or file
        for split in ("train", "val") if not is_corpus(cfg.data_dir) else ():  # train.py builds the built-in one
            find_shards(cfg.data_dir, split)  # present, at least (train.py checks their contents)
        shorter = [(b, *shorter_budget(files, overrides, cfg, b, branch)) for b in budgets if b != 1]
        variants.append(("+".join(os.path.basename(f).removesuffix(".py") for f in files), files, cfg.max_steps,
                         shorter))
    names = [v for v, *_ in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"variant {twice[0]} given twice (its runs would share directories)")
    runs = []
    for seed in seeds:
        for variant, files, steps, shorter in variants:
            full = Run(variant, files, seed, 1, steps, overrides, out_dir, keep_full=tuple(p for *_, p in shorter if p))
            runs += [full] + [Run(variant, files, seed, b, m, overrides, out_dir, parent=full if p else None, point=p)
                              for b, m, p in shorter]
    return runs


def shorter_budget(files, overrides, cfg, budget, branch):
    """(max_steps, branch point or None) of a budget below 1 of the full run's cfg. Its branch point is the latest
    exact one (train.schedule_differs: up to it, both schedules agree at every step); where that saves less than
    MIN_BRANCH_SHARE of the shorter run, it is refused in one line."""
    steps = round(budget * cfg.max_steps)
    if steps < 1:
        raise ValueError(f"--budgets: {budget:g} of max_steps={cfg.max_steps} is no step at all")
    short = check_run(files + overrides + [f"--max_steps={steps}"])
    if not branch:
        return steps, None
    differs = schedule_differs(cfg, short, steps)
    point = steps - 1 if differs is None else differs  # a step the shorter run still takes after: its own log
    if point < MIN_BRANCH_SHARE * steps:
        raise ValueError(f"--budgets: {budget:g} ({steps} steps): its schedule and the full run's differ from step "
                         f"{point}, so a branch would save {point} of its {steps} steps, less than "
                         f"{MIN_BRANCH_SHARE:.0%}; --budgets_from_scratch runs it on its own")
    return steps, point


def check_run(args):
    """The TrainConfig that args give a new train.py run, checked as train.py checks it before it runs one process:
    keys, types, the model and the batch layout (no file is read but the config files)."""
    cfg, model_config = split_config({**ALL_DEFAULTS, **read_args(args, ALL_DEFAULTS)})
    cfg.check(model_config, 1)
    return cfg


def slots(parallel):
    """The environment of each of `parallel` slots: one GPU each when GPUs are visible, else a share of the cores."""
    import torch
    gpus = torch.cuda.device_count()
    if gpus:
        if parallel > gpus:
            raise ValueError(f"--parallel={parallel}: only {gpus} GPU(s) visible, one run per GPU")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
        return [{"CUDA_VISIBLE_DEVICES": visible[i]} for i in range(parallel)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, cores // parallel))
    return [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}] * parallel


def minutes(seconds):
    return f"{seconds / 60:.1f} min"


class Progress:
    """The sweep's lines: one when a run starts, ends, stops or fails, with the count and an ETA from the mean
    duration of the runs finished so far."""

    def __init__(self, total, parallel):
        self.total, self.parallel, self.done, self.durations = total, parallel, 0, []

    def say(self, text, count=None):
        print(f"[{self.done if count is None else count}/{self.total}] {text}", flush=True)

    def ended(self, r, code, left):
        """Say how r ended (exit status code, `left` runs to go); whether it did not fail."""
        elapsed = time.time() - r.started
        if code == 0:
            self.done += 1
            self.durations.append(elapsed)
            eta = f"ETA {minutes(np.mean(self.durations) * left / self.parallel)}" if left else "all done"
            self.say(f"done {r.name} in {minutes(elapsed)} (CPU {minutes(r.cpu)}); {eta}")
        elif code == PREEMPTED:
            self.say(f"stopped {r.name} after {minutes(elapsed)}: it resumes next time")
        else:
            self.say(f"FAILED {r.name} (exit status {code}); see {r.dir}/train.out")
        return code in (0, PREEMPTED)


def print_commands(runs):
    """One shell command per run: the full runs first, then each branch after a line naming the file it waits for."""
    for r in sorted(runs, key=lambda r: r.waits_for is not None):
        print(*[f"# waits for {r.waits_for}"] * bool(r.waits_for), r.command(), sep="\n")


def stranded(todo, busy):
    """The branches in todo whose branch point can no longer appear: their full run is neither running nor to run
    (it failed, or it finished without it)."""
    return [r for r in todo if not r.ready() and r.parent not in todo and r.parent not in busy.values()]


def sweep(runs, parallel):
    """Run every unfinished run, `parallel` at a time (a branch as soon as its branch point exists), a line per start
    and end. SIGINT/SIGTERM stop the running ones at their next step, with a checkpoint. Returns (the failed runs,
    whether a signal stopped the sweep)."""
    envs = slots(parallel)
    todo = [r for r in runs if not r.finished()]
    for r in runs:
        if r not in todo:
            print(f"skip {r.name}: finished (step {r.max_steps})")
    progress, failed, busy, stopping = Progress(len(todo), parallel), [], {}, []

    def stop(signum, frame):
        if not stopping:
            print(f"sweep.py: {signal.Signals(signum).name}: stopping the running runs at their next step "
                  f"(each writes a checkpoint); the same command continues the sweep", flush=True)
        stopping.append(signum)
        for r in busy.values():
            r.proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (todo and not stopping) or busy:
            for slot in [s for s in range(parallel) if s not in busy]:
                r = next((r for r in todo if r.ready()), None)
                if r is None or stopping:
                    break
                todo.remove(r)
                busy[slot] = r
                r.start(envs[slot])
                progress.say(f"start {r.name} ({r.dir})", progress.done + len(busy))
            time.sleep(POLL)
            for slot, r in list(busy.items()):
                if r.poll() is not None:
                    del busy[slot]
                    if not progress.ended(r, r.proc.returncode, len(todo) + len(busy)):
                        failed.append(r)
            for r in [] if stopping else stranded(todo, busy):
                if r.parent in failed:
                    todo.remove(r)
                    failed.append(r)
                    progress.say(f"FAILED {r.name}: its full run {r.parent.name} failed")
                else:
                    progress.say(r.on_its_own())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return failed, bool(stopping)


# ----------------------------------------------------------------------------- Slurm

def slurm(cmd, env=None):
    """The stdout of a Slurm command (env: added to this one's); a ValueError with its error line if it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode:
        why = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()[-1]
        raise ValueError(f"{cmd[0]} failed: {why}")
    return r.stdout


def queued_jobs(runs):
    """{run: job id} of the runs whose last job (the id in <run dir>/slurm_job) Slurm still holds: pending, running,
    suspended or requeued."""
    recorded = {}
    for r in runs:
        with contextlib.suppress(FileNotFoundError):
            with open(os.path.join(r.dir, JOB_FILE)) as f:
                recorded[r] = f.read().strip()
    if not recorded:
        return {}
    try:  # a finished job may be forgotten by now: squeue refuses a single unknown id, and skips it in a list
        held = set(slurm(["squeue", "--noheader", "--format=%A", f"--jobs={','.join(recorded.values())}"]).split())
    except ValueError as e:
        if "Invalid job id" not in str(e):
            raise
        held = set()
    return {r: job for r, job in recorded.items() if job in held}


def sbatch_command(r, options, after=None):
    """The sbatch command of run r: the user's options (GPUs, time, account, partition), its output file in its
    directory, and a dependency on job `after` (its full run), which Slurm cancels if that job fails."""
    return ["sbatch", "--parsable", f"--job-name={r.name}", f"--output={os.path.abspath(r.dir)}/slurm-%j.out",
            *options, *([f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"] if after else []),
            SBATCH, *r.args]


def job_env():
    """What train.sbatch runs: this interpreter and this train.py, wherever the sweep is started from."""
    return {"PYTHON": sys.executable, "TRAIN_PY": os.path.join(ROOT, "train.py")}


def submit(runs, options):
    """Submit, as a job each, the runs that are neither finished nor queued; a branch whose branch point is not yet
    written waits for its full run's job. A line per run. Returns {run: job id} of the jobs Slurm holds now."""
    missing = [c for c in ("sbatch", "squeue") if not shutil.which(c)]
    if missing:
        raise ValueError(f"--slurm: no {missing[0]} on PATH (Slurm's commands, on a machine that submits jobs)")
    queued, jobs = queued_jobs([r for r in runs if not r.finished()]), {}
    for r in runs:  # a full run comes before its branches
        if r.finished():
            print(f"skip {r.name}: finished (step {r.max_steps})")
        elif r in queued:
            jobs[r] = queued[r]
            print(f"queued {r.name}: job {jobs[r]}")
        else:
            after = None
            if not r.ready():
                if r.parent in jobs:
                    after = jobs[r.parent]
                else:
                    print(r.on_its_own())
            os.makedirs(r.dir, exist_ok=True)
            submitted = slurm(sbatch_command(r, options, after), job_env())
            jobs[r] = submitted.strip().split(";")[0]  # --parsable: the id, then ";cluster" on a federation
            with atomic_write(os.path.join(r.dir, JOB_FILE), "w") as f:
                f.write(jobs[r] + "\n")
            print(f"submitted {r.name}: job {jobs[r]}" + (f", after job {after}" if after else ""), flush=True)
    return jobs


def print_jobs(runs, options):
    """The shell commands that submit the sweep's jobs, a branch after its full run's job (its id in a variable)."""
    env = [f"{k}={v}" for k, v in job_env().items()]
    print(shlex.join(["mkdir", "-p", *(os.path.abspath(r.dir) for r in runs)]))  # where the jobs' output goes
    ids = {}
    for n, r in enumerate(runs, 1):
        ids[r] = f"job{n}"
        cmd = env + sbatch_command(r, options, r.waits_for and f"${ids[r.parent]}")
        print(f"{ids[r]}=$(" + " ".join(w if w.startswith("--dependency=") else shlex.quote(w) for w in cmd) + ")")


# ----------------------------------------------------------------------------- the report

# Keys that cannot change what a run computes or logs (train.py's BRANCH_FREE), and the seed: runs differing only in
# them are replicates of one variant
RUN_KEYS = BRANCH_FREE | {"seed"}
# Student's t 0.975 quantiles for 1..30 degrees of freedom (any table); beyond, 1.96 + 2.4/df is within 0.001
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
BOOTSTRAP = 4000  # resamples of the seeds for the ratios' intervals (a fixed RNG: the report is reproducible)


@dataclass
class RunLog:
    """What the report reads of one run directory: its log.jsonl."""
    path: str
    config: dict  # the last (re)start's whole configuration
    curve: list  # [(step, val_loss)] of every evaluation, step 0 included

    @property
    def seed(self):
        return self.config["seed"]

    @property
    def max_steps(self):
        return self.config["max_steps"]

    @property
    def tokens_per_step(self):
        return self.config["total_batch_size"]

    @property
    def final(self):
        """The validation loss of the last step, or None for a run that has not finished."""
        return self.curve[-1][1] if self.curve and self.curve[-1][0] == self.max_steps else None


def read_run(path):
    """The RunLog of a run directory, or a ValueError saying why it is none."""
    entries = read_log(path)
    configs = [e["config"] for e in entries if "config" in e]
    if not configs:
        raise ValueError(f"{log_path(path)}: no configuration record (not written by train.py)")
    return RunLog(path, configs[-1], val_curve(entries))


def t_interval(xs):
    """(mean, std with ddof 1, [lo, hi] of the mean's 95% t interval); std and interval None for one value."""
    xs = np.asarray(xs, dtype=float)
    mean = float(xs.mean())
    if len(xs) < 2:
        return mean, None, None
    std, df = float(xs.std(ddof=1)), len(xs) - 1
    half = (T975[df - 1] if df <= len(T975) else 1.96 + 2.4 / df) * std / math.sqrt(len(xs))
    return mean, std, [mean - half, mean + half]


def tokens_to_target(run, target):
    """Tokens at which the run's validation curve first reaches target, linearly interpolated between the two
    evaluations around the crossing; None if it never does."""
    for (s0, l0), (s1, l1) in zip(run.curve, run.curve[1:]):
        if l1 <= target:
            step = s1 if l0 == l1 else s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
            return max(step, s0) * run.tokens_per_step
    return None


def token_ratio(ref_runs, runs, target=None):
    """Reference tokens at its last evaluation / mean tokens_to_target of the runs that reach the target (the
    mean of the reference's final losses unless given); None if none reaches it."""
    target = np.mean([r.final for r in ref_runs]) if target is None else target
    reached = [t for t in (tokens_to_target(r, target) for r in runs) if t is not None]
    ref_tokens = np.mean([r.max_steps * r.tokens_per_step for r in ref_runs])
    return float(ref_tokens / np.mean(reached)) if reached else None


def budget_ratio(ref_runs, budgets):
    """Reference tokens / the budget (tokens) at which the variant's mean final loss equals the reference's mean
    final loss, interpolated linearly between the two budgets around it; budgets: {tokens: [runs]}. None when
    the target lies outside the budgets measured."""
    target = np.mean([r.final for r in ref_runs])
    ref_tokens = np.mean([r.max_steps * r.tokens_per_step for r in ref_runs])
    points = sorted((tokens, np.mean([r.final for r in runs])) for tokens, runs in budgets.items())
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l0 >= target >= l1:
            return float(ref_tokens / (t1 if l0 == l1 else t0 + (l0 - target) / (l0 - l1) * (t1 - t0)))
    return None


def bootstrap(statistic, *groups, seed=0):
    """95% percentile interval of statistic(*groups) over BOOTSTRAP resamples, each group's runs resampled with
    replacement on its own; resamples where the statistic is undefined (None) are left out. None if too few,
    or if a group has a single run (nothing to resample)."""
    sizes = [len(r) for g in groups for r in (g.values() if isinstance(g, dict) else [g])]
    if min(sizes) < 2:
        return None
    rng, values = np.random.default_rng(seed), []
    for _ in range(BOOTSTRAP):
        value = statistic(*[resample(g, rng) for g in groups])
        if value is not None:
            values.append(value)
    if len(values) < BOOTSTRAP / 2:
        return None
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]


def resample(group, rng):
    """A list of runs drawn with replacement; or {budget: runs on the same seeds, in seed order}, the same seeds drawn
    for every budget, so that each resampled curve is on one set of seeds too."""
    n = len(next(iter(group.values())) if isinstance(group, dict) else group)
    picks = rng.integers(0, n, n)
    if isinstance(group, dict):
        return {k: [v[i] for i in picks] for k, v in group.items()}
    return [group[i] for i in picks]


def budget_curve(runs):
    """({tokens: runs in seed order}, seeds) of a variant's budgets, on only the seeds that every budget has: each
    point of the curve is then a mean over the same seeds, and the ratio compares budgets, not seed sets."""
    budgets = {}
    for r in runs:
        budgets.setdefault(r.max_steps * r.tokens_per_step, []).append(r)
    seeds = sorted(set.intersection(*({r.seed for r in rs} for rs in budgets.values())))
    return {t: sorted((r for r in rs if r.seed in seeds), key=lambda r: r.seed)
            for t, rs in sorted(budgets.items())}, seeds


def group_variants(runs):
    """{label: [runs]} in the order first seen: runs whose configurations differ only in RUN_KEYS (and in
    max_steps: a variant's budgets) are one variant. A label is the variant's GPTConfig.name, plus the keys that
    tell it apart from variants of the same name."""
    key = lambda r: json.dumps({k: v for k, v in r.config.items() if k not in RUN_KEYS | {"max_steps"}},
                               sort_keys=True)
    groups = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    configs = {k: json.loads(k) for k in groups}
    name = {k: GPTConfig.from_dict({f: c[f] for f in MODEL_KEYS if f in c}).name for k, c in configs.items()}
    labels = {}
    for k, c in configs.items():
        twins = [configs[o] for o in configs if o != k and name[o] == name[k]]
        differing = sorted({f for t in twins for f in c if t.get(f) != c[f]})
        labels[k] = name[k] + (f" ({', '.join(f'{f}={c[f]!r}' for f in differing)})" if differing else "")
    return {labels[k]: rs for k, rs in groups.items()}


def describe(label, runs, ref_label, ref_full):
    """The report's entry for one variant against the reference's full-budget runs."""
    full_steps = max(r.max_steps for r in runs)
    full = sorted((r for r in runs if r.max_steps == full_steps), key=lambda r: r.seed)
    finals = [r.final for r in full]
    mean, std, ci = t_interval(finals)
    out = {"runs": len(full), "seeds": [r.seed for r in full], "final_val_loss": finals, "mean": mean, "std": std,
           "ci95": ci, "max_steps": full_steps, "tokens": full_steps * full[0].tokens_per_step}
    ref_by_seed = {r.seed: r.final for r in ref_full}
    deltas = [r.final - ref_by_seed[r.seed] for r in full if r.seed in ref_by_seed]
    if label != ref_label and deltas:
        d_mean, _, d_ci = t_interval(deltas)
        out.update(paired_seeds=[r.seed for r in full if r.seed in ref_by_seed], delta_mean=d_mean, delta_ci95=d_ci,
                   resolved=None if d_ci is None else not d_ci[0] <= 0 <= d_ci[1])
    target = float(np.mean([r.final for r in ref_full]))
    out.update(target=target, tokens_to_target=[tokens_to_target(r, target) for r in full])
    budgets, seeds = budget_curve(runs)
    out.update(budget_seeds=seeds, target_seeds=[r.seed for r in ref_full])
    out["budgets"] = {str(t): {"max_steps": m, "seeds": seeds, "mean_final_val_loss": mean_or_none(rs),
                               "seeds_left_out": sorted(r.seed for r in runs
                                                        if r.max_steps == m and r.seed not in seeds)}
                      for t, rs in budgets.items() for m in [t // full[0].tokens_per_step]}
    if label != ref_label:  # the reference against itself would be 1 by definition
        out.update(token_ratio=token_ratio(ref_full, full), token_ratio_ci95=bootstrap(token_ratio, ref_full, full))
        if len(budgets) > 1 and seeds:
            out.update(budget_ratio=budget_ratio(ref_full, budgets),
                       budget_ratio_ci95=bootstrap(budget_ratio, ref_full, budgets))
    return out


def mean_or_none(runs):
    return float(np.mean([r.final for r in runs])) if runs else None


def report(run_dirs, reference=None):
    """({label: entry}, {label: full-budget runs}) for the finished runs among run_dirs, the reference first
    (docs/STUDY.md and REFERENCE.md's Sweeps define each number); unfinished runs are left out with a note."""
    runs = []
    for d in run_dirs:
        r = read_run(d)
        if r.final is None:
            last = r.curve[-1][0] if r.curve else 0
            print(f"note: {d}: not finished (evaluated up to step {last} of {r.max_steps}), left out", file=sys.stderr)
        else:
            runs.append(r)
    if not runs:
        raise ValueError("no finished run among the run directories")
    variants = group_variants(runs)
    ref = reference or next(iter(variants))
    if ref not in variants:
        raise ValueError(f"--reference={ref!r}: no such variant; the variants are {', '.join(map(repr, variants))}")
    full = {v: [r for r in runs if r.max_steps == max(r.max_steps for r in runs)] for v, runs in variants.items()}
    order = [ref] + [v for v in variants if v != ref]
    rep = {v: {"reference": v == ref, **describe(v, variants[v], ref, full[ref])} for v in order}
    return rep, {v: full[v] for v in order}


def markdown(rep):
    """The report as a markdown table."""
    f = lambda x, fmt=".4f": "–" if x is None else format(x, fmt)
    ci = lambda c, fmt=".4f": "–" if c is None else f"[{f(c[0], fmt)}, {f(c[1], fmt)}]"
    lines = ["| variant | seeds | final val loss, mean ± std | 95% CI | Δ vs reference (paired) | Δ 95% CI "
             "| resolved | token ratio | 95% CI | budget ratio | 95% CI |", "|" + "---|" * 11]
    for label, e in rep.items():
        delta = "reference" if e["reference"] else f(e.get("delta_mean"), "+.4f")
        resolved = {True: "yes", False: "no", None: "–"}[e.get("resolved")]
        lines.append(f"| {label} | {len(e['seeds'])} | {f(e['mean'])} ± {f(e['std'])} | {ci(e['ci95'])} | {delta} | "
                     f"{ci(e.get('delta_ci95'), '+.4f')} | {resolved} | {f(e.get('token_ratio'), '.3f')} | "
                     f"{ci(e.get('token_ratio_ci95'), '.3f')} | {f(e.get('budget_ratio'), '.3f')} | "
                     f"{ci(e.get('budget_ratio_ci95'), '.3f')} |")
    return "\n".join(lines + [note for label, e in rep.items() if (note := budget_note(label, e, rep))])


def budget_note(label, e, rep):
    """The line under the table that says which seeds a variant's budget ratio uses, and its target's."""
    if len(e["budgets"]) < 2 or e["reference"]:  # the reference has no budget ratio
        return None
    seeds = lambda xs: ", ".join(map(str, xs)) or "none"
    left = "; ".join(f"seeds {seeds(b['seeds_left_out'])} of the {b['max_steps']}-step runs" for b in
                     e["budgets"].values() if b["seeds_left_out"])
    ref = next(k for k, v in rep.items() if v["reference"])
    return (f"\n{label}: the budget curve uses seeds {seeds(e['budget_seeds'])}, those every budget has"
            f"{f' (left out: {left})' if left else ''}. Its target is {ref}'s mean final loss over all its seeds "
            f"({seeds(e['target_seeds'])}), the token ratio's target too: the reference's loss, which all its runs "
            f"estimate, whichever seeds the variant has.")


def plot_report(rep, full_runs, path):
    """Mean validation loss against tokens per variant (its full-budget runs), a min-max band over the seeds, and
    the target line; the whole run, and its last 30% where the curves separate. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    target = next(iter(rep.values()))["target"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for label, runs in full_runs.items():
        steps = sorted(set.intersection(*[{s for s, _ in r.curve} for r in runs]))
        losses = np.array([[dict(r.curve)[s] for s in steps] for r in runs])
        tokens = np.array(steps) * runs[0].tokens_per_step / 1e6
        for ax in axes:
            line, = ax.plot(tokens, losses.mean(0), label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(tokens, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
    end = max(r.max_steps * r.tokens_per_step for runs in full_runs.values() for r in runs) / 1e6
    late = [l for runs in full_runs.values() for r in runs for s, l in r.curve
            if s * r.tokens_per_step / 1e6 >= 0.7 * end]
    for ax, title in zip(axes, ("validation loss (mean over seeds; band: min to max)", "the last 30%")):
        ax.axhline(target, color="gray", ls="--", lw=0.8, label="target: the reference's mean final loss")
        ax.set(title=title, xlabel="tokens (millions)", ylabel="validation loss")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(min(late) - 0.1, target + 3)  # the first steps' losses (~10.8) would squash the rest
    axes[1].set(xlim=(0.7 * end, 1.01 * end), ylim=(min(late) - 0.01, max(late) + 0.01))
    axes[1].legend(fontsize=8)
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


def write_report(run_dirs, reference=None, out=None):
    """Report on run_dirs: print the table, write the JSON (default: report.json in their common folder) and,
    with matplotlib, the figure beside it (report.png)."""
    rep, full_runs = report(run_dirs, reference)
    out = out or os.path.join(os.path.commonpath([os.path.abspath(d) for d in run_dirs]), "report.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with atomic_write(out, "w") as f:
        f.write(json.dumps(rep, indent=1) + "\n")
    print(markdown(rep))
    print(f"wrote {out}")
    figure = plot_report(rep, full_runs, os.path.splitext(out)[0] + ".png")
    print(f"wrote {figure}" if figure else "matplotlib is not installed: no figure (pip install matplotlib)")
    return rep


# ----------------------------------------------------------------------------- command line

def build_parser():
    """The sweep's own options; every other --key=value is a train.py key (parse_args passes it on)."""
    p = argparse.ArgumentParser(description="Variants x seeds as train.py runs, and their report", allow_abbrev=False,
                                epilog="Every other --key=value is a train.py key and goes to every run.")
    p.add_argument("configs", nargs="*", help="one variant each: a config file, or files joined by '+'")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: each variant runs once per seed")
    p.add_argument("--out_dir", default="out/sweep", help="the runs go to OUT_DIR/<variant>_s<seed>")
    p.add_argument("--parallel", type=int, default=1, help="runs at once: one per GPU, or a share of the CPU cores")
    p.add_argument("--budgets", default="1", help="fractions of max_steps, each a run with its own full schedule "
                   "(the budget-matched data efficiency), e.g. 0.5,0.75,1: a shorter one branches its cooldown from "
                   "the same seed's full run")
    p.add_argument("--budgets_from_scratch", action="store_true", help="run each shorter budget on its own, from "
                   "step 0, instead of branching it from the full run")
    p.add_argument("--print", action="store_true", help="print one shell command per run and run nothing (with "
                   "--slurm: the sbatch commands)")
    p.add_argument("--slurm", action="store_true", help="submit every run that is neither finished nor queued as a "
                   "Slurm job of train.sbatch, a branch after its full run's job; report once all have finished")
    p.add_argument("--sbatch", default="", metavar="OPTIONS", help="sbatch options for every job, after an '=': "
                   "--sbatch=\"--gpus-per-node=1 --time=4:00:00 --account=A --partition=P\"")
    p.add_argument("--report", nargs="+", metavar="RUN_DIR", help="only compare these run directories")
    p.add_argument("--reference", default=None, help="the report's reference variant (default: the first)")
    p.add_argument("--out", default=None, help="the report's JSON (default: OUT_DIR/report.json)")
    return p


def parse_args(argv):
    """(sweep options, train.py overrides, configs) of a sweep's command line."""
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    args.configs += [a for a in rest if not a.startswith("-")]  # configs given after a train.py key
    rest = [a for a in rest if a.startswith("-")]
    bad = [a for a in rest if not a.startswith("--") or "=" not in a]
    if bad:
        p.error(f"{bad[0]}: expected --key=value (a train.py key)")
    for a in rest:
        if a.split("=")[0] in ("--seed", "--init_from", "--keep_full"):
            p.error(f"{a}: the sweep sets it for every run (use --seeds)")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.budgets = sorted({float(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        p.error(f"--seeds={args.seeds} / --budgets={args.budgets}: expected comma-separated numbers")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds: expected distinct integers, got {args.seeds}")
    if not all(0 < b <= 1 for b in args.budgets) or 1 not in args.budgets:
        p.error(f"--budgets={args.budgets}: expected fractions in (0, 1], 1 among them")
    if args.parallel < 1:
        p.error(f"--parallel={args.parallel}: expected a positive integer")
    if not args.report and not args.configs:
        p.error("expected CONFIG... to run, or --report RUN_DIR...")
    try:
        args.sbatch = shlex.split(args.sbatch)
    except ValueError as e:
        p.error(f"--sbatch={args.sbatch}: {e} (expected sbatch options, as on a shell command line)")
    if args.sbatch and not args.slurm:
        p.error("--sbatch: expected with --slurm (the options of its jobs)")
    return args, rest


def main(argv=None):
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.report:
            return write_report(args.report, args.reference, args.out)
        runs = plan(args.configs, args.seeds, args.budgets, overrides, args.out_dir, not args.budgets_from_scratch)
        if args.print:  # nothing runs
            print_jobs(runs, args.sbatch) if args.slurm else print_commands(runs)
            return runs
        if args.slurm:
            jobs = submit(runs, args.sbatch)
            if jobs:
                print(f"{len(jobs)} job(s) in Slurm's queue; the same command again submits what is neither finished "
                      f"nor queued, and reports once every run has finished")
                return runs
        else:
            failed, stopped = sweep(runs, args.parallel)
            if stopped:
                sys.exit(PREEMPTED)
            if failed:
                sys.exit(f"sweep.py: error: {len(failed)} run(s) failed: {', '.join(r.name for r in failed)}")
        return write_report([r.dir for r in runs], args.reference,
                            args.out or os.path.join(args.out_dir, "report.json"))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"sweep.py: error: {e}")


if __name__ == "__main__":
    main()
