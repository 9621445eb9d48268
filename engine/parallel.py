"""
The processes of a run: joining the process group under torchrun, each worker's device and precision, placing the
model on the workers (DDP, or sharded: sharding.py has FSDP's, for models beyond one GPU's memory) and Muon's
orthogonalisation over the ranks, and stopping together: on a signal, with exit status 75; on a failed collective, in
one line.

    with parallel.join(cfg) as worker:                  # one process, or one of torchrun's
        model = parallel.data_parallel(model, worker)   # DDP when there are several
        Muon(..., exchange=parallel.Exchange)           # train.py: a share of Muon's stacks on each rank
        ...
    # the process group has ended here, after the DDP wrappers that nothing holds were freed

Everything here also runs on a CPU with gloo, where the tests exercise it; on CUDA the same calls use NCCL.
"""
import contextlib
import ctypes
import gc
import inspect
import math
import os
import re
import signal
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import optim
from engine import sharding
from model import triton_available

# ----------------------------------------------------------------------------- where a model runs

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (glibc's malloc.h)


def keep_freed_memory():
    """On a CPU: glibc's malloc hands each large tensor (the loss's 0.4 GB of logits, say) back to the kernel when
    it is freed, and gets it again, page-faulted and zeroed, at the next allocation. That was a quarter of a
    quick-start step on 2 cores (measured: 1.78 s -> 1.32 s a step, system time 23 s -> 2 s over 25 steps, the same
    losses). This has malloc keep freed memory for the next tensor instead. Nothing where there is no glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_MAX, 0)  # large blocks from the heap too, not from mmap, which unmaps them on free
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # and the heap's free top kept (up to 2 GB), not trimmed


@dataclass(frozen=True)
class Runtime:
    """Where a model runs and in what precision. The defaults: CUDA if there is a GPU; bf16 autocast on CUDA (the
    weights stay fp32), fp32 on a CPU (its bf16 matmuls are slow)."""
    device: str
    dtype: torch.dtype

    @classmethod
    def pick(cls, device=None, dtype=None, quiet=False):
        """device: 'cpu', 'cuda', 'cuda:1' or None (auto); dtype: 'float32', 'bfloat16', 'float16' or None. A GPU
        without bf16 (older than sm80) gets float32 for None, with one line on stderr (none when quiet)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = device.startswith("cuda") and torch.cuda.is_available()
        if dtype is None and cuda and not torch.cuda.is_bf16_supported(including_emulation=False):
            if not quiet:
                print(f"note: {torch.cuda.get_device_name(device)} has no bfloat16 (older than sm80): float32",
                      file=sys.stderr, flush=True)
            dtype = "float32"
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r}: expected 'float32', 'bfloat16' or 'float16'")
        if device == "cpu":
            keep_freed_memory()
        return cls(device, getattr(torch, dtype))

    def autocast(self):
        """The forward pass's autocast context (none for float32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.dtype)


# ----------------------------------------------------------------------------- the processes

def attempt_store(world_size, timeout):
    """The process group's rendezvous keys, under a prefix of this torchrun attempt; None outside torchrun (then
    init_process_group's env:// as usual). torchrun keeps one store for all the restarts of --max-restarts, and a
    restarted worker could read the dead attempt's addresses and hang, or fail, connecting to them (gloo's
    "connectFullMesh failed ... Connection refused", seen here after a kill -9)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1 and os.environ.get("RANK") == "0":  # torchrun on several hosts
        tell("train.py: warning: torchrun's hosts share one store for all restarts: a restart can hang (the hosts may "
             "count restarts differently) and a host started again cannot join; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
             "for torchrun on every host gives each restart a store of its own (docs/LONG_RUNS.md)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"train.py/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


@dataclass
class Worker:
    """This process: its rank among world_size, its device and precision (runtime), whether it compiles, and
    whether it is in a process group (under torchrun, with one process too: nanoGPT's rule, and one GPU runs
    NCCL and DDP as eight do). As a context manager it ends the group on a normal exit, after every rank's work
    has finished and after a garbage collection has freed the DDP wrappers that nothing holds any more (a group
    destroyed from a reducer's deallocation at interpreter exit can deadlock); on an error the group is left
    to die with the process."""
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

    def say(self, *args):
        """A line on rank 0's stdout."""
        if self.master:
            print(*args, flush=True)

    def any(self, flag):
        """Whether flag is true on any rank: the same answer on every rank (a collective: all ranks must ask)."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor(float(bool(flag)), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    def agree(self, error):
        """Of every rank's error (an exception, or None), the first by rank, the same on every rank; None when none
        failed. A collective: every rank asks (files.agreed)."""
        if not self.distributed:
            return error
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e is not None), None)

    def from_master(self, value):
        """Rank 0's value (any picklable one) on every rank; the others' are ignored. A collective (files.decided)."""
        if not self.distributed:
            return value
        sent = [value]
        dist.broadcast_object_list(sent, src=0)
        return sent[0]

    def sum(self, t):
        """t summed over the ranks (in place; a no-op in one process)."""
        if self.distributed:
            dist.all_reduce(t)
        return t

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if self.distributed and exc_type is None:
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def pick_runtime(cfg, rank):
    """The device (cuda:<LOCAL_RANK> under torchrun), the autocast dtype and whether to compile, from cfg's
    device, dtype and compile keys; a GPU that cannot compile (no Triton) falls back with one line."""
    if cfg.dtype not in (None, "float32", "bfloat16"):  # float16 would need a gradient scaler
        raise ValueError(f"dtype={cfg.dtype!r}: expected 'float32' or 'bfloat16'")
    runtime = Runtime.pick(cfg.device, cfg.dtype, quiet=rank > 0)
    if runtime.device == "cuda":
        runtime = replace(runtime, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    cuda = runtime.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(runtime.device)
    use_compile = cuda if cfg.compile is None else cfg.compile
    if not isinstance(use_compile, bool):
        raise ValueError(f"compile={cfg.compile!r}: expected True, False or None (auto)")
    if use_compile and cuda and not triton_available():  # inductor's GPU kernels
        if rank == 0:
            print(f"note: no Triton for {torch.cuda.get_device_name()} (not installed, or a GPU older than sm70): "
                  f"compile=False, and document masks are dense SDPA masks", file=sys.stderr, flush=True)
        use_compile = False
    return runtime, use_compile


def join(cfg):
    """This process as a Worker, in torchrun's process group if there is one (cfg: its device, dtype, compile and
    dist_timeout keys; a wrong value is a ValueError before any group is joined)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cfg.fsdp and "RANK" not in os.environ:
        raise ValueError("fsdp=True: expected a run under torchrun (torchrun --nproc_per_node=1 for one process)")
    runtime, use_compile = pick_runtime(cfg, rank)
    worker = Worker(rank, world_size, runtime, use_compile, distributed="RANK" in os.environ)  # torchrun's
    if worker.distributed:
        cuda, timeout = worker.device.startswith("cuda"), timedelta(seconds=cfg.dist_timeout)
        store = attempt_store(world_size, timeout)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                device_id=torch.device(worker.device) if cuda else None,
                                **({} if store is None else dict(store=store, rank=rank, world_size=world_size)))
    return worker


