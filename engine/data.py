"""Data on disk: the tokenizer (GPT-2's, or another ranks file's) and its record, the binary shard format, the readers
the trainer uses, and the built-in corpus (this Python's standard library as shards). Nothing here touches the network
(httpclient.py does), so the trainer imports no network package.

Shard format (llm.c / modded-nanogpt): a header of 256 little-endian int32 words (magic 20240520,
version 1, token count, then zeros), followed by the tokens as little-endian uint16. A shard of
ntok tokens is therefore exactly 1024 + 2*ntok bytes; anything else is a truncated or foreign file.

A data folder's manifest.json lists the shards written into it (prepare.py's, the built-in corpus's, and downloads
with the sha256 the Hub published for them): each one's size and sha256, hashed as it was written, and the tokenizer
that made them (read_tokenizer's record; a folder holds one tokenizer's shards). train.py checks the sizes at every
start and the hashes with verify_data=True; prepare.py --verify checks both (check_data); train.py takes the
tokenizer from there (data_tokenizer).
"""
import ast
import base64
import binascii
import contextlib
import fcntl
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sysconfig
import tempfile
import time

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

from engine.files import DamagedError, HashingWriter, agreed, atomic_write, check_entry, share

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TOKENIZER = os.path.join(ROOT, "tokenizer", "gpt2.tiktoken")  # shipped: the ranks of tiktoken's gpt2 (r50k_base),
#   under OpenAI's licence beside it, so that no tool downloads them
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # that file's: tiktoken's expected
#   hash of r50k_base.tiktoken (tiktoken_ext/openai_public.py)
EOT_TEXT = "<|endoftext|>"  # the one special token: its id is the number of ranks, right after them


def read_tokenizer(path=None):
    """A tokenizer as corpora and checkpoints record it: the record of a `.tiktoken` ranks file (path; default
    GPT-2's, shipped in tokenizer/), {"name": the file's name, "sha256": of its bytes, "eot_token": the id of
    <|endoftext|>, "n_vocab": the tokens with it}, and "ranks", the file's text, unless it is GPT-2's (which every
    clone has). The file is read every time, never through a cache: a ranks file rewritten in place is read anew."""
    path = TOKENIZER if path is None else str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: not a readable .tiktoken ranks file ({e.strerror})") from None
    ranks, sha256 = parse_ranks(data, path), hashlib.sha256(data).hexdigest()
    record = {"name": os.path.basename(path), "sha256": sha256, "eot_token": len(ranks), "n_vocab": len(ranks) + 1}
    return record if sha256 == GPT2_SHA256 else {**record, "ranks": data.decode("ascii")}


def parse_ranks(data, source):
    """{token bytes: rank} of a `.tiktoken` file's bytes (a base64 token and its rank a line, as tiktoken's
    load_tiktoken_bpe reads them), its ranks 0 to n-1; a one-line error naming source otherwise."""
    try:
        ranks = {base64.b64decode(token, validate=True): int(rank)
                 for token, rank in (line.split() for line in data.splitlines() if line)}
    except (ValueError, binascii.Error):
        raise ValueError(f"{source}: not a readable .tiktoken ranks file (a base64 token and a rank a line)") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{source}: its ranks are not 0 to {len(ranks) - 1}, each once")
    return ranks


def load_encoding(tokenizer=None):
    """The tiktoken encoding of a tokenizer: tokenizer is a ranks file (None: GPT-2's, shipped in tokenizer/) or a
    record of one (read_tokenizer's, as a corpus's manifest or a checkpoint holds it). GPT-2's split pattern, and
    <|endoftext|> right after the ranks (50256 for GPT-2). Every tool loads its tokenizer here; nothing is downloaded
    (tiktoken's get_encoding("gpt2") would fetch the same ranks on first use) and nothing is cached."""
    record = tokenizer if isinstance(tokenizer, dict) else read_tokenizer(tokenizer)
    if "ranks" in record:
        data, source = record["ranks"].encode("ascii"), f"the recorded tokenizer {record['name']}"
    elif record["sha256"] == GPT2_SHA256:
        with open(TOKENIZER, "rb") as f:
            data, source = f.read(), TOKENIZER
    else:
        raise ValueError(f"the recorded tokenizer {record['name']} holds no ranks, and is not GPT-2's")
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise DamagedError(f"{source}: its ranks' sha256 is not the recorded {record['sha256']}")
    return tiktoken.Encoding(name=f"{record['name']}:{record['sha256'][:12]}", pat_str=GPT2_PATTERN,
                             mergeable_ranks=parse_ranks(data, source), special_tokens={EOT_TEXT: record["eot_token"]})


