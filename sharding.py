"""
Sharding (FSDP2): everything that training a model beyond one GPU's memory adds, in one room. Each rank holds 1/N of
every weight, gradient and optimiser state. A reader of the one-process and DDP story can skip this file: the other
modules reach it through a few calls, each of which does nothing for a whole (unsharded) tensor or model:

    model = sharding.fully_shard_model(model, worker)     # train.py builds a sharded model instead of DDP's
    exchange = sharding.Exchange(stacks, moments)         # optim.py: Muon's whole matrices, to their owners and back
    sharding.save(path, ...), sharding.read_state(path)   # checkpoint.py: the ckpt.dcp format (PyTorch's DCP)

Everything here also runs on a CPU with gloo, where the tests exercise it; on CUDA the same calls use NCCL.
"""
import contextlib
import json
import math
import mmap
import os
import pickle
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import zeros as distributed_zeros

from files import atomic_write, fsync_dir
from model import GPTConfig, check_state


# ----------------------------------------------------------------------------- the model, sharded

def fully_shard_model(model, worker):
    """model (built on the CPU) sharded in place with FSDP2 over the worker's ranks, each unit moved to its device
    as it is sharded: every block, the embedding and the anchor projection are units of their own, gathered for
    their forward and backward only; the root unit holds the rest (lm_head, ln_f, the anchor norms): the loss reads
    lm_head's weight instead of calling the module (model.LMHeadLoss), so a unit of its own would never be gathered.
    Blocks are compiled one by one, as torchtitan does, when the worker compiles. In bf16 (CUDA's default)
    the parameters are gathered in bf16 and the gradients reduced in fp32 (MixedPrecisionPolicy); the shards, what
    the optimisers update, stay fp32. FSDP reduce-scatters every micro-step's gradients into the shards (its default,
    as torchtitan's): holding them unsharded until the last would keep 4 bytes a parameter on every rank, what FSDP
    is there to save."""
    mesh = init_device_mesh(torch.device(worker.device).type, (worker.world_size,))
    bf16 = worker.runtime.dtype == torch.bfloat16
    shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else
                 MixedPrecisionPolicy())
    config = model.config
    # a block returns its projections as views (for internal anchors), which FSDP warns of in case they are changed
    # in place: nothing does that
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for i, block in enumerate(model.blocks):
        if worker.compile:
            model.blocks[i] = block = torch.compile(block)
        # internal anchors pass layer 1's QK-norm after layer 1 has run (GPT.normalize): keep that unit gathered
        fully_shard(block, **shard, reshard_after_forward=not (i == 0 and config.anchor == "internal"
                                                                 and config.anchor_norm))
    for unit in (model.wte, model.anchor_proj):
        if unit is not None:
            fully_shard(unit, **shard)
    return fully_shard(model, **shard)


def reshard(model):
    """Every FSDP unit of model back to its shards, as the checkpoint functions need them; whether there is any (a
    sharded model). A unit leaves its parameters gathered after a forward without backward (the root's, always)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    return bool(units)


def is_sharded(tensor):
    """Whether a parameter (or optimiser state) is FSDP's: a DTensor, of whose rows this rank holds a shard."""
    return isinstance(tensor, DTensor)


def local(tensors):
    """This rank's part of each tensor: a DTensor's local shard, any other tensor itself."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def zeros(shape, like):
    """Zeros of shape on like's device; sharded by rows over like's ranks when like is a DTensor, so that DCP
    reshards them with it."""
    if isinstance(like, DTensor):
        return distributed_zeros(shape, device_mesh=like.device_mesh, placements=[Shard(0)])
    return torch.zeros(shape, device=like.device)


def full_value(t):
    """A tensor's whole value on every rank (a DTensor's is gathered: the gradient norm of clipping, say)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- Muon under FSDP: whole matrices
# Orthogonalising each shard alone would not be Muon. Each matrix has an owner (assign_owners); one all-to-all brings
# each owner the rows of its matrices' Nesterov updates and second moments from every rank, the owner runs Muon's
# steps 2 and 3 on them whole (optim.Muon.update), and a second all-to-all returns each rank its rows of the results.

