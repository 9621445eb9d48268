"""
The dry run of a launch (train.py --dry_run=True): what each of its N processes would hold on its GPU, traced in one
process on a CPU. The launch is configured and built as train.py does it (train.build: every part, model and check a
fork adds there; on the launch's data where it is here, else on a stand-in of its layout), then its real step
(train.train_step: every micro-step's forward and backward, the clip, every optimiser's step with Muon's exchange)
runs twice, and an evaluation (train.log_entry's) once, over fake tensors (FakeTensorMode: shapes, no data) and a
fake process group of N ranks (its collectives do nothing), as rank 0. torch's trackers count what the step holds,
by kind (FSDPMemTracker under FSDP, MemTracker otherwise); this file makes the group and the worker, traces the steps,
names the kinds, and judges the peak against the GPU's memory. train.py passes itself in (`recipe`): the engine
imports nothing above it.

What the emulation leaves out, or changes, and why the margin (HEADROOM) stays:
  - the CUDA context, NCCL's buffers, kernels' workspaces (cuBLAS, FlexAttention) and the caching allocator's
    fragmentation: none of them is a tensor;
  - torch.compile: the step is traced eagerly (compiled kernels fuse elementwise work and keep less, not more);
  - document masks: the trace attends causally (CPU SDPA's flash kernel: out and logsumexp kept, no T x T scores, as
    FlexAttention on a GPU); the BlockMask itself, a few (T/128)^2 index tables, is left out;
  - DDP's reducer (it cannot run on fake tensors): its buckets are the gradients themselves (gradient_as_bucket_view),
    which the trace holds; its all-reduce is not traced;
  - bf16 autocast is the CPU's (the same ops run in bf16 as on CUDA for the matmuls; a few elementwise ones may
    differ);
  - a value read from a tensor (an evaluation's .item()) is 1.0: there are no values.
"""
import contextlib
import copy
import os
import tempfile
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.checkpoint import OWN_CLASSES, tensors
from engine.data import write_shard
from engine.parallel import Runtime, Worker
from engine.sharding import assign_owners
from optim import Muon, clip_norm, moment_shape

GiB = 2 ** 30
GB = 1e9  # a GPU's memory as its maker states it (80 GB)
GPU_MEMORY_GB = 80  # the GPU the documented commands are sized for: an H100 or H200 at 80 GB (docs/MEMORY.md)
HEADROOM = 0.9  # of a GPU's memory usable by tensors: the rest for what no tracker sees (above), as docs/MEMORY.md
#                 and bench.py state it, until a GPU measures it
# the trackers' kinds (torch.distributed._tools' reference types, by their names) in the kinds this table prints
KINDS = {"parameters": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
         "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
         "optimiser": ("Optstate", "OptState"),  # its states, and what its step makes (Muon's exchange, ...)
         "activations": ("Activation",),
         "collectives": ("All Gather", "Reduce Scatter"),
         "temporaries": ("Temp", "Inputs", "Other")}


