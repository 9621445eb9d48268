"""
The dry run of a launch (train.py --dry_run=True): what each of its N processes would hold on its GPU, traced in one
process on a CPU. train.py builds the model as the launch does and runs its real step (every micro-step's forward and
backward, the clip, every optimiser's step with Muon's exchange) over fake tensors (FakeTensorMode: shapes, no data)
and a fake process group of N ranks (its collectives do nothing), as rank 0. torch's trackers count what the step
holds, by kind (FSDPMemTracker under FSDP, MemTracker otherwise); this file makes the group and the worker, names the
kinds, and judges the peak against the GPU's memory.

What the emulation leaves out, or changes, and why the margin (HEADROOM) stays:
  - the CUDA context, NCCL's buffers, kernels' workspaces (cuBLAS, FlexAttention) and the caching allocator's
    fragmentation: none of them is a tensor;
  - torch.compile: the step is traced eagerly (compiled kernels fuse elementwise work and keep less, not more);
  - document masks: the trace attends causally (CPU SDPA's flash kernel: out and logsumexp kept, no T x T scores, as
    FlexAttention on a GPU); the BlockMask itself, a few (T/128)^2 index tables, is left out;
  - DDP's reducer (it cannot run on fake tensors): its buckets are the gradients themselves (gradient_as_bucket_view),
    which the trace holds; its all-reduce is not traced;
  - bf16 autocast is the CPU's (the same ops run in bf16 as on CUDA for the matmuls; a few elementwise ones may
    differ).
"""
import copy

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from optim import Muon, moment_shape
from engine.parallel import Runtime, Worker
from engine.sharding import assign_owners

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


class _GlobalPeak:
    """torch's tracker, keeping only the peak of the whole process: its per-module peaks, which the dry run does not
    read, walk every module's stats at every op (O(layers²) a step: 348 s of CPU for the 1B's DDP dry run at 8 ranks,
    2 cores, torch 2.13). The rest is torch's _update_peak_stats as it is."""

    def _update_peak_stats(self, peak_state):
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(snap)


def tracker(model, optimizers, sharded):
    """torch's memory tracker of the step: FSDPMemTracker for a sharded model (it follows FSDP's gathers and
    reduce-scatters; it takes one optimiser, and the others' states are counted through their step hooks, as it
    counts its own), MemTracker otherwise (every optimiser through torch's global step hooks)."""
    # imported here: they import dynamo, which no run but a dry one should pay for (~2 CPU-s a process)
    from torch.distributed._tools import FSDPMemTracker, MemTracker
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    if not sharded:
        t = type("MemTracker", (_GlobalPeak, MemTracker), {})()
        t.track_external(model, *optimizers.values())
        return t
    first, *rest = optimizers.values()
    t = type("FSDPMemTracker", (_GlobalPeak, FSDPMemTracker), {})(model, first)

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
