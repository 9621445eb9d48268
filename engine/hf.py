"""
The Hugging Face format, both ways: a model folder that transformers loads,
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True), and that every tool here reads as a checkpoint
(checkpoint.load_checkpoint); and the Hub: such a folder downloaded from a repository, or pushed to one.

A folder (convert.py --to_hf DIR) holds:
    model.safetensors        GPT's state dict (fp32) under its own keys; the metadata's "exoformer" entry, a JSON
                             string, holds the checkpoint's step, training config, tokenizer and source note (the
                             rest of checkpoint.WEIGHTS), so that the folder converts back to the same checkpoint
    config.json              GPTConfig's fields, and what transformers reads: model_type, auto_map (the classes of
                             modeling_exoformer.py), tie_word_embeddings false (lm_head is untied), the token ids
    model.py, modeling_exoformer.py   this repository's model, copied as it is, and transformers' thin wrapper over it
    generation_config.json   <|endoftext|> ends generation; the rows past the tokenizer's ids (vocab_size padding)
                             are suppressed, as sample.py never samples them
    tokenizer.json, tokenizer_config.json   the BPE of the tiktoken ranks (the checkpoint's, or --tokenizer's), for
                             transformers' tokenizers library: it encodes as data.load_encoding does
    README.md                the model card: variant, training tokens, final validation loss, citation
Nothing in it is a pickle: safetensors holds raw tensors and a JSON header, and reading it runs no code.
transformers, safetensors and huggingface_hub are optional imports, needed only here; without them each command
says what to install (PIP).
"""
import importlib
import json
import os
import shutil
import struct
from dataclasses import asdict, fields

from engine.data import EOT_TEXT, GPT2_PATTERN
from engine.files import atomic_write
from model import GPTConfig

PIP = "pip install -r tests/requirements.txt"  # the optional packages, these among them, at the versions tested
WEIGHTS, CONFIG = "model.safetensors", "config.json"
WRAPPER = "modeling_exoformer.py"  # transformers' thin wrapper, beside this file
CODE = ("model.py", WRAPPER)  # copied from this repository into every folder
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the repository: model.py
HF_URL = "https://huggingface.co"  # the Hub; HF_ENDPOINT (huggingface_hub's variable) names a mirror
HUB_CACHE = "data/hub"  # where Hub folders are downloaded: HUB_CACHE/OWNER/NAME/
MODEL_CLASSES = {"AutoConfig": "modeling_exoformer.ExoFormerConfig",
                 "AutoModelForCausalLM": "modeling_exoformer.ExoFormerForCausalLM"}
CITATION = """@article{su2026exoformer,
  title   = {Attention Projection Mixing with Exogenous Anchors},
  author  = {Su, Jonathan},
  journal = {arXiv preprint arXiv:2601.08131},
  year    = {2026}
}"""


