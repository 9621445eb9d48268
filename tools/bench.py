"""
Time training steps (forward + backward + Muon/AdamW) of several variants side by side, in one process,
interleaved so that they share the machine's ups and downs, and compare with their FLOP ratios:

    python -m tools.bench configs/gated.py configs/exoformer_e.py configs/dyn_exo.py --block_size=256 --batch_size=8
    python -m tools.bench configs/gated.py configs/dyn_exo.py --n_layer=4 --n_embd=128 --n_head=4   # CPU size

Each positional argument is one model: files are not composed as in train.py, so give a size as
--key=value. Every --key=value (any train.py or model key, plus the bench keys) applies to all models;
--compare=KEY times each of them with a True/False key off and on, side by side. The first row is the
reference of the ratio columns. --profile=True says instead where each model's step time goes, by part of the
model (the anchors, the dynamic scales, the mix, a recompute, the rest, the optimisers), forward and backward, under
torch.profiler, eager:

    python -m tools.bench configs/gated.py configs/dyn_exo.py --block_size=256 --batch_size=2 --optimizer=False \
        --profile=True --rounds=2 --steps=2 --warmup=1

--memory=True measures activation memory instead of time:

    python -m tools.bench configs/gated.py configs/dyn_exo.py --memory=True --dtype=bfloat16

--ranks=8,64 adds what each GPU holds when FSDP shards the model over that many (an estimate from the shapes).
Under torchrun the rows train in DDP, or FSDP with --fsdp=True (--compare=fsdp gives both), and a table per rank
follows, measured: the bytes of this rank's parameters, gradients and optimiser states (FSDP's: its shards) and
what a step's collectives move, by kind:

    torchrun --nproc_per_node=2 -m tools.bench configs/dyn_exo.py --n_layer=4 --n_embd=128 --n_head=4 --compare=fsdp

--checkpoint=DIR times writing each model's resume checkpoint into DIR (tmpfs such as /dev/shm, or a disk) instead,
as ckpt.pt and as ckpt.dcp, side by side: without checksums, as before the manifests (torch.save's CRC-32s) and now
(and ckpt.dcp's manifest), the checksums that every read verifies:

    python -m tools.bench configs/dyn_exo.py --checkpoint=/dev/shm

With --resume_ranks=1,2,4 it then launches train.py under torchrun with the row's keys (--data_dir among them), at
each number of processes, DDP (ckpt.pt) and FSDP (ckpt.dcp), fresh and resumed, and prints what a resume reads (each
process's /proc/self/io rchar at its first step, summed, less a fresh start's) in units of the checkpoint's bytes,
and the seconds from the launch to the first step; then what --verify_data=True reads at the most processes:

    python -m tools.bench configs/dyn_exo.py --n_layer=4 --n_embd=128 --n_head=4 --block_size=256 --batch_size=2 \\
        --total_batch_size=2048 --data_dir=data/stdlib --checkpoint=/dev/shm --resume_ranks=1,2,4

--gpu=True is the check for a CUDA GPU: Gated Attention against Dynamic E-ExoFormer at the paper's 450M shapes,
with compile and doc_mask each off and on, beside the paper's overhead and the FLOP ratio:

    python -m tools.bench --gpu=True
"""
import collections
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.utils.serialization
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import model as model_file
import train
from engine import parallel, sharding
from engine.checkpoint import save_checkpoint
from engine.configurator import help_text, key_comments, load_config, wants_help
from engine.data import read_manifest
from model import EOT, GPT, GPTConfig, flops_per_token
from optim import Muon, clip_gradients, moment_shape, muon_params, state_floats
from train import ALL_DEFAULTS, build_optimizers, help_sections, split_config

