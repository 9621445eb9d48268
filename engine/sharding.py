"""
Sharding (FSDP2): everything that training a model beyond one GPU's memory adds, in one room. Each rank holds 1/N of
every weight, gradient and optimiser state. A reader of the one-process and DDP story can skip this file: the other
modules reach it through a few calls, each of which does nothing for a whole (unsharded) tensor or model:

    model = sharding.fully_shard_model(model, worker)     # train.py builds a sharded model instead of DDP's
    Muon(..., exchange=sharding.Exchange)                 # train.py, when sharded: Muon's matrices to their owners
    sharding.save(path, ...), sharding.read_state(path)   # checkpoint.py: the ckpt.dcp format (PyTorch's DCP)

Everything here also runs on a CPU with gloo, where the tests exercise it; on CUDA the same calls use NCCL.
"""
import contextlib
import io
import json
import math
import mmap
import os
import pickle
import shutil
import struct
import sys
import warnings
import zipfile
import zlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import optim
from engine.files import (DamagedError, HashingWriter, WholeReads, agreed, atomic_write, check_entry, fsync_dir, note,
                          share, verify_zip)
from model import GPTConfig, check_state

# torch's FSDP, DTensor and DCP are imported by the functions here that use them: importing them costs about 1 CPU-s
# a process (DTensor's shape propagation pulls in sympy; measured on 2 cores, torch 2.13.0), which every run, tool
# and test that never shards would pay. Until they are imported, no tensor is a DTensor and no module is FSDP's.




# ----------------------------------------------------------------------------- the model, sharded