def shard_tokenizer(path=None):
    """read_tokenizer's record of a ranks file to write shards with (prepare.py, the built-in corpus): a one-line
    error if its ids do not fit the shards' uint16 tokens."""
    record = read_tokenizer(path)
    if record["n_vocab"] > 2**16:
        raise ValueError(f"{record['name']}: {record['n_vocab']:,} tokens do not fit the uint16 shard format")
    return record


def same_tokenizer(a, b):
    """Whether two records (None: not recorded, written before tokenizers were: GPT-2's) name the same tokenizer."""
    return (a or {}).get("sha256", GPT2_SHA256) == (b or {}).get("sha256", GPT2_SHA256)


def describe_tokenizer(record):
    """A record in words: `bytes.tiktoken (257 tokens, <|endoftext|> 256)`."""
    if record is None:
        return "none recorded (written before tokenizers were: GPT-2's assumed)"
    return f"{record['name']} ({record['n_vocab']:,} tokens, {EOT_TEXT} {record['eot_token']})"


# ----------------------------------------------------------------------------------------------
# The shard format: the only place that knows it.

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = 4 * HEADER_WORDS
MAX_TOKENS_PER_SHARD = 2**31 - 1  # the count is an int32
_CHUNK = 1 << 24                  # tokens per step when scanning a shard (32 MB of uint16)


def write_shard(path, tokens):
    """Write `tokens` (ids in [0, 65535]) as a shard. Atomic: a crash never leaves a partial file. Returns its
    manifest entry ({"bytes", "sha256"}), hashed as it is written."""
    path = str(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if len(tokens) > MAX_TOKENS_PER_SHARD:
        raise ValueError(f"{path}: {len(tokens)} tokens, a shard holds at most {MAX_TOKENS_PER_SHARD}")
    if tokens.dtype != np.uint16:
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**16):
            raise ValueError(f"{path}: token ids must lie in [0, 65535] to be stored as uint16")
        tokens = tokens.astype(np.uint16)
    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    with atomic_write(path) as f:
        f = HashingWriter(f)
        f.write(header.tobytes())
        f.write(memoryview(np.ascontiguousarray(tokens, dtype="<u2")).cast("B"))  # no copy for uint16 input
    return f.entry()


def read_header(path):
    """Check a shard's header and exact file size; return its token count."""
    path = str(path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: shard not found") from None
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header "
                         f"(truncated copy?)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
    magic, version, ntok = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ValueError(f"{path}: magic number {magic}, expected {MAGIC} (not a token shard)")
    if version != VERSION:
        raise ValueError(f"{path}: shard version {version}, expected {VERSION}")
    if ntok < 0 or size != HEADER_BYTES + 2 * ntok:
        raise ValueError(f"{path}: {size} bytes, expected {HEADER_BYTES + 2 * ntok} = "
                         f"{HEADER_BYTES} + 2*{ntok} tokens from the header (truncated copy?)")
    return ntok


def open_shard(path):
    """The shard's tokens as a read-only uint16 memory map (nothing is read until it is indexed)."""
    ntok = read_header(path)
    if ntok == 0:  # numpy cannot memory-map zero bytes
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(ntok,))


def validate_shard(path, vocab_size):
    """Header and size checks, plus every token id < vocab_size; return the token count.
    Scans in chunks, so memory stays small whatever the shard size."""
    tokens = open_shard(path)
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        top = int(chunk.max())
        if top >= vocab_size:
            where = start + int(np.argmax(chunk >= vocab_size))
            raise ValueError(f"{path}: token id {int(tokens[where])} at position {where} is >= "
                             f"vocab_size {vocab_size} (wrong tokenizer or corrupt shard)")
    return len(tokens)