BENCH_DEFAULTS = dict(
    steps=5,  # timed steps per model per round
    rounds=3,  # rounds of interleaving; the median step time over all rounds is reported
    warmup=2,  # untimed steps per model first (compilation, allocator)
    optimizer=True,  # False: time forward + backward only (isolates the model's own cost)
    compare="",  # a True/False key (doc_mask, activation_checkpointing): every model with it off, then on
    doc_len=1000,  # mean document length of the synthetic tokens (an <|endoftext|> opens each document)
    memory=False,  # True: instead of timing, measure the activation memory of one block_size sequence
    ranks=(),  # with memory: also the bytes per GPU, and the micro-batch that fits, with FSDP over these many GPUs
    gpu=False,  # True: configs/gated.py against configs/dyn_exo.py, compile and doc_mask off and on (CUDA only)
    checkpoint="",  # a folder: time writing a resume checkpoint there instead, its checksums off and on
    profile=False,  # True: instead of timing, where each model's step time goes, by part (torch.profiler, eager)
    resume_ranks=(),  # with checkpoint: also what a train.py resume reads, at each of these numbers of processes
)
# the paper's pair at 450M: Gated Attention, Dynamic E-ExoFormer
GPU_MODELS = ["configs/gated.py", "configs/dyn_exo.py"]
# ExoFormer's extra step time over Gated Attention's in the authors' code, as the paper reports it (the figure
# docs/REFERENCE.md and issue 20 quote)
PAPER_OVERHEAD = "8-15%"
# What a GPU holds besides activations, per parameter: fp32 weights and gradients (DDP's buckets are the same memory:
# parallel.data_parallel's gradient_as_bucket_view), and its optimiser's fp32 state (optim.state_floats: Muon a
# momentum, its NorMuon moments being small; AdamW two moments); bytes per parameter.
WEIGHT_BYTES = GRAD_BYTES = 4
LOGIT_BYTES = 2 + 4 + 4  # a loss chunk's transient logits: bf16, fp32, and their gradient
HEADROOM = 0.9  # of a GPU's memory usable for all this: the rest for CUDA context, workspaces, fragmentation
# FSDP's transient bytes per parameter: the unit being run and the one prefetched, gathered in bf16 with their
# unsharded gradients (bf16, then fp32 for the reduce-scatter); the root unit (lm_head, ln_f) is gathered for
# the whole step. Ours, from fully_shard's defaults, not measured (test_cuda.py measures a GPU's peak).
GATHERED_BYTES = 2 + 2 + 4
# Muon under FSDP: each owner holds its whole matrices, the gathered update in fp32, and its result (fp32) with
# Polar Express's bf16 iterates (X, A, A @ A), per parameter it owns (sharding.Exchange)
OWNED_BYTES = 4 + 4 + 3 * 2
# the c10d ops that torch.distributed's collectives dispatch, by kind, and the argument whose bytes are counted:
# a whole buffer (all-reduce, broadcast: the tensor; all-gather: its output; reduce-scatter, all-to-all: the input)
COLLECTIVES = {"allreduce_": ("all_reduce", 0), "broadcast_": ("broadcast", 0), "allgather_": ("all_gather", 0),
               "_allgather_base_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
               "alltoall_base_": ("all_to_all", 1)}


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
    if argv and argv[0].startswith("--first_step"):  # a process of resume_table's launches
        return first_step(argv[0].partition("=")[2], argv[0].startswith("--first_step_stop"), argv[1:])
    if wants_help(argv):
        print(help_text(__doc__, [("bench keys", BENCH_DEFAULTS, key_comments(__file__, "BENCH_DEFAULTS"))]
                        + help_sections()))
        return None
    files = [a for a in argv if not a.startswith("--")]
    overrides = [a for a in argv if a.startswith("--")]
    defaults = {**ALL_DEFAULTS, **BENCH_DEFAULTS}
    try:
        if load_config(overrides, defaults)["gpu"]:
            return gpu_check(files, [o for o in overrides if not o.startswith("--gpu=")])
        if not files:
            sys.exit(__doc__)
        runs = []  # a Row of every row of the table: one per file, or two with compare
        for f in files:
            flat = load_config([f] + overrides, defaults)
            key = flat["compare"]
            if key and not isinstance(ALL_DEFAULTS.get(key), bool):
                raise ValueError(f"--compare={key}: expected a True/False key such as doc_mask or "
                                 f"activation_checkpointing")
            name = os.path.basename(f)[:-3]
            for on in (False, True) if key else (None,):
                row = {**flat, key: on} if key else flat
                runs.append(Row(name + f"+{key}" * bool(on), *split_config(row),
                                {k: row[k] for k in BENCH_DEFAULTS}))  # checks every model before any work
        folder = runs[0].bench["checkpoint"]
        if folder and not os.path.isdir(folder):
            raise FileNotFoundError(f"--checkpoint={folder}: no such folder")
        env = parallel.join(next((r.cfg for r in runs if r.cfg.fsdp), runs[0].cfg))  # FSDP needs torchrun
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"bench.py: error: {e}")
    if env.rank:  # under torchrun every rank runs the same rows; rank 0 prints them
        sys.stdout = open(os.devnull, "w")
    if runs[0].bench["memory"]:
        return memory_table(runs, env)
    if runs[0].bench["checkpoint"]:
        result = checkpoint_table(runs, runs[0].bench["checkpoint"])
        for row in runs if runs[0].bench["resume_ranks"] else ():
            result.update(resume_table(row, runs[0].bench["checkpoint"]))
        return result
    if runs[0].bench["profile"]:
        return profile_table(runs, env)
    return timing_table(runs, env)