def chunk_rows(n, world):
    """The rows of each rank's shard of n rows, as FSDP and DTensor's Shard(0) split them: torch.chunk's chunks of
    ceil(n / world) rows, then empty ones."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]


def assign_owners(shapes, world):
    """The rank that orthogonalises each matrix, balanced by cost: the costliest first, each to the rank with the
    least so far (Polar Express on m x n, m <= n: ~2m²n + m³ multiply-adds an iteration; the all-to-all bytes
    follow m·n, in the same order). The same answer on every rank."""
    cost = [min(s) ** 2 * (2 * max(s) + min(s)) for s in shapes]
    load, owners = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        owners[i] = min(range(world), key=lambda r: load[r])
        load[owners[i]] += cost[i]
    return owners


def by_shape(indices, shapes):
    """The indices grouped by their matrix's shape, in order: one stack each."""
    groups = {}
    for i in indices:
        groups.setdefault(shapes[i][0], []).append(i)
    return list(groups.values())


class Exchange:
    """The sharded exchange of a Muon step, two all-to-alls, for stacks of same-shaped matrices (lists of DTensor
    parameters, their rows split over the ranks: chunk_rows) and their second moments (DTensors split the same way).
    Matrix i, counted through the stacks in order, is k = 2 tensors (its update and its second moment); owners[i] is
    the rank that gets it whole."""

    def __init__(self, stacks, moments):
        params, moments = [p for s in stacks for p in s], [m for s in moments for m in s]
        mesh = params[0].device_mesh
        self.shapes = [[tuple(p.shape), tuple(m.shape)] for p, m in zip(params, moments)]
        self.sizes = [len(s) for s in stacks]
        self.owners = assign_owners([s for s, _ in self.shapes], mesh.size())
        self.rank, self.world, self.group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
        self.device = params[0].to_local().device
        self.mine = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        self.owned = by_shape(self.mine, self.shapes)  # the stacks this rank orthogonalises
        self.k = 2

    def to_owners(self, updates, moments):
        """updates, moments: this rank's rows of every matrix, by stack. Returns the whole matrices this rank owns,
        every rank's rows in rank order, stacked by shape: [[updates (k, rows, cols), second moments], ...]."""
        parts = [[u, m] for u, m in zip([u for s in updates for u in s], [m for s in moments for m in s])]
        outgoing = [[t for i, o in enumerate(self.owners) if o == r for t in parts[i]] for r in range(self.world)]
        incoming = [[s for i in self.mine for s in self._shard_shapes(i, r)] for r in range(self.world)]
        received = self._swap(outgoing, incoming)
        whole = {i: [torch.cat([received[r][n * self.k + j] for r in range(self.world)]) for j in range(self.k)]
                 for n, i in enumerate(self.mine)}
        return [[torch.stack([whole[i][j] for i in idx]) for j in range(self.k)] for idx in self.owned]

    def from_owners(self, stacks):
        """stacks: to_owners's, updated: [[normed updates, second moments], ...]. Returns this rank's rows of every
        matrix's, each from its owner, stacked as the stacks of the step: [(normed updates, second moments), ...]."""
        results = {i: [t[n] for t in stack] for stack, idx in zip(stacks, self.owned) for n, i in enumerate(idx)}
        pieces = {i: [t.split(chunk_rows(t.shape[0], self.world)) for t in results[i]] for i in self.mine}
        outgoing = [[parts[r] for i in self.mine for parts in pieces[i]] for r in range(self.world)]
        incoming = [[s for i, o in enumerate(self.owners) if o == r for s in self._shard_shapes(i, self.rank)]
                    for r in range(self.world)]
        received, seen, mine = self._swap(outgoing, incoming), [0] * self.world, []
        for owner in self.owners:  # each owner's matrices arrive in index order
            mine.append(received[owner][seen[owner]:seen[owner] + self.k])
            seen[owner] += self.k
        starts = [sum(self.sizes[:n]) for n in range(len(self.sizes))]
        return [[torch.stack([m[j] for m in mine[a:a + n]]) for j in range(self.k)] for a, n in zip(starts, self.sizes)]

    def _shard_shapes(self, i, r):
        """Rank r's shards of the tensors of matrix i."""
        return [(chunk_rows(s[0], self.world)[r], *s[1:]) for s in self.shapes[i]]

    def _swap(self, outgoing, incoming):
        """One all_to_all_single: outgoing[r], the tensors for rank r; incoming[r], the shapes of those rank r
        sends here. Returns what each rank sent, shaped."""
        out_sizes = [sum(t.numel() for t in ts) for ts in outgoing]
        send = torch.cat([t.reshape(-1) for ts in outgoing for t in ts] or [torch.zeros(0, device=self.device)])
        in_sizes = [sum(math.prod(s) for s in shapes) for shapes in incoming]
        received = send.new_empty(sum(in_sizes)) if self.world > 1 else send  # one rank: it sends to itself
        if self.world > 1:
            dist.all_to_all_single(received, send, in_sizes, out_sizes, group=self.group)
        return [[t.view(s) for t, s in zip(part.split([math.prod(s) for s in shapes]), shapes)]
                for part, shapes in zip(received.split(in_sizes), incoming)]


