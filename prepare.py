"""Prepare token shards for training (format: see data.py).

Download the GPT-2-tokenised FineWeb-Edu 10B shards:
    python prepare.py [--data_dir data/finewebedu10B] [--train_shards N] [--workers 4] [--base_url URL]
or tokenise your own text (.txt, .jsonl, .jsonl.gz) into the same format:
    python prepare.py --tokenize PATH... --data_dir DIR [--name NAME] [--shard_tokens N]
                      [--val_tokens N] [--workers N] [--tokenizer PATH.tiktoken]
or build the built-in corpus, this Python's standard library (train.py builds it when data_dir=data/stdlib is
missing), or the same from another Python's library folder, or with another tokenizer:
    python prepare.py --stdlib [LIBRARY_DIR] [--data_dir data/stdlib] [--workers N] [--tokenizer PATH.tiktoken]
or check a data folder's shards against its manifest.json (every byte read and hashed):
    python prepare.py --verify --data_dir DIR
Each mode writes the shards' sizes and sha256 into the folder's manifest.json (data.py), and the tokenizer that made
them (its ranks file's sha256, <|endoftext|>'s id, its size): train.py takes it from there. A downloaded shard is
compared first with the sha256 the Hub publishes for it (its LFS object id).
"""
import argparse
import glob
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from engine.data import (MANIFEST, add_to_manifest, build_corpus, check_data, check_tokenizer, encoder, read_header,
                         read_tokenizer, shard_tokenizer, write_shard)
from engine.files import read_jsonl
from engine.httpclient import ByteBar, DownloadError, download_file

BASE_URL = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main"
NUM_TRAIN_SHARDS = 99  # finewebedu_train_000001 ... 000099 of kjj0/finewebedu10B-gpt2


def shard_names(train_shards):
    return ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin"
                                            for i in range(1, train_shards + 1)]


def valid_shard(path):
    """A downloaded shard's check: its header and exact size (see data.read_header)."""
    try:
        read_header(path)
    except ValueError as e:
        raise ValueError(f"not a valid shard ({e})") from None


def download_shards(data_dir, train_shards=NUM_TRAIN_SHARDS, workers=4, base_url=BASE_URL):
    """Fetch the val shard and the first `train_shards` train shards into data_dir, in parallel, each checked
    against the sha256 the server announces (httpclient.download_file) and added to data_dir's manifest as it
    arrives (with GPT-2's tokenizer, which made them). Files already present with a valid header and size are
    skipped without any request."""
    if not 0 <= train_shards <= NUM_TRAIN_SHARDS:
        raise ValueError(f"--train_shards {train_shards}: the dataset has 0 to {NUM_TRAIN_SHARDS}")
    if workers < 1:
        raise ValueError(f"--workers {workers}: need at least 1")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base_url {base_url}: expected an http:// or https:// URL")
    gpt2 = check_tokenizer(data_dir, read_tokenizer())  # the dataset's tokenizer
    os.makedirs(data_dir, exist_ok=True)
    todo = []
    for name in shard_names(train_shards):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            try:
                read_header(path)
                continue
            except ValueError as e:
                print(f"{e}; downloading it again")
        todo.append(name)
    skipped = train_shards + 1 - len(todo)
    t0, stop = time.time(), threading.Event()
    bar = ByteBar(desc="download")
    try:
        with ThreadPoolExecutor(workers) as pool:
            offline = f"copy the shards into {data_dir} from a machine with internet"
            jobs = {pool.submit(download_file, f"{base_url.rstrip('/')}/{name}", os.path.join(data_dir, name),
                                bar, stop, check=valid_shard, offline=offline): name for name in todo}
            try:
                for job in as_completed(jobs):
                    add_to_manifest(data_dir, {jobs[job]: {k: v for k, v in job.result().items()
                                                           if k != "announced"}}, gpt2)
            except BaseException:
                stop.set()  # the other threads stop at their next chunk; .part files stay to resume
                pool.shutdown(cancel_futures=True)
                raise
    finally:
        bar.close()
    nbytes, dt = sum(os.path.getsize(os.path.join(data_dir, n)) for n in todo), time.time() - t0
    print(f"downloaded {len(todo)} files ({nbytes / 1e6:,.1f} MB in {dt:.1f}s, "
          f"{nbytes / 1e6 / max(dt, 1e-9):,.1f} MB/s); {skipped} already present; in {data_dir}")
    return {"downloaded": len(todo), "skipped": skipped, "bytes": nbytes, "seconds": dt}