# DDP's gradient buckets. Compiled, DDP also splits the graph at bucket boundaries (dynamo's DDPOptimizer), so that
# each bucket's all-reduce overlaps the rest of backward: 25 MiB (the default) cuts the 450M models (1.7 GB of fp32
# gradients) into ~41 graphs and the 1B ones into ~67; 100 MiB gives 14 and 28 (about 2 layers each, counted
# with dist._compute_bucket_assignment_by_size), which keeps most fusion and still overlaps. Ours, not measured.
DDP_BUCKET_MB = 100


def data_parallel(model, worker, bucket_mb=DDP_BUCKET_MB):
    """model in DDP when the worker is in a process group, else model itself. Gradients are views of the buckets
    (no second copy: 1.7 GB at 450M), and buffers are not broadcast before each forward: the only ones, RoPE's
    tables, are computed from the config on every rank."""
    if not worker.distributed:
        return model
    cuda = worker.device.startswith("cuda")
    # torch 2.13 names it forward_sync_buffers and deprecates broadcast_buffers; older ones know only the latter
    new_name = "forward_sync_buffers" in inspect.signature(DDP).parameters
    return DDP(model, device_ids=[torch.device(worker.device).index] if cuda else None, bucket_cap_mb=bucket_mb,
               gradient_as_bucket_view=True, **{"forward_sync_buffers" if new_name else "broadcast_buffers": False})


