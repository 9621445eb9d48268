"""
Checkpoints: the one place that knows their format, as data.py is for shards, and where a loaded model gets
its device and precision. Every tool reads a checkpoint here; train.py builds and writes them here.

A checkpoint is a torch.save'd dict of tensors and plain types, read with torch.load(weights_only=True), so a
checkpoint can never run code:
    model          the (uncompiled) model's state dict
    model_config   GPTConfig as a dict
    step           optimiser steps taken
    config         train.py's whole configuration (absent from converted authors' models)
    source         convert.py's note of where the weights came from (weights-only files only)
and, for resuming (train.py's rolling <out_dir>/ckpt.pt only): optimizers, loader, rng, pending_log.
A weights-only checkpoint (convert.py's exports, train.py's keep_every history) holds the first five. A model
folder in the Hugging Face format (hf.py, convert.py --to_hf) reads as one.
"""
import contextlib
import json
import mmap
import os
import pickle
import random
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import hf
from data import atomic_write
from model import GPT, GPTConfig

WEIGHTS = ("model", "model_config", "step", "config", "source")  # what a weights-only checkpoint keeps
RESUME = ("model", "model_config", "step", "optimizers", "loader", "rng")  # what resuming needs


def checkpoint_path(out_dir, sharded=False):
    """A run's resume checkpoint, the one --init_from=resume and auto continue from: <out_dir>/ckpt.pt, or the
    directory <out_dir>/ckpt.dcp of a sharded (FSDP) run."""
    return os.path.join(out_dir, "ckpt.dcp" if sharded else "ckpt.pt")


def kept_path(out_dir, step):
    """The weights-only copy of a step that keep_every keeps beside the resume checkpoint."""
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def full_path(out_dir, step, sharded=False):
    """The resumable copy of a step that keep_full keeps beside the resume checkpoint: a branch point (a sharded
    run's: a directory, as its ckpt.dcp)."""
    return os.path.join(out_dir, f"ckpt_{step:06d}_full.{'dcp' if sharded else 'pt'}")


def save_checkpoint(path, state):
    """Write atomically: a crash mid-write, or a full disk, leaves the previous checkpoint intact."""
    with atomic_write(path) as f:
        torch.save(state, f)


def weights_only(ckpt):
    """The weights-only checkpoint of any checkpoint: its WEIGHTS keys (optimiser, data and RNG state dropped)."""
    return {k: ckpt[k] for k in WEIGHTS if k in ckpt}


def load_checkpoint(path, keys=("model", "model_config"), mmap=False):
    """The dict saved by train.py (or convert.py) on the CPU, read with torch.load(weights_only=True); or that of
    a model folder in the Hugging Face format (hf.py: safetensors, no pickle), or of a Hub repository OWNER/NAME
    that holds one (downloaded once); or a sharded checkpoint (a DCP directory: load_sharded), read whole.
    keys: what it must hold. mmap: map the tensors instead of reading them (those never used are never read;
    safetensors maps them anyway)."""
    if hf.is_folder(path) or (hf.is_repo_name(path) and not os.path.exists(path)):
        ckpt = hf.read_folder(path if os.path.isdir(path) else hf.hub_folder(path))
    elif is_sharded(path):
        return load_sharded(path, keys)
    else:
        ckpt = read_torch(path, mmap)
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return ckpt


def is_sharded(path):
    """Whether path is to be read as a sharded checkpoint: a directory that is not a Hugging Face folder
    (load_sharded says so in one line when it holds no DCP checkpoint)."""
    return os.path.isdir(path) and not hf.is_folder(path)