# ----------------------------------------------------------------------------------------------
# Tokenising raw text

INPUT_TYPES = (".txt", ".jsonl", ".jsonl.gz")


def check_inputs(paths):
    """Fail before any work on a missing, unreadable, empty or unknown input file."""
    for p in paths:
        if not str(p).endswith(INPUT_TYPES):
            raise ValueError(f"{p}: unknown input type, expected one of {', '.join(INPUT_TYPES)}")
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p}: no such file")
        if not os.path.isfile(p):
            raise ValueError(f"{p}: not a regular file")
        try:
            with open(p, "rb") as f:
                empty = not f.read(1)
        except OSError as e:
            raise ValueError(f"{p}: unreadable ({e.strerror})") from None
        if empty:
            raise ValueError(f"{p}: empty file")


def read_documents(paths):
    """Yield documents in order: a .txt file is one document; each .jsonl(.gz) line has a "text"."""
    for p in map(str, paths):
        n = 0
        try:
            if p.endswith(".txt"):
                with open(p, encoding="utf-8") as f:
                    text = f.read()
                n = 1
                yield text
                continue
            for doc in read_jsonl(p, check=lambda d: None if isinstance(d, dict) and isinstance(d.get("text"), str)
                                  else 'expected a JSON object with a "text" string'):
                n += 1
                yield doc["text"]
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
            raise ValueError(f"{p}: unreadable ({e})") from None
        if n == 0:
            raise ValueError(f"{p}: no documents in it")


