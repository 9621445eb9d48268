"""
Turn a checkpoint into a weights-only checkpoint of this code: `model` (fp32 state dict), `model_config`,
`step` and a `source` note, which eval.py, `train.py --eval_only` and model.load_model read as they are.

    python convert.py Jonnester/Baseline --out out/authors_baseline/ckpt.pt    # the authors' release
    python convert.py Jonnester/Baseline/ckpt_step:38146.pt --out ...           # REPO/FILENAME
    python convert.py path/to/ckpt_step:38146.pt --out ...                     # a local file
    python convert.py out/ckpt.pt --out out/export/ckpt.pt                     # ours: drop the optimiser state

The authors' format (their train.py) holds `model` (their state dict: bf16 Linear/Embedding weights,
keys maybe prefixed `_orig_mod.`) and `model_args` (their ModelConfig). Four versions of their model
file wrote such files, with different names for the same tensors; their_config reads the variant from
the flags and the tensors present, from_authors maps the names. Everything is read with
torch.load(weights_only=True): a checkpoint can never run code.
"""
import argparse
import glob
import os
import re
import urllib.parse
import zipfile
from dataclasses import asdict

import torch

from configurator import load_config
from data import ByteBar, DownloadError, download_file
from checkpoint import check_state, load_checkpoint, save_checkpoint
from model import GRANULARITY_SHAPES, PROJECTIONS, GPTConfig

HF_URL = "https://huggingface.co"
HF_FILE = "ckpt_step:38146.pt"  # the one file of each of the authors' repositories
CACHE_DIR = "data/authors"
ROOT = os.path.dirname(os.path.abspath(__file__))

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
# Norms of internal v/g anchors: in every layer (their model2.py, `v_norm`) or in layer 0 only (their
# latest model.py, `v_res_norm`). Only layer 0's is applied, so only it becomes our anchor_norms.{v,g}.
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
    dynamic = any(".attn.dynamic_mixing." in k for k in sd)
    if "anchor_proj.weight" in sd:
        anchor = "exo"
        normed = {s for s in mix if f"anchor_{s}_norm.weight" in sd}
        mismatch = f"anchor norms for {''.join(s for s in mix if s in normed)} only, of mixed {mix}"
    elif mix:
        anchor = "internal"
        flags = {s: args[f"{s}_residual_norm_enabled"] for s in mix if f"{s}_residual_norm_enabled" in args}
        if flags:  # their latest model.py: one flag per projection
            normed = {s for s, on in flags.items() if on}
            mismatch = ", ".join(f"{s}_residual_norm_enabled={on}" for s, on in flags.items())
        else:  # model1.py (raw anchors) or model2.py (normalised v and g, a norm in every layer)
            normed = set(mix) if any(INTERNAL_NORM.fullmatch(k) for k in sd) else set()
            mismatch = ""
    else:
        anchor, normed, mismatch = "none", set(), ""
    if normed and normed != set(mix):
        raise ValueError(f"{source}: {mismatch}: model.py normalises every mixed anchor or none")
    try:
        return GPTConfig(block_size=args["block_size"], vocab_size=args["vocab_size"], n_layer=args["n_layer"],
                         n_head=args["n_head"], n_embd=args["n_embd"], rope_theta=float(args["rope_theta"]),
                         gate=gate, anchor=anchor, mix=mix,
                         granularity=args["residual_mode"] if mix else "scalar",  # no λ: as configs/ say
                         anchor_norm=bool(normed), dynamic=dynamic)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def from_authors(ckpt, source):
    """(GPTConfig, our fp32 state dict) of a checkpoint written by the authors' code."""
    sd = {k.removeprefix(COMPILED): v for k, v in ckpt["model"].items()}
    config = their_config(ckpt, sd, source)
    H, D, C, mix = config.n_head, config.head_dim, config.n_embd, config.mixed
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


