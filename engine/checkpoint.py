"""
Checkpoints: the one place that knows their format, as data.py is for shards. Two kinds, each saved and loaded here,
and one reader that every tool calls for anything it accepts:

    save_resumable, load_resumable, restore    train.py's <out_dir>/ckpt.pt: the run, to continue it bit for bit
    continued_config                           the keys of a run that continues one: which it may change
    with_data_tokenizer                        the tokenizer of a run's data, checked against its model and checkpoint
    declare_input, check_parts                 a file a run reads, checked on resume; state no part saves, refused
    save_weights, save_checkpoint              a weights-only checkpoint: train.py's keep_every, convert.py's exports
    load_checkpoint, load_model                any checkpoint: ours, FSDP's ckpt.dcp directory, a Hugging Face folder
    trained_tokenizer                          the tokenizer a checkpoint's model was trained with, for every tool

load_resumable alone decides what a resume reads (own_checkpoint: ckpt.pt or ckpt.dcp, the later; a branch point;
for --init_from=auto the newest that verifies), going down into sharding.py once for a ckpt.dcp (read_state); under
torchrun once for the launch, the ranks together (files.decided, files.agreed).

Every read verifies the bytes before a tensor is used: torch.save's zip holds a CRC-32 of every entry, checked from
the bytes torch.load reads (_read_torch: one read; mapped, verify_torch_file first), and a ckpt.dcp a manifest of
its files (and each tensor in them its zip's CRC-32s), checked before DCP reads any of it (sharding.verify: the
ranks share it). A damaged file is a one-line error naming the file and the entry, the same on every rank;
--init_from=auto skips it for the newest checkpoint that verifies.

A checkpoint is a torch.save'd dict of tensors and plain types, read with torch.load(weights_only=True), so a
checkpoint can never run code:
    model          the (uncompiled) model's state dict
    model_config   GPTConfig as a dict
    step           optimiser steps taken
    config         train.py's whole configuration (absent from converted authors' models)
    tokenizer      the tokenizer of the data it trained on, data.read_tokenizer's record (its ranks file's name and
                   sha256, <|endoftext|>'s id, its size, and its ranks unless GPT-2's); None, or absent (written
                   before tokenizers were recorded): GPT-2's is assumed. The tools take it from here (trained_tokenizer)
    source         convert.py's note of where the weights came from (weights-only files only)
and, for resuming, a run's resumable parts, each under its name ("parts" lists them): model, optimizers (each
optimiser's state by its name), loader, rng, and any a fork registers (among them inputs: the sha256 of each file
the run reads beside its checkpoint, declare_input); pending_log. A run under FSDP writes the
directory ckpt.dcp instead (sharding.py); a model folder in the Hugging Face format (hf.py) reads as a weights-only
checkpoint.
"""
import contextlib
import errno
import hashlib
import os
import random
import re
import shutil
from dataclasses import asdict, replace

import numpy as np
import torch

from engine import hf, sharding
from engine.data import data_tokenizer, describe_tokenizer, read_tokenizer, same_tokenizer
from engine.files import DamagedError, VerifyingReader, WholeReads, agreed, atomic_write, decided, note, verify_zip
from model import GPT, GPTConfig, check_state

WEIGHTS = ("model", "model_config", "step", "config", "tokenizer", "source")  # what a weights-only checkpoint keeps
# the parts of a checkpoint written before they were listed in it (its optimizers a list: [Muon's, AdamW's])
EARLIER_PARTS = ("model", "optimizers", "loader", "rng")


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


def is_branch(path, out_dir):
    """Whether a run in out_dir starting from the checkpoint path starts from another run's (a branch point of
    keep_full), not from its own, of either kind."""
    return path not in (checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True))


# ----------------------------------------------------------------------------- the resumable kind