def launch(recipe, given, cfg):
    """The dry run of the launch of these keys (given: as read; cfg: its TrainConfig) at dry_world_size processes (or
    torchrun's), with recipe (the train module: its configure, build, train_step and log_entry): configured and built
    as the launch does (build: every part, model and check a fork adds there), the model on the meta device, then two
    train_steps and an evaluation (log_entry's) over fake tensors as rank 0 of a fake process group, in bf16
    autocast. Prints rank 0's peak GPU memory by kind against gpu_memory, whether it fits, and each error the launch
    would hit, one line each (a ValueError or OSError in the launch's own words). Returns whether it fits with no
    error."""
    world = cfg.dry_world_size or int(os.environ.get("WORLD_SIZE", 1))
    if world < 1 or cfg.gpu_memory <= 0:
        print(f"train.py: dry run: error: dry_world_size={cfg.dry_world_size}, gpu_memory={cfg.gpu_memory}: expected "
              f"a number of processes (0: torchrun's) and a positive number of GB")
        return False
    errors, worker, fits = [], fake_worker(world), False
    try:
        try:
            cfg, model_config, _, _ = recipe.configure(given, cfg, worker)
        except ValueError as e:  # the first wrong key: the launch stops there, but the model can still be traced
            errors.append(str(e))
            model_config = recipe.split_config({**recipe.ALL_DEFAULTS, **given})[1]
            micro = cfg.batch_size * model_config.block_size * world  # in steps of whole micro-steps
            cfg = replace(cfg, total_batch_size=max(1, cfg.total_batch_size // micro) * micro)
        with stand_in_data(cfg, model_config.block_size, world, worker.say) as data_dir:
            fake = fake_tensors()
            try:
                run = recipe.build(replace(cfg, data_dir=data_dir), model_config, worker, storage=fake)
            except (ValueError, OSError) as e:  # a check of the build: the launch's line
                errors.append(str(e))
                return False
            # causal attention: the memory of FlexAttention's document masks on a GPU (no T x T scores), above; the
            # evaluation of one global batch: each holds as much
            run.cfg = replace(run.cfg, doc_mask=False, eval_tokens=world * cfg.batch_size * model_config.block_size)
            peaks, where = trace(run, recipe, fake)
        lines, fits = report(peaks, world, cfg.gpu_memory, where, cfg.fsdp,
                             muon_owners(run.optimizers, world) if cfg.fsdp else None)
        for line in lines:
            worker.say(line)
    except Exception as e:  # what the launch would hit in its first step, said in one line
        errors.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        fits = False
    finally:
        end(worker)
        for e in errors:
            worker.say(f"dry run: error: {e}")
    return fits and not errors


@contextlib.contextmanager
def stand_in_data(cfg, block_size, world, say):
    """The data folder the dry run's build reads: the launch's, when it is here; else, said in one line, a stand-in
    of its layout in a temporary folder (a train and a val shard of one step's tokens, or one global batch's if more,
    each token 0), which the launch's checks of its data pass as its data would."""
    if os.path.isdir(cfg.data_dir):
        yield cfg.data_dir
        return
    say(f"dry run: note: {cfg.data_dir}: not here (the launch's machines need it); built on a stand-in of its layout")
    tokens = np.zeros(max(cfg.total_batch_size, world * cfg.batch_size * block_size) + 1, dtype=np.uint16)
    with tempfile.TemporaryDirectory(prefix="dry_run_data.") as folder:
        for name in ("stand_in_train_000001.bin", "stand_in_val_000000.bin"):
            write_shard(os.path.join(folder, name), tokens)
        yield folder


def trace(run, recipe, fake):
    """Two of run's whole optimiser steps, recipe.train_step(run, batches), over fake tokens in fake (the fake tensors'
    mode), then an evaluation, recipe.log_entry's, their memory tracked: (rank 0's peak by kind, by_kind's; the part
    of the run in which it grew last). Every model and tensor the run holds beside its model and optimisers (a
    teacher, a part's) is tracked from the start; a .item() of the evaluation gives 1.0 (no data: ScalarStub)."""
    model, cfg = run.model, run.cfg
    with fake:  # the clip and the optimisers once, untracked: DTensor runs each new op's sharding propagation on
        for p in model.parameters():  # whole-size fake tensors once, which a tracker would count as held
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        clip_norm(model, cfg.grad_clip)
        for opt in run.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    tracker_ = tracker(model, run.optimizers, cfg.fsdp, held(run))
    peak = lambda: by_kind(tracker_.get_tracker_snapshot("peak"))[1]
    before = []  # the peak as each step's optimisers begin
    hook = next(iter(run.optimizers.values())).register_step_pre_hook(lambda *_: before.append(peak()))
    B, T, V = cfg.batch_size, model.config.block_size, model.config.vocab_size
    with fake, tracker_:
        def batches():  # fake tokens; the tracker takes each micro-step's forward as a new one
            for i in range(run.accum):
                tracker_.reset_mod_stats()
                yield torch.randint(V, (B, T)), torch.randint(V, (B, T)), i == run.accum - 1

        stepped, top = False, 0  # whether the peak grew last in an optimiser step; the peak so far
        for _ in range(2):  # every micro-step of a step, twice
            recipe.train_step(run, batches())
            now = peak()
            stepped, top = now > before[-1] or (stepped and before[-1] == top), now
        with ScalarStub():
            tracker_.reset_mod_stats()
            recipe.log_entry(run, {}, evaluating=True)
        evaluated = peak() > top
    hook.remove()
    where = "an evaluation" if evaluated else "an optimiser step" if stepped else "forward and backward"
    return by_kind(tracker_.get_tracker_snapshot("peak")), where


def held(run):
    """What the run holds beside its model and optimisers that a GPU would: its other modules (a teacher), and the
    tensors of the parts of a fork's own class (an average of the weights), each once."""
    mine = {id(run.model), id(run.eval_model), id(run.train_model), id(run.optimizers)}
    found = {}
    for value in [*vars(run).values(), *run.parts.values()]:
        if id(value) in mine:
            continue
        if isinstance(value, torch.nn.Module):
            found[id(value)] = value
        elif hasattr(value, "state_dict") and type(value).__module__.split(".")[0] not in OWN_CLASSES:  # a fork's
            found.update((id(t), t) for t in tensors(value.state_dict()))
    return list(found.values())


class ScalarStub(TorchDispatchMode):
    """.item() of a fake tensor (which has no value) as 1.0, so that an evaluation runs to its end in the dry run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


def fake_worker(world_size, rank=0):
    """This process as rank `rank` of a fake process group of world_size (torch's "fake" backend: every collective
    returns at once, data untouched), on the CPU in bf16 as a GPU's worker runs, not compiling. It is not marked
    distributed: DDP's wrapper (which needs real tensors) is left out, and a step's loss is not all-reduced."""
    if dist.is_initialized():
        raise RuntimeError("dry run: a process group is already initialised in this process")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend (torch 2.13 has no

    # public import for it; FSDP's modules import this one, which a run that never shards has not imported)
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    return Worker(rank, world_size, Runtime("cpu", torch.bfloat16), compile=False)


def end(worker):
    """The fake process group of fake_worker, ended."""
    if dist.is_initialized():
        dist.destroy_process_group()


def fake_tensors():
    """The mode a dry run makes its tensors in: fake ones (shapes, devices, dtypes; no data), the meta-built model's
    parameters admitted as they are until to_empty gives them fake storage."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class _NoHook:
    """The handle of a gradient hook that a frozen parameter does not take (tracker): nothing to remove."""

    @staticmethod
    def remove():
        pass


class _GlobalPeak:
    """torch's tracker, keeping only the peak of the whole process: its per-module peaks, which the dry run does not
    read, walk every module's stats at every op (O(layers²) a step: 348 s of CPU for the 1B's DDP dry run at 8 ranks,
    2 cores, torch 2.13). The rest is torch's _update_peak_stats as it is."""

    def _update_peak_stats(self, peak_state):
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(snap)


def tracker(model, optimizers, sharded, others=()):
    """torch's memory tracker of the step: FSDPMemTracker for a sharded model (it follows FSDP's gathers and
    reduce-scatters; it takes one optimiser, and the others' states are counted through their step hooks, as it
    counts its own), MemTracker otherwise (every optimiser through torch's global step hooks). others: modules and
    tensors held beside them, counted from the start."""
    # imported here: they import dynamo, which no run but a dry one should pay for (~2 CPU-s a process)
    from torch.distributed._tools import FSDPMemTracker, MemTracker
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    if not sharded:
        t = type("MemTracker", (_GlobalPeak, MemTracker), {})()
        # torch's tracker hooks every parameter's gradient, which a frozen one (anchor_frozen's, a teacher's) refuses:
        # none is hooked, as it has no gradient to count
        modules = [m for m in (model, *others) if isinstance(m, torch.nn.Module)]
        t._param_to_grad_hook_handles.update((p, (_NoHook, _NoHook)) for m in modules for p in m.parameters()
                                             if not p.requires_grad)
        t.track_external(model, *optimizers.values(), *others)
        return t
    first, *rest = optimizers.values()
    t = type("FSDPMemTracker", (_GlobalPeak, FSDPMemTracker), {})(model, first)
    if others:
        t.track_external(*others)

    def after(opt, *_):
        t._track_optimizer_states(_FSDPRefType.OPT, opt)
        t._in_opt = False

    for opt in rest:  # FSDPMemTracker's own (_instrument_optimizer), for the others: it takes only one optimiser
        t._track_optimizer_states(_FSDPRefType.OPT, opt)
        opt.register_step_pre_hook(lambda *_: setattr(t, "_in_opt", True))
        opt.register_step_post_hook(after)
    return t


def by_kind(snapshot):
    """A tracker's snapshot {device: {reference type: bytes}} as bytes by KINDS' kinds, and the total."""
    found = {kind: 0 for kind in KINDS}
    total = 0
    for per_type in snapshot.values():
        for ref, n in per_type.items():
            name = getattr(ref, "value", ref)
            if name == "Total":
                total += n
                continue
            kind = next((k for k, names in KINDS.items() if name in names), "temporaries")
            found[kind] += n
    return found, total


def muon_owners(optimizers, world_size):
    """Under FSDP, the whole matrices (fp32 bytes of updates and second moments) each rank gathers for Muon's steps 2
    and 3 (sharding.assign_owners, as sharding.Exchange assigns them): {rank: bytes}."""
    shapes = [tuple(p.shape) for opt in optimizers.values() if isinstance(opt, Muon)
              for g in opt.param_groups for p in g["params"]]
    owned = {r: 0 for r in range(world_size)}
    for shape, owner in zip(shapes, assign_owners(shapes, world_size)):
        owned[owner] += 4 * (shape[0] * shape[1] + int(torch.Size(moment_shape(*shape)).numel()))
    return owned


def report(peaks, world_size, gpu_memory_gb, where, sharded, owned=None):
    """The dry run's table: rank 0's peak by kind against the GPU's memory, and the verdict. peaks: (bytes by kind,
    total); where: the part of the step the peak falls in. Returns (lines, fits)."""
    kinds, total = peaks
    usable = gpu_memory_gb * GB * HEADROOM
    lines = [f"dry run: {world_size} rank(s), {'FSDP' if sharded else 'DDP' if world_size > 1 else 'one process'}, "
             f"bf16 autocast; rank 0 traced" + (" (its shards are the largest: the first, ceil(rows / N) rows each)"
                                                  if sharded else " (every rank holds the same)"),
             f"{'rank':<6}" + "".join(f"{k:>18}" for k in KINDS) + f"{'peak':>10}{'GPU':>9}{'usable':>9}",
             f"{0:<6}" + "".join(f"{kinds[k] / GiB:>14.2f} GiB" for k in KINDS)
             + f"{total / GiB:>6.2f} GiB{gpu_memory_gb * GB / GiB:>5.1f} GiB{usable / GiB:>5.1f} GiB"]
    if owned:
        heaviest = max(owned, key=owned.get)
        if heaviest != 0:
            lines.append(f"Muon: rank {heaviest} gathers the most whole matrices, {owned[heaviest] / GiB:.2f} GiB "
                         f"(rank 0: {owned[0] / GiB:.2f} GiB) in its optimiser step; its shards are no larger")
    fits = total <= usable
    lines.append(f"the peak, during {where}: {total / GiB:.2f} GiB of {gpu_memory_gb:g} GB "
                 f"({gpu_memory_gb * GB / GiB:.1f} GiB) x {HEADROOM} usable = {usable / GiB:.1f} GiB: "
                 + ("fits" if fits else "does NOT fit")
                 + f" ({1 - HEADROOM:.0%} left for the CUDA context, NCCL, workspaces and fragmentation)")
    return lines, fits