def read_torch(path, mmap=False):
    """A torch.save'd file, read with torch.load(weights_only=True), or a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint there")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises UnpicklingError for forbidden globals, others for corrupt files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True) ({first_line})") from None
    return ckpt


def resume_state(model, config, step, optimizers, loader, pending_log=None):
    """The resume checkpoint of a training run at `step`: what --init_from=resume needs to continue it bit for bit
    (config: train.py's whole configuration, flat; pending_log: the log entry of a stop at an evaluation step)."""
    return {"model": model.state_dict(), "model_config": asdict(model.config), "config": config, "step": step,
            "optimizers": [opt.state_dict() for opt in optimizers], "loader": loader.state_dict(),
            "rng": rng_state(), **({"pending_log": pending_log} if pending_log else {})}


def exported_state(model, config, step, source):
    """A weights-only checkpoint of a model (WEIGHTS): what eval.py, sample.py, analyze.py and convert.py read."""
    return {"model": model.state_dict(), "model_config": asdict(model.config), "step": step, "config": config,
            "source": source}


def load_resume(out_dir, init_from, eval_only, sharded=False):
    """(checkpoint, its path) that a train.py run starts from, loaded to the CPU (RNG states must stay CPU
    tensors), or (None, None) for a new run. auto: out_dir's checkpoint if there is one, of either kind
    (resume_path; sharded: the kind this run writes when there is none). A file (a branch): that file, or out_dir's
    own checkpoint once there is one (a branch that was stopped goes on from it). A file that is not a resumable
    checkpoint is an error, never overwritten. A sharded checkpoint comes as its state.json (read_resumable)."""
    own = resume_path(out_dir, sharded)
    if eval_only:
        return read_resumable(own, ("model", "model_config", "step")), own
    if init_from == "scratch" or (init_from == "auto" and not os.path.exists(own)):
        return None, None
    path = own if init_from in ("resume", "auto") or os.path.exists(own) else init_from
    if path == init_from and not os.path.exists(path):
        raise ValueError(f"init_from={init_from!r}: no such file; expected 'scratch', 'resume', 'auto' or a "
                         f"checkpoint to branch from (a ckpt_<step>_full.pt, or .dcp, of keep_full)")
    try:
        return read_resumable(path, RESUME), path
    except ValueError as e:
        raise ValueError(f"{e}; a run resumes from train.py's own <out_dir>/ckpt.pt (or branches from a "
                         f"ckpt_<step>_full.pt of keep_full), not a weights-only copy") from None


def read_resumable(path, keys):
    """load_checkpoint(path, keys), but a sharded checkpoint as its state.json (sharded_state): its tensors go into
    the model and optimisers themselves (restore_weights, restore_training), sharded or not."""
    if not os.path.isdir(path):
        return load_checkpoint(path, keys)
    state = sharded_state(path)
    missing = [k for k in keys if k not in state and k not in ("model", "optimizers")]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return state


def is_own(path, out_dir):
    """Whether path is out_dir's own resume checkpoint, of either kind (else a branch point of another run)."""
    return path in (checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True))


def resumed_model_config(ckpt, given, path):
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


def restore_weights(ckpt, model):
    """A checkpoint's weights put into model, whatever the two are: ckpt.pt or a sharded checkpoint (DCP
    reshards it), a model sharded with FSDP or whole (one process, DDP)."""
    sharded = reshard(model)
    if "sharded" in ckpt:
        state = get_model_state_dict(model)
        dcp_load({"model": state}, ckpt["sharded"])
        set_model_state_dict(model, state)
    elif sharded:
        set_model_state_dict(model, ckpt["model"], options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(ckpt["model"])


def restore_training(ckpt, model, optimizers, loader):
    """A resume checkpoint's optimiser states (into model's optimisers, sharded or not, as restore_weights), data
    position and RNG states put back; returns its pending_log."""
    sharded = reshard(model)
    if "sharded" in ckpt:
        state = get_optimizer_state_dict(model, optimizers)  # the states to load into (a step at lr 0 makes them)
        dcp_load({"optimizers": state["state"]}, ckpt["sharded"])
        set_optimizer_state_dict(model, optimizers, {"state": state["state"], "param_groups": ckpt["param_groups"]})
    elif sharded:
        set_optimizer_state_dict(model, optimizers, named_optimizer_state(model, optimizers, ckpt["optimizers"]),
                                 options=StateDictOptions(full_state_dict=True))
    else:
        for opt, state in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(state)
    loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"])
    return ckpt.get("pending_log")


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


def rng_state(as_json=False):
    """Python's, numpy's, torch's (and CUDA's) RNG states, as a checkpoint keeps them (as_json: torch's as lists
    of bytes, for a sharded checkpoint's state.json; set_rng_state takes either)."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if as_json:
        state.update(torch=state["torch"].tolist(), **({"cuda": [t.tolist() for t in state["cuda"]]}
                                                         if "cuda" in state else {}))
    return state


def set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))  # JSON made them lists
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(t, dtype=torch.uint8) for t in state["cuda"]])


def disk_plan(out_dir, model, optimizers, ckpt_interval, kept=0, keep_every=0, full=0, path=None):
    """One line: what a run's checkpoints will take on disk (the resume one, path, every ckpt_interval steps, `kept`
    weights-only ones every keep_every, `full` resumable ones of keep_full), and what the disk has free."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    muon, adam = (sum(p.numel() for g in opt.param_groups for p in g["params"]) for opt in optimizers)
    resume = weights + 4 * muon + 8 * adam  # + Muon's momentum, AdamW's two moments (fp32)
    os.makedirs(out_dir, exist_ok=True)
    stat = os.statvfs(out_dir)
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    return (f"checkpoints: {path or checkpoint_path(out_dir)} ~{gb(resume)}, every {ckpt_interval} steps" +
            (f"; {kept} weights-only ckpt_<step>.pt of ~{gb(weights)} (every {keep_every} steps): "
             f"{gb(kept * weights)} more" if keep_every else "") +
            (f"; {full} resumable ckpt_<step>_full.pt (keep_full): {gb(full * resume)} more" if full else "") +
            f"; {gb(stat.f_bavail * stat.f_frsize)} free there")