MANIFEST = "manifest.json"  # a data folder's shards, as they were written, and the tokenizer that made them:
#                             {"files": {name: {"bytes", "sha256"}}, "tokenizer": read_tokenizer's record}


def _manifest(data_dir):
    """data_dir's manifest.json as read ({} if it has none), or a one-line error if it is damaged."""
    path = os.path.join(str(data_dir), MANIFEST)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            manifest = json.load(f)
        manifest["files"] = {name: {"bytes": int(e["bytes"]), "sha256": str(e["sha256"])}
                             for name, e in manifest["files"].items()}
        if not isinstance(manifest.get("tokenizer", {}), dict):
            raise TypeError("its tokenizer is not a record")
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedError(f"{path}: damaged, not a manifest of shards ({type(e).__name__}: {e})") from None


def read_manifest(data_dir):
    """{name: {"bytes", "sha256"}} of data_dir's manifest, {} if it has none; a one-line error if it is damaged."""
    return _manifest(data_dir).get("files", {})


def data_tokenizer(data_dir):
    """The tokenizer that made data_dir's shards (read_tokenizer's record, as its manifest holds it), or None where
    none is recorded: a folder written before tokenizers were (GPT-2's is assumed), by hand, or not there."""
    return _manifest(data_dir).get("tokenizer") if os.path.isdir(str(data_dir)) else None


def add_to_manifest(data_dir, entries, tokenizer=None):
    """entries ({name: {"bytes", "sha256"}}) added to data_dir's manifest, which is written anew, atomically, naming
    tokenizer (read_tokenizer's record: the one that made them; None: none known). A folder holds one tokenizer's
    shards: another one's (check_tokenizer) is a one-line error."""
    manifest = _manifest(data_dir)
    tokenizer = check_tokenizer(data_dir, tokenizer, manifest, new=entries) or manifest.get("tokenizer")
    with atomic_write(os.path.join(str(data_dir), MANIFEST), "w") as f:
        json.dump({"files": dict(sorted({**manifest.get("files", {}), **entries}.items())),
                   **({"tokenizer": tokenizer} if tokenizer else {})}, f, indent=1)


def check_tokenizer(data_dir, tokenizer, manifest=None, new=()):
    """tokenizer (a record), if data_dir's shards but those named in new, if any, are that tokenizer's too (those of
    a folder that records none were written before tokenizers were: GPT-2's); a one-line error if they are another's."""
    manifest = _manifest(data_dir) if manifest is None else manifest
    shards = {*manifest.get("files", {}), *map(os.path.basename, glob.glob(os.path.join(
        glob.escape(str(data_dir)), "*_*_*.bin")))} - set(new)
    if tokenizer and shards and not same_tokenizer(manifest.get("tokenizer"), tokenizer):
        raise ValueError(f"{data_dir}: its shards were made by the tokenizer "
                         f"{describe_tokenizer(manifest.get('tokenizer'))}, not by {describe_tokenizer(tokenizer)}: "
                         f"a folder holds one tokenizer's shards (choose another --data_dir)")
    return tokenizer


def check_data(data_dir, hashes=False, say=None, worker=None):
    """The shards of data_dir against its manifest: each one's size, and with hashes its sha256 (a read of every
    byte), a DamagedError naming the first that differs. Returns the shards the manifest does not list (copied in
    by hand: not verifiable); a folder without a manifest (written before manifests) lists them all. say: where a
    check of the hashes notes those it could not verify (a function of one line; None: no note). worker (a
    parallel.Worker; None: one process): the ranks share the hashing, each reading about 1/world_size of the bytes
    (files.share), and stop together, with the same line (files.agreed)."""
    return agreed(lambda: _check_data(str(data_dir), hashes, say, worker), worker)


def _check_data(data_dir, hashes, say, worker):
    """check_data on this rank: every size; its share of the hashes."""
    files = read_manifest(data_dir)
    names, listing = sorted(files), os.path.join(data_dir, MANIFEST)
    for name in names:
        check_entry(os.path.join(data_dir, name), files[name], listing, hashes=False)
    for i in share([files[name]["bytes"] for name in names], worker) if hashes else ():
        check_entry(os.path.join(data_dir, names[i]), files[names[i]], listing)
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(data_dir), "*_*_*.bin")))
    unlisted = [name for name in shards if name not in files]
    if unlisted and hashes and say:
        say(f"note: {data_dir}: {len(unlisted)} shard(s) not in a manifest.json, not verified "
            f"({unlisted[0]}{', ...' * (len(unlisted) > 1)})")
    return unlisted