def fully_shard_model(model, worker):
    """model (built on the meta device, or on the CPU) sharded in place with FSDP2 over the worker's ranks, each unit
    moved to its device as it is sharded (a meta model's stay there until to_empty gives its shards storage): every
    block, the embedding and the anchor projection are units of their own, gathered for their forward and backward
    only; the root unit holds the rest (lm_head, ln_f, the anchor norms): the loss reads
    lm_head's weight instead of calling the module (model.LMHeadLoss), so a unit of its own would never be gathered.
    Blocks are compiled one by one, as torchtitan does, when the worker compiles. In bf16 (CUDA's default)
    the parameters are gathered in bf16 and the gradients reduced in fp32 (MixedPrecisionPolicy); the shards, what
    the optimisers update, stay fp32. FSDP reduce-scatters every micro-step's gradients into the shards (its default,
    as torchtitan's): holding them unsharded until the last would keep 4 bytes a parameter on every rank, what FSDP
    is there to save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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


def write_part(param, whole):
    """Store in param the part of whole (the parameter's whole value) that this process holds: under FSDP its shard,
    the rows chunk_rows gives this rank; else all of it (GPT.init_weights's write)."""
    if not is_sharded(param):
        return param.copy_(whole)
    mine = param.to_local()
    if mine.shape == whole.shape:  # all the rows
        return mine.copy_(whole)
    rows, rank = chunk_rows(whole.shape[0], param.device_mesh.size()), param.device_mesh.get_local_rank()
    start = sum(rows[:rank])
    return mine.copy_(whole[start:start + rows[rank]])


def check_optimizers(model, optimizers):
    """What a sharded checkpoint can hold of a run's optimisers ({name: optimiser}): each a torch.optim.Optimizer over
    the sharded model's parameters (its state then DTensors, saved by parameter name); a one-line error if not."""
    params = {id(p) for p in model.parameters()}
    for name, opt in optimizers.items():
        if not isinstance(opt, torch.optim.Optimizer) or any(id(p) not in params for g in opt.param_groups
                                                              for p in g["params"]):
            raise ValueError(f"fsdp=True: the optimiser {name!r} ({type(opt).__name__}) is not a torch.optim.Optimizer "
                             f"over the model's parameters, so its state could not be saved sharded (ckpt.dcp)")


def reshard(model):
    """Every FSDP unit of model back to its shards, as the checkpoint functions need them; whether there is any (a
    sharded model). A unit leaves its parameters gathered after a forward without backward (the root's, always)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    units = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)] if fsdp else []
    for unit in units:
        unit.reshard()
    return bool(units)


def is_sharded(tensor):
    """Whether a parameter (or optimiser state) is FSDP's: a DTensor, of whose rows this rank holds a shard."""
    return optim.is_dtensor(tensor)


def local(tensors):
    """This rank's part of each tensor: a DTensor's local shard, any other tensor itself."""
    return [t.to_local() if is_sharded(t) else t for t in tensors]


def full_value(t):
    """A tensor's whole value on every rank (a DTensor's is gathered: the gradient norm of clipping, say)."""
    return t.full_tensor() if is_sharded(t) else t


# ----------------------------------------------------------------------------- Muon under FSDP: whole matrices
# Orthogonalising each shard alone would not be Muon. Each matrix has an owner (assign_owners); one all-to-all brings
# each owner the rows of its matrices' Nesterov updates and second moments from every rank, the owner runs Muon's
# steps 2 and 3 on them whole (optim.Muon.update, as in one process), and a second all-to-all returns each rank its
# rows of the results.

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


class Exchange(optim.Exchange):
    """The sharded exchange of a Muon step (FSDP's; optim.Exchange's methods), two all-to-alls, for the stacks of
    same-shaped matrices of a step (lists of DTensor parameters, their rows split over the ranks: chunk_rows) and
    their second moments (DTensors split the same way). Matrix i, counted through the stacks in order, is k = 2
    tensors (its update and its second moment); owners[i] is the rank that gets it whole, and orthogonalises it
    (share and gather: optim.Exchange's, which keep all of a stack)."""
    sharded = True

    def __init__(self, stacks):
        params = [p for s in stacks for p in s]
        mesh = params[0].device_mesh
        self.shapes = [[tuple(p.shape), optim.moment_shape(*p.shape)] for p in params]
        self.sizes = [len(s) for s in stacks]
        self.owners = assign_owners([s for s, _ in self.shapes], mesh.size())
        self.rank, self.world, self.group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
        self.device = params[0].to_local().device
        self.mine = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        self.owned = by_shape(self.mine, self.shapes)  # the stacks this rank orthogonalises
        self.k = 2

    def zeros(self, shape, like):
        """Zeros of shape, sharded by rows over like's ranks (a DTensor), so that DCP reshards them with it."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import zeros as distributed_zeros
        return distributed_zeros(shape, device_mesh=like.device_mesh, placements=[Shard(0)])

    def local(self, tensors):
        """This rank's rows of each tensor (DTensors)."""
        return local(tensors)

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
# A sharded checkpoint is a directory, <out_dir>/ckpt.dcp, holding what engine/checkpoint.py says a resume checkpoint
# holds: torch.distributed.checkpoint's (DCP's) files of the tensors of every resumable part, each rank writing its
# own shards, DCP's .metadata, and state.json, everything else (the header, and each part's values that are not
# tensors: the loader's position, the optimisers' param_groups by name). The model and the optimisers are saved
# with torch's distributed state-dict functions (tensors by parameter name); any other part with its own state_dict().
# What a part must satisfy for that: its state_dict() is a dict (nested dicts, string keys) whose leaves are tensors
# (a DTensor for what is sharded, as the model's parameters are; any other tensor the same on every rank: one copy is
# kept) or JSON values (rank 0's are kept); before its load_state_dict, its state_dict() already holds tensors of the
# saved shapes, which DCP loads into. DCP reshards on load: any number of ranks, or one process without FSDP, reads
# it. It holds only tensors, which DCP reads without unpickling; its .metadata is a pickle of DCP's own, which DCP
# would unpickle as it is: read_state reads it once, with an unpickler that knows only DCP's metadata classes, and
# restore hands DCP what it read.
# Every file of it is listed in its manifest.json, with its size, counted as it is written (each rank's DCP files
# through _hashing, gathered to rank 0, which writes the manifest last), and the sha256 of the small ones
# (.metadata, state.json), hashed as they are written. A .distcp file needs none: DCP writes each of its tensors
# with torch.save, whose zip holds a CRC-32 of every entry, so that checking them adds nothing to a write. Every
# read verifies every file first (verify); under torchrun the ranks share the check of the tensors, each about
# 1/world_size of their bytes, and agree on the verdict before any of them reads a tensor.
STATE_FILE = "state.json"
MANIFEST = "manifest.json"
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


def _metadata(path, data=None):
    """The DCP metadata of a sharded checkpoint, read with _MetadataUnpickler (data: its bytes, read already); a
    one-line error if it is not one, or if it holds anything but tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        if data is None:
            with open(os.path.join(path, ".metadata"), "rb") as f:
                data = f.read()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise ValueError(f"{path}: not a sharded checkpoint of train.py ({e})") from None
    other = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if other:
        raise ValueError(f"{path}: {other[0]} is not a tensor (DCP would unpickle it); refused")
    return metadata


def _dcp_load(state, path, alone=False, metadata=None):
    """dcp.load of path into the tensors of state, in place: by all the ranks of the process group, or in this
    process alone (alone=True, or without a group), which DCP warns of though it is what is meant. metadata: its
    .metadata as read_state read and checked it, which DCP then neither reads nor unpickles again."""
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(path)
    reader.fs = _whole_reads(reader.fs)
    if metadata is not None:
        reader.read_metadata = lambda *args, **kwargs: metadata
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.load(state, storage_reader=reader, no_dist=alone or not dist.is_initialized())


def verify(path, worker=None):
    """Every file of a sharded checkpoint checked against its manifest before DCP reads any of it: its size, and
    the sha256 of .metadata and state.json; then, as .metadata places them, every tensor's torch.save'd zip in the
    .distcp files, against its CRC-32s (which must cover each file whole). A DamagedError names the file (and the
    tensor); a file the manifest does not list is one too. A checkpoint written before manifests has none: a note
    says it cannot be verified. Returns (its metadata, state.json's bytes): each read once, and checked as read.
    worker (a parallel.Worker; None: one process): the ranks share the tensors' check, each reading about
    1/world_size of their bytes (files.share), and agree on the verdict, the same on every rank (files.agreed)."""
    return agreed(lambda: _verify(path, worker), worker)


def _verify(path, worker):
    """verify's checks on this rank: its share of the tensors', and all the others (sizes; the small files, which
    each rank reads)."""
    expected = _manifest(path, worker)
    if expected is not None:
        extra = sorted(set(os.listdir(path)) - set(expected) - {MANIFEST})
        if extra:
            raise DamagedError(f"{os.path.join(path, extra[0])}: not in {MANIFEST}: not a file written with this "
                               f"checkpoint (or the manifest is damaged)")
        for name in sorted(expected):
            check_entry(os.path.join(path, name), expected[name], os.path.join(path, MANIFEST), hashes=False)
    metadata, state = (_read_listed(path, name, expected) for name in (".metadata", STATE_FILE))
    metadata = _metadata(path, metadata)
    if expected is not None:
        _verify_tensors(path, expected, metadata, worker)
    return metadata, state


def _manifest(path, worker=None):
    """A sharded checkpoint's manifest.json, {name: {"bytes"(, "sha256")}}; None for one written before manifests
    (with a note, rank 0's), a DamagedError if it is missing though state.json says it was written, or damaged."""
    listing = os.path.join(path, MANIFEST)
    if not os.path.exists(listing):
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                written = json.load(f).get("manifest")
        except (OSError, ValueError, AttributeError):  # read_state says what is wrong with it
            written = None
        if written:
            raise DamagedError(f"{listing}: missing, though {STATE_FILE} says it was written")
        if os.path.isdir(path):
            note(f"note: {path}: no {MANIFEST} (written before checksums): its bytes cannot be verified", worker)
        return None
    try:
        with open(listing) as f:
            files = json.load(f)["files"]
        return {name: {"bytes": int(e["bytes"]), **({"sha256": str(e["sha256"])} if "sha256" in e else {})}
                for name, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedError(f"{listing}: damaged: not the manifest written with it ({type(e).__name__}: {e})") from None


def _read_listed(path, name, expected):
    """The bytes of the small file name of a sharded checkpoint, checked against its manifest entry (expected: the
    manifest, None for a checkpoint written before manifests) as they are read; None if it cannot be read (read_state
    says why)."""
    try:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
    except OSError:
        data = None
    if expected is not None and name in expected:
        check_entry(os.path.join(path, name), expected[name], os.path.join(path, MANIFEST), data=data)
    return data


def _verify_tensors(path, expected, metadata, worker):
    """Each tensor's zip in the .distcp files, at the places metadata gives, against its CRC-32s: this rank's share
    of them (files.share); that they cover each file whole, on every rank (metadata alone)."""
    items = {}  # each .distcp file's tensors, as (offset, length, name)
    for index, info in metadata.storage_data.items():
        items.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    tensors = []  # (file, offset, length, name), in the files' order
    for name in sorted(n for n in expected if "sha256" not in expected[n]):
        end = 0
        for offset, length, fqn in sorted(items.get(name, [])):
            if offset != end:
                break
            tensors.append((name, offset, length, fqn))
            end = offset + length
        if end != expected[name]["bytes"]:
            raise DamagedError(f"{os.path.join(path, name)}: its tensors, as .metadata places them, do not cover "
                               f"its {expected[name]['bytes']} bytes (a damaged .metadata, or not its file)")
    mine = [tensors[i] for i in share([length for _, _, length, _ in tensors], worker)]
    for name in sorted({name for name, *_ in mine}):
        with WholeReads(os.path.join(path, name)) as f:
            for _, offset, length, fqn in (t for t in mine if t[0] == name):
                verify_zip(_Slice(f, offset, length), f"{os.path.join(path, name)}: {fqn}")


class _Slice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open binary file, as a file of their own (a tensor of a .distcp
    file, a zip of its own, for zipfile)."""

    def __init__(self, f, offset, length):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = max(0, min(self.length, [pos, self.pos + pos, self.length + pos][whence]))
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buffer):
        self.f.seek(self.offset + self.pos)
        n = self.f.readinto(memoryview(buffer)[:self.length - self.pos])
        self.pos += n
        return n


def _hashing(fs):
    """DCP's file system fs, each file it writes counted, and hashed but for a .distcp file, as its bytes go through
    (files.HashingWriter): fs.entries, by file name, what the manifest lists. DCP writes .metadata as .metadata.tmp,
    then renames it. (fs's own create_stream wrapped, not a subclass of DCP's class: DCP is imported only where it is
    used.)"""
    create_stream, fs.entries = fs.create_stream, {}

    @contextlib.contextmanager
    def counted(path, mode):
        with create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            writer = HashingWriter(stream, sha256=not str(path).endswith(".distcp"))  # its tensors' zips: CRC-32s
            yield writer
        fs.entries[os.path.basename(str(path)).removesuffix(".tmp")] = writer.entry()

    fs.create_stream = counted
    return fs


def _whole_reads(fs):
    """DCP's file system fs, each file it reads opened as files.WholeReads: DCP seeks to each tensor and torch.loads
    it, and the buffer of Python's open() reads ahead at each seek (a tensor's few kB at the quick start's size read
    about twice over)."""
    create_stream = fs.create_stream

    @contextlib.contextmanager
    def opened(path, mode):
        if mode != "rb":
            with create_stream(path, mode) as stream:
                yield stream
            return
        with WholeReads(path) as stream:
            yield stream

    fs.create_stream = opened
    return fs


def read_state(path, worker=None):
    """Everything but the tensors of a sharded checkpoint (its state.json), marked with "sharded": path, and its
    metadata (DCP's, under "sharded_metadata": what restore gives DCP); restore puts its tensors into a model and its
    optimisers. Every file is verified first (verify; worker: by the ranks together)."""
    metadata, data = verify(path, worker)
    try:
        if data is None:
            raise OSError("cannot be read")
        state = json.loads(data)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no readable {STATE_FILE} ({e})") from None
    return {**state, "sharded": path, "sharded_metadata": metadata}


def load_whole(path, keys=("model", "model_config")):
    """A sharded checkpoint read whole into one process (no process group), as checkpoint.load_checkpoint returns a
    ckpt.pt: state.json's entries, each part's tensors in place (the optimisers' states by parameter name), the
    model's always, the others' with their name in keys."""
    state = read_state(path)
    metadata = state.pop("sharded_metadata")
    wanted = {"model"} | set(keys)
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if k.split(".", 1)[0] in wanted}
    _dcp_load(tensors, path, alone=True, metadata=metadata)
    for key, tensor in tensors.items():  # each back where it was in its part's nested state (DCP's planner_data)
        *route, leaf = metadata.planner_data[key]
        node = state
        for step in route:
            node = node.setdefault(step, {})
        node[leaf] = tensor
    if "optimizers" in keys and "parts" not in state:  # written before the optimisers had names in state.json
        state["optimizers"] = {"all": {"state": state.get("optimizers", {}), "param_groups": state["param_groups"]}}
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return state


def _state_dict(part, model):
    """A resumable part's state, as a sharded checkpoint holds it: the model's and each optimiser's by parameter name
    (torch's distributed state-dict functions; an optimiser with no state yet gets it, from a step at lr 0)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    if part is model:
        return get_model_state_dict(model)
    if _is_optimizers(part):
        return {name: get_optimizer_state_dict(model, opt) for name, opt in part.items()}
    return part.state_dict()


def _is_optimizers(part):
    """Whether a resumable part is a run's optimisers, {name: torch.optim.Optimizer} (optim.Optimizers)."""
    return isinstance(part, dict) and all(isinstance(o, torch.optim.Optimizer) for o in part.values())


def _split(tree):
    """(the tensors of a nested dict, the rest of it): what DCP saves, what state.json keeps."""
    tensors, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            t, r = _split(value)
            tensors.update({key: t} if t else {})
            rest.update({key: r} if r or not t else {})
        elif torch.is_tensor(value):
            tensors[key] = value
        else:
            rest[key] = value
    return tensors, rest


def _merge(tensors, rest):
    """A nested dict of _split's two halves, whole again."""
    return {**rest, **{k: _merge(v, rest.get(k, {})) if isinstance(v, dict) else v for k, v in tensors.items()}}


def save(path, parts, header, master):
    """A sharded run's resume checkpoint as the directory path: the tensors of every part ({name: part}, the model
    first), every rank writing its shards, and header (plain values) with the rest of each part in state.json.
    Written in path.tmp, then swapped in by two renames (path -> path.old, path.tmp -> path) and path.old removed, so
    that a stop or a full disk mid-write leaves the previous checkpoint whole (checkpoint.own_checkpoint completes a
    swap cut between the renames). A rank's OSError (a full disk) is raised on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException
    tmp, old = path + ".tmp", path + ".old"
    if master and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a write that was cut short
    dist.barrier()
    model = parts["model"]
    reshard(model)
    tensors, state = {}, {**header, "parts": list(parts), "manifest": MANIFEST}  # a checkpoint that has one
    for name, part in parts.items():
        tensors[name], state[name] = _split(_state_dict(part, model))
    try:
        files = write_tensors(tensors, tmp)
    except CheckpointException as e:  # DCP gathers every rank's failure onto every rank
        if master:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        raise next((exc for exc, _ in e.failures.values() if isinstance(exc, OSError)), e) from None
    if master:
        with atomic_write(os.path.join(tmp, STATE_FILE)) as f:
            hashing = HashingWriter(f)
            hashing.write(json.dumps(state).encode())
        write_manifest(tmp, {**files, STATE_FILE: hashing.entry()})
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(old, ignore_errors=True)


def write_tensors(tensors, path, checksums=True, alone=False):
    """DCP's files of tensors (a nested dict) in the directory path, every rank writing its shards (alone: this
    process without a group). checksums: each file counted, and .metadata hashed, as DCP writes them
    (_hashing), and torch.save's CRC-32s in the .distcp files as they are (on by default); returns every
    rank's {file name: {"bytes"(, "sha256")}}, gathered onto each ({} without checksums)."""
    import torch.distributed.checkpoint as dcp
    writer = dcp.FileSystemWriter(path)
    if checksums:
        writer.fs = _hashing(writer.fs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.save(tensors, storage_writer=writer, no_dist=alone)
    entries = [getattr(writer.fs, "entries", {})]
    if not alone and dist.is_initialized() and dist.get_world_size() > 1:  # to rank 0, which wrote .metadata
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, writer.fs.entries if checksums else {})
    return {name: e for rank in entries for name, e in rank.items()}


def write_manifest(path, files):
    """A sharded checkpoint's manifest.json: files ({name: {"bytes"(, "sha256")}}), written last, into the directory
    that save then renames into place (so never seen half-written), and fsynced as DCP's files are."""
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def restore(ckpt, parts):
    """Every part ({name: part}, the model first) from ckpt when either is sharded: a sharded checkpoint (read_state's)
    into any model, sharded or whole (DCP reshards it into what each part holds now), or a whole one into a sharded
    model (torch's distributed state-dict functions; a part's DTensors get their shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    model = parts["model"]
    reshard(model)
    optimizers = [name for name, part in parts.items() if _is_optimizers(part)]
    if "sharded" not in ckpt:
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, ckpt["model"], options=whole)
        for name in optimizers:
            for o, state in parts[name].named(ckpt[name]).items():
                opt = parts[name][o]
                set_optimizer_state_dict(model, opt, named_optimizer_state(model, opt, state), options=whole)
        for name, part in parts.items():
            if part is not model and name not in optimizers:
                part.load_state_dict(_shard_like(ckpt[name], part.state_dict()))
        return
    current = {name: _state_dict(part, model) for name, part in parts.items()}
    if "parts" in ckpt:
        tensors = {name: _split(state)[0] for name, state in current.items()}
        _dcp_load(tensors, ckpt["sharded"], metadata=ckpt.get("sharded_metadata"))
        saved = {name: _merge(tensors[name], ckpt.get(name, {})) for name in parts}
    else:
        saved = _earlier(ckpt, current, optimizers)
    for name, part in parts.items():
        if part is model:
            set_model_state_dict(model, saved[name])
        elif name in optimizers:  # by name, their groups' factors checked (Optimizers.named)
            for o, state in part.named(saved[name]).items():
                set_optimizer_state_dict(model, part[o], state)
        else:
            part.load_state_dict(saved[name])


def _earlier(ckpt, current, optimizers):
    """restore's saved states of a sharded checkpoint written before state.json named the parts: it holds the model,
    the optimisers (their tensors under their parameters' names, their param_groups in one list), loader and rng."""
    flat = {fqn: t for name in optimizers for o in current[name].values() for fqn, t in _split(o["state"])[0].items()}
    tensors = {"model": current["model"], "optimizers": flat}
    _dcp_load(tensors, ckpt["sharded"], metadata=ckpt.get("sharded_metadata"))
    saved = {"model": tensors["model"], "loader": ckpt["loader"], "rng": ckpt["rng"]}
    for name in optimizers:
        saved[name] = {o: {"state": {fqn: flat[fqn] for fqn in s["state"]},
                           "param_groups": [g for g in ckpt["param_groups"] if set(g["params"]) <= set(s["state"])]}
                       for o, s in current[name].items()}
    return saved


def _shard_like(whole, current):
    """A part's state from a whole checkpoint, each tensor sharded as the part's own tensor in its place is (a
    DTensor under FSDP), to load into a sharded run."""
    if isinstance(whole, dict):
        return {k: _shard_like(v, current.get(k) if isinstance(current, dict) else None) for k, v in whole.items()}
    if is_sharded(current):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(whole.to(current.device_mesh.device_type), current.device_mesh, current.placements)
    return whole


def named_optimizer_state(model, optimizer, state):
    """An optimiser's state in torch's format (each parameter by its index in the optimiser), as ckpt.pt holds it,
    keyed by parameter name instead: the format of torch.distributed.checkpoint.state_dict."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)].replace("_orig_mod.", "") for group in optimizer.param_groups for p in group["params"]]
    return {"state": {fqns[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]}


def save_weights(path, model, header, master):
    """The weights-only checkpoint of a sharded model ({"model": its tensors, **header}), gathered one tensor at a
    time, every rank taking part (each holds at most one whole matrix at a time), and streamed by rank 0 into the
    file (write_streamed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    tensors = get_model_state_dict(model)

    def fill(mapped):
        for name, t in tensors.items():
            whole = full_value(t)
            if mapped is not None:
                mapped[name].copy_(whole)
            del whole  # before the next one is gathered

    if not master:
        return fill(None)
    write_streamed(path, header, {name: (t.shape, t.dtype) for name, t in tensors.items()}, fill)


def export(src, out, source):
    """The weights-only checkpoint of a sharded checkpoint directory src, in one process without the model in
    memory: DCP reads each tensor's shards straight into out (write_streamed). Returns its state.json's entries."""
    state = read_state(src)
    metadata = state.pop("sharded_metadata")
    shapes = {k[len("model."):]: (m.size, m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
              if k.startswith("model.")}
    check_state(GPTConfig.from_dict(state["model_config"], f"{src}: model_config"),
                {k: torch.empty(shape, device="meta") for k, (shape, _) in shapes.items()}, src)
    header = {"model_config": state["model_config"], "step": state["step"], "config": state["config"],
              "tokenizer": state.get("tokenizer"), "source": source}
    write_streamed(out, header, shapes, lambda mapped: _dcp_load({"model": mapped}, src, alone=True, metadata=metadata))
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
        # skip_data leaves each tensor's CRC-32 in the zip at 0: set from the bytes just written (in memory), in
        # the order torch.save gave the storages their keys (data/0, data/1, ...: each fake tensor its own)
        _set_zip_crcs(tmp, {f"data/{i}": zlib.crc32(t.detach().reshape(-1).view(torch.uint8).numpy())
                            for i, t in enumerate(mapped.values())})
        del mapped  # unmapped: its pages are the file's
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _set_zip_crcs(path, crcs):
    """The CRC-32s of a zip's entries ({name under the archive's folder: crc}) set in place: in its central directory,
    what readers check, and in each entry's data descriptor (torch.save writes one after each entry's data)."""
    with zipfile.ZipFile(path) as z:
        infos, position = z.infolist(), z.start_dir
    with open(path, "r+b") as f:
        for info in infos:  # the central directory's records, in the same order
            f.seek(position)
            record = f.read(46)  # the fixed part of a central directory record (the zip format, APPNOTE 4.3.12)
            name = info.filename.split("/", 1)[-1]
            if name in crcs:
                f.seek(position + 16)
                f.write(struct.pack("<I", crcs[name]))
                f.seek(info.header_offset + 26)  # the local header's name and extra lengths (APPNOTE 4.3.7)
                n, m = struct.unpack("<HH", f.read(4))
                descriptor = info.header_offset + 30 + n + m + info.compress_size
                f.seek(descriptor)
                signed = f.read(4) == b"PK\x07\x08"  # the descriptor's optional signature (APPNOTE 4.3.9)
                f.seek(descriptor + 4 * signed)
                f.write(struct.pack("<I", crcs[name]))
            position += 46 + sum(struct.unpack("<HHH", record[28:34]))