def save_resumable(path, parts, step, config, worker=None, pending_log=None, tokenizer=None):
    """A training run's checkpoint, as this module's docstring lists it: every resumable part (parts: {name: part},
    the model first) under its name, the step, the run's whole configuration (config: flat), its data's tokenizer
    (a record) and pending_log. Rank 0 writes it, atomically: a crash mid-write, or a full disk, leaves the previous
    one intact; under FSDP it is a directory that every rank writes (sharding.save). worker (None: one process):
    every rank learns whether that worked, and a rank's OSError is raised on all of them. Written as a run's ckpt.pt
    or ckpt.dcp, it removes the other kind's there, which is older (a run that switched between DDP and FSDP)."""
    header = {"model_config": asdict(parts["model"].config), "config": config, "step": step, "tokenizer": tokenizer,
              **({"pending_log": pending_log} if pending_log else {})}
    master, error = worker is None or worker.master, None
    try:
        if sharding.reshard(parts["model"]):  # FSDP: every rank writes its shards
            sharding.save(path, parts, header, master)
        elif master:
            with atomic_write(path) as f:
                torch.save({**header, "parts": list(parts), **{n: part.state_dict() for n, part in parts.items()}}, f)
    except OSError as e:
        error = e
    if worker.any(error is not None) if worker else error:
        why = f"{error.strerror or error}" if error else "rank 0 could not write it"
        raise OSError(f"{path}: {why}{' (the disk is full)' if error and error.errno == errno.ENOSPC else ''}")
    other = {"ckpt.pt": "ckpt.dcp", "ckpt.dcp": "ckpt.pt"}.get(os.path.basename(path))
    if master and other and os.path.exists(os.path.join(os.path.dirname(path), other)):
        _remove(os.path.join(os.path.dirname(path), other))


def load_resumable(out_dir, init_from, eval_only=False, sharded=False, worker=None):
    """Resuming: (checkpoint, its path) that a train.py run starts from, on the CPU (RNG states must stay CPU
    tensors), or (None, None) for a new run. auto: out_dir's checkpoint if there is one, of either kind (the later
    one if both; when there is none, the kind this run writes); one that does not verify (a damaged byte) is skipped,
    with a line saying why, for the newest resumable one of out_dir that does (its other kind, then the branch points
    of keep_full, the latest first), so that a requeued job goes on by itself. A file (a branch point of keep_full):
    that file, or out_dir's own checkpoint once there is one (a branch that was stopped goes on from it). A file that
    is not a resumable checkpoint is an error, never overwritten. FSDP's ckpt.dcp comes as its state.json: restore
    puts its tensors into the parts themselves. eval_only: out_dir's checkpoint, of any kind.
    worker (a parallel.Worker; None: one process): the ranks of a launch choose once, together: which checkpoints
    are there is rank 0's view (files.decided), and each is verified in the read that loads it (a ckpt.pt) or by the
    ranks sharing its files (a ckpt.dcp), the verdict agreed before any tensor is used (files.agreed), so that every
    rank resumes from the same one, skips the same ones (rank 0 says so) or stops with the same line."""
    present = decided(lambda: _present(out_dir, init_from), worker)
    own, read = own_checkpoint(out_dir, sharded, worker, present)
    if not eval_only and (init_from == "scratch" or (init_from == "auto" and own not in present)):
        return None, None
    if read is not None and (init_from in ("resume", "auto") or eval_only):  # read already, choosing it
        return read, own
    path = own if eval_only or init_from in ("resume", "auto") or own in present else init_from
    if path == init_from and path not in present:
        raise ValueError(f"init_from={init_from!r}: no such file; expected 'scratch', 'resume', 'auto' or a "
                         f"checkpoint to branch from (a ckpt_<step>_full.pt, or .dcp, of keep_full)")
    if init_from == "auto" and not eval_only:
        return _newest_that_verifies(out_dir, path, worker, present)
    return _read_resumable(path, eval_only, worker), path


BRANCH_NAME = re.compile(r"ckpt_\d+_full\.(pt|dcp)")  # a branch point of keep_full (branch_path)