def find_shards(data_dir, split):
    """Sorted paths of `*_{split}_*.bin` in data_dir (split: 'train' or 'val')."""
    data_dir = str(data_dir)
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"{data_dir}: data directory not found (run prepare.py first)")
    files = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"*_{split}_*.bin")))
    if not files:
        raise FileNotFoundError(f"{data_dir}: no *_{split}_*.bin shards in it (run prepare.py first)")
    return files


# ----------------------------------------------------------------------------------------------
# Readers. Both cut the token stream into global windows of world_size*B*T tokens (+1 for the
# targets, shifted by one); rank r takes the r-th block of B*T. A window never straddles two
# shards: when the next one does not fit, the reader moves on to the next shard.

def _check_layout(batch_size, block_size, rank, world_size):
    for name, v in (("batch_size", batch_size), ("block_size", block_size), ("world_size", world_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")


def _window(tokens, pos, rank, batch_size, block_size):
    """(x, y) int64 tensors of shape (B, T) for `rank` in the global window starting at `pos`."""
    n = batch_size * block_size
    buf = torch.from_numpy(tokens[pos + rank * n: pos + (rank + 1) * n + 1].astype(np.int64))
    return buf[:-1].view(batch_size, block_size), buf[1:].view(batch_size, block_size)


class DataLoader:
    """Training batches from data_dir/*_train_*.bin, in order, wrapping around after the last shard.

    Every shard is validated (header, size, token ids) at construction, so a bad file fails before
    training starts. Gradient accumulation: A calls for A micro-steps read the same tokens as A
    ranks would, except near a shard's end (each call checks that its own window fits). For exact
    equality everywhere, ask for batch_size=A*B once per step and split the rows into A chunks.
    `epoch` counts the passes over the data (1 on the first); `tokens_per_epoch` is what one pass reads.
    """

    def __init__(self, data_dir, batch_size, block_size, rank=0, world_size=1, vocab_size=50304):
        _check_layout(batch_size, block_size, rank, world_size)
        self.B, self.T, self.rank, self.world_size = batch_size, block_size, rank, world_size
        self.window = world_size * batch_size * block_size  # tokens consumed per call, all ranks
        self.files = find_shards(data_dir, "train")
        self.ntoks = [validate_shard(f, vocab_size) for f in self.files]
        if not any(self._fits(i, 0) for i in range(len(self.files))):
            raise ValueError(f"{data_dir}: every train shard is shorter than one global batch of "
                             f"{self.window} + 1 tokens (world_size*batch_size*block_size + 1)")
        self.shard, self.pos, self.tokens, self.epoch = 0, 0, None, 1
        # every window that fits, shard by shard (the tail of each shard is skipped)
        self.tokens_per_epoch = self.window * sum(max(0, (n - 1) // self.window) for n in self.ntoks)

    def _fits(self, shard, pos):
        return pos + self.window + 1 <= self.ntoks[shard]

    def next_batch(self):
        while not self._fits(self.shard, self.pos):  # skip the tail and any too-short shard
            self.shard, self.pos, self.tokens = (self.shard + 1) % len(self.files), 0, None
            self.epoch += self.shard == 0  # wrapped around: the data repeats from here
        if self.tokens is None:
            self.tokens = open_shard(self.files[self.shard])
        x, y = _window(self.tokens, self.pos, self.rank, self.B, self.T)
        self.pos += self.window
        return x, y

    def state_dict(self):
        """Where the next batch starts: the same on every rank, so rank 0 can save it for all."""
        return {"shard": self.shard, "pos": self.pos, "window": self.window,
                "num_shards": len(self.files), "epoch": self.epoch}

    def load_state_dict(self, state):
        # Only the global window must match: B, T or the number of ranks may change (e.g. 8 GPUs
        # -> 4 GPUs with batch_size doubled) and the token stream continues unchanged.
        if state.get("window") != self.window or state.get("num_shards") != len(self.files):
            raise ValueError(f"data loader state (window {state.get('window')} tokens, "
                             f"{state.get('num_shards')} shards) does not match this loader "
                             f"(window {self.window} = world_size*batch_size*block_size, "
                             f"{len(self.files)} shards)")
        shard, pos = int(state["shard"]), int(state["pos"])
        if not (0 <= shard < len(self.files) and 0 <= pos <= self.ntoks[shard]):
            raise ValueError(f"data loader state (shard {shard}, pos {pos}) is outside the data")
        # a state saved before epochs were counted has none: call it the first
        self.shard, self.pos, self.tokens, self.epoch = shard, pos, None, int(state.get("epoch", 1))


def val_batches(data_dir, batch_size, block_size, max_tokens=None, rank=0, world_size=1,
                vocab_size=50304):
    """Iterator of (x, y) over a fixed slice of data_dir/*_val_*.bin: the first global windows,
    at most max_tokens tokens over all ranks together (None: every window of every val shard).
    The same batches on every call; every rank gets the same number of them."""
    _check_layout(batch_size, block_size, rank, world_size)
    window = world_size * batch_size * block_size
    files = find_shards(data_dir, "val")
    starts = []  # (file index, position) of each global window, checked before any batch is made
    for i, f in enumerate(files):
        ntok = validate_shard(f, vocab_size)
        starts += [(i, pos) for pos in range(0, ntok - window, window)]  # pos + window + 1 <= ntok
    if max_tokens is not None:
        if max_tokens < window:
            raise ValueError(f"max_tokens {max_tokens} is less than one global batch of {window} "
                             f"tokens (world_size*batch_size*block_size)")
        starts = starts[:max_tokens // window]
    if not starts:
        raise ValueError(f"{data_dir}: every val shard is shorter than one global batch of "
                         f"{window} + 1 tokens (world_size*batch_size*block_size + 1)")

    def batches():
        opened = {}
        for i, pos in starts:
            if i not in opened:
                opened = {i: open_shard(files[i])}  # keep one map open at a time
            yield _window(opened[i], pos, rank, batch_size, block_size)
    return batches()


# ----------------------------------------------------------------------------------------------
# Tokenising documents, in worker processes (prepare.py --tokenize, the built-in corpus)

BATCH_CHARS = 1 << 20  # characters of text per task sent to a worker

_encoding = None  # the encoding of this (worker) process


def _start_worker(tokenizer):
    # each worker builds its own encoding: tiktoken Encoding objects are not meant to be pickled
    global _encoding
    _encoding = load_encoding(tokenizer)


def _start_pool_worker(tokenizer):
    # Pool.terminate ends its workers with SIGTERM: a handler inherited from the parent (train.py's stop signals,
    # while it builds the corpus) would leave the worker waiting on the pool's queue, and terminate waiting on it. The
    # worker is born with SIGTERM blocked (encoder), so one sent before this line waits for it, and then ends it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _start_worker(tokenizer)


def _encode(texts):
    """Tokens of a batch of documents, each <|endoftext|> then the document (special-token text
    inside a document is plain text). One array per batch: pickling per document costs more."""
    ids = []
    for text in texts:
        ids.append(_encoding.eot_token)
        ids.extend(_encoding.encode_ordinary(text))
    return np.array(ids, dtype=np.uint16), len(texts)


def _batches(docs):
    """Group documents into batches of about BATCH_CHARS characters (a worker's unit of work)."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def encoder(tokenizer=None, workers=1):
    """encode(docs): the (tokens, number of documents) of each batch of about BATCH_CHARS characters of the
    documents, in their order, each document <|endoftext|> then its tokens. `workers` processes (forked here,
    before the caller starts a progress bar's thread, so that no lock is copied held), or with 1 this process
    alone: the same tokens either way."""
    pool = None
    try:
        if workers > 1:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the workers' until _start_pool_worker
            try:
                pool = multiprocessing.Pool(workers, initializer=_start_pool_worker, initargs=(tokenizer,))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        else:
            _start_worker(tokenizer)
        # imap returns the batches in input order, whichever worker finishes first
        yield lambda docs: pool.imap(_encode, _batches(docs)) if pool else map(_encode, _batches(docs))
    finally:
        if pool is not None:
            pool.terminate()


# ----------------------------------------------------------------------------------------------
# The built-in corpus: the running Python's own standard library, one document per module and one per pydoc help
# topic. Every machine that runs this code holds it, so the quick start trains with no download, and nothing of
# it is copied into the repository: it is read from the reader's own Python when it is built.

CORPUS_NAME = "stdlib"  # its directory's name, or its name's start (stdlib_small, stdlib-3.12): train.py builds a
#                         missing data_dir of such a name first
CORPUS_VAL_ONE_IN = 20  # one document in 20 goes to validation, picked by a hash of its name (ours: measured 0.16M
#                         tokens of Debian's python3.11, 1.0M of a full CPython 3.11 build with its tests: more than
#                         the 32,768 configs/tiny.py evaluates)
NOT_THE_LIBRARY = {"site-packages", "dist-packages", "__pycache__"}  # installed packages (pyenv's sit inside the
#                                                                   library's folder) and bytecode
CORPUS_WORKERS = 4  # at most: the whole build takes 3 s on 2 cores (measured), so more would mostly add start-ups
TOPICS = "pydoc_data/topics.py"  # pydoc's help topics: a dict of texts, each topic a document of its own


def is_corpus(data_dir):
    """Whether data_dir names the built-in corpus: its last part is CORPUS_NAME, or starts with it and a _, - or .)."""
    name = os.path.basename(os.path.normpath(str(data_dir)))
    return name == CORPUS_NAME or (name.startswith(CORPUS_NAME) and name[len(CORPUS_NAME)] in "_-.")


def library_documents(lib_dir):
    """({name: text}, [skipped]) of a Python library folder: every module (*.py, by its path under lib_dir) and
    every pydoc help topic ('pydoc_data/topics.py:<topic>'), read from the files, never imported; the files that
    cannot be read, or are not UTF-8, are skipped and named."""
    docs, skipped = {}, []
    for root, dirs, files in os.walk(lib_dir):
        dirs[:] = sorted(d for d in dirs if d not in NOT_THE_LIBRARY)
        for file in sorted(f for f in files if f.endswith(".py")):
            name = os.path.relpath(os.path.join(root, file), lib_dir).replace(os.sep, "/")
            try:
                with open(os.path.join(root, file), encoding="utf-8") as f:
                    text = f.read()
                if name == TOPICS:
                    docs.update((f"{name}:{k}", v) for k, v in pydoc_topics(text).items())
                else:
                    docs[name] = text
            except (OSError, UnicodeDecodeError, ValueError, SyntaxError):
                skipped.append(name)
    return docs, skipped


def pydoc_topics(source):
    """The `topics = {...}` dict of pydoc_data/topics.py, evaluated as a literal (no code of it runs)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topics"]:
            return ast.literal_eval(node.value)
    raise ValueError("no topics = {...} in it")


def corpus_order(name):
    """A document's place: its name's sha256, which also picks the validation documents (the same on every build and
    machine, and a module's split does not depend on which others the library has)."""
    return hashlib.sha256(name.encode()).digest()


def corpus_split(docs):
    """{"val": names, "train": names} of the documents: each part in the order of the names' hashes (corpus_order),
    so that the first batches mix the whole library; one document in CORPUS_VAL_ONE_IN to val, picked by its hash."""
    order = {n: corpus_order(n) for n in docs}  # each name hashed once: its place, and its split
    names = sorted(docs, key=order.get)
    val = {n for n in names if int.from_bytes(order[n][:8], "big") % CORPUS_VAL_ONE_IN == 0}
    return {"val": [n for n in names if n in val], "train": [n for n in names if n not in val]}


def staging_folder(data_dir):
    """A new temporary folder beside data_dir, to build it in and rename into place when it is whole."""
    parent = os.path.dirname(os.path.abspath(data_dir))
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f"{os.path.basename(data_dir)}.tmp", dir=parent)
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp's folder is private (0700); the corpus is as any new folder
    return stage


def write_corpus_shards(stage, name, docs, split, workers, desc, tokenizer):
    """{part: tokens} of the split's documents, tokenised by `workers` processes with tokenizer (a record) and
    written into stage as {name}_val_000000.bin and {name}_train_000001.bin, listed in stage's manifest.json as they
    are written, with the tokenizer."""
    tokens, entries = {}, {}
    with encoder(tokenizer, workers) as encode:
        bar = tqdm(total=len(docs), unit="doc", desc=desc)
        for index, part in ((0, "val"), (1, "train")):
            arrays = []
            for ids, n in encode(docs[d] for d in split[part]):
                arrays.append(ids)
                bar.update(n)
            tokens[part] = np.concatenate(arrays) if arrays else np.zeros(0, np.uint16)
            shard = f"{name}_{part}_{index:06d}.bin"
            entries[shard] = write_shard(os.path.join(stage, shard), tokens[part])
        bar.close()
    add_to_manifest(stage, entries, tokenizer)
    return tokens


def build_corpus(data_dir, lib_dir=None, workers=min(CORPUS_WORKERS, os.cpu_count() or 1), tokenizer=None):
    """Tokenise a Python library folder (default: the running Python's, sysconfig's stdlib) with tokenizer (a ranks
    file; None: GPT-2's) into data_dir:
    {name}_val_000000.bin, {name}_train_000001.bin (name: data_dir's basename), their manifest.json, and corpus.json,
    what went where.
    Documents in the order of their names' hashes, so that the first batches mix the whole library; the validation
    set one document in CORPUS_VAL_ONE_IN. Built in a temporary folder that is renamed into place when it is whole:
    a build cut short is never taken for one. Two builds from the same folder give the same bytes."""
    data_dir = os.path.normpath(str(data_dir))
    lib_dir = lib_dir or sysconfig.get_paths()["stdlib"]
    if os.path.exists(data_dir):
        raise ValueError(f"{data_dir}: already exists; remove it to build the corpus again")
    if not os.path.isdir(lib_dir):
        raise FileNotFoundError(f"{lib_dir}: no such Python library folder")
    t0, name, tokenizer = time.time(), os.path.basename(data_dir), shard_tokenizer(tokenizer)
    docs, skipped = library_documents(lib_dir)
    if not docs:
        raise ValueError(f"{lib_dir}: no Python modules in it")
    split = corpus_split(docs)
    stage = staging_folder(data_dir)
    try:
        tokens = write_corpus_shards(stage, name, docs, split, workers, f"building {data_dir}", tokenizer)
        summary = {"source": lib_dir, "skipped": skipped,
                   **{f"{part}_documents": len(split[part]) for part in split},
                   **{f"{part}_tokens": len(tokens[part]) for part in split}, "val_names": split["val"]}
        with atomic_write(os.path.join(stage, "corpus.json"), "w") as f:
            json.dump(summary, f, indent=1)
        os.rename(stage, data_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(f"built {data_dir}: {len(docs):,} documents of {lib_dir} ({summary['train_documents']:,} train, "
          f"{summary['val_documents']:,} val{f', {len(skipped)} unreadable or not UTF-8 skipped' if skipped else ''}), "
          f"{summary['train_tokens']:,} train and {summary['val_tokens']:,} val tokens in {time.time() - t0:.1f} s",
          flush=True)
    return summary


def ensure_corpus(data_dir, lib_dir=None):
    """The built-in corpus in data_dir, built first (build_corpus) if it is not there. Processes that start together
    (torchrun's, sweep.py --parallel's) build it once: each takes a lock in turn, the first builds, the others find
    it built."""
    if os.path.isdir(data_dir) or not is_corpus(data_dir):
        return
    parent = os.path.dirname(os.path.abspath(data_dir))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{CORPUS_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if os.path.isdir(data_dir):
            return
        for stale in glob.glob(os.path.join(glob.escape(parent), f"{CORPUS_NAME}.tmp*")):
            shutil.rmtree(stale, ignore_errors=True)  # a build that was killed midway
        lib_dir = lib_dir or sysconfig.get_paths()["stdlib"]
        print(f"{data_dir}: not there yet; building the built-in corpus from this Python's standard library "
              f"({lib_dir}), once", flush=True)
        build_corpus(data_dir, lib_dir)
