"""
Checkpoints: the one place that knows their format, as data.py is for shards, and where a loaded model gets
its device and precision. Every tool reads a checkpoint here; train.py writes them here.

A checkpoint is a torch.save'd dict of tensors and plain types, read with torch.load(weights_only=True), so a
checkpoint can never run code:
    model          the (uncompiled) model's state dict
    model_config   GPTConfig as a dict
    step           optimiser steps taken
    config         train.py's whole configuration (absent from converted authors' models)
    source         convert.py's note of where the weights came from (weights-only files only)
and, for resuming (train.py's rolling <out_dir>/ckpt.pt only): optimizers, loader, rng, pending_log.
A weights-only checkpoint (convert.py's exports, train.py's keep_every history) holds the first five.
"""
import contextlib
import os
import sys
from dataclasses import dataclass

import torch

from data import atomic_write
from model import GPT, GPTConfig

WEIGHTS = ("model", "model_config", "step", "config", "source")  # what a weights-only checkpoint keeps
RESUME = ("model", "model_config", "step", "optimizers", "loader", "rng")  # what resuming needs


def save_checkpoint(path, state):
    """Write atomically: a crash mid-write, or a full disk, leaves the previous checkpoint intact."""
    with atomic_write(path) as f:
        torch.save(state, f)


def weights_only(ckpt):
    """The weights-only checkpoint of any checkpoint: its WEIGHTS keys (optimiser, data and RNG state dropped)."""
    return {k: ckpt[k] for k in WEIGHTS if k in ckpt}


def load_checkpoint(path, keys=("model", "model_config"), mmap=False):
    """The dict saved by train.py (or convert.py) on the CPU, read with torch.load(weights_only=True).
    keys: what it must hold. mmap: map the tensors instead of reading them (those never used are never read)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint there")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises UnpicklingError for forbidden globals, others for corrupt files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True) ({first_line})") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
    return ckpt


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