def _present(out_dir, init_from=None):
    """The checkpoints a start may read, those there now: out_dir's ckpt.pt and ckpt.dcp (after finishing
    sharding.save's swap if a stop came between its two renames), init_from if it names one, and out_dir's branch
    points of keep_full, the latest first."""
    whole, directory = checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True)
    if not os.path.exists(directory) and os.path.isdir(directory + ".old"):
        with contextlib.suppress(FileNotFoundError):  # another start's rename may come first: that is the swap
            os.rename(directory + ".old", directory)
    given = [init_from] if init_from not in (None, "scratch", "resume", "auto") else []
    branches = sorted(p for p in os.listdir(out_dir) if BRANCH_NAME.fullmatch(p)) if os.path.isdir(out_dir) else []
    return [p for p in [whole, directory] + given if os.path.exists(p)] + \
        [os.path.join(out_dir, p) for p in reversed(branches)]


def own_checkpoint(out_dir, sharded, worker=None, present=None):
    """(path, the checkpoint read if it had to be) of out_dir's resume checkpoint: its ckpt.pt or its ckpt.dcp,
    whichever holds the later step (a run may switch between DDP and FSDP; both are read, and one that does not read
    is passed over: the other is chosen, and verified as it is read again); when there is neither, the one a run of
    this kind writes (path, None). present: _present's list, as load_resumable decided it (None: decided here)."""
    if present is None:
        present = decided(lambda: _present(out_dir), worker)
    whole, directory = checkpoint_path(out_dir), checkpoint_path(out_dir, sharded=True)
    found = [p for p in (whole, directory) if p in present]
    if len(found) < 2:  # the usual case: one kind, or none yet
        return (found[0] if found else directory if sharded else whole), None
    read = {}  # stopped between a save and the removal of the other kind's older one
    for path in found:
        with contextlib.suppress(ValueError):  # damaged, or not one: the other is chosen
            read[path] = _read_resumable(path, worker=worker)
    later = max(read, key=lambda p: (read[p]["step"], p == directory), default=directory)  # neither reads: read
    #   again, it says why
    return later, read.get(later)


def _read_resumable(path, eval_only=False, worker=None):
    """The checkpoint at path, verified, if it is one a run resumes from (eval_only: any), or a one-line error: the
    same on every rank of worker's (files.agreed)."""
    def read():
        try:
            ckpt = sharding.read_state(path, worker) if _is_dcp(path) else \
                load_checkpoint(path, ("model", "model_config", "step"), worker=worker)
            _check_keys(ckpt, ("model_config", "step") if eval_only else ("model_config", "step", "config"), path)
            if not eval_only and "parts" not in ckpt and "optimizers" not in ckpt and "param_groups" not in ckpt:
                raise ValueError(f"{path}: no resumable parts in this checkpoint")
        except ValueError as e:
            if eval_only or isinstance(e, DamagedError):
                raise
            raise ValueError(f"{e}; a run resumes from train.py's own <out_dir>/ckpt.pt (or branches from a "
                             f"ckpt_<step>_full.pt of keep_full), not a weights-only copy") from None
        return ckpt
    return agreed(read, worker)


def _newest_that_verifies(out_dir, own, worker=None, present=()):
    """auto's checkpoint: own (out_dir's resume checkpoint) if it verifies, else the newest of out_dir's other
    resumable ones (of present, _present's list) that does, each one skipped said in one line (by rank 0); a one-line
    error naming own's damage if none does."""
    other = checkpoint_path(out_dir, sharded=not own.endswith(".dcp"))
    branches = [p for p in present if BRANCH_NAME.fullmatch(os.path.basename(p))]
    first = None
    for path in [own] + [other] * (other in present) + branches:
        try:
            return _read_resumable(path, worker=worker), path
        except DamagedError as e:
            first = first or e
            note(f"note: --init_from=auto: skipped {e}; trying the next newest checkpoint", worker)
    raise DamagedError(f"{first}; no other checkpoint in {out_dir} verifies")