# ----------------------------------------------------------------------------- sharded checkpoints (DCP)
# A sharded checkpoint is a directory, <out_dir>/ckpt.dcp: torch.distributed.checkpoint's (DCP's) files of the
# model's and the optimisers' tensors, each rank writing its own shards, DCP's .metadata, and state.json: everything
# else of a resume checkpoint (model_config, config, step, loader, rng, param_groups, pending_log). DCP reshards on
# load: any number of ranks, or one process without FSDP, reads it. It holds only tensors, which DCP reads without
# unpickling; its .metadata is a pickle of DCP's own, unpickled by DCP, which is why read_state first reads it
# with an unpickler that knows only DCP's metadata classes.
STATE_FILE = "state.json"
DCP_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes")


def _metadata(path):
    """The DCP metadata of a sharded checkpoint, read with _MetadataUnpickler; a one-line error if it is not one,
    or if it holds anything but tensors."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise ValueError(f"{path}: not a sharded checkpoint of train.py ({e})") from None
    other = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if other:
        raise ValueError(f"{path}: {other[0]} is not a tensor (DCP would unpickle it); refused")
    return metadata


def _dcp_load(state, path, alone=False):
    """dcp.load of path into the tensors of state, in place: by all the ranks of the process group, or in this
    process alone (alone=True, or without a group), which DCP warns of though it is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.load(state, checkpoint_id=path, no_dist=alone or not dist.is_initialized())


def read_state(path):
    """Everything but the tensors of a sharded checkpoint (its state.json), marked with "sharded": path; restore
    puts its tensors into a model and its optimisers."""
    _metadata(path)
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no readable {STATE_FILE} ({e})") from None
    return {**state, "sharded": path}


def load_whole(path, keys=("model", "model_config")):
    """A sharded checkpoint read whole into one process (no process group), as checkpoint.load_checkpoint returns a
    ckpt.pt: state.json's entries, the model's tensors, and with "optimizers" in keys the optimisers' states
    (one dict, keyed by parameter name)."""
    state, metadata = read_state(path), _metadata(path)
    wanted = {"model"} | ({"optimizers"} & set(keys))
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if k.split(".", 1)[0] in wanted}
    _dcp_load(tensors, path, alone=True)
    state["model"] = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if "optimizers" in keys:
        named = {}
        for k, v in tensors.items():
            if k.startswith("optimizers."):
                fqn, name = k[len("optimizers."):].rsplit(".", 1)
                named.setdefault(fqn, {})[name] = v
        state["optimizers"] = [{"state": named, "param_groups": state["param_groups"]}]
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return state