def gpu_check(files, overrides):
    """--gpu=True: a micro-step of train.py's (8 x 2048 tokens, bf16 autocast) and the optimisers' step, of the
    paper's pair at 450M, with compile and doc_mask each off and on, on one CUDA GPU; each table followed by the
    ExoFormer/Gated step-time ratio."""
    if files:
        raise ValueError(f"--gpu=True times {' and '.join(GPU_MODELS)}: leave out {' '.join(files)}")
    if not torch.cuda.is_available():
        raise ValueError("--gpu=True measures the 450M models on a CUDA GPU, and torch sees none here")
    for use_compile in (False, True):
        for doc_mask in (False, True):
            gated, exo = main(GPU_MODELS + overrides + [f"--compile={use_compile}", f"--doc_mask={doc_mask}"])
            T = gated.config.block_size
            print(f"Dynamic E-ExoFormer / Gated Attention step time: "
                  f"{statistics.median(exo.times) / statistics.median(gated.times):.3f} (the paper: {PAPER_OVERHEAD} "
                  f"more); FLOP ratio {flops_per_token(exo.model, T) / flops_per_token(gated.model, T):.4f}\n")
            del gated, exo
            torch.cuda.empty_cache()
    return None


@dataclass
class Row:
    """One row of a table: a model and its settings, then what was measured of it."""
    name: str
    cfg: object  # train.TrainConfig
    config: GPTConfig
    bench: dict  # the BENCH_DEFAULTS keys
    model: GPT = None
    optimizers: list = None
    forward: object = None  # the model, compiled or not
    times: list = field(default_factory=list)  # seconds per timed step
    memory: int = None  # peak bytes allocated (CUDA)
    per_layer: int = None  # --memory: bytes saved for backward per layer, ...
    fixed: int = None  # ... and outside the layers
    total: int = None  # ... and in all, at full depth
    state: int = None  # ... and the bytes of weights, gradients, optimiser states and a loss chunk's logits
    fits: list = None  # micro-batches that fit 40, 80 and 141 GB
    parts: collections.Counter = None  # --profile: self CPU µs by (part, phase) over all profiled steps


def timing_table(runs, env):
    first = runs[0]
    B, T = first.cfg.batch_size, first.config.block_size
    what = "forward+backward+optimisers" if first.bench["optimizer"] else "forward+backward"
    print(f"{what}: {env.device}, {first.cfg.dtype or 'auto'} dtype, compile={env.compile}, "
          f"doc_mask={first.cfg.doc_mask}, batch {B} x {T} tokens, "
          f"{first.bench['rounds']} rounds x {first.bench['steps']} steps (+{first.bench['warmup']} warmup)")
    x, y = synthetic_batch(B, T, first.config.vocab_size, first.bench["doc_len"], env.device, first.config.eot_token)
    for row in runs:  # built one after another: peak memory is per model
        base = peak_memory_reset(env.device)
        build(row, env)
        for _ in range(row.bench["warmup"]):
            step(row, x, y, env)
        row.memory = peak_memory(env.device, base)
    for _ in range(first.bench["rounds"]):
        for row in runs:
            for _ in range(row.bench["steps"]):
                row.times.append(step(row, x, y, env))

    ref_ms = statistics.median(first.times) * 1000
    ref_flops = flops_per_token(first.model, T)
    print(f"\n{'config':<36}{'params':>14}{'ms/step':>10}{'tok/s':>12}{'MFU':>7}{'peak mem':>11}{'time ratio':>12}"
          f"{'FLOP ratio':>12}")
    for row in runs:
        ms = statistics.median(row.times) * 1000
        mem = "-" if row.memory is None else f"{row.memory / 2**30:.2f} GiB"
        # the FLOPs train.py's MFU counts (causal attention); on a CPU there is no peak to hold them against
        mfu = f"{flops_per_token(row.model, T) * B * T / ms * 1000 / row.cfg.gpu_peak_flops:.1%}" \
            if env.device.startswith("cuda") else "-"
        print(f"{row.name:<36}{row.model.num_params():>14,}{ms:>10.1f}{B * T / ms * 1000:>12,.0f}{mfu:>7}"
              f"{mem:>11}{ms / ref_ms:>12.4f}{flops_per_token(row.model, T) / ref_flops:>12.4f}")
    for row in runs[1:]:  # one run's own spread: each round's median against the first row's in the same round
        ratios = [a / b for a, b in zip(round_medians(row), round_medians(first))]
        print(f"time ratio by round, {row.name}: {' '.join(f'{r:.4f}' for r in ratios)} "
              f"(spread {max(ratios) - min(ratios):.4f})")
    if env.distributed:
        rank_table(runs, x, y, env)
    return runs


def round_medians(row):
    """The median step time of each round of row.times (steps per round, in the order they ran)."""
    n = row.bench["steps"]
    return [statistics.median(row.times[i:i + n]) for i in range(0, len(row.times), n)]


def build(row, env):
    """The row's model (seeded) and optimisers, as train.py builds them: under torchrun in DDP, or sharded by FSDP
    (the row's fsdp key)."""
    torch.manual_seed(row.cfg.seed)
    model = GPT(row.config)
    model.activation_checkpointing = row.cfg.activation_checkpointing
    if row.cfg.fsdp:
        row.model = row.forward = sharding.fully_shard_model(model, env)
    else:
        row.model = model.to(env.device)
        row.forward = parallel.data_parallel(torch.compile(row.model) if env.compile else row.model, env)
    row.optimizers = build_optimizers(row.model, row.cfg) if row.bench["optimizer"] else None


