"""
Checkpoints: the one place that knows their format, as data.py is for shards. Two kinds, each saved and loaded here,
and one reader that every tool calls for anything it accepts:

    save_resumable, load_resumable, restore    train.py's <out_dir>/ckpt.pt: the run, to continue it bit for bit
    save_weights, save_checkpoint              a weights-only checkpoint: train.py's keep_every, convert.py's exports
    load_checkpoint, load_model                any checkpoint: ours, FSDP's ckpt.dcp directory, a Hugging Face folder

A checkpoint is a torch.save'd dict of tensors and plain types, read with torch.load(weights_only=True), so a
checkpoint can never run code:
    model          the (uncompiled) model's state dict
    model_config   GPTConfig as a dict
    step           optimiser steps taken
    config         train.py's whole configuration (absent from converted authors' models)
    source         convert.py's note of where the weights came from (weights-only files only)
and, for resuming: optimizers, loader, rng, pending_log. A run under FSDP writes the directory ckpt.dcp instead
(sharding.py); a model folder in the Hugging Face format (hf.py) reads as a weights-only checkpoint.
"""
import os
import random
import shutil
from dataclasses import asdict

import numpy as np
import torch

import hf
import sharding
from files import atomic_write
from model import GPT, GPTConfig, check_state

WEIGHTS = ("model", "model_config", "step", "config", "source")  # what a weights-only checkpoint keeps
RESUME = ("model", "model_config", "step", "optimizers", "loader", "rng")  # what resuming needs


def checkpoint_path(out_dir, sharded=False):
    """A run's resume checkpoint, the one --init_from=resume and auto continue from: <out_dir>/ckpt.pt, or the
    directory <out_dir>/ckpt.dcp of a run under FSDP."""
    return os.path.join(out_dir, "ckpt.dcp" if sharded else "ckpt.pt")


def kept_path(out_dir, step):
    """The weights-only copy of a step that keep_every keeps beside the resume checkpoint."""
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def branch_path(out_dir, step, sharded=False):
    """The resumable copy of a step that keep_full keeps beside the resume checkpoint: a branch point (under FSDP a
    directory, as its ckpt.dcp)."""
    return os.path.join(out_dir, f"ckpt_{step:06d}_full.{'dcp' if sharded else 'pt'}")


# ----------------------------------------------------------------------------- the resumable kind

def save_resumable(path, model, optimizers, loader, config, step, pending_log=None, master=True):
    """Saving a training run's checkpoint at `step`: what --init_from=resume needs to continue it bit for bit (config:
    train.py's whole configuration, flat; pending_log: the log entry of a stop at an evaluation step). Rank 0 writes
    it, atomically: a crash mid-write, or a full disk (an OSError), leaves the previous one intact. Under FSDP it
    is a directory that every rank writes (sharding.save). Written as a run's ckpt.pt or ckpt.dcp, it
    removes the other kind's there, which is older (a run that switched between DDP and FSDP)."""
    pending = {"pending_log": pending_log} if pending_log else {}
    if sharding.reshard(model):  # FSDP: every rank writes its shards
        sharding.save(path, model, optimizers, {"model_config": asdict(model.config), "config": config, "step": step,
                                                "loader": loader.state_dict(), "rng": _rng_state(as_json=True),
                                                **pending}, master)
    elif master:
        with atomic_write(path) as f:
            torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "config": config,
                        "step": step, "optimizers": [opt.state_dict() for opt in optimizers],
                        "loader": loader.state_dict(), "rng": _rng_state(), **pending}, f)
    other = {"ckpt.pt": "ckpt.dcp", "ckpt.dcp": "ckpt.pt"}.get(os.path.basename(path))
    if master and other and os.path.exists(os.path.join(os.path.dirname(path), other)):
        _remove(os.path.join(os.path.dirname(path), other))