def restore(ckpt, parts, path, every_part=True):
    """A checkpoint put back into a run: each of parts ({name: part}, the model first) from its state under its name.
    every_part: the checkpoint's parts and these are the same names (a resume; eval_only takes the model alone). Either
    kind of checkpoint goes into either kind of model (sharding.restore: a ckpt.dcp into any model, or any
    checkpoint into a model under FSDP). A part that does not fit is a one-line error. Returns the pending_log."""
    saved = ckpt.get("parts", EARLIER_PARTS)
    missing, extra = [n for n in parts if n not in saved], [n for n in saved if n not in parts and every_part]
    if missing or extra:
        raise ValueError(f"{path}: " + "; ".join(
            [f"no {', '.join(missing)} in it, which this run has"] * bool(missing) +
            [f"it holds {', '.join(extra)}, which this run has none of (it would be lost)"] * bool(extra)))
    try:
        if "sharded" in ckpt or sharding.reshard(parts["model"]):
            sharding.restore(ckpt, parts)
        else:
            for name, part in parts.items():
                part.load_state_dict(ckpt[name])
    except (ValueError, KeyError, RuntimeError) as e:  # torch's: a model's missing keys, a group of another size
        lines = [line.strip() for line in str(e).strip().splitlines()] or [type(e).__name__]
        raise ValueError(f"{path}: {' '.join(lines[:2])}") from None  # torch's: a heading, then what
    return ckpt.get("pending_log")


def continued_config(recipe, given, cfg, ckpt, path, say):
    """(cfg, model_config) of a run that continues the checkpoint ckpt (at path): each key left out is the
    checkpoint's, but recipe.PER_START's (recipe: the train module, its keys' kinds and its schedule). A resume may
    change recipe.EXECUTION's keys; a branch (a keep_full point of another run) only recipe.BRANCH_FREE's, and only
    from a step before which the two schedules agree (Hagele et al., 2024: exact or refused); an evaluation any but
    the model's. A key given with another value than one it may not change is refused in one line."""
    model_config = GPTConfig.from_dict(ckpt["model_config"], f"{path}: model_config")
    branch = is_branch(path, cfg.out_dir) and cfg.init_from != "auto"  # auto: out_dir's own, maybe a kept one
    if branch:  # a branch's own BRANCH_FREE keys are its own, never its parent's
        rule = recipe.BRANCH_FREE, "a branch changes max_steps only", recipe.PER_START | recipe.BRANCH_FREE
    elif cfg.eval_only:
        rule = set(recipe.DEFAULTS), "the model is the checkpoint's", recipe.PER_START
    else:
        rule = recipe.EXECUTION, "a run continues with the recipe it was saved with", recipe.PER_START
    saved, flat = continued_keys(ckpt, given, path, recipe.ALL_DEFAULTS, *rule)
    cfg, parent = recipe.split_config(flat)[0], recipe.split_config(saved)[0]
    if branch and (t := recipe.schedule_differs(parent, cfg, ckpt["step"])) is not None:
        raise ValueError(f"{path}: cannot branch from it: the schedules of max_steps={parent.max_steps} and "
                         f"max_steps={cfg.max_steps} differ from step {t}: a branch point s needs the same schedule at "
                         f"every step before s (here s <= {t})")
    if not (branch or cfg.eval_only) and cfg.max_steps != parent.max_steps:
        t = recipe.schedule_differs(parent, cfg, max(cfg.max_steps, parent.max_steps))
        say(f"max_steps={cfg.max_steps}, the run's was {parent.max_steps}: the two schedules "
            + ("agree at every step" if t is None else f"differ from step {t} on"))
    return cfg, model_config


def continued_keys(ckpt, given, path, defaults, changeable, why, own):
    """(saved, keys) of a run that continues a checkpoint, both flat: saved, the checkpoint's (a key it lacks, added
    after it was written, at its default; doc_mask: trained_doc_mask); keys, the run's: saved, but the keys of own at
    their defaults, then what is given. A given key that is not changeable and differs from saved is refused in one
    line naming both values, and why."""
    recorded = {**ckpt.get("config", {}), **ckpt["model_config"], "doc_mask": trained_doc_mask(ckpt)}
    saved = {k: recorded.get(k, default) for k, default in defaults.items()}
    saved.update({k: tuple(v) for k, v in saved.items() if isinstance(v, list)})  # a tuple key, as JSON keeps it
    refused = [k for k in defaults if k in given and k not in changeable and given[k] != saved[k]]
    if refused:
        show = lambda d: ", ".join(f"{k}={d[k]!r}" for k in refused)
        raise ValueError(f"{path}: {show(saved)} in the checkpoint, {show(given)} given: {why} (leave the key out to "
                         f"take the checkpoint's)")
    return saved, {**saved, **{k: defaults[k] for k in own}, **given}