# --profile=True: the parts of a step, each the forward of some modules or functions of model.py and, linked to it by
# autograd's sequence numbers, its backward; "recompute" is any of them (or a checkpointed block) run again in backward
PARTS = ("anchors", "dynamic scales", "mix", "recompute", "rest", "optimizers")
PHASES = ("forward", "backward", "optimizer")  # step's record_function ranges
PART_FUNCTIONS = {"mix_with_anchor": "mix", "dynamic_mix": "mix"}  # model.py's functions that are a part
BACKWARD_NODE = "autograd::engine::evaluate_function: "  # the profiler's range around each backward node it runs


@contextlib.contextmanager
def named_parts(model):
    """Inside it, each part of model's forward (PARTS) runs in a record_function range "part::NAME", set from outside
    model.py by wrappers of modules' forward (anchor_proj, each DynamicScale; each Block, only when run again) and of
    functions (GPT.normalize, PART_FUNCTIONS). Run inside a backward pass (checkpointing's recompute, which may stop
    midway: a range closes on the way out of an exception too), a part is named "recompute"."""
    def wrapped(fn, part):
        def run(*args, **kwargs):
            name = "recompute" if torch._C._current_autograd_node() is not None else part  # inside a backward node
            if name is None:
                return fn(*args, **kwargs)
            with record_function("part::" + name):
                return fn(*args, **kwargs)
        return run

    modules = [(model.anchor_proj, "anchors")] + [(b.attn.dyn, "dynamic scales") for b in model.blocks] + \
        [(b, None) for b in model.blocks]
    owners = [(m, "forward", part) for m, part in modules if m is not None] + [(model, "normalize", "anchors")] + \
        [(model_file, name, part) for name, part in PART_FUNCTIONS.items() if hasattr(model_file, name)]
    originals = [getattr(owner, name) for owner, name, _ in owners]
    for (owner, name, part), fn in zip(owners, originals):
        setattr(owner, name, wrapped(fn, part))  # an instance's attribute, over its class's method
    try:
        yield
    finally:
        for (owner, name, _), fn in zip(owners, originals):
            if owner is model_file:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # the class's method again


def part_times(events):
    """{(part, phase): self CPU µs} of the profiled events: each event's own time (not its children's) goes to the
    part of its nearest enclosing part range, or of the backward node it runs in (the part of the forward op with that
    node's sequence number), else to "rest"; under the optimizer range, to "optimizers". Their sum is the time of the
    step's ranges."""
    def ancestors(e):
        while e is not None:
            yield e
            e = e.cpu_parent

    def enclosing(e, forward_part):  # the part of e, or None
        for a in ancestors(e):
            if a.name.startswith("part::"):
                return a.name[len("part::"):]
            if a.name.startswith(BACKWARD_NODE):
                return forward_part.get(a.sequence_nr)
        return None

    forward_part = {}  # sequence number of a forward op made in a part -> the part
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE):
            part = enclosing(e, {})
            if part is not None:
                forward_part[e.sequence_nr] = part
    times = collections.Counter()
    for e in events:
        phase = next((a.name for a in ancestors(e) if a.cpu_parent is None), None)
        if phase in PHASES:
            part = "optimizers" if phase == "optimizer" else (enclosing(e, forward_part) or "rest")
            times[part, phase] += e.self_cpu_time_total
    return times


