"""
Turn a checkpoint into a weights-only checkpoint of this code: `model` (fp32 state dict), `model_config`,
`step` and a `source` note, which eval.py, `train.py --eval_only` and checkpoint.load_model read as they are.

    python -m tools.convert --list Jonnester                                   # the authors' checkpoints on the Hub
    python -m tools.convert Jonnester/Baseline --out out/authors_baseline/ckpt.pt # the authors' release
    python -m tools.convert Jonnester/Baseline/ckpt_step:38146.pt --out ...    # REPO/FILENAME
    python -m tools.convert path/to/ckpt_step:38146.pt --out ...               # a local file
    python -m tools.convert out/ckpt.pt --out out/export/ckpt.pt               # ours: drop the optimiser state
    python -m tools.convert out/ckpt.dcp --out out/export/ckpt.pt              # ours, sharded (train.py --fsdp=True)
    python -m tools.convert out/ckpt.pt --to_hf out/hf [--push USER/NAME]      # a transformers folder (hf.py)
    python -m tools.convert out/hf --out out/back/ckpt.pt                      # such a folder, or a Hub repo of one

The authors' format (their train.py) holds `model` (their state dict: bf16 Linear/Embedding weights,
keys maybe prefixed `_orig_mod.`) and `model_args` (their ModelConfig). Five versions of their model
file (oldmodels/model1..4.py, model.py) wrote such files, with different names for the same tensors;
their_config reads the variant from the flags and the tensors present, from_authors maps the names.
Everything is read with torch.load(weights_only=True) or safetensors: a checkpoint can never run code.
--to_hf writes the Hugging Face folder of any of these (hf.export), --push uploads it (hf.push).

The Hub is read through its public JSON API (httpclient.get_json): GET /api/models?author=USER lists a user's
repositories, GET /api/models/OWNER/NAME?blobs=true a repository's files and their sizes (hf.hub_files), and files
come from /OWNER/NAME/resolve/main/FILENAME (httpclient.download_file). A repository that holds a model folder
(config.json and model.safetensors) is read as one (hf.hub_folder).
"""
import argparse
import glob
import os
import re
import urllib.parse
import zipfile
from dataclasses import asdict

import torch

from engine import hf, sharding
from engine.checkpoint import load_checkpoint, save_checkpoint, trained_tokenizer
from engine.configurator import load_config
from engine.data import load_encoding
from engine.httpclient import ByteBar, DownloadError, download_file, get_json
from engine.runlog import log_path, read_log, val_curve
from model import GRANULARITY_SHAPES, PROJECTIONS, GPTConfig, check_state

HF_URL = "https://huggingface.co"
CACHE_DIR = "data/authors"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# Their ModelConfig fields whose value must be the one model.py implements (an absent field has it)
IMPLEMENTED = {"norm_pos": "before", "qk_norm": True, "act_type": "swiglu", "mlp_ratio": 4, "mlp_hidden_dim": None,
               "weight_tying": False, "smear_gate_enabled": False, "per_layer_backout": False,
               "logit_soft_cap": None, "clip_qkv": None, "yarn_enabled": False,
               "embedding_layer0_mix_enabled": False, "anchor_delta_enabled": False, "rmsnorm_eps": 1e-6,
               "rmsnorm_use_weight": True, "rmsnorm_use_bias": False}
REQUIRED = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "rope_theta", "gated_attention_enabled",
            "query_res_enabled", "key_res_enabled", "value_res_enabled", "gate_res_enabled", "residual_mode")
RES_FLAGS = {"q": "query_res_enabled", "k": "key_res_enabled", "v": "value_res_enabled", "g": "gate_res_enabled"}
COMPILED = "_orig_mod."  # torch.compile's prefix on the names of a compiled model's weights