def with_data_tokenizer(model_config, data_dir, given, ckpt=None, path=None):
    """model_config of a run on data_dir's shards, made by the tokenizer its manifest records (data.data_tokenizer),
    checked before any work, each refusal in one line: a run that continues a checkpoint (ckpt, at path) refuses data
    of another tokenizer than the one it trained on; a vocabulary without room for every token is refused, and so is
    an eot_token given otherwise than the tokenizer's. A new run takes the tokenizer's eot_token, the <|endoftext|>
    its document masks look for. Data that records none (written before tokenizers were recorded, or by hand) keeps
    the model's (GPT-2's unless given), and its token ids are checked as every shard's are (data.validate_shard)."""
    tokenizer = data_tokenizer(data_dir) if ckpt is None else check_data_tokenizer(ckpt, data_dir, path)
    if tokenizer is None:
        return model_config
    if tokenizer["n_vocab"] > model_config.vocab_size:
        raise ValueError(f"vocab_size={model_config.vocab_size}: {data_dir}'s tokenizer is "
                         f"{describe_tokenizer(tokenizer)}: expected vocab_size >= {tokenizer['n_vocab']}")
    if given.get("eot_token", tokenizer["eot_token"]) != tokenizer["eot_token"]:
        raise ValueError(f"eot_token={given['eot_token']}: {data_dir}'s tokenizer is {describe_tokenizer(tokenizer)} "
                         f"(leave eot_token out: a run takes it from its data)")
    return model_config if ckpt is not None else replace(model_config, eot_token=tokenizer["eot_token"])


def check_data_tokenizer(ckpt, data_dir, path):
    """data_dir's tokenizer (data.data_tokenizer), if it is the one the checkpoint ckpt (at path) was trained with; a
    one-line error if not: its model reads those ids, and no other's."""
    tokenizer = data_tokenizer(data_dir)
    if not same_tokenizer(ckpt.get("tokenizer"), tokenizer):
        raise ValueError(f"{data_dir}: its tokenizer is {describe_tokenizer(tokenizer)}, {path} was trained with "
                         f"{describe_tokenizer(ckpt.get('tokenizer'))}: its model reads that one's data")
    return tokenizer


class RNG:
    """Python's, numpy's, torch's (and CUDA's) random number generators, as a resumable part. Its state: torch's as
    tensors, the rest as JSON's types (a ckpt.dcp keeps those in its state.json)."""

    @staticmethod
    def state_dict():
        np_state = np.random.get_state()
        state = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:])}
        if torch.cuda.is_available():
            state["cuda"] = {str(i): t for i, t in enumerate(torch.cuda.get_rng_state_all())}
        return state

    @staticmethod
    def load_state_dict(state):  # torch's, CUDA's: tensors, or lists of bytes (a ckpt.dcp of before, in state.json)
        random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))  # JSON made them lists
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"].values() if isinstance(state["cuda"], dict) else state["cuda"]
            torch.cuda.set_rng_state_all([torch.as_tensor(t, dtype=torch.uint8) for t in cuda])


class Inputs:
    """The files a run reads beside its checkpoint (a teacher, an initialisation, a table of a fork's own), as a
    resumable part: each one's sha256 as the run declared it (declare_input), kept in every checkpoint. A run that
    continues one (a resume, a branch) refuses, in one line naming it, a file that changed since, as it refuses a
    recipe key given with another value: its weights would differ from the unbroken run's."""

    def __init__(self):
        self.sha256 = {}  # {path: sha256 of its bytes, as read when declared}

    def state_dict(self):
        return {"sha256": dict(self.sha256)}

    def load_state_dict(self, state):
        saved, said = state["sha256"], lambda digest: f"sha256 {digest[:12]}..." if digest else "not declared"
        for path in sorted(set(saved) | set(self.sha256)):
            if saved.get(path) != self.sha256.get(path):
                raise ValueError(f"input {path}: {said(saved.get(path))} when the checkpoint was written, "
                                 f"{said(self.sha256.get(path))} now: a run continues with the inputs it was saved "
                                 f"with")