class _ShardWriter:
    """Cuts the token stream into shards: the first min(val_tokens, total // 10) tokens go to the
    val shard, the rest to train shards of shard_tokens. The val size is only known once the
    stream reaches 10*val_tokens tokens (or ends), so tokens are held in memory until then."""

    def __init__(self, out_dir, name, shard_tokens, val_tokens):
        self.out_dir, self.name = out_dir, name
        self.shard_tokens, self.val_tokens = shard_tokens, val_tokens
        self.pending, self.n_pending, self.total, self.n_val, self.files = [], 0, 0, None, []
        self.entries = {}  # each shard's manifest entry, hashed as it is written

    def _take(self, n):
        buf = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.n_pending = [buf[n:]], len(buf) - n
        return buf[:n]

    def _write(self, split, index, tokens):
        path = os.path.join(self.out_dir, f"{self.name}_{split}_{index:06d}.bin")
        self.entries[os.path.basename(path)] = write_shard(path, tokens)
        self.files.append(path)

    def _flush(self, final):
        while self.n_pending >= self.shard_tokens or (final and self.n_pending):
            self._write("train", len(self.files), self._take(min(self.shard_tokens, self.n_pending)))

    def _write_val(self, n):
        if n == 0:
            raise ValueError(f"only {self.total} tokens in the inputs: too little text for a "
                             f"validation shard (a tenth of the tokens) and a train shard")
        self.n_val = n
        self._write("val", 0, self._take(n))

    def add(self, tokens):
        self.pending.append(tokens)
        self.n_pending += len(tokens)
        self.total += len(tokens)
        if self.n_val is None and self.total >= 10 * self.val_tokens:
            self._write_val(self.val_tokens)
        if self.n_val is not None:
            self._flush(final=False)

    def finish(self):
        if self.n_val is None:
            self._write_val(self.total // 10)
        self._flush(final=True)
        return self.files


def check_request(paths, data_dir, name, shard_tokens, val_tokens, workers, tokenizer):
    """tokenize's input, checked before any work: the shard name and the tokenizer's record it returns, the sizes,
    the inputs, no shards of that name in data_dir yet, a tokenizer whose ids fit uint16 and that made any shards
    data_dir holds."""
    name = name or os.path.basename(os.path.abspath(data_dir))
    # the readers find shards by '*_train_*.bin' / '*_val_*.bin': the name must not confuse them
    if not name or "/" in name or "_train_" in name + "_" or "_val_" in name + "_":
        raise ValueError(f"--name {name!r}: must be a plain file name without '_train_' or '_val_'")
    for label, v in (("--shard_tokens", shard_tokens), ("--val_tokens", val_tokens),
                     ("--workers", workers)):
        if v < 1:
            raise ValueError(f"{label} {v}: must be at least 1")
    if shard_tokens > 2**31 - 1:
        raise ValueError(f"--shard_tokens {shard_tokens}: a shard holds at most 2**31 - 1 tokens")
    check_inputs(paths)
    prefix = os.path.join(glob.escape(data_dir), glob.escape(name))
    existing = sorted(glob.glob(f"{prefix}_train_*.bin") + glob.glob(f"{prefix}_val_*.bin"))
    if existing:
        raise ValueError(f"{data_dir}: already holds {name}_*.bin shards "
                         f"({os.path.basename(existing[0])}, ...); remove them or choose another --name")
    record = shard_tokenizer(tokenizer)  # in the main process: a bad --tokenizer fails here, before any work
    check_tokenizer(data_dir, record)  # a folder holds one tokenizer's shards
    return name, record


def tokenize(paths, data_dir, name=None, shard_tokens=10**8, val_tokens=10**7, workers=4,
             tokenizer=None):
    """Tokenise text files with tokenizer (a ranks file; None: GPT-2's) into data_dir/<name>_val_000000.bin and
    <name>_train_000001.bin, ... (name defaults to data_dir's basename), the tokenizer recorded in data_dir's
    manifest (data.read_tokenizer). Byte-identical output for any number of workers."""
    data_dir = str(data_dir)
    name, tokenizer = check_request(paths, data_dir, name, shard_tokens, val_tokens, workers, tokenizer)
    os.makedirs(data_dir, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{name}.", dir=data_dir)  # shards appear only if all succeeds
    t0, ndocs, bar = time.time(), 0, None
    try:
        with encoder(tokenizer, workers) as encode:
            bar = tqdm(unit="tok", unit_scale=True, desc="tokenize")
            writer = _ShardWriter(stage, name, shard_tokens, val_tokens)
            for tokens, n in encode(read_documents(paths)):
                writer.add(tokens)
                bar.update(len(tokens))
                ndocs += n
            files = writer.finish()
        for f in files:
            os.replace(f, os.path.join(data_dir, os.path.basename(f)))
        add_to_manifest(data_dir, writer.entries, tokenizer)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(stage, ignore_errors=True)
    dt = time.time() - t0
    print(f"{ndocs:,} documents, {writer.total:,} tokens ({writer.n_val:,} val, "
          f"{writer.total - writer.n_val:,} train in {len(files) - 1} shard(s)) in {dt:.1f}s: "
          f"{writer.total / max(dt, 1e-9):,.0f} tokens/s; shards in {data_dir}")
    return {"documents": ndocs, "tokens": writer.total, "val_tokens": writer.n_val,
            "files": [os.path.join(data_dir, os.path.basename(f)) for f in files], "seconds": dt}


def verify(data_dir):
    """Every shard of data_dir against its manifest.json, each byte read and hashed: a one-line error naming the
    first that differs (files.DamagedError). Returns the number checked."""
    t0 = time.time()
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"{data_dir}: no such data folder")
    if not os.path.exists(os.path.join(data_dir, MANIFEST)):
        raise FileNotFoundError(f"{data_dir}: no {MANIFEST} to verify against (its shards were written before "
                                f"manifests, or copied in by hand)")
    unlisted = check_data(data_dir, hashes=True)
    checked = [n for n in os.listdir(data_dir) if n.endswith(".bin") and n not in unlisted]
    nbytes = sum(os.path.getsize(os.path.join(data_dir, n)) for n in checked)
    if unlisted:
        print(f"note: {data_dir}: {len(unlisted)} shard(s) not in its manifest.json, not verified: "
              f"{', '.join(unlisted[:3])}{', ...' * (len(unlisted) > 3)}")
    print(f"{data_dir}: {len(checked)} shard(s) ({nbytes / 1e6:,.1f} MB) match manifest.json "
          f"(sizes and sha256, {time.time() - t0:.1f} s)")
    return len(checked)


def build_parser():
    """prepare.py's command line: its three modes (download, --tokenize, --stdlib) and their options."""
    p = argparse.ArgumentParser(description="Download FineWeb-Edu 10B token shards, tokenise "
                                            "your own text into the same shard format, or build the "
                                            "built-in corpus (--stdlib).")
    p.add_argument("--data_dir", help="where the shards go (download default: data/finewebedu10B)")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads / tokenizer processes")
    d = p.add_argument_group("download (the default mode)")
    d.add_argument("--train_shards", type=int,
                   help=f"train shards to fetch (default all {NUM_TRAIN_SHARDS})")
    d.add_argument("--base_url", help=f"where the files are (default {BASE_URL})")
    t = p.add_argument_group("tokenize")
    t.add_argument("--tokenize", nargs="+", metavar="PATH", help=".txt, .jsonl or .jsonl.gz files")
    t.add_argument("--name", help="shard name prefix (default: the basename of --data_dir)")
    t.add_argument("--shard_tokens", type=int, help="tokens per train shard (default 100M)")
    t.add_argument("--val_tokens", type=int,
                   help="tokens for the val shard (default 10M, at most a tenth)")
    t.add_argument("--tokenizer", metavar="PATH.tiktoken",
                   help="a .tiktoken ranks file, for --tokenize and --stdlib (default: tokenizer/gpt2.tiktoken, "
                        "GPT-2's own); recorded in the folder's manifest.json")
    c = p.add_argument_group("the built-in corpus")
    c.add_argument("--stdlib", nargs="?", const="", metavar="LIBRARY_DIR",
                   help="tokenise a Python standard library (default: this Python's) into --data_dir "
                        "(default data/stdlib): one document per module and per pydoc topic")
    v = p.add_argument_group("verify")
    v.add_argument("--verify", action="store_true",
                   help="check --data_dir's shards against its manifest.json (sizes and sha256; reads every byte)")
    return p


def mode_error(args):
    """The usage error of an option given outside its mode (--stdlib, --tokenize or the download), or None."""
    tok_only = [o for o in ("name", "shard_tokens", "val_tokens") if getattr(args, o) is not None]
    dl_only = [o for o in ("train_shards", "base_url") if getattr(args, o) is not None]
    if args.verify and (args.tokenize or args.stdlib is not None or tok_only or dl_only or args.tokenizer
                        or not args.data_dir):
        return "--verify takes --data_dir alone (the folder to check)"
    if args.stdlib is not None and (args.tokenize or tok_only or dl_only):
        return (f"--stdlib builds the built-in corpus; --{'tokenize' if args.tokenize else (tok_only + dl_only)[0]} "
                f"does not apply to it")
    if args.tokenize and dl_only:
        return f"--{dl_only[0]} is for downloads, not --tokenize"
    if args.tokenizer and not (args.tokenize or args.stdlib is not None):
        return "--tokenizer only applies with --tokenize or --stdlib"
    if not args.tokenize and tok_only:
        return f"--{tok_only[0]} only applies with --tokenize"
    if args.tokenize and not args.data_dir:
        return "--tokenize needs --data_dir (where to write the shards)"
    return None


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    error = mode_error(args)
    if error:
        p.error(error)
    try:
        if args.verify:
            verify(args.data_dir)
        elif args.stdlib is not None:
            build_corpus(args.data_dir or "data/stdlib", args.stdlib or None, args.workers, args.tokenizer)
        elif args.tokenize:
            tokenize(args.tokenize, args.data_dir, name=args.name,
                     shard_tokens=10**8 if args.shard_tokens is None else args.shard_tokens,
                     val_tokens=10**7 if args.val_tokens is None else args.val_tokens,
                     workers=args.workers, tokenizer=args.tokenizer)
        else:
            download_shards(args.data_dir or "data/finewebedu10B",
                            NUM_TRAIN_SHARDS if args.train_shards is None else args.train_shards,
                            args.workers, args.base_url or BASE_URL)
    except (ValueError, OSError, DownloadError) as e:  # a DamagedError is a ValueError
        raise SystemExit(f"prepare.py: error: {e}")
    except KeyboardInterrupt:
        raise SystemExit("prepare.py: interrupted; nothing was written" if args.tokenize or args.stdlib is not None else
                         "prepare.py: interrupted; run the same command again to resume the downloads")


if __name__ == "__main__":
    main()