def place_model(model, worker, fsdp, storage=None):
    """A model built on the meta device, placed on the worker's device in its three roles: (the model, what evaluates,
    what trains), in DDP or FSDP. Under FSDP it is sharded in place (sharding.fully_shard_model: each block compiled)
    and all three are it; otherwise it is compiled (when the worker compiles) and in DDP (with several processes).
    Each process gives storage to what it holds (its shards, or its replica) and initialises it, one whole parameter
    at a time (GPT.init_weights, sharding.write_part): none holds the whole model in host memory. storage: the
    context the tensors are made in instead (the dry run's FakeTensorMode), with no values."""
    if fsdp:
        model = sharding.fully_shard_model(model, worker)
    with storage or contextlib.nullcontext():
        model.to_empty(device=worker.device)
    if storage is None:
        model.init_weights(sharding.write_part)
    if fsdp:
        return model, model, model
    eval_model = torch.compile(model) if worker.compile else model
    return model, eval_model, data_parallel(eval_model, worker)


def gradient_sync(model, last):
    """The context of one micro-step's backward: under DDP gradients are all-reduced on the last micro-step only
    (no_sync before it), so accumulation costs one all-reduce per optimiser step."""
    return model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()


# ----------------------------------------------------------------------------- Muon under DDP: a share each

class Exchange(optim.Exchange):
    """Muon's exchange under DDP (optim.Exchange's methods): every rank holds every matrix whole, and orthogonalises
    only a share of every stack (Polar Express, the costly step, falls as 1/N), all-gathered in bf16. NorMuon then
    runs on the whole stack on every rank, so that the second moments, and so the parameters, stay identical on
    every rank (and checkpointable from rank 0). Outside a process group (one process), nothing is shared."""

    def __init__(self, stacks):
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def share(self, stack):
        """This rank's share of a stack of matrices (k, rows, cols), padded with zero matrices so that every rank's is
        the same size."""
        if self.world_size == 1:
            return stack
        share = math.ceil(len(stack) / self.world_size)
        mine = stack[self.rank * share:(self.rank + 1) * share]
        return torch.cat([mine, mine.new_zeros(share - len(mine), *mine.shape[1:])]) if len(mine) < share else mine

    def gather(self, share, k):
        """Every rank's share of a stack of k matrices, back as the whole stack."""
        if self.world_size == 1:
            return share
        parts = [torch.empty_like(share) for _ in range(self.world_size)]
        dist.all_gather(parts, share)
        return torch.cat(parts)[:k]


# ----------------------------------------------------------------------------- stopping together

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

    def agreed(self, worker):
        """Whether any rank received a signal: the same answer on every rank, so all stop after the same step."""
        return worker.any(self.received is not None)

    def stopped(self, worker, step, ckpt_path):
        """What stopped the run after step (this rank's signal, or another's), said on this rank's stderr."""
        why = self.received or "a signal to another rank"
        tell(f"train.py: rank {worker.rank}: stopped after step {step} ({why}); {ckpt_path} holds it: the same command "
             f"with --init_from=auto continues the run (exit status {PREEMPTED})")
        return why


COLLECTIVE_ERRORS = ("gloo", "NCCL", "Timed out", "Connection closed", "Connection reset")  # their messages


def collective_failure(e, world_size):
    """The first line of e, without gloo's source location, when it is a failed collective; else None."""
    text = str(e).strip()
    if world_size == 1 or not (isinstance(e, dist.DistError) or any(w in text for w in COLLECTIVE_ERRORS)):
        return None
    return re.sub(r"^\[[^]]*\]\s*", "", text.splitlines()[0]) if text else type(e).__name__


class RunFailed(Exception):
    """A run that cannot go on (a failed collective, a non-finite loss, a checkpoint that could not be written): its
    message, one line, says why and what resumes it. train.py's main prints it and exits."""


@contextlib.contextmanager
def collectives_fail_in_one_line(worker, timeout, ckpt_path):
    """A collective that fails inside (a peer died or hangs: gloo and NCCL raise RuntimeError or its subclass
    DistError) becomes a RunFailed, one line saying so and how to resume from ckpt_path; any other error passes
    through."""
    try:
        yield
    except RuntimeError as e:
        why = collective_failure(e, worker.world_size)
        if why is None:
            raise
        raise RunFailed(f"rank {worker.rank}: a collective failed ({why}): another process died or stopped "
                        f"answering (dist_timeout={timeout} s); --init_from=auto resumes from {ckpt_path}") from None
