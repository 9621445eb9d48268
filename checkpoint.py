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
import os
import random
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch

import hf
from data import atomic_write
from model import GPT, GPTConfig

WEIGHTS = ("model", "model_config", "step", "config", "source")  # what a weights-only checkpoint keeps
RESUME = ("model", "model_config", "step", "optimizers", "loader", "rng")  # what resuming needs


def checkpoint_path(out_dir):
    """A run's resume checkpoint, the one --init_from=resume and auto continue from."""
    return os.path.join(out_dir, "ckpt.pt")


def kept_path(out_dir, step):
    """The weights-only copy of a step that keep_every keeps beside the resume checkpoint."""
    return os.path.join(out_dir, f"ckpt_{step:06d}.pt")


def full_path(out_dir, step):
    """The resumable copy of a step that keep_full keeps beside the resume checkpoint: a branch point."""
    return os.path.join(out_dir, f"ckpt_{step:06d}_full.pt")


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
    that holds one (downloaded once). keys: what it must hold. mmap: map the tensors instead of reading them
    (those never used are never read; safetensors maps them anyway)."""
    if hf.is_folder(path) or (hf.is_repo_name(path) and not os.path.exists(path)):
        ckpt = hf.read_folder(path if os.path.isdir(path) else hf.hub_folder(path))
    else:
        ckpt = read_torch(path, mmap)
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return ckpt


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


def load_resume(out_dir, init_from, eval_only):
    """(checkpoint, its path) that a train.py run starts from, loaded to the CPU (RNG states must stay CPU
    tensors), or (None, None) for a new run. auto: out_dir's checkpoint if there is one. A file (a branch): that
    file, or out_dir's own checkpoint once there is one (a branch that was stopped goes on from it). A file
    that is not a resumable checkpoint is an error, never overwritten."""
    own = checkpoint_path(out_dir)
    if eval_only:
        return load_checkpoint(own, ("model", "model_config", "step")), own
    if init_from == "scratch" or (init_from == "auto" and not os.path.exists(own)):
        return None, None
    path = own if init_from in ("resume", "auto") or os.path.exists(own) else init_from
    if path == init_from and not os.path.isfile(path):
        raise ValueError(f"init_from={init_from!r}: no such file; expected 'scratch', 'resume', 'auto' or a "
                         f"checkpoint to branch from (a ckpt_<step>_full.pt of keep_full)")
    try:
        return load_checkpoint(path, RESUME), path
    except ValueError as e:
        raise ValueError(f"{e}; a run resumes from train.py's own <out_dir>/ckpt.pt (or branches from a "
                         f"ckpt_<step>_full.pt of keep_full), not a weights-only copy") from None


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


def restore_training(ckpt, optimizers, loader):
    """A resume checkpoint's optimiser states, data position and RNG states put back; returns its pending_log."""
    for opt, state in zip(optimizers, ckpt["optimizers"]):
        opt.load_state_dict(state)
    loader.load_state_dict(ckpt["loader"])
    set_rng_state(ckpt["rng"])
    return ckpt.get("pending_log")


def rng_state():
    """Python's, numpy's, torch's (and CUDA's) RNG states, as a checkpoint keeps them."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def disk_plan(out_dir, model, optimizers, ckpt_interval, kept=0, keep_every=0, full=0):
    """One line: what a run's checkpoints will take on disk (the resume one every ckpt_interval steps, `kept`
    weights-only ones every keep_every, `full` resumable ones of keep_full), and what the disk has free."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    muon, adam = (sum(p.numel() for g in opt.param_groups for p in g["params"]) for opt in optimizers)
    resume = weights + 4 * muon + 8 * adam  # + Muon's momentum, AdamW's two moments (fp32)
    os.makedirs(out_dir, exist_ok=True)
    stat = os.statvfs(out_dir)
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    return (f"checkpoints: {checkpoint_path(out_dir)} ~{gb(resume)}, every {ckpt_interval} steps" +
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