def declare_input(parts, path):
    """path, a file (or a folder of files) that the run reads beside its checkpoint, declared where build reads it,
    in one line (`teacher = load_model(declare_input(parts, cfg.teacher))[0]`): its sha256 goes into the resumable
    part "inputs" (Inputs), and a run that continues the checkpoint refuses a file that changed. Returns path."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (an input this run reads)")
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(os.path.join(root, f) for root, _, fs in os.walk(path)
                                                       for f in fs)
    for name in files:  # a folder: each file's path under it, then its bytes
        digest.update(os.path.relpath(name, path).encode() + b"\0")
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    parts.setdefault("inputs", Inputs()).sha256[str(path)] = digest.hexdigest()
    return path


GENERATORS = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)  # each a state of its own
OWN_CLASSES = ("engine", "model", "optim", "torch")  # modules whose classes' state_dict is known: searched


def check_parts(run):
    """A one-line error for state the run holds that no part of run.parts saves, which a resume would start again,
    the resumed run then differing from the unbroken one with nothing said: a random generator (the global ones
    are the part rng's), an object with state_dict() and load_state_dict() that is not a part, a module with
    trained parameters that the model does not hold. Searched: run's attributes, what they hold, and the modules
    of every model; not a part of a fork's own class, whose state_dict saves what it holds."""
    parts = [p for p in run.parts.values() if p is not None]
    trusted = {id(p) for p in parts if type(p).__module__.split(".")[0] not in OWN_CLASSES}
    trained = {id(p) for p in run.model.parameters()}
    seen = {id(run.cfg), id(run.worker), id(torch.default_generator)}
    stack = [(f"run.{k}", v) for k, v in reversed(vars(run).items())]
    while stack:
        where, obj = stack.pop()
        if id(obj) in seen or id(obj) in trusted or isinstance(obj, (str, bytes, int, float, torch.Tensor, np.ndarray,
                                                                     torch.optim.Optimizer)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, GENERATORS):
            what = "a random generator"
        elif isinstance(obj, torch.nn.Module):
            if any(p.requires_grad and id(p) not in trained for p in obj.parameters()):
                what = "a module with trained parameters"
            else:  # what its modules hold beside parameters, buffers and submodules, which no state_dict saves
                seen.update(id(m) for m in obj.modules())
                stack += [(f"{where}.{n}.{k}" if n else f"{where}.{k}", v) for n, m in obj.named_modules()
                          for k, v in vars(m).items() if not k.startswith("_")]
                continue
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and all(obj is not p for p in parts):
            what = "an object with a state_dict"
        else:
            if isinstance(obj, dict):
                stack += [(f"{where}[{k!r}]", v) for k, v in obj.items()]
            elif isinstance(obj, (list, tuple, set)):
                stack += [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
            elif type(obj).__module__.split(".")[0] not in ("torch", "numpy", "builtins") and hasattr(obj, "__dict__"):
                stack += [(f"{where}.{k}", v) for k, v in vars(obj).items()]
            continue
        raise ValueError(f"{where}: {what} that no part of run.parts saves: a resume would start it again (keep it in "
                         f"a part registered in train.build: docs/FORKING.md)")
    return run


def tensors(state):
    """The tensors of a nested state dict."""
    for value in state.values():
        if isinstance(value, dict):
            yield from tensors(value)
        elif torch.is_tensor(value):
            yield value


def _remove(path):
    """A checkpoint file, or a ckpt.dcp directory."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# ----------------------------------------------------------------------------- the weights-only kind

def save_weights(path, model, config, step, source, master=True, tokenizer=None):
    """A weights-only checkpoint of a model (WEIGHTS): what eval.py, sample.py, analyze.py and convert.py read. A
    model under FSDP's is streamed from its shards, a tensor at a time (sharding.save_weights)."""
    header = {"model_config": asdict(model.config), "step": step, "config": config, "tokenizer": tokenizer,
              "source": source}
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

def load_checkpoint(path, keys=("model", "model_config"), mmap=False, worker=None):
    """The dict saved by train.py (or convert.py) on the CPU, read with torch.load(weights_only=True); or that of
    a model folder in the Hugging Face format (hf.py: safetensors, no pickle), or of a Hub repository OWNER/NAME
    that holds one (downloaded once); or FSDP's ckpt.dcp directory, read whole.
    keys: what it must hold. mmap: map the tensors instead of reading them (those never used are never read;
    safetensors maps them anyway). worker: a note is said by rank 0 alone of the ranks that all read the file."""
    if hf.is_folder(path) or (hf.is_repo_name(path) and not os.path.exists(path)):
        ckpt = hf.read_folder(path if os.path.isdir(path) else hf.hub_folder(path))
    elif _is_dcp(path):
        return sharding.load_whole(path, keys)
    else:
        ckpt = _read_torch(path, mmap, worker)
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


def trained_tokenizer(ckpt, given=None, source="the checkpoint"):
    """The tokenizer a checkpoint's model was trained with (a record of data.read_tokenizer's, for data.load_encoding),
    the one it records; for a checkpoint that records none (written before tokenizers were), given (a tool's
    --tokenizer), or GPT-2's. given, where one is recorded, must be that one: another is refused in one line."""
    recorded = ckpt.get("tokenizer")
    if given is None:
        return recorded or read_tokenizer()
    record = read_tokenizer(given)
    if recorded is not None and not same_tokenizer(recorded, record):
        raise ValueError(f"--tokenizer {given}: {describe_tokenizer(record)}, but {source} was trained with "
                         f"{describe_tokenizer(recorded)}, which it records (leave --tokenizer out)")
    return record


def trained_doc_mask(ckpt):
    """Whether a checkpoint's model was trained (and validated) with document masking: as its training
    config says; checkpoints from before that option were not; files without a training config, the
    authors' models converted by convert.py, were."""
    return ckpt["config"].get("doc_mask", False) if "config" in ckpt else True


def _is_dcp(path):
    """Whether path is to be read as FSDP's checkpoint: a directory that is not a Hugging Face folder
    (sharding.read_state says so in one line when it holds no DCP checkpoint)."""
    return os.path.isdir(path) and not hf.is_folder(path)


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6: a zip file, a CRC-32 of every entry


def verify_torch_file(path):
    """Every entry of a torch.save'd file read and checked against the CRC-32 its zip holds (zipfile checks it at
    an entry's end), before torch.load uses a byte: a DamagedError naming the file and the entry. A file of torch's
    format before 1.6 (not a zip) holds none: a note says it cannot be verified."""
    with open(path, "rb") as f:
        if _is_zip(f, path):
            verify_zip(f, path)


def _read_torch(path, mmap=False, worker=None):
    """A torch.save'd file read with torch.load(weights_only=True) and verified in the same read: each entry's CRC-32
    computed from the bytes torch.load reads (files.VerifyingReader), checked before anything it read is returned
    (mmap: the whole file verified first, verify_torch_file, as a mapped file's bytes are read when used). A damaged
    byte is verify_torch_file's one-line error, anything else torch.load cannot read one of its own. worker: a note is
    said by rank 0 alone."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no checkpoint there")
    if mmap:
        verify_torch_file(path)
        return _torch_load(path, path, mmap=True)
    with WholeReads(path) as f:
        if not _is_zip(f, path, worker):
            return _torch_load(path, path)
        reader = VerifyingReader(f, path)
        try:
            ckpt = _torch_load(reader, path)
        except ValueError:
            reader.check()  # what stopped torch.load was a damaged byte: that line
            raise
        reader.check()
    return ckpt


def _is_zip(f, path, worker=None):
    """Whether the file f (at its start) is a zip, as torch.save writes since torch 1.6; if not, a note (rank 0's)
    says that its bytes cannot be verified. f is left at its start."""
    zipped = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    f.seek(0)
    if not zipped:
        note(f"note: {path}: not a zip file (torch's format before 1.6): its bytes cannot be verified", worker)
    return zipped


def _torch_load(f, path, mmap=False):
    """torch.load(f, weights_only=True) onto the CPU, or a one-line error naming path."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises UnpicklingError for forbidden globals, others for corrupt files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not loadable with torch.load(weights_only=True) ({first_line})") from None


def _check_keys(ckpt, keys, path):
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} in this checkpoint")