def profile_table(runs, env):
    """--profile=True: rounds x steps steps of each model, interleaved, under torch.profiler (eager); per part (PARTS)
    and phase, the mean self CPU time of a step, and what each model adds to the first's, as a share of its step."""
    first = runs[0]
    if env.compile or not env.device.startswith("cpu"):
        raise ValueError("--profile=True: eager on a CPU only (compile fuses the parts; a GPU's kernels run "
                         "asynchronously, outside the ranges)")
    B, T = first.cfg.batch_size, first.config.block_size
    x, y = synthetic_batch(B, T, first.config.vocab_size, first.bench["doc_len"], env.device)
    for row in runs:
        build(row, env)
        for _ in range(row.bench["warmup"]):
            step(row, x, y, env)
        row.parts = collections.Counter()
    for _ in range(first.bench["rounds"]):
        for row in runs:
            with named_parts(row.model), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(row.bench["steps"]):
                    row.times.append(step(row, x, y, env))
            row.parts.update(part_times(prof.events()))
    n = len(first.times)
    print(f"where a step's time goes (torch.profiler: self CPU time, mean ms of {n} profiled steps): {env.device}, "
          f"{first.cfg.dtype or 'auto'} dtype, eager, doc_mask={first.cfg.doc_mask}, batch {B} x {T} tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    ms = lambda row, *keys: sum(v for k, v in row.parts.items() if all(a in k for a in keys)) / n / 1000
    ref = ms(first)
    print(f"\n{'part':<16}{'phase':<10}" + "".join(f"{r.name[:14]:>15}" for r in runs)
          + "".join(f"{'+' + r.name[:13]:>15}{'% step':>8}" for r in runs[1:]))
    lines = [(part, phase) for part in PARTS for phase in PHASES[:2] if part != "optimizers"] + \
        [("optimizers", "optimizer"), ("step", "")]
    for part, phase in lines:
        keys = (part, phase) if part != "step" else ()
        values = [ms(r, *keys) for r in runs]
        print(f"{part:<16}{phase:<10}" + "".join(f"{v:>15.1f}" for v in values)
              + "".join(f"{v - values[0]:>15.1f}{(v - values[0]) / ref:>8.1%}" for v in values[1:]))
    print(f"\nstep time ratio {' '.join(f'{ms(r) / ref:.4f}' for r in runs)} (profiled), FLOP ratio "
          + " ".join(f"{flops_per_token(r.model, T) / flops_per_token(first.model, T):.4f}" for r in runs))
    # the same steps' own shares: unlike the ratio, untouched by a load that changes between one model's steps and
    # the next's
    print("the parts' share of each model's own step: " + " ".join(
        f"{r.name} {1 - (ms(r, 'rest') + ms(r, 'optimizers')) / ms(r):.1%}" for r in runs))
    return runs


class CollectiveBytes(TorchDispatchMode):
    """The bytes that torch.distributed's collectives (DDP's, FSDP's, Muon's) pass to the c10d ops inside it, by
    kind (COLLECTIVES). DTensor's own collectives (the clip's one-number all-reduce under FSDP) run below it."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind, arg = COLLECTIVES.get(func.__name__.split(".")[0], (None, 0)) if func.namespace == "c10d" else (None, 0)
        if kind:
            self.bytes[kind] += sum(t.nbytes for t in tree_leaves(args[arg]) if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def local_bytes(tensors):
    """The bytes this rank holds of tensors: a DTensor's own shard."""
    return sum(t.nbytes for t in sharding.local(t for t in tensors if torch.is_tensor(t)))


def rank_table(runs, x, y, env):
    """Under torchrun, per row: this rank's bytes of parameters, gradients, each optimiser's state (FSDP: its
    shards), and the bytes of one step's collectives, by kind (CollectiveBytes), with the step time against the
    first row's."""
    kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    names = [type(opt).__name__ for opt in (runs[0].optimizers or {}).values()]
    print(f"\nrank 0 of {env.world_size}, one step: MiB held, MB passed to collectives\n{'config':<28}{'ms/step':>9}"
          f"{'ratio':>7}{'params':>9}{'grads':>9}" + "".join(f"{n:>9}" for n in names)
          + "".join(f"{k:>15}" for k in kinds))
    for row in runs:
        with CollectiveBytes() as counted:
            with env.runtime.autocast():
                row.forward(x, y, z_loss=row.cfg.z_loss, doc_mask=row.cfg.doc_mask)[1].backward()
            held = [local_bytes(row.model.parameters()), local_bytes(p.grad for p in row.model.parameters())]
            if row.optimizers:
                optimizer_step(row)
        held += [local_bytes(v for s in opt.state.values() for v in s.values())
                 for opt in (row.optimizers or {}).values()]
        ms = statistics.median(row.times) * 1000
        ratio = statistics.median(row.times) / statistics.median(runs[0].times)
        print(f"{row.name:<28}{ms:>9.1f}{ratio:>7.3f}" + "".join(f"{b / 2**20:>9.3f}" for b in held)
              + "".join(f"{counted.bytes[k] / 1e6:>15.3f}" for k in kinds))


def synthetic_batch(B, T, vocab_size, doc_len, device, eot=EOT):
    """Random tokens (B, T) and their targets, with an <|endoftext|> (eot: the model's eot_token) opening a document
    every doc_len tokens on average when the vocabulary has it."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, min(vocab_size, eot), (B, T + 1), generator=g)
    if vocab_size > eot:
        data[torch.rand(B, T + 1, generator=g) < 1 / doc_len] = eot
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


def layer_split(row, x, y, env, checkpointing):
    """(per-layer, fixed) bytes saved for backward, from 2- and 3-layer copies of the model (internal
    anchors make layer 1 unlike the others)."""
    measured = []
    for n_layer in (2, 3):
        torch.manual_seed(row.cfg.seed)
        model = GPT(replace(row.config, n_layer=n_layer)).to(env.device)
        model.activation_checkpointing = checkpointing
        measured.append(saved_bytes(model, x, y, env.runtime.autocast(), row.cfg.doc_mask))
    return measured[1] - measured[0], measured[0] - 2 * (measured[1] - measured[0])


def memory_table(runs, env):
    """Activation memory of one block_size sequence per model: the per-layer and fixed parts autograd saves,
    their total at full depth (with activation checkpointing, plus the one block that backward recomputes
    at a time), and the micro-batch that fits 40, 80 and 141 GB GPUs next to the weights, gradients,
    optimiser states and the loss's transient logits."""
    first = runs[0]
    T = first.config.block_size
    x, y = synthetic_batch(1, T, first.config.vocab_size, first.bench["doc_len"], env.device, first.config.eot_token)
    print(f"activation memory of one sequence of {T} tokens: {env.device}, {first.cfg.dtype or 'auto'} dtype, eager")
    print(f"\n{'config':<36}{'params':>14}{'per layer':>12}{'fixed':>10}{'GiB/seq':>9}"
          f"{'B @ 40GB':>10}{'B @ 80GB':>10}{'B @ 141GB':>11}")
    for row in runs:
        checkpointing = row.cfg.activation_checkpointing
        row.per_layer, row.fixed = layer_split(row, x, y, env, checkpointing)
        recompute = layer_split(row, x, y, env, False)[0] if checkpointing else 0
        row.total = row.fixed + row.config.n_layer * row.per_layer + recompute
        with torch.device("meta"):
            full = GPT(row.config)
        trained = [(opt, p) for opt in build_optimizers(full, row.cfg).values() for g in opt.param_groups
                   for p in g["params"]]  # a frozen parameter (anchor_frozen): its weights only
        row.state = WEIGHT_BYTES * full.num_params() + sum((GRAD_BYTES + 4 * state_floats(opt)) * p.numel()
                                                           for opt, p in trained) + \
            full.loss_chunk * row.config.vocab_size * LOGIT_BYTES
        row.fits = [max(0, int((gb * 1e9 * HEADROOM - row.state) // row.total)) for gb in (40, 80, 141)]
        print(f"{row.name:<36}{full.num_params():>14,}{row.per_layer / 2**20:>8.1f} MiB{row.fixed / 2**20:>6.0f} MiB"
              f"{row.total / 2**30:>9.2f}{row.fits[0]:>10}{row.fits[1]:>10}{row.fits[2]:>11}")
    if first.bench["ranks"]:
        sharded_table(runs)
    return runs


def sharded_bytes(model, n, cfg):
    """Bytes per GPU of a model (on the meta device) sharded by FSDP over n GPUs, from its shapes: (weights,
    gradients, each optimiser's state, transient): fp32 shards of ceil(rows / n) rows (Muon: momentum and NorMuon's
    moments; any other optimiser: optim.state_floats), and what a step gathers (GATHERED_BYTES of the largest unit
    twice and of the root unit, OWNED_BYTES of Muon's share)."""
    shard = lambda shape: -(-shape[0] // n) * math.prod(shape[1:])
    weights = 4 * sum(shard(p.shape) for p in model.parameters())
    states = [4 * sum(shard(p.shape) + shard(moment_shape(*p.shape)) if isinstance(opt, Muon) else
                      state_floats(opt) * shard(p.shape) for g in opt.param_groups for p in g["params"])
              for opt in build_optimizers(model, cfg).values()]
    units = [sum(p.numel() for p in m.parameters()) for m in [*model.blocks, model.wte, model.anchor_proj] if m]
    gathered = GATHERED_BYTES * (2 * max(units) + model.num_params() - sum(units))
    owned = OWNED_BYTES * sum(p.numel() for p in muon_params(model)) / n
    logits = model.loss_chunk * model.config.vocab_size * LOGIT_BYTES
    return weights, weights, *states, gathered + owned + logits


def sharded_table(runs):
    """--ranks: per model and number of GPUs, the bytes per GPU under FSDP and the micro-batch that fits 40, 80 and
    141 GB beside them (the activation table's GiB/seq per sequence)."""
    with torch.device("meta"):
        names = [type(opt).__name__ for opt in build_optimizers(GPT(runs[0].config), runs[0].cfg).values()]
    print(f"\nFSDP over N GPUs, per GPU (GiB): weights, gradients, optimiser states (shards), transient (estimate)"
          f"\n{'config':<36}{'N':>5}{'weights':>9}{'grads':>7}" + "".join(f"{n:>7}" for n in names)
          + f"{'transient':>10}{'B @ 40GB':>10}{'B @ 80GB':>10}{'B @ 141GB':>11}")
    for row in runs:
        with torch.device("meta"):
            full = GPT(row.config)
        for n in row.bench["ranks"]:
            held = sharded_bytes(full, n, row.cfg)
            fits = [max(0, int((gb * 1e9 * HEADROOM - sum(held)) // row.total)) for gb in (40, 80, 141)]
            print(f"{row.name:<36}{n:>5}" + "".join(f"{b / 2**30:>{w}.2f}" for b, w in
                                                     zip(held, (9, 7, *[7] * (len(held) - 3), 10)))
                  + f"{fits[0]:>10}{fits[1]:>10}{fits[2]:>11}")


def resume_tensors(row):
    """The tensors of a model's resume checkpoint, as the run holds them after a step (fp32): the weights, and each
    optimiser's state (optim.state_floats: a copy of each of its parameters per float it keeps)."""
    model = GPT(row.config)
    optimizers = build_optimizers(model, row.cfg)
    states = {name: {str(i): [p.detach().clone() for _ in range(state_floats(opt))]
                     for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
              for name, opt in optimizers.items()}
    return {"model": model.state_dict(), "optimizers": states}


CHECKPOINT_KINDS = ("ckpt.pt", "ckpt.dcp")
# how a checkpoint is written: without any checksum (torch.save's CRC-32s off: torch.utils.serialization.config);
# as before the manifests (torch.save's CRC-32s, on by default, of ckpt.pt and of each tensor in ckpt.dcp's files);
# now (that, and ckpt.dcp's manifest: each file counted, .metadata hashed, as DCP writes them)
WRITES = ("none", "before", "now")


def write_checkpoint(tensors, path, how):
    """tensors written as a resume checkpoint of path's kind, as train.py writes it (fsynced), how (WRITES) says."""
    with torch.utils.serialization.config.patch({"save.compute_crc32": how != "none"}):
        if path.endswith(".pt"):  # the same write before and now: only reads verify it
            return save_checkpoint(path, tensors)
        files = sharding.write_tensors(tensors, path, checksums=how == "now", alone=True)
    if how == "now":
        sharding.write_manifest(path, files)


def checkpoint_table(runs, folder):
    """--checkpoint=DIR: per model and kind, the median seconds to write its resume checkpoint into DIR in each way
    (WRITES), interleaved over rounds x steps writes each, and the ratios: what the checksums cost a write, and what
    the manifest adds to what torch.save already did."""
    print(f"writing resume checkpoints into {folder}: median seconds of {runs[0].bench['rounds']} x "
          f"{runs[0].bench['steps']} writes each (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'model':<24} {'kind':<9} {'GB':>6} {'none s':>8} {'before s':>9} {'now s':>8} {'now/none':>9} "
          f"{'now/before':>11}")
    result = {}
    for row in runs:
        tensors = resume_tensors(row)
        nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(tensors))
        times = collections.defaultdict(list)
        for _ in range(row.bench["rounds"]):
            for _ in range(row.bench["steps"]):
                for kind in CHECKPOINT_KINDS:
                    for how in WRITES:  # side by side: the same moment of a shared machine
                        path = os.path.join(folder, f"bench_{os.getpid()}_{kind}")
                        t0 = time.perf_counter()
                        write_checkpoint(tensors, path, how)
                        times[kind, how].append(time.perf_counter() - t0)
                        (shutil.rmtree if os.path.isdir(path) else os.remove)(path)
        for kind in CHECKPOINT_KINDS:
            none, before, now = (statistics.median(times[kind, how]) for how in WRITES)
            result[row.name, kind] = dict(zip(WRITES, (none, before, now)))
            print(f"{row.name:<24} {kind:<9} {nbytes / 1e9:>6.2f} {none:>8.3f} {before:>9.3f} {now:>8.3f} "
                  f"{now / none:>9.3f} {now / before:>11.3f}")
        del tensors
    return result


# what a resume reads: train.py itself launched under torchrun, each process noting at its first step what it has read
# (/proc/self/io's rchar: every read() of a file, from the page cache too; a mapped file's pages are not counted) and
# when; a resume less the same launch started fresh is what reading the checkpoint took
RESUME_KINDS = {"ckpt.pt": [], "ckpt.dcp": ["--fsdp=True"]}


def resume_table(row, folder):
    """--checkpoint with --resume_ranks: of the row's train.py run at each number of processes, under DDP (ckpt.pt)
    and FSDP (ckpt.dcp), what a resume reads, summed over the processes, in units of S (the checkpoint's bytes); the
    seconds from the launch to the first step (of the last process), and the CPU seconds of train.start (configure,
    build, restore: what reading the checkpoint adds to a start; summed over the processes, which a shared machine's
    load changes less than the time), fresh and resumed, medians of rounds launches each; then what
    --verify_data=True adds to a fresh start, in units of D (the listed shards' bytes). The row's keys (data_dir among
    them) are train.py's."""
    given = {**asdict(row.cfg), **asdict(row.config)}
    keys = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in given.items()
            if v != ALL_DEFAULTS[k] and k not in ("out_dir", "init_from", "max_steps")]
    # the measured start: one validation batch per process (the loss of step 0, which a fresh run evaluates first)
    keys.append(f"--eval_tokens={row.cfg.batch_size * row.config.block_size * max(row.bench['resume_ranks'])}")
    rounds = range(row.bench["rounds"])
    print(f"\nresuming train.py ({row.name}) from {folder}: the bytes its processes read before the first step "
          f"(/proc/self/io rchar, summed), a resume less a fresh start; seconds, fresh and resumed, medians of "
          f"{len(rounds)}")
    print(f"{'kind':<10}{'ranks':>6}{'S GB':>8}{'read/S':>8}{'per rank':>9}   to the first step   "
          f"train.start CPU-s")
    result = {}
    with tempfile.TemporaryDirectory(dir=folder) as work:
        for kind, extra in RESUME_KINDS.items():
            for n in row.bench["resume_ranks"]:
                out = os.path.join(work, f"{kind}_{n}")
                # the first fresh launch goes on to write the checkpoint (of step 1) that every resume starts from
                fresh = [launch(n, keys + extra + [f"--out_dir={out}{r or ''}", "--max_steps=1"], work, stop=r > 0)
                         for r in rounds]
                size = tree_bytes(os.path.join(out, kind))
                resumed = [launch(n, keys + extra + [f"--out_dir={out}", "--max_steps=2", "--init_from=auto"], work)
                           for _ in rounds]
                m = result[row.name, kind, n] = median_launch(resumed, fresh, size)
                print(f"{kind:<10}{n:>6}{size / 1e9:>8.3f}{m['read']:>8.2f}{m['read'] / n:>9.2f}   "
                      f"{m['seconds'][0]:>6.1f} -> {m['seconds'][1]:>5.1f}     {m['start'][0]:>6.2f} -> "
                      f"{m['start'][1]:>5.2f}")
        n = max(row.bench["resume_ranks"])
        listed = sum(e["bytes"] for e in read_manifest(row.cfg.data_dir).values())
        plain, verified = ([launch(n, keys + [f"--out_dir={os.path.join(work, f'data_{v}_{r}')}", "--max_steps=1",
                                              f"--verify_data={v}"], work) for r in rounds] for v in (False, True))
        m = result[row.name, "verify_data", n] = median_launch(verified, plain, listed)
        print(f"--verify_data=True at {n} ranks: D = {listed / 1e6:.1f} MB of shards, {m['read']:.2f} D read "
              f"({m['read'] / n:.2f} D per rank); seconds to the first step {m['seconds'][0]:.1f} -> "
              f"{m['seconds'][1]:.1f}, train.start CPU-s {m['start'][0]:.2f} -> {m['start'][1]:.2f}")
    return result


def median_launch(measured, baseline, unit):
    """{"read": the median bytes read by measured's launches less baseline's, in units of unit; "seconds", "start":
    (baseline's, measured's) median seconds to the first step, and CPU seconds in train.start}."""
    median = lambda launches, key: statistics.median(e[key] for e in launches)
    return dict(read=(median(measured, "read") - median(baseline, "read")) / unit,
                **{key: (median(baseline, key), median(measured, key)) for key in ("seconds", "start")})


def launch(n, keys, work, stop=True):
    """train.py with keys under torchrun at n processes (stop: each exits at its first step): {"read": the bytes
    its processes had read then, summed; "seconds": from the launch to the last one's first step; "start": the CPU
    seconds of its processes in train.start, summed}."""
    notes = tempfile.mkdtemp(dir=work)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                           "-m", "tools.bench", f"--first_step{'_stop' * stop}={notes}", *keys], cwd=root,
                          capture_output=True, text=True)
    noted = [json.load(open(os.path.join(notes, f))) for f in sorted(os.listdir(notes))]
    if done.returncode or len(noted) != n:
        raise RuntimeError(f"train.py {' '.join(keys)} at {n} processes: exit status {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return {"read": sum(e["rchar"] for e in noted), "seconds": max(e["time"] for e in noted) - t0,
            "start": sum(e["start"] for e in noted)}


def first_step(notes, stop, argv):
    """train.main(argv), this process's bytes read so far (/proc/self/io rchar), the time and the CPU seconds (of all
    its threads) that train.start took noted at its first step, in notes/<rank>.json; with stop, it exits there."""
    start, step, took = train.start, train.train_step, []

    def timed(*args):
        t0 = time.process_time()
        run = start(*args)
        took.append(time.process_time() - t0)
        return run

    def noted(run, batches):
        with open("/proc/self/io") as f:
            rchar = int(next(line for line in f if line.startswith("rchar:")).split()[1])
        with open(os.path.join(notes, f"{run.worker.rank}.json"), "w") as f:
            json.dump({"rchar": rchar, "time": time.time(), "start": took[0]}, f)
        if stop:
            os._exit(0)
        train.train_step = step
        return step(run, batches)

    train.start, train.train_step = timed, noted
    return train.main(argv)


def tree_bytes(path):
    """The bytes of a file, or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def step(row, x, y, env):
    """One training step (as in train.py without accumulation); returns its wall time in seconds."""
    cuda = env.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with record_function("forward"), env.runtime.autocast():  # the phases --profile=True tells apart
        _, loss = row.forward(x, y, z_loss=row.cfg.z_loss, doc_mask=row.cfg.doc_mask)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        if row.optimizers:
            optimizer_step(row)
        else:
            row.model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def optimizer_step(row):
    """Clip the gradients, then step and clear every optimiser, as train.py's loop does."""
    clip_gradients(row.model, row.cfg.grad_clip)
    for opt in row.optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main(sys.argv[1:])