# Their names -> ours ({i} a layer). Any other name in their state dict is refused.
RENAMES = [(re.compile(theirs), ours) for theirs, ours in [
    (r"transformer\.wte\.weight", "wte.weight"),
    (r"transformer\.final_norm\.weight", "ln_f.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"anchor_proj\.weight", "anchor_proj.weight"),
    (r"anchor_([qkvg])_norm\.weight", r"anchor_norms.\1.weight"),
    (r"transformer\.layers\.(\d+)\.attn_norm\.weight", r"blocks.\1.ln_1.weight"),
    (r"transformer\.layers\.(\d+)\.mlp_norm\.weight", r"blocks.\1.ln_2.weight"),
    (r"transformer\.layers\.(\d+)\.attn\.(c_attn|c_proj|q_norm|k_norm)\.weight", r"blocks.\1.attn.\2.weight"),
    (r"transformer\.layers\.(\d+)\.attn\.lambda_([qkvg][12])", r"blocks.\1.attn.lam.\2"),
    (r"transformer\.layers\.(\d+)\.attn\.dynamic_mixing\.(fc1\.weight|fc2\.weight|fc2\.bias)",
     r"blocks.\1.attn.dyn.\2"),
    (r"transformer\.layers\.(\d+)\.mlp\.(fc1|fc2)\.weight", r"blocks.\1.mlp.\2.weight"),
]]
# Norms of internal v/g anchors: in every layer (their model2.py, `v_norm`) or in layer 0 only (their model3.py,
# model4.py and model.py, `v_res_norm`). Only layer 0's is applied, so only it becomes our anchor_norms.{v,g}.
INTERNAL_NORM = re.compile(r"transformer\.layers\.(\d+)\.attn\.([vg])_(?:res_)?norm\.weight")
THEIR_LAMBDA = {"scalar": lambda H, D: (), "headwise": lambda H, D: (H,), "elementwise": lambda H, D: (H, D)}


def their_config(ckpt, sd, source):
    """Our GPTConfig of an authors' checkpoint: sizes and mixing flags from `model_args`; whether anchors
    are exogenous, normalised or dynamic from the tensors present (their flags are not always right)."""
    args = ckpt["model_args"]
    if not isinstance(args, dict):
        raise ValueError(f"{source}: model_args is {type(args).__name__}, expected a dict")
    missing = [f for f in REQUIRED if f not in args]
    if missing:
        raise ValueError(f"{source}: model_args has no {', '.join(missing)}")
    for field, value in IMPLEMENTED.items():
        if args.get(field, value) != value:
            raise ValueError(f"{source}: model_args.{field}={args[field]!r}: model.py implements only "
                             f"{field}={value!r}, so it cannot run this model")
    gate = bool(args["gated_attention_enabled"])
    mix = "".join(s for s in PROJECTIONS if args[RES_FLAGS[s]] and (s != "g" or gate))
    anchor = "exo" if "anchor_proj.weight" in sd else "internal" if mix else "none"
    try:
        return GPTConfig(block_size=args["block_size"], vocab_size=args["vocab_size"], n_layer=args["n_layer"],
                         n_head=args["n_head"], n_embd=args["n_embd"], rope_theta=float(args["rope_theta"]),
                         gate=gate, anchor=anchor, mix=mix,
                         granularity=args["residual_mode"] if mix else "scalar",  # no λ: as configs/ say
                         anchor_norm=anchor_normalised(args, sd, anchor, mix, source),
                         dynamic=any(".attn.dynamic_mixing." in k for k in sd))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def anchor_normalised(args, sd, anchor, mix, source):
    """Whether the mixed anchors are RMS-normalised: only the tensors say. Every one of their model files declares
    q/k/v/g_residual_norm_enabled (default True), but model1.py and model2.py never read them: a model1 ResFormer,
    NKQR or OQKRN file says v_residual_norm_enabled=True and mixes raw anchors. The flags count only where they
    disagree with each other: model3.py, model4.py and model.py normalise per flag, and some anchors normalised,
    some not, is a model model.py does not implement."""
    if anchor == "none":
        return False
    if anchor == "exo":  # model3/4.py and model.py: anchor_{s}_norm exactly where the flag is on
        normed = {s for s in mix if f"anchor_{s}_norm.weight" in sd}
    else:
        found = [m for m in map(INTERNAL_NORM.fullmatch, sd) if m]
        if any("_res_" not in m[0] for m in found):  # model2.py: v_norm in every layer, normalised whatever the flags
            return True
        normed = {m[2] for m in found if m[1] == "0"}  # model3/4.py, model.py: {v,g}_res_norm in layer 0, per flag
        if normed:  # a file of those: its q, k anchors go through layer 1's QK-norm (no tensor of their own), so
            normed |= set("qk")  # a model.py file mixing only q, k with v_residual_norm_enabled=False reads as raw
        flags = {s: args[f"{s}_residual_norm_enabled"] for s in mix if f"{s}_residual_norm_enabled" in args}
        if len(set(flags.values())) > 1:
            detail = ", ".join(f"{s}_residual_norm_enabled={on}" for s, on in flags.items())
            raise ValueError(f"{source}: {detail}: model.py normalises every mixed anchor or none")
        normed &= set(mix)
    if normed and normed != set(mix):
        raise ValueError(f"{source}: anchor norms for {''.join(s for s in PROJECTIONS if s in normed)} only, "
                         f"of mixed {mix}: model.py normalises every mixed anchor or none")
    return bool(normed)


def from_authors(ckpt, source):
    """(GPTConfig, our fp32 state dict) of a checkpoint written by the authors' code."""
    sd = {k.removeprefix(COMPILED): v for k, v in ckpt["model"].items()}
    config = their_config(ckpt, sd, source)
    H, D, C, mix = config.n_head, config.head_dim, config.n_embd, config.mixed_projections
    slots = PROJECTIONS[:4 if config.gate else 3]  # their anchor_proj blocks and dynamic outputs: always all
    out = {}
    for k, t in sd.items():
        m = INTERNAL_NORM.fullmatch(k)
        if m:  # applied only as layer 0's internal anchor norm
            if not (m[1] == "0" and config.anchor == "internal" and config.anchor_norm and m[2] in mix):
                continue
            name = f"anchor_norms.{m[2]}.weight"
        else:
            name = next((rx.sub(ours, k) for rx, ours in RENAMES if rx.fullmatch(k)), None)
            if name is None:
                raise ValueError(f"{source}: unexpected tensor {k} (in none of the authors' layouts)")
            if name.startswith("anchor_norms.") and not (config.anchor_norm and name.split(".")[1] in mix):
                continue  # their exo model has a norm per projection, mixed or not
        if ".lam." in name:  # theirs (), (H,) or (H, D); ours broadcast over (B, H, T, D)
            if t.shape != (theirs := THEIR_LAMBDA[config.granularity](H, D)):
                raise ValueError(f"{source}: tensor {k} has shape {tuple(t.shape)}, expected {theirs} "
                                 f"for residual_mode={config.granularity!r}")
            t = t.reshape(GRANULARITY_SHAPES[config.granularity](H, D))
        elif name == "anchor_proj.weight" or ".dyn.fc2." in name:  # keep the rows of the mixed projections
            per = C if name == "anchor_proj.weight" else 2  # one C-block of rows, or two outputs (λ1, λ2)
            if t.shape[0] != len(slots) * per:
                raise ValueError(f"{source}: tensor {k} has {t.shape[0]} rows, expected {len(slots) * per} "
                                 f"({per} per projection of {slots})")
            t = torch.cat([t[slots.index(s) * per:(slots.index(s) + 1) * per] for s in mix])
        if name in out:
            raise ValueError(f"{source}: tensors {k} and another one both map to {name}")
        out[name] = t.to(torch.float32, copy=True)  # bf16 -> fp32 is exact; a copy owns its storage
    return config, out


def from_ours(ckpt, source):
    """(GPTConfig, state dict) of a checkpoint of this code (train.py's, or an export)."""
    return GPTConfig.from_dict(ckpt["model_config"], f"{source}: model_config"), ckpt["model"]


def model_configs():
    """(path, GPTConfig) of every model description in configs/ (files with training settings too are not)."""
    files = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        try:
            files.append((os.path.relpath(path, ROOT), GPTConfig(**load_config([path], asdict(GPTConfig())))))
        except ValueError:
            continue
    return files


def config_file(config):
    """(path, True) for the file of configs/ that builds this model (vocab_size aside), else (path, False)
    for one of the same variant at another size, else (None, False)."""
    exact = lambda c: {**asdict(c), "mix": c.mixed_projections, "vocab_size": None}
    variant = lambda c: (c.gate, c.anchor, c.mixed_projections, c.granularity, c.anchor_norm, c.dynamic)
    files = model_configs()
    for same, key in ((True, exact), (False, variant)):
        for path, c in files:
            if key(c) == key(config):
                return path, same
    return None, False


def complete_zip(path):
    """A downloaded checkpoint's check: torch.save writes a zip archive, whose directory comes last,
    so a truncated copy is not one."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"not a complete torch.save file ({path})")


# ----------------------------------------------------------------------------- the Hub

STEP_FILE = re.compile(r"ckpt_step:(\d+)\.pt")  # their train.py saves out_dir/ckpt_step:{step}.pt
NAMED_FILES = ("final_model.pt", "checkpoint.pt")  # looked for before ckpt_step:N.pt (their loader: ckpt_file_name)
# the authors' names for the variants (their README) that are not the paper's names of configs/ (GPTConfig.name)
AUTHORS_NAMES = {"Gated": "configs/gated.py", "NKQR": "configs/nkqr_e.py", "NuResFormer-NKQR-E": "configs/nkqr_e.py",
                 "OQKRN": "configs/nuresformer_e_nonorm.py", "NuResFormer-OQKRN-E": "configs/nuresformer_e_nonorm.py"}
OFFLINE = "copy a checkpoint of {} into {} from a machine with internet"  # what to do without internet


def checkpoint_files(names):
    """The checkpoint files among a repository's, best first, as the authors' loader (their utils.get_model) picks
    one: the named file it is given (here final_model.pt, then checkpoint.pt), else the highest ckpt_step:N.pt,
    by N."""
    steps = sorted((n for n in names if STEP_FILE.fullmatch(n)), key=lambda n: -int(STEP_FILE.fullmatch(n)[1]))
    return [n for n in NAMED_FILES if n in names] + steps


def pick_checkpoint(repo, names):
    files = checkpoint_files(names)
    if not files:
        raise ValueError(f"{repo}: no checkpoint ({', '.join(NAMED_FILES)} or ckpt_step:N.pt) among its files: "
                         f"{', '.join(sorted(names)) or 'none'}")
    return files[0]


def hub_repos(user, base_url=HF_URL):
    """The model repositories OWNER/NAME of a Hub user: GET /api/models?author=USER (one page, sorted)."""
    url = f"{base_url.rstrip('/')}/api/models?author={urllib.parse.quote(user)}"
    repos = get_json(url, None, "list them on a machine with internet")
    if not isinstance(repos, list) or not all(isinstance(r, dict) and "id" in r for r in repos):
        raise ValueError(f"{url}: expected a JSON list of objects with an 'id'")
    return sorted(r["id"] for r in repos)


def variant_of(repo, cache_dir=CACHE_DIR):
    """(variant, how we know) of a repository without downloading it: the variant of a checkpoint of it in the
    cache, read from its tensors; else the paper's or the authors' name of a variant that its name spells
    (case and punctuation aside); else (None, None)."""
    cached = cached_checkpoint(repo, cache_dir)
    if cached:
        ckpt = load_checkpoint(cached, keys=("model",), mmap=True)
        config = (from_ours if "model_config" in ckpt else from_authors)(ckpt, cached)[0]
        return f"{config.name} ({config_file(config)[0] or 'no file in configs/'})", f"read from {cached}"
    spell = lambda name: re.sub(r"[^a-z0-9]", "", name.lower())
    configs = model_configs()
    names = {spell(c.name): (c.name, path) for path, c in reversed(configs)}  # the first file of a name wins
    names.update({spell(n): (dict(configs)[path].name, path) for n, path in AUTHORS_NAMES.items()})
    hit = names.get(spell(repo.split("/")[-1]))
    return (f"{hit[0]} ({hit[1]})", "by its name") if hit else (None, None)


def cached_checkpoint(repo, cache_dir):
    """The best complete checkpoint of repo downloaded before into cache_dir/OWNER/NAME, or None."""
    folder = os.path.join(cache_dir, repo)
    files = checkpoint_files([n for n in os.listdir(folder) if zipfile.is_zipfile(os.path.join(folder, n))]
                             if os.path.isdir(folder) else [])
    return os.path.join(folder, files[0]) if files else None


def list_user(user, base_url=HF_URL, cache_dir=CACHE_DIR):
    """Print and return each repository of a Hub user: its checkpoint files and sizes, the one convert.py takes,
    and its variant where the name or a downloaded file tells it."""
    found = []
    for repo in hub_repos(user, base_url):
        files = hf.hub_files(repo, base_url, OFFLINE.format(repo, os.path.join(cache_dir, repo)))
        ckpts = checkpoint_files(files)
        variant, how = variant_of(repo, cache_dir)
        print(f"{repo}: {variant + ', ' + how if variant else 'variant ?'}")
        for name in ckpts:
            size = "size ?" if files[name] is None else f"{files[name] / 1e6:,.1f} MB"
            taken = f"   <- convert.py {repo} takes this one" if name == ckpts[0] else ""
            print(f"    {name:<24} {size:>12}{taken}")
        if not ckpts:
            print(f"    no checkpoint; its files: {', '.join(sorted(files)) or 'none'}")
        found.append({"repo": repo, "files": {n: files[n] for n in ckpts}, "pick": ckpts[0] if ckpts else None,
                      "variant": variant})
    print(f"{len(found)} repositories of {user}, {sum(r['pick'] is not None for r in found)} with a checkpoint")
    return found


def fetch(src, cache_dir=CACHE_DIR, base_url=HF_URL):
    """(local path, label) of SRC: the file or model folder itself, or the Hub file OWNER/NAME[/FILENAME] downloaded
    once into cache_dir/OWNER/NAME/FILENAME (resumable, size-checked, renamed when complete). For OWNER/NAME: a
    checkpoint of it downloaded before, else the model folder it holds (hf.hub_folder), else the checkpoint the
    Hub's listing offers first (checkpoint_files)."""
    if os.path.isfile(src) or os.path.isdir(src):  # a file, a model folder, or a sharded checkpoint
        return src, src
    parts = src.split("/")
    if len(parts) < 2 or "" in parts or parts[0] in (".", "..") or (len(parts) == 2 and src.endswith(".pt")):
        raise FileNotFoundError(f"{src}: no such file, and not a Hugging Face repository OWNER/NAME[/FILENAME]")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    if not filename:
        folder, filename = repo_content(repo, cache_dir, base_url)
        if folder:
            return folder, repo
    dest = os.path.join(cache_dir, repo, filename)
    if zipfile.is_zipfile(dest):  # False for a missing file too
        print(f"{dest}: downloaded before, not fetched again")
        return dest, f"{repo}/{filename}"
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    url = f"{base_url.rstrip('/')}/{repo}/resolve/main/{urllib.parse.quote(filename)}"  # ':' -> %3A
    bar = ByteBar(desc=filename)
    try:
        download_file(url, dest, bar, check=complete_zip)
    finally:
        bar.close()
    return dest, f"{repo}/{filename}"


def repo_content(repo, cache_dir, base_url):
    """(local folder, None) for a repository holding a model folder, else (None, FILENAME of its checkpoint): one
    downloaded before into cache_dir, else the best the Hub lists."""
    cached = cached_checkpoint(repo, cache_dir)
    if cached:
        return None, os.path.basename(cached)
    if hf.is_folder(os.path.join(hf.HUB_CACHE, repo)):
        return hf.hub_folder(repo, base_url), None
    files = hf.hub_files(repo, base_url, OFFLINE.format(repo, os.path.join(cache_dir, repo)))
    if hf.WEIGHTS in files and hf.CONFIG in files:
        return hf.hub_folder(repo, base_url, files), None
    return None, pick_checkpoint(repo, files)


def source(src, cache_dir, base_url):
    """(the weights-only checkpoint of SRC, {path, label, params, tokens: the authors' count, if any}), after one
    line saying what it is. Our checkpoints, model folders included, and the authors'."""
    path, label = fetch(src, cache_dir, base_url)
    ckpt = load_checkpoint(path, keys=("model",), mmap=True)  # the optimiser state is never read
    if "model_config" in ckpt:
        config, sd = from_ours(ckpt, path)
        kind, note = "checkpoint of this code", f"weights-only export of {label} by convert.py"
        # its training settings (train.py's `config`) are small and say how the model was made, as its tokenizer does
        extra = {k: ckpt[k] for k in ("config", "tokenizer") if k in ckpt}
    elif "model_args" in ckpt:
        config, sd = from_authors(ckpt, path)
        kind, note = "authors' checkpoint", f"the authors' checkpoint {label}, converted by convert.py"
        extra = {}  # their `config` holds their training script's settings, not ours
    else:
        raise ValueError(f"{path}: neither 'model_config' (this code's format) nor 'model_args' "
                         f"(the authors') in it")
    n_params = check_state(config, sd, path).num_params()
    step = ckpt.get("step")
    match, same = config_file(config)
    where = f"= {match}" if same else f"as {match} at another size" if match else "no file in configs/ matches"
    print(f"{label}: {kind}: {config.name} ({where}), {config.n_layer} layers, C={config.n_embd}, "
          f"vocab {config.vocab_size}, step {step}")
    result = {"model": sd, "model_config": asdict(config), "step": step, "source": note, **extra}
    return result, {"path": path, "label": label, "params": n_params, "tokens": ckpt.get("tokens_processed")}


def convert(src, out, cache_dir=CACHE_DIR, base_url=HF_URL):
    """Write the weights-only checkpoint of SRC (see the module docstring) to out; return its summary."""
    if os.path.isdir(src) and not hf.is_folder(src):  # train.py --fsdp=True's ckpt.dcp: streamed a tensor at a time,
        state = sharding.export(src, out, f"weights-only export of {src} by convert.py")  # never whole in memory
        config = GPTConfig.from_dict(state["model_config"])
        print(f"{src}: sharded checkpoint of this code: {config.name}, {config.n_layer} layers, C={config.n_embd}, "
              f"step {state['step']}; wrote {out}, {os.path.getsize(out) / 1e6:,.1f} MB")
        return {"config": config, "step": state["step"], "bytes_out": os.path.getsize(out)}
    result, info = source(src, cache_dir, base_url)
    path = info["path"]
    if os.path.abspath(out) == os.path.abspath(path):
        raise ValueError(f"--out {out}: that is the checkpoint being converted; write to another file")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_checkpoint(out, result)
    before, after = disk_size(path), os.path.getsize(out)
    print(f"wrote {out}: {info['params']:,} parameters in fp32, {after / 1e6:,.1f} MB "
          f"(the input: {before / 1e6:,.1f} MB)")
    return {"config": GPTConfig(**result["model_config"]), "step": result["step"], "params": info["params"],
            "bytes_in": before, "bytes_out": after}


def disk_size(path):
    """Bytes of a file, or of the files of a folder."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def final_val_loss(path, step):
    """The last validation loss at or before step in the log.jsonl beside a checkpoint (train.py's run folder),
    or None without one."""
    run_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isfile(log_path(run_dir)):
        return None
    curve = val_curve(read_log(run_dir), step)
    return curve[-1][1] if curve else None


def to_hf(src, folder, tokenizer=None, push=None, token=None, cache_dir=CACHE_DIR, base_url=HF_URL):
    """Write the Hugging Face model folder of SRC (hf.export) with the tokenizer it records (checkpoint.
    trained_tokenizer: tokenizer, a ranks file, must be that one; for one that records none, tokenizer or GPT-2's);
    with push, then upload it to that Hub repository with token (hf.push). Returns the model card's facts."""
    hf.check_target(folder)  # before the checkpoint is read
    result, info = source(src, cache_dir, base_url)
    path = info["path"]
    if os.path.abspath(folder) == os.path.abspath(path):
        raise ValueError(f"--to_hf {folder}: that is the folder being converted; write to another one")
    step, train = result["step"], result.get("config") or {}
    tokens = info["tokens"] or (step * train["total_batch_size"] if step is not None and "total_batch_size" in train
                                else None)
    card = {"repo": push or folder, "params": info["params"], "step": step, "tokens": tokens,
            "val_loss": final_val_loss(path, step), "source": result["source"]}
    tokenizer = trained_tokenizer(result, tokenizer, src)  # the folder records the one its tokenizer.json holds
    hf.export({**result, "tokenizer": tokenizer}, folder, load_encoding(tokenizer), card)
    print(f"wrote {folder}: {', '.join(sorted(os.listdir(folder)))}")
    if push:
        print(f"pushed {folder} to {push}: {hf.push(folder, push, token, base_url)}")
    return card


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Write a weights-only checkpoint of this code, or a Hugging Face model "
                                            "folder, from one of the authors' released checkpoints or from one of "
                                            "ours; or list a Hub user's checkpoints.")
    p.add_argument("src", nargs="?", help="a local checkpoint or model folder, or a Hugging Face repository "
                                          "OWNER/NAME[/FILENAME] (without FILENAME: the model folder it holds, "
                                          "else final_model.pt, checkpoint.pt or the highest ckpt_step:N.pt)")
    p.add_argument("--out", help="the checkpoint to write, e.g. out/authors_baseline/ckpt.pt")
    p.add_argument("--to_hf", metavar="DIR", help="write a Hugging Face model folder instead (safetensors, "
                                                  "config.json, the modeling code, the tokenizer, a model card)")
    p.add_argument("--push", metavar="REPO", help="--to_hf: then upload the folder to the Hub repository OWNER/NAME "
                                                  "(a token: HF_TOKEN or `hf auth login`)")
    p.add_argument("--tokenizer", help="--to_hf: the model's .tiktoken ranks file, which a checkpoint records (for one "
                                       "that records none: default tokenizer/gpt2.tiktoken, GPT-2's)")
    p.add_argument("--list", metavar="USER", help="list USER's Hub repositories, their checkpoints and variants")
    p.add_argument("--cache_dir", default=CACHE_DIR, help="where downloads are kept: CACHE_DIR/OWNER/NAME/FILENAME")
    p.add_argument("--base_url", default=None, help=f"the Hugging Face Hub, or a mirror with its URL layout "
                                                    f"(default: HF_ENDPOINT, else {HF_URL})")
    args = p.parse_args(argv)
    if args.list is not None and (args.src or args.out or args.to_hf):
        p.error("--list USER takes no SRC, --out or --to_hf")
    if args.list is None and not (args.src and (args.out is None) != (args.to_hf is None)):
        p.error("expected SRC and one of --out PATH and --to_hf DIR (or --list USER)")
    if (args.push or args.tokenizer) and not args.to_hf:
        p.error("--push and --tokenizer go with --to_hf DIR")
    if args.push and not hf.is_repo_name(args.push):
        p.error(f"--push {args.push}: expected a Hub repository OWNER/NAME")
    args.base_url = hf.hub_url(args.base_url)
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.list is not None:
            return list_user(args.list, args.base_url, args.cache_dir)
        if args.out:
            return convert(args.src, args.out, args.cache_dir, args.base_url)
        for module in ("safetensors.torch", "tokenizers"):  # what the folder needs, before anything is read
            hf.optional(module)
        token = hf.hub_token() if args.push else None
        return to_hf(args.src, args.to_hf, args.tokenizer, args.push, token, args.cache_dir, args.base_url)
    except (ValueError, OSError, DownloadError, ImportError) as e:
        raise SystemExit(f"convert.py: error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("convert.py: interrupted; the same command resumes the download, nothing else was written")


if __name__ == "__main__":
    main()