def load_resumable(out_dir, init_from, eval_only=False, sharded=False):
    """Resuming: (checkpoint, its path) that a train.py run starts from, on the CPU (RNG states must stay CPU
    tensors), or (None, None) for a new run. auto: out_dir's checkpoint if there is one, of either kind (the later one if both;
    when there is none, the kind this run writes). A file (a branch point of keep_full): that file, or out_dir's own
    checkpoint once there is one (a branch that was stopped goes on from it). A file that is not a resumable
    checkpoint is an error, never overwritten. FSDP's ckpt.dcp comes as its state.json: restore puts its tensors
    into the model and optimisers themselves. eval_only: out_dir's checkpoint, of any kind."""
    own = sharding.resume_path(checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True), sharded)
    if not eval_only and (init_from == "scratch" or (init_from == "auto" and not os.path.exists(own))):
        return None, None
    path = own if eval_only or init_from in ("resume", "auto") or os.path.exists(own) else init_from
    if path == init_from and not os.path.exists(path):
        raise ValueError(f"init_from={init_from!r}: no such file; expected 'scratch', 'resume', 'auto' or a "
                         f"checkpoint to branch from (a ckpt_<step>_full.pt, or .dcp, of keep_full)")
    keys = ("model", "model_config", "step") if eval_only else RESUME
    try:
        if _is_dcp(path):
            ckpt = sharding.read_state(path)
            _check_keys(ckpt, [k for k in keys if k not in ("model", "optimizers")], path)
        else:
            ckpt = load_checkpoint(path, keys)
    except ValueError as e:
        if eval_only:
            raise
        raise ValueError(f"{e}; a run resumes from train.py's own <out_dir>/ckpt.pt (or branches from a "
                         f"ckpt_<step>_full.pt of keep_full), not a weights-only copy") from None
    return ckpt, path


def restore(ckpt, model, optimizers=None, loader=None):
    """A checkpoint put back into a run: the weights into model; with optimizers, their states; with loader, its
    data position and the RNG states. Either kind of checkpoint goes into either kind of model (sharding.restore:
    a ckpt.dcp into any model, or any checkpoint into a model under FSDP). Returns the checkpoint's pending_log."""
    if "sharded" in ckpt or sharding.reshard(model):
        sharding.restore(ckpt, model, optimizers)
    else:
        model.load_state_dict(ckpt["model"])
        for opt, state in zip(optimizers or [], ckpt.get("optimizers", [])):
            opt.load_state_dict(state)
    if loader is not None:
        loader.load_state_dict(ckpt["loader"])
        _set_rng_state(ckpt["rng"])
    return ckpt.get("pending_log")


def _rng_state(as_json=False):
    """Python's, numpy's, torch's (and CUDA's) RNG states, as a checkpoint keeps them (as_json: torch's as lists
    of bytes, for a ckpt.dcp's state.json; _set_rng_state takes either)."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if as_json:
        state.update(torch=state["torch"].tolist(), **({"cuda": [t.tolist() for t in state["cuda"]]}
                                                         if "cuda" in state else {}))
    return state


def _set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))  # JSON made them lists
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(t, dtype=torch.uint8) for t in state["cuda"]])


def _remove(path):
    """A checkpoint file, or a ckpt.dcp directory."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# ----------------------------------------------------------------------------- the weights-only kind

def save_weights(path, model, config, step, source, master=True):
    """A weights-only checkpoint of a model (WEIGHTS): what eval.py, sample.py, analyze.py and convert.py read. A
    model under FSDP's is streamed from its shards, a tensor at a time (sharding.save_weights)."""
    header = {"model_config": asdict(model.config), "step": step, "config": config, "source": source}
    if sharding.reshard(model):
        sharding.save_weights(path, model, header, master)
    elif master:
        with atomic_write(path) as f:
            torch.save({"model": model.state_dict(), **header}, f)


def save_checkpoint(path, ckpt):
    """Write a checkpoint dict with torch.save, atomically: a crash mid-write, or a full disk, leaves the previous
    file intact."""
    with atomic_write(path) as f:
        torch.save(ckpt, f)


# ----------------------------------------------------------------------------- reading, for every tool

def load_checkpoint(path, keys=("model", "model_config"), mmap=False):
    """The dict saved by train.py (or convert.py) on the CPU, read with torch.load(weights_only=True); or that of
    a model folder in the Hugging Face format (hf.py: safetensors, no pickle), or of a Hub repository OWNER/NAME
    that holds one (downloaded once); or FSDP's ckpt.dcp directory, read whole.
    keys: what it must hold. mmap: map the tensors instead of reading them (those never used are never read;
    safetensors maps them anyway)."""
    if hf.is_folder(path) or (hf.is_repo_name(path) and not os.path.exists(path)):
        ckpt = hf.read_folder(path if os.path.isdir(path) else hf.hub_folder(path))
    elif _is_dcp(path):
        return sharding.load_whole(path, keys)
    else:
        ckpt = _read_torch(path, mmap)
    _check_keys(ckpt, keys, path)
    return ckpt


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


def _is_dcp(path):
    """Whether path is to be read as FSDP's checkpoint: a directory that is not a Hugging Face folder
    (sharding.read_state says so in one line when it holds no DCP checkpoint)."""
    return os.path.isdir(path) and not hf.is_folder(path)


def _read_torch(path, mmap=False):
    """A torch.save'd file, read with torch.load(weights_only=True), or a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint there")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises UnpicklingError for forbidden globals, others for corrupt files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True) ({first_line})") from None


def _check_keys(ckpt, keys, path):
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