def save(path, model, optimizers, state, master):
    """A sharded run's resume checkpoint as the directory path: the model's and optimisers' tensors, every rank
    writing its shards, and state (the rest, JSON) in state.json. Written in path.tmp, then swapped in by two renames
    (path -> path.old, path.tmp -> path) and path.old removed, so that a stop or a full disk mid-write leaves the
    previous checkpoint whole (resume_path completes a swap cut between the renames). A rank's OSError (a full disk)
    is raised on every rank."""
    tmp, old = path + ".tmp", path + ".old"
    if master and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a write that was cut short
    dist.barrier()
    reshard(model)
    optimizer_state = get_optimizer_state_dict(model, optimizers)
    try:
        dcp.save({"model": get_model_state_dict(model), "optimizers": optimizer_state["state"]}, checkpoint_id=tmp)
    except CheckpointException as e:  # DCP gathers every rank's failure onto every rank
        if master:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        raise next((exc for exc, _ in e.failures.values() if isinstance(exc, OSError)), e) from None
    if master:
        with atomic_write(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({**state, "param_groups": optimizer_state["param_groups"]}, f)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(old, ignore_errors=True)


def resume_path(whole, directory, sharded):
    """A run's resume checkpoint: its ckpt.pt (whole) or its ckpt.dcp (directory), whichever holds the later step (a
    run may switch between DDP and FSDP), after finishing save's swap if a stop came between its two renames; when
    there is neither, the one a run of this kind (sharded or not) writes."""
    if not os.path.exists(directory) and os.path.isdir(directory + ".old"):
        with contextlib.suppress(FileNotFoundError):  # every rank may try; the first one's rename is the swap
            os.rename(directory + ".old", directory)
    found = [p for p in (whole, directory) if os.path.exists(p)]
    if len(found) == 2:  # stopped between a save and the removal of the other kind's older one
        try:
            whole_step = torch.load(whole, map_location="cpu", weights_only=True, mmap=True)["step"]
        except Exception as e:  # a corrupt file, or one that is not a checkpoint
            raise ValueError(f"{whole}: no step readable with torch.load(weights_only=True) ({type(e).__name__})") \
                from None
        return found[read_state(directory)["step"] >= whole_step]
    return found[0] if found else (directory if sharded else whole)


def restore(ckpt, model, optimizers=None):
    """The weights, and with optimizers their states, of ckpt put into model when either is sharded: a sharded
    checkpoint (read_state's) into any model, sharded or whole (DCP reshards it), or a whole one into a sharded
    model (torch's distributed state-dict functions)."""
    reshard(model)
    if "sharded" in ckpt:
        state = get_model_state_dict(model)
        _dcp_load({"model": state}, ckpt["sharded"])
        set_model_state_dict(model, state)
        if optimizers:
            state = get_optimizer_state_dict(model, optimizers)  # the states to load into (a step at lr 0 makes them)
            _dcp_load({"optimizers": state["state"]}, ckpt["sharded"])
            set_optimizer_state_dict(model, optimizers, {"state": state["state"], "param_groups": ckpt["param_groups"]})
        return
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, ckpt["model"], options=whole)
    if optimizers:
        set_optimizer_state_dict(model, optimizers, named_optimizer_state(model, optimizers, ckpt["optimizers"]),
                                 options=whole)


def named_optimizer_state(model, optimizers, states):
    """ckpt.pt's optimiser states (torch's format: each parameter by its index in its optimiser) as one dict keyed
    by parameter name, the format of torch.distributed.checkpoint.state_dict."""
    names = {id(p): n.replace("_orig_mod.", "") for n, p in model.named_parameters()}  # compiled blocks' prefix
    named = {"state": {}, "param_groups": []}
    for opt, saved in zip(optimizers, states):
        fqns = [names[id(p)] for group in opt.param_groups for p in group["params"]]
        named["state"].update({fqns[i]: state for i, state in saved["state"].items()})
        named["param_groups"] += [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]]
    return named


def save_weights(path, model, header, master):
    """The weights-only checkpoint of a sharded model ({"model": its tensors, **header}), gathered one tensor at a
    time, every rank taking part (each holds at most one whole matrix at a time), and streamed by rank 0 into the
    file (write_streamed)."""
    tensors = get_model_state_dict(model)

    def fill(mapped):
        for name, t in tensors.items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if mapped is not None:
                mapped[name].copy_(whole)
            del whole  # before the next one is gathered

    if not master:
        return fill(None)
    write_streamed(path, header, {name: (t.shape, t.dtype) for name, t in tensors.items()}, fill)


def export(src, out, source):
    """The weights-only checkpoint of a sharded checkpoint directory src, in one process without the model in
    memory: DCP reads each tensor's shards straight into out (write_streamed). Returns its state.json's entries."""
    state, metadata = read_state(src), _metadata(src)
    shapes = {k[len("model."):]: (m.size, m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
              if k.startswith("model.")}
    check_state(GPTConfig.from_dict(state["model_config"], f"{src}: model_config"),
                {k: torch.empty(shape, device="meta") for k, (shape, _) in shapes.items()}, src)
    header = {"model_config": state["model_config"], "step": state["step"], "config": state["config"],
              "source": source}
    write_streamed(out, header, shapes, lambda mapped: _dcp_load({"model": mapped}, src, alone=True))
    return state


def write_streamed(path, header, shapes, fill):
    """A weights-only checkpoint, {"model": tensors of shapes {name: (shape, dtype)}, **header}, written without
    its tensors in memory: torch.save writes the file with their bytes left out (skip_data, of fake tensors), then
    fill(mapped) writes them through mapped, the file's tensors in a shared memory map. Atomic, as
    files.atomic_write."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with FakeTensorMode():
            fake = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save({"model": fake, **header}, tmp)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(tmp, mmap=True, weights_only=True)["model"]
        fill(mapped)
        del mapped  # unmapped: its pages are the file's
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