def check_state(config, state_dict, source):
    """A one-line error naming the first missing, unexpected or misshapen tensor of state_dict for a GPT of
    config; returns that GPT built on the meta device (no memory, no init: 13 s saved at 450M on a CPU)."""
    with torch.device("meta"):
        model = GPT(config)
    own = model.state_dict()
    for problem, names in (("missing", [k for k in own if k not in state_dict]),
                           ("unexpected", [k for k in state_dict if k not in own])):
        if names:
            raise ValueError(f"{source}: {problem} tensor(s) {', '.join(names[:3])}"
                             f"{' ...' if len(names) > 3 else ''} for this model config")
    for k, v in state_dict.items():
        if v.shape != own[k].shape:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    return model


def check_checkpoint(path, mmap=False):
    """A checkpoint of a model and its GPTConfig, its tensors checked against the config without building
    the model: what load_model needs, or a one-line error. mmap: no tensor is read (a cheap check)."""
    ckpt = load_checkpoint(path, mmap=mmap)
    config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
    check_state(config, ckpt["model"], path)
    return ckpt, config


def load_model(path, device="cpu"):
    """The model of a checkpoint, in eval mode, and the checkpoint itself: what every tool calls."""
    ckpt, config = check_checkpoint(path)
    model = GPT(config)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


def trained_doc_mask(ckpt):
    """Whether a checkpoint's model was trained (and validated) with document masking: as its training
    config says; checkpoints from before that option were not; files without a training config, the
    authors' models converted by convert.py, were."""
    return ckpt["config"].get("doc_mask", False) if "config" in ckpt else True


# ----------------------------------------------------------------------------- sharded checkpoints (FSDP)
# A sharded checkpoint is a directory, <out_dir>/ckpt.dcp: torch.distributed.checkpoint's (DCP's) files of the
# model's and the optimisers' tensors, each rank writing its own shards, DCP's .metadata, and state.json: everything
# else of a resume checkpoint (model_config, config, step, loader, rng, param_groups, pending_log). DCP reshards on
# load: any number of ranks, or one process without FSDP, reads it. It holds only tensors, which DCP reads without
# unpickling; its .metadata is a pickle of DCP's own, unpickled by DCP, which is why sharded_state first reads it
# with an unpickler that knows only DCP's metadata classes.
SHARDED_STATE = "state.json"
DCP_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


def reshard(model):
    """Every FSDP unit of model back to its shards, as the checkpoint functions need them; whether there is any (a
    sharded model). A unit leaves its parameters gathered after a forward without backward (the root's, always)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    return bool(units)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes")


def dcp_metadata(path):
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


def dcp_load(state, path, alone=False):
    """dcp.load of path into the tensors of state, in place: by all the ranks of the process group, or in this
    process alone (alone=True, or without a group), which DCP warns of though it is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.load(state, checkpoint_id=path, no_dist=alone or not dist.is_initialized())


