"""Data on disk: the GPT-2 tokenizer, the binary shard format, the readers the trainer uses, atomic writes and
JSON Lines. Nothing here touches the network (httpclient.py does), so the trainer imports no network package.

Shard format (llm.c / modded-nanogpt): a header of 256 little-endian int32 words (magic 20240520,
version 1, token count, then zeros), followed by the tokens as little-endian uint16. A shard of
ntok tokens is therefore exactly 1024 + 2*ntok bytes; anything else is a truncated or foreign file.
"""
import contextlib
import glob
import gzip
import json
import os
import sys

import numpy as np
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def load_encoding(path=None):
    """GPT-2 BPE. With `path`, read the ranks from a local `.tiktoken` file (offline clusters, tests);
    the pattern and `<|endoftext|>` (placed right after the ranks, 50256 for GPT-2) are GPT-2's.
    Every tool loads its tokenizer here, so the offline hint below is the same everywhere."""
    if path is None:
        import requests  # tiktoken's own client: it downloads 'gpt2' on first use
        try:
            return tiktoken.get_encoding("gpt2")
        except (OSError, requests.RequestException) as e:
            raise ValueError(f"tiktoken could not download its gpt2 vocabulary ({type(e).__name__}); offline, "
                             f"pass --tokenizer PATH to a copy of GPT-2's r50k_base.tiktoken (README.md: "
                             f"Troubleshooting)") from None
    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable .tiktoken ranks file ({e})") from None
    return tiktoken.Encoding(name=f"gpt2:{path}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write through a temp file that is fsynced and renamed into place when the block succeeds:
    readers never see half a file, and a crash or error leaves the previous file, if any, intact."""
    path = str(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_jsonl(path, check=None):
    """The JSON values of a JSON Lines file (gzipped if it ends in .gz), one per non-blank line, as they are read.
    A last line that is not JSON and has no newline was cut by a crash mid-write (train.py's log.jsonl, say): it
    is skipped with a note. Any other bad line is an error naming it, as is check(value) when it returns what
    is wrong with a value (None when it is right)."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                if not line.endswith("\n"):
                    print(f"note: {path}:{n}: the last line is cut short (a crash mid-write?), skipped",
                          file=sys.stderr)
                    return
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            problem = check(value) if check else None
            if problem:
                raise ValueError(f"{path}:{n}: {problem}")
            yield value


# ----------------------------------------------------------------------------------------------
# The shard format: the only place that knows it.

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = 4 * HEADER_WORDS
MAX_TOKENS_PER_SHARD = 2**31 - 1  # the count is an int32
_CHUNK = 1 << 24                  # tokens per step when scanning a shard (32 MB of uint16)


def write_shard(path, tokens):
    """Write `tokens` (ids in [0, 65535]) as a shard. Atomic: a crash never leaves a partial file."""
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
        f.write(header.tobytes())
        f.write(memoryview(np.ascontiguousarray(tokens, dtype="<u2")))  # no copy for uint16 input


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