def optional(module):
    """An optional package's module, or an ImportError of one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"the Hugging Face format needs {module.split('.')[0]}, which is not installed: "
                          f"{PIP}") from None


def hub_url(base_url=None):
    return (base_url or os.environ.get("HF_ENDPOINT") or HF_URL).rstrip("/")


# ----------------------------------------------------------------------------- export

def export(ckpt, folder, enc, card):
    """Write the folder of a weights-only checkpoint (model, model_config, step, and config, source if any) with
    the tokenizer enc; card: the model card's facts (model_card). Written into a temporary folder that replaces
    `folder` only when complete: a crash or an error never leaves a half-written one."""
    safetensors = optional("safetensors.torch")
    optional("tokenizers")
    config = GPTConfig.from_dict(ckpt["model_config"], "model_config")
    check_target(folder)
    if enc.n_vocab > config.vocab_size:
        raise ValueError(f"--tokenizer has {enc.n_vocab} tokens, the model only vocab_size={config.vocab_size}")
    tmp = f"{os.path.abspath(folder)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        extra = {k: ckpt[k] for k in ("step", "config", "tokenizer", "source") if k in ckpt}
        safetensors.save_file(own_storage(ckpt["model"]), os.path.join(tmp, WEIGHTS),
                              metadata={"format": "pt", "exoformer": json.dumps(extra)})
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(os.path.join(tmp, WEIGHTS), 0o666 & ~umask)  # safetensors writes 0600: readable as the others
        write_json(os.path.join(tmp, CONFIG), {"architectures": ["ExoFormerForCausalLM"], "model_type": "exoformer",
                                               "auto_map": MODEL_CLASSES, **asdict(config),
                                               "tie_word_embeddings": False, "bos_token_id": enc.eot_token,
                                               "eos_token_id": enc.eot_token, "dtype": "float32"})
        padding = list(range(enc.n_vocab, config.vocab_size))  # rows no token of the tokenizer has
        write_json(os.path.join(tmp, "generation_config.json"), {"bos_token_id": enc.eot_token,
                   "eos_token_id": enc.eot_token, **({"suppress_tokens": padding} if padding else {})})
        for name in CODE:
            shutil.copyfile(os.path.join(HERE if name == WRAPPER else ROOT, name), os.path.join(tmp, name))
        write_tokenizer(enc, tmp, config.block_size)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(model_card(config, card))
        replace_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def own_storage(state):
    """The state dict with every tensor in storage of its own: safetensors refuses tensors that share memory (a
    head tied to the embedding), so a tensor whose storage an earlier one holds is copied."""
    seen, out = set(), {}
    for k, t in state.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def write_json(path, obj):
    with atomic_write(path, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")


def check_target(folder):
    """A one-line error for a --to_hf target that holds something other than an earlier export (or nothing)."""
    if os.path.exists(folder) and (not os.path.isdir(folder) or (os.listdir(folder) and not is_folder(folder))):
        raise ValueError(f"--to_hf {folder}: exists and is not a folder written by --to_hf; choose another")


def replace_folder(tmp, folder):
    """tmp renamed to folder; an earlier folder there is moved aside first and removed after, so that folder is
    at every moment either the old one or the new one, whole."""
    old = f"{os.path.abspath(folder)}.old{os.getpid()}"
    check_target(folder)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- the tokenizer

def bytes_to_unicode():
    """GPT-2's map of the 256 bytes to printable characters (its encoder.py), which byte-level BPE vocabularies
    (tokenizer.json) are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in keep]
    return dict(zip(keep + extra, [chr(c) for c in keep] + [chr(256 + n) for n in range(len(extra))]))


def bpe_merges(ranks):
    """The merges of a byte-level BPE from tiktoken's ranks {token bytes: rank}: for each token of two bytes or
    more, in rank order, the pair that tiktoken's own BPE reaches when it merges the token's bytes by their ranks
    (lowest first) among the tokens of lower rank; for GPT-2's ranks, its merges file's 50,000 merges."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = [token[i:i + 1] for i in range(len(token))]
        lower = lambda piece: ranks[piece] if ranks.get(piece, rank) < rank else float("inf")
        while len(parts) > 2:
            i = min(range(len(parts) - 1), key=lambda j: lower(parts[j] + parts[j + 1]))
            if lower(parts[i] + parts[i + 1]) == float("inf"):
                break  # no merge makes it: tiktoken, and ignore_merges, find it only as a piece of its own
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(tuple(parts))
    return merges


def write_tokenizer(enc, folder, block_size):
    """tokenizer.json and tokenizer_config.json of a tiktoken encoding of data.load_encoding's kind: GPT-2's
    pattern splits the text, each piece is looked up whole first (as tiktoken does: ignore_merges) and else
    merged byte by byte; <|endoftext|> is its special token."""
    tk = optional("tokenizers")
    specials = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in specials}
    char = bytes_to_unicode()
    text = lambda b: "".join(char[x] for x in b)
    tok = tk.Tokenizer(tk.models.BPE({text(b): i for b, i in ranks.items()},
                                     [(text(a), text(b)) for a, b in bpe_merges(ranks)], ignore_merges=True))
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(GPT2_PATTERN), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(EOT_TEXT, special=True, normalized=False)])
    if tok.token_to_id(EOT_TEXT) != enc.eot_token:
        raise ValueError(f"the tokenizer's {EOT_TEXT} is id {enc.eot_token}, expected right after its ranks")
    tok.save(os.path.join(folder, "tokenizer.json"))
    write_json(os.path.join(folder, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT_TEXT, "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT, "model_max_length": block_size, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False})  # decode gives the text back as it was


CARD = """---
library_name: transformers
license: mit
pipeline_tag: text-generation
tags: [exoformer, custom_code]
---
# {name}