def config_file(config):
    """(path, True) for the file of configs/ that builds this model (vocab_size aside), else (path, False)
    for one of the same variant at another size, else (None, False)."""
    exact = lambda c: {**asdict(c), "mix": c.mixed, "vocab_size": None}
    variant = lambda c: (c.gate, c.anchor, c.mixed, c.granularity, c.anchor_norm, c.dynamic)
    files = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        try:
            files.append((os.path.relpath(path, ROOT), GPTConfig(**load_config([path], asdict(GPTConfig())))))
        except ValueError:  # a file with training settings too: not a model description
            continue
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


def fetch(src, cache_dir=CACHE_DIR, base_url=HF_URL):
    """(local path, label) of SRC: the file itself, or the Hugging Face file OWNER/REPO[/FILENAME]
    downloaded once into cache_dir/OWNER/REPO/FILENAME (resumable, size-checked, renamed when complete)."""
    if os.path.isfile(src):
        return src, src
    parts = src.split("/")
    if len(parts) < 2 or "" in parts or parts[0] in (".", "..") or (len(parts) == 2 and src.endswith(".pt")):
        raise FileNotFoundError(f"{src}: no such file, and not a Hugging Face repository OWNER/NAME[/FILENAME]")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:]) or HF_FILE
    dest = os.path.join(cache_dir, repo, filename)
    try:
        complete_zip(dest)
        print(f"{dest}: downloaded before, not fetched again")
        return dest, f"{repo}/{filename}"
    except ValueError:
        pass
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    url = f"{base_url.rstrip('/')}/{repo}/resolve/main/{urllib.parse.quote(filename)}"  # ':' -> %3A
    bar = ByteBar(desc=filename)
    try:
        download_file(url, dest, bar, check=complete_zip)
    finally:
        bar.close()
    return dest, f"{repo}/{filename}"


def convert(src, out, cache_dir=CACHE_DIR, base_url=HF_URL):
    """Write the weights-only checkpoint of SRC (see the module docstring) to out; return its summary."""
    path, label = fetch(src, cache_dir, base_url)
    if os.path.abspath(out) == os.path.abspath(path):
        raise ValueError(f"--out {out}: that is the checkpoint being converted; write to another file")
    ckpt = load_checkpoint(path, keys=("model",), mmap=True)  # the optimiser state is never read
    if "model_config" in ckpt:
        config, sd = from_ours(ckpt, path)
        kind, note = "checkpoint of this code", f"weights-only export of {label} by convert.py"
        # its training settings (train.py's `config`) are small and say how the model was made
        extra = {"config": ckpt["config"]} if "config" in ckpt else {}
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
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_checkpoint(out, result)
    before, after = os.path.getsize(path), os.path.getsize(out)
    print(f"wrote {out}: {n_params:,} parameters in fp32, {after / 1e6:,.1f} MB (the input: {before / 1e6:,.1f} MB)")
    return {"config": config, "step": step, "params": n_params, "bytes_in": before, "bytes_out": after}


def main(argv=None):
    p = argparse.ArgumentParser(description="Write a weights-only checkpoint of this code from one of the "
                                            "authors' released checkpoints or from one of ours.")
    p.add_argument("src", help=f"a local checkpoint, or a Hugging Face repository OWNER/NAME[/FILENAME] "
                               f"(default file {HF_FILE})")
    p.add_argument("--out", required=True, help="the checkpoint to write, e.g. out/authors_baseline/ckpt.pt")
    p.add_argument("--cache_dir", default=CACHE_DIR, help="where downloads are kept: CACHE_DIR/OWNER/NAME/FILENAME")
    p.add_argument("--base_url", default=HF_URL, help="the Hugging Face Hub, or a mirror with its URL layout")
    args = p.parse_args(argv)
    try:
        return convert(args.src, args.out, args.cache_dir, args.base_url)
    except (ValueError, OSError, DownloadError) as e:
        raise SystemExit(f"convert.py: error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("convert.py: interrupted; the same command resumes the download, nothing else was written")


if __name__ == "__main__":
    main()