def sharded_state(path):
    """Everything but the tensors of a sharded checkpoint (state.json), marked with "sharded": path."""
    dcp_metadata(path)
    try:
        with open(os.path.join(path, SHARDED_STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no readable {SHARDED_STATE} ({e})") from None
    return {**state, "sharded": path}


def load_sharded(path, keys=("model", "model_config")):
    """A sharded checkpoint read whole into one process (no process group), as load_checkpoint returns a
    ckpt.pt: state.json's entries, the model's tensors, and with "optimizers" in keys the optimisers' states
    (one dict, keyed by parameter name)."""
    state, metadata = sharded_state(path), dcp_metadata(path)
    wanted = {"model"} | ({"optimizers"} & set(keys))
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
               if k.split(".", 1)[0] in wanted}
    dcp_load(tensors, path, alone=True)
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


def resume_path(out_dir, sharded=False):
    """The resume checkpoint in out_dir: ckpt.pt or ckpt.dcp, whichever holds the later step (a run may switch
    between DDP and FSDP), after finishing a sharded one's interrupted swap (save_sharded); when there is none, the
    one a run of this kind writes."""
    full, directory = checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True)
    if not os.path.exists(directory) and os.path.isdir(directory + ".old"):
        os.rename(directory + ".old", directory)  # stopped between save_sharded's two renames
    found = [p for p in (full, directory) if os.path.exists(p)]
    if len(found) == 2:  # stopped between a save and the removal of the other kind's older one
        steps = [load_checkpoint(full, ("step",), mmap=True)["step"], sharded_state(directory)["step"]]
        return found[steps[1] >= steps[0]]
    return found[0] if found else (directory if sharded else full)


def save_sharded(path, model, config, step, optimizers, loader, pending_log, master):
    """An FSDP run's resume checkpoint (what resume_state holds) as the directory path, every rank writing its
    shards. Written in path.tmp, then swapped in by two renames (path -> path.old, path.tmp -> path) and path.old
    removed, so that a stop or a full disk mid-write leaves the previous checkpoint whole (resume_path finishes a
    swap cut between the renames). A rank's OSError (a full disk) is raised on every rank."""
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
        with atomic_write(os.path.join(tmp, SHARDED_STATE), "w") as f:
            json.dump({"model_config": asdict(model.config), "config": config, "step": step,
                       "loader": loader.state_dict(), "rng": rng_state(as_json=True),
                       "param_groups": optimizer_state["param_groups"],
                       **({"pending_log": pending_log} if pending_log else {})}, f)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(old, ignore_errors=True)


def drop_stale(out_dir, sharded):
    """After a run of one kind (sharded or not) wrote its resume checkpoint, the other kind's in out_dir is older
    (a run that switched, or an earlier run there): removed, so that --init_from=auto never takes it."""
    other = checkpoint_path(out_dir, sharded=not sharded)
    if os.path.isdir(other):
        shutil.rmtree(other)
    elif os.path.exists(other):
        os.remove(other)


def fsync_dir(path):
    """Make the renames in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(path, model, config, step, source, master):
    """A weights-only checkpoint of a model (exported_state's), whole or sharded. A sharded model's is gathered one
    tensor at a time, every rank taking part (each holds at most one whole matrix at a time), and rank 0 streams
    each into the file (write_streamed)."""
    if not reshard(model):
        if master:
            save_checkpoint(path, exported_state(model, config, step, source))
        return
    tensors = get_model_state_dict(model)

    def fill(mapped):
        for name, t in tensors.items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if mapped is not None:
                mapped[name].copy_(whole)
            del whole  # before the next one is gathered

    if not master:
        return fill(None)
    shapes = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    header = {"model_config": asdict(model.config), "step": step, "config": config, "source": source}
    write_streamed(path, header, shapes, fill)


def export_sharded(src, out, source):
    """The weights-only checkpoint of a sharded checkpoint directory src, in one process without the model in
    memory: DCP reads each tensor's shards straight into out (write_streamed). Returns its state.json's entries."""
    state, metadata = sharded_state(src), dcp_metadata(src)
    shapes = {k[len("model."):]: (m.size, m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
              if k.startswith("model.")}
    check_state(GPTConfig.from_dict(state["model_config"], f"{src}: model_config"),
                {k: torch.empty(shape, device="meta") for k, (shape, _) in shapes.items()}, src)
    header = {"model_config": state["model_config"], "step": state["step"], "config": state["config"],
              "source": source}
    write_streamed(out, header, shapes, lambda mapped: dcp_load({"model": mapped}, src, alone=True))
    return state


def write_streamed(path, header, shapes, fill):
    """A weights-only checkpoint, {"model": tensors of shapes {name: (shape, dtype)}, **header}, written without
    its tensors in memory: torch.save writes the file with their bytes left out (skip_data, of fake tensors), then
    fill(mapped) writes them through mapped, the file's tensors in a shared memory map. Atomic, as
    save_checkpoint."""
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


# ----------------------------------------------------------------------------- where a model runs

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
        return cls(device, getattr(torch, dtype))

    def autocast(self):
        """The forward pass's autocast context (none for float32)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.dtype)