{name}, a variant of ExoFormer ("Attention Projection Mixing with Exogenous Anchors",
[arXiv 2601.08131](https://arxiv.org/abs/2601.08131)): {n_layer} layers, width {n_embd},
{n_head} heads, {params:,} parameters, vocabulary {vocab_size}, context {block_size}.

| | |
|---|---|
| variant | {name} ({fields}) |
| training tokens | {tokens} |
| steps | {steps} |
| final validation loss | {val_loss} |
| source | {source} |

## Use

```python
from transformers import pipeline
generate = pipeline("text-generation", model="{repo}", trust_remote_code=True)
print(generate("The theory of", max_new_tokens=40)[0]["generated_text"])
```

`trust_remote_code=True` runs the two Python files of this repository: `model.py`, the model as the ExoFormer code
has it, and `modeling_exoformer.py`, the transformers wrapper over it (`AutoModelForCausalLM` and `AutoTokenizer`
load them the same way).

## Citation

```bibtex
{citation}
```
"""  # README.md of a folder: the Hub's front matter, what the model is, how to load it, the citation


def model_card(config, card):
    """The model card of a folder. card: repo (what from_pretrained is given), params, step, tokens, val_loss (None:
    not known), source."""
    known = lambda v, fmt: "not recorded" if v is None else fmt.format(v)
    fields = ", ".join(f"{k}={getattr(config, k)}" for k in ("gate", "anchor", "mix", "granularity", "anchor_norm",
                                                               "dynamic", "anchor_frozen"))
    return CARD.format(name=config.name, fields=fields, repo=card["repo"], params=card["params"],
                       n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head, vocab_size=config.vocab_size,
                       block_size=config.block_size, tokens=known(card["tokens"], "{:,}"),
                       steps=known(card["step"], "{:,}"), val_loss=known(card["val_loss"], "{:.4f}"),
                       source=card["source"], citation=CITATION)


# ----------------------------------------------------------------------------- import

def is_folder(path):
    """Whether path is a model folder (a config.json in a folder): what checkpoint.load_checkpoint reads here."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def read_folder(path):
    """The checkpoint dict (checkpoint.py's weights-only keys) of a model folder, with safetensors: no pickle."""
    weights, config_path = os.path.join(path, WEIGHTS), os.path.join(path, CONFIG)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{path}: no {WEIGHTS} (a model folder holds its weights there)")
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "exoformer":
        raise ValueError(f"{config_path}: model_type {cfg.get('model_type') if isinstance(cfg, dict) else None!r}, "
                         f"expected 'exoformer' (a folder written by convert.py --to_hf)")
    safetensors = optional("safetensors")
    try:
        with safetensors.safe_open(weights, framework="pt") as f:
            extra = json.loads((f.metadata() or {}).get("exoformer", "{}"))
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (safetensors.SafetensorError, ValueError) as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    model_config = {f.name: cfg[f.name] for f in fields(GPTConfig) if f.name in cfg}
    return {"model": state, "model_config": model_config, **extra}


def complete_safetensors(path):
    """A downloaded weights file's check: its JSON header's tensors must end exactly where the file does."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
        except ValueError:
            header = None
    ends = [t["data_offsets"][1] for k, t in (header or {}).items() if k != "__metadata__"]
    if header is None or 8 + n + max(ends, default=0) != size:
        raise ValueError(f"not a complete safetensors file ({path})")


def complete_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except ValueError:
        raise ValueError(f"not a complete JSON file ({path})") from None


# ----------------------------------------------------------------------------- the Hub

def is_repo_name(src):
    """Whether src reads as a Hub repository OWNER/NAME (and not as a local path: no '.', '..' or '.pt')."""
    parts = src.split("/")
    return len(parts) == 2 and "" not in parts and parts[0] not in (".", "..") and not src.endswith(".pt")


def hub_files(repo, base_url=None, offline=None):
    """{filename: size in bytes, None if not said} of a Hub model repository. GET /api/models/REPO lists the files
    (siblings[].rfilename); blobs=true adds each one's size, so one request per repository tells both."""
    from engine.httpclient import get_json  # here: the trainer reads checkpoints through checkpoint.py and imports no

    # network package (data.py)
    url = f"{hub_url(base_url)}/api/models/{repo}"
    info = get_json(url, {"blobs": "true"}, offline or f"copy the folder {os.path.join(HUB_CACHE, repo)} "
                                                       f"from a machine with internet")
    siblings = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(siblings, list) or not all(isinstance(f, dict) and "rfilename" in f for f in siblings):
        raise ValueError(f"{url}: expected a JSON object whose 'siblings' are objects with an 'rfilename'")
    return {f["rfilename"]: f.get("size") for f in siblings}


def hub_folder(repo, base_url=None, files=None):
    """The local copy of a Hub repository holding a model folder: its config.json and model.safetensors, downloaded
    once into HUB_CACHE/OWNER/NAME (httpclient.download_file: resumed, retried, each file renamed into place only
    when complete); a copy there is used without asking the Hub. files: the repository's listing, if known."""
    from engine.httpclient import ByteBar, DownloadError, download_file  # here, as in hub_files
    folder = os.path.join(HUB_CACHE, repo)
    if is_folder(folder) and os.path.isfile(os.path.join(folder, WEIGHTS)):
        print(f"{folder}: downloaded before, not fetched again")
        return folder
    try:
        files = hub_files(repo, base_url) if files is None else files
        missing = [n for n in (WEIGHTS, CONFIG) if n not in files]
        if missing:
            raise ValueError(f"{repo}: no {' or '.join(missing)} among its files ({', '.join(sorted(files)) or 'none'})"
                             f": not a model folder of convert.py --to_hf (its .pt checkpoints: convert.py {repo})")
        os.makedirs(folder, exist_ok=True)
        # config.json last: it marks the folder whole (is_folder)
        for name, check in ((WEIGHTS, complete_safetensors), (CONFIG, complete_json)):
            bar = ByteBar(desc=name)
            try:
                download_file(f"{hub_url(base_url)}/{repo}/resolve/main/{name}", os.path.join(folder, name), bar,
                              check=check, offline=f"copy the folder {folder} from a machine with internet")
            finally:
                bar.close()
    except DownloadError as e:  # a ValueError, which every tool reports in one line
        raise ValueError(f"{repo}: no such local file or folder; as a Hub repository: {e}") from None
    return folder


def hub_token():
    """The Hub token huggingface_hub finds (HF_TOKEN, or the one `hf auth login` saved), or a one-line error."""
    token = optional("huggingface_hub").get_token()
    if not token:
        raise ValueError("--push needs a Hub token with write access: set HF_TOKEN or run `hf auth login`")
    return token


def push(folder, repo, token, base_url=None):
    """Upload a folder written by export to the Hub repository REPO (created if missing) in one commit, through
    huggingface_hub: the Hub shows the new revision only once every file has arrived whole, and a failed upload
    leaves none. Returns the commit's URL."""
    hub = optional("huggingface_hub")
    names = sorted(os.listdir(folder))
    for name in (CONFIG, WEIGHTS, *CODE):
        if name not in names:
            raise ValueError(f"{folder}: no {name}; push a folder that convert.py --to_hf wrote whole")
    complete_safetensors(os.path.join(folder, WEIGHTS))
    api = hub.HfApi(endpoint=hub_url(base_url), token=token)
    try:
        api.create_repo(repo, exist_ok=True)
        ops = [hub.CommitOperationAdd(path_in_repo=n, path_or_fileobj=os.path.join(folder, n)) for n in names]
        info = api.create_commit(repo, operations=ops, commit_message=f"ExoFormer model folder ({', '.join(names)})")
    except Exception as e:  # huggingface_hub's HTTP and connection errors: no commit was made
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"--push {repo}: the upload failed, and the Hub holds no new revision ({first}); the same "
                         f"command tries again") from None
    return info.commit_url
