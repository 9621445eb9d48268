"""Shard format and readers. Shards are written by hand here (struct + numpy), not by data.py."""
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import data
from engine.data import DataLoader, find_shards, open_shard, read_header, val_batches, validate_shard, write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def make_shard(path, tokens, magic=20240520, version=1, ntok=None, cut=0):
    """A shard as the llm.c format defines it; the knobs make corrupt ones. Returns the path."""
    tokens = np.asarray(tokens, dtype="<u2")
    header = struct.pack("<3i", magic, version, len(tokens) if ntok is None else ntok) + bytes(1012)
    body = header + tokens.tobytes()
    with open(path, "wb") as f:
        f.write(body[:len(body) - cut])
    return str(path)


# ---------------------------------------------------------------- tokenizer

def test_the_shipped_tokenizer_is_tiktokens_gpt2(offline):
    """tokenizer/gpt2.tiktoken is r50k_base, byte for byte, and the default of every tool: with the network closed
    (offline: requests refused, tiktoken's cache empty) it loads, and encodes as GPT-2 does."""
    import hashlib
    with open(data.TOKENIZER, "rb") as f:
        ranks = f.read()
    assert hashlib.sha256(ranks).hexdigest() == \
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # r50k_base (docs/REFERENCE.md)
    enc = data.load_encoding()
    assert len(ranks.splitlines()) == 50256 and enc.eot_token == 50256 and enc.n_vocab == 50257
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    licence = open(os.path.join(os.path.dirname(data.TOKENIZER), "LICENSE")).read()
    assert "gpt2.tiktoken" in licence and "Modified MIT License" in licence and "Copyright (c) 2019 OpenAI" in licence


def test_a_ranks_file_of_ones_own_is_a_file_like_any_other_for_git():
    """A fork's ranks file in tokenizer/ is committed as any file (issue 50: `*.tiktoken` was ignored, and a new one
    needed `git add -f`); the shipped ones are tracked."""
    assert subprocess.run(["git", "check-ignore", "-q", "tokenizer/mine.tiktoken"], cwd=ROOT).returncode == 1
    tracked = subprocess.run(["git", "ls-files", "tokenizer"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert {"tokenizer/gpt2.tiktoken", "tokenizer/bytes.tiktoken"} <= set(tracked)


@pytest.mark.quick
def test_a_ranks_file_rewritten_in_place_tokenises_with_its_new_contents(enc_file, tmp_path, monkeypatch):
    """Issue 50's "done when": a ranks file is read anew at every load, never through tiktoken's cache keyed by its
    path (data-gym-cache, here in a folder of its own, filled by tiktoken's loader first): rewritten from the tests'
    291 tokens to the 256 bytes, the same path gives the new tokens, <|endoftext|> 256, and a new recorded sha256."""
    from tiktoken.load import load_tiktoken_bpe
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "mine.tiktoken"
    path.write_bytes(open(enc_file, "rb").read())
    assert len(load_tiktoken_bpe(str(path))) == 290  # tiktoken's loader has cached it by its path
    before, record = data.load_encoding(str(path)), data.read_tokenizer(path)
    path.write_bytes(open(os.path.join(ROOT, "tokenizer", "bytes.tiktoken"), "rb").read())
    after = data.load_encoding(str(path))
    assert (before.n_vocab, before.eot_token, after.n_vocab, after.eot_token) == (291, 290, 257, 256)
    assert after.encode_ordinary(" the") == list(b" the") != before.encode_ordinary(" the")
    assert data.read_tokenizer(path)["sha256"] != record["sha256"] and len(load_tiktoken_bpe(str(path))) == 290
    assert data.load_encoding(record).encode_ordinary(" the") == before.encode_ordinary(" the")  # a record's own
    with pytest.raises(data.DamagedError, match="its ranks' sha256 is not the recorded"):
        data.load_encoding({**record, "ranks": record["ranks"].replace("MA==", "MQ==", 1)})


@pytest.mark.quick
def test_a_manifest_records_the_tokenizer_of_its_shards_and_one_folder_holds_one(enc_file, tmp_path):
    """The manifest names the tokenizer that made a folder's shards (read_tokenizer's record: GPT-2's without its
    ranks, which ship); adding another tokenizer's shards is refused in one line; a folder that records none (written
    before tokenizers were) reads as None, GPT-2's assumed, and takes GPT-2's shards only."""
    gpt2, mine = data.read_tokenizer(), data.read_tokenizer(enc_file)
    assert "ranks" not in gpt2 and (gpt2["eot_token"], gpt2["n_vocab"]) == (50256, 50257) and mine["n_vocab"] == 291
    entry = write_shard(tmp_path / "a_train_000001.bin", [1, 2, 3])
    data.add_to_manifest(tmp_path, {"a_train_000001.bin": entry}, mine)
    assert data.data_tokenizer(tmp_path) == mine and data.read_manifest(tmp_path) == {"a_train_000001.bin": entry}
    with pytest.raises(ValueError, match=r"its shards were made by the tokenizer test.tiktoken \(291 tokens, "
                                         r"<\|endoftext\|> 290\), not by gpt2.tiktoken \(50,257 tokens"):
        data.add_to_manifest(tmp_path, {"b_train_000001.bin": entry}, gpt2)
    old = tmp_path / "old"
    old.mkdir()
    write_shard(old / "a_train_000001.bin", [1, 2, 3])  # written before tokenizers were recorded
    assert data.data_tokenizer(old) is None and data.data_tokenizer(tmp_path / "missing") is None
    assert data.check_tokenizer(old, gpt2) == gpt2
    with pytest.raises(ValueError, match="made by the tokenizer none recorded"):
        data.check_tokenizer(old, mine)


# ---------------------------------------------------------------- format

def test_write_shard_bytes_match_the_format(tmp_path):
    tokens = [0, 1, 50256, 65535, 7]
    write_shard(tmp_path / "a.bin", np.array(tokens))  # int64 input is converted
    expected = struct.pack("<256i", 20240520, 1, 5, *[0] * 253) + struct.pack("<5H", *tokens)
    assert (tmp_path / "a.bin").read_bytes() == expected
    write_shard(tmp_path / "b.bin", np.array(tokens, dtype=np.uint16))
    assert (tmp_path / "b.bin").read_bytes() == expected
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]  # no temp file left


def test_write_shard_rejects_ids_outside_uint16(tmp_path):
    for bad in ([1, 65536], [-1, 3]):
        with pytest.raises(ValueError, match="65535"):
            write_shard(tmp_path / "a.bin", np.array(bad))
    assert os.listdir(tmp_path) == []


def test_read_header_and_open_shard(tmp_path):
    tokens = np.arange(300) * 7
    path = make_shard(tmp_path / "x_train_000001.bin", tokens)
    assert read_header(path) == 300
    mm = open_shard(path)
    assert isinstance(mm, np.memmap) and mm.dtype == np.uint16
    assert mm.tolist() == tokens.tolist()
    assert validate_shard(path, vocab_size=300 * 7) == 300  # max id 2093 < 2100


@pytest.mark.parametrize("kind, kw, match", [
    ("magic", dict(magic=20240521), "magic number 20240521, expected 20240520"),
    ("version", dict(version=2), "version 2, expected 1"),
    ("truncated", dict(cut=3), "2041 bytes, expected 2044"),
    ("header only part", dict(cut=1500), "shorter than the 1024-byte shard header"),
    ("count too big", dict(ntok=1000), "expected 3024"),
])
def test_read_header_rejects_bad_shards(tmp_path, kind, kw, match):
    path = make_shard(tmp_path / "bad_train_000001.bin", np.arange(510), **kw)
    for check in (read_header, open_shard, lambda p: validate_shard(p, 50304)):
        with pytest.raises(ValueError, match=match) as e:
            check(path)
        assert str(e.value).startswith(path) and "\n" not in str(e.value)


def test_missing_shard(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        read_header(tmp_path / "nope.bin")


def test_validate_shard_finds_a_bad_id_in_a_later_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHUNK", 7)  # many chunks on a small shard
    tokens = np.arange(40) % 10
    tokens[23] = 10
    path = make_shard(tmp_path / "a_train_000001.bin", tokens)
    with pytest.raises(ValueError, match=r"token id 10 at position 23 is >= vocab_size 10"):
        validate_shard(path, vocab_size=10)
    assert validate_shard(path, vocab_size=11) == 40


def test_find_shards(tmp_path):
    for name in ["b_train_000002.bin", "a_train_000001.bin", "a_val_000000.bin",
                 "a_train_000003.bin.part", "a_train_000004.bin.tmp", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    assert find_shards(tmp_path, "train") == [str(tmp_path / "a_train_000001.bin"),
                                              str(tmp_path / "b_train_000002.bin")]
    assert find_shards(tmp_path, "val") == [str(tmp_path / "a_val_000000.bin")]
    with pytest.raises(FileNotFoundError, match=r"missing: data directory not found"):
        find_shards(tmp_path / "missing", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no \*_val_\*.bin shards"):
        find_shards(tmp_path / "empty", "val")


# ---------------------------------------------------------------- training reader

@pytest.fixture
def stream(tmp_path):
    """Two train shards of distinct token values (shard 1: 0..95, shard 2: 1000..1049) and a val
    shard (2000..2095). 96 tokens: a window at 88 would fit but for its last target."""
    make_shard(tmp_path / "d_train_000001.bin", np.arange(96))
    make_shard(tmp_path / "d_train_000002.bin", np.arange(1000, 1050))
    make_shard(tmp_path / "d_val_000000.bin", np.arange(2000, 2096))
    return tmp_path


@pytest.mark.quick
def test_batches_are_the_exact_windows(stream):
    loader = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    x, y = loader.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 4)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    starts = [x[0, 0].item()] + [loader.next_batch()[0][0, 0].item() for _ in range(20)]
    # 8 tokens per batch (+1 target): shard 1 fits starts 0..80 (80+9 <= 96 < 88+9), shard 2
    # starts 1000..1040 (40+9 <= 50), then back to shard 1.
    assert starts == list(range(0, 81, 8)) + list(range(1000, 1041, 8)) + [0, 8, 16, 24]


def test_epochs_are_counted_at_each_wrap_around(stream):
    loader = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    assert loader.tokens_per_epoch == 8 * (11 + 6)  # the windows that fit: 11 in shard 1, 6 in shard 2
    epochs = []
    for _ in range(40):
        loader.next_batch()
        epochs.append(loader.epoch)
    assert epochs == [1] * 17 + [2] * 17 + [3] * 6  # the 18th and 35th batches start the data again
    assert loader.state_dict()["epoch"] == 3
    resumed = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 3
    old = {k: v for k, v in loader.state_dict().items() if k != "epoch"}  # saved before epochs were counted
    resumed.load_state_dict(old)
    assert resumed.epoch == 1 and (resumed.next_batch()[0] == loader.next_batch()[0]).all()
    for _ in range(5):
        x, y = loader.next_batch()
        assert (y[:, :-1] == x[:, 1:]).all() and (y[0, -1] == x[1, 0]).all()


def test_two_ranks_split_the_global_batch(stream):
    ranks = [DataLoader(stream, batch_size=2, block_size=3, rank=r, world_size=2, vocab_size=5000)
             for r in range(2)]
    single = DataLoader(stream, batch_size=4, block_size=3, vocab_size=5000)  # one process, 2B rows
    for step in range(12):  # crosses into shard 2 and wraps around
        (x0, y0), (x1, y1) = (r.next_batch() for r in ranks)
        xs, ys = single.next_batch()
        start = xs[0, 0].item()
        a, b = set(x0.flatten().tolist()), set(x1.flatten().tolist())
        assert not a & b
        assert sorted(a | b) == list(range(start, start + 12))  # the whole global window
        assert x0.flatten().tolist() == list(range(start, start + 6))
        assert (torch.cat([x0, x1]) == xs).all() and (torch.cat([y0, y1]) == ys).all()


def test_accumulation_matches_ranks_inside_a_shard(stream):
    """1 process x 2 micro-steps reads the same tokens as 2 ranks x 1 step."""
    ranks = [DataLoader(stream, 2, 4, rank=r, world_size=2, vocab_size=5000) for r in range(2)]
    single = DataLoader(stream, 2, 4, vocab_size=5000)
    for step in range(5):  # 5 * 16 + 1 <= 96: inside shard 1
        for r in ranks:
            x, y = single.next_batch()
            xr, yr = r.next_batch()
            assert (x == xr).all() and (y == yr).all()


@pytest.mark.quick
def test_resume_continues_with_the_next_batch(stream):
    loader = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    for _ in range(10):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))  # plain ints: survives any checkpoint format
    expected = [loader.next_batch() for _ in range(12)]  # crosses a shard end and wraps
    resumed = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    resumed.load_state_dict(state)
    for (x, y), (xe, ye) in zip((resumed.next_batch() for _ in range(12)), expected):
        assert (x == xe).all() and (y == ye).all()


def test_resume_on_fewer_ranks_with_the_same_global_batch(stream):
    two = [DataLoader(stream, 2, 4, rank=r, world_size=2, vocab_size=5000) for r in range(2)]
    for _ in range(3):
        [r.next_batch() for r in two]
    one = DataLoader(stream, 4, 4, vocab_size=5000)
    one.load_state_dict(two[0].state_dict())
    x, _ = one.next_batch()
    assert x.flatten().tolist() == list(range(48, 64))


def test_resume_rejects_a_mismatched_state(stream):
    loader = DataLoader(stream, batch_size=2, block_size=4, vocab_size=5000)
    other = DataLoader(stream, batch_size=2, block_size=8, vocab_size=5000)
    with pytest.raises(ValueError, match="window 16 tokens.*window 8"):
        loader.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="outside the data"):
        loader.load_state_dict(dict(loader.state_dict(), shard=5))


@pytest.mark.parametrize("kw, match", [
    (dict(magic=1234), "magic number 1234"),
    (dict(version=3), "version 3"),
    (dict(cut=2), "expected"),
])
def test_loader_rejects_a_corrupt_shard_before_training(stream, kw, match):
    bad = make_shard(stream / "d_train_000003.bin", np.arange(60), **kw)
    with pytest.raises(ValueError, match=match) as e:
        DataLoader(stream, 2, 4, vocab_size=5000)
    assert bad in str(e.value)


def test_loader_rejects_token_ids_beyond_the_vocab(stream):
    bad = make_shard(stream / "d_train_000003.bin", [1, 2, 50304, 4])
    with pytest.raises(ValueError, match=r"token id 50304 at position 2 is >= vocab_size 50304") as e:
        DataLoader(stream, 2, 4)
    assert bad in str(e.value)


def test_loader_missing_dir_and_no_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: data directory not found"):
        DataLoader(tmp_path / "nowhere", 2, 4)
    make_shard(tmp_path / "d_val_000000.bin", np.arange(10))
    with pytest.raises(FileNotFoundError, match=r"no \*_train_\*.bin"):
        DataLoader(tmp_path, 2, 4)


def test_loader_skips_short_shards_and_rejects_all_short(tmp_path):
    make_shard(tmp_path / "d_train_000001.bin", np.arange(8))  # 8 < 8 + 1: never fits
    make_shard(tmp_path / "d_train_000002.bin", np.arange(100, 120))
    loader = DataLoader(tmp_path, 2, 4, vocab_size=5000)
    assert [loader.next_batch()[0][0, 0].item() for _ in range(3)] == [100, 108, 100]
    assert loader.epoch == 2 and loader.tokens_per_epoch == 16  # skipping shard 1 at the start is no wrap
    with pytest.raises(ValueError, match="shorter than one global batch of 32"):
        DataLoader(tmp_path, 4, 4, world_size=2, vocab_size=5000)


def test_loader_rejects_bad_layout(stream):
    with pytest.raises(ValueError, match="rank 2 outside"):
        DataLoader(stream, 2, 4, rank=2, world_size=2, vocab_size=5000)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        DataLoader(stream, 0, 4, vocab_size=5000)


# ---------------------------------------------------------------- validation reader

def test_val_batches_fixed_slice(stream):
    make_shard(stream / "d_val_000001.bin", np.arange(3000, 3020))
    starts = lambda it: [x[0, 0].item() for x, _ in it]
    # window 8: shard 0 (96 tokens) fits starts 0..80, shard 1 (20 tokens) 0 and 8
    everything = starts(val_batches(stream, 2, 4, vocab_size=5000))
    assert everything == list(range(2000, 2081, 8)) + [3000, 3008]
    assert starts(val_batches(stream, 2, 4, max_tokens=20, vocab_size=5000)) == [2000, 2008]
    assert starts(val_batches(stream, 2, 4, max_tokens=20, vocab_size=5000)) == [2000, 2008]  # again
    x, y = next(val_batches(stream, 2, 4, vocab_size=5000))
    assert x.dtype == torch.int64 and x.tolist() == [[2000, 2001, 2002, 2003], [2004, 2005, 2006, 2007]]
    assert y.tolist() == [[2001, 2002, 2003, 2004], [2005, 2006, 2007, 2008]]


def test_val_batches_ranks_partition_the_slice(stream):
    per_rank = [[x for x, _ in val_batches(stream, 2, 4, max_tokens=40, rank=r, world_size=2,
                                           vocab_size=5000)] for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2  # 40 // (2*2*4) global windows
    tokens = sorted(t for xs in per_rank for x in xs for t in x.flatten().tolist())
    assert tokens == list(range(2000, 2032))  # disjoint, and together exactly the first 32 tokens


def test_val_batches_errors(stream, tmp_path):
    with pytest.raises(ValueError, match="max_tokens 7 is less than one global batch of 8"):
        val_batches(stream, 2, 4, max_tokens=7, vocab_size=5000)
    with pytest.raises(ValueError, match="every val shard is shorter"):
        val_batches(stream, 16, 16, vocab_size=5000)
    bad = make_shard(stream / "d_val_000001.bin", np.arange(10), version=7)
    with pytest.raises(ValueError, match="version 7") as e:
        val_batches(stream, 2, 4, vocab_size=5000)  # raised at the call, before any batch
    assert bad in str(e.value)
    with pytest.raises(ValueError, match="token id 2050 at position 50 is >= vocab_size 2050"):
        val_batches(stream, 2, 4, vocab_size=2050)
    with pytest.raises(FileNotFoundError, match=r"no \*_val_\*.bin"):
        val_batches(_only_train(tmp_path / "only_train"), 2, 4)


def _only_train(d):
    d.mkdir()
    make_shard(d / "d_train_000001.bin", np.arange(100))
    return d


# ---------------------------------------------------------------- the built-in corpus

def make_library(root, modules=120):
    """A Python library folder as the corpus builder sees one: modules, packages, pydoc's topics, and what it must
    leave out (installed packages, bytecode, other files) or skip (not UTF-8, unreadable). Returns
    {document name: text} of what the corpus must hold."""
    expected = {}
    for i in range(modules):
        name = f"mod{i:03d}.py" if i % 3 else f"pkg{i % 7}/sub_{i:03d}.py"
        text = f'"""Module {i}."""\n\ndef f{i}(x):\n    return x * {i}  # {"word " * (i % 13)}\n'
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        expected[name] = text
    (root / "pydoc_data").mkdir()
    topics = {"if": "The if statement\n****************\n", "for": "The for statement\n*****************\n"}
    (root / "pydoc_data" / "topics.py").write_text(f"# Autogenerated by Sphinx\ntopics = {topics!r}\n")
    expected.update({f"pydoc_data/topics.py:{k}": v for k, v in topics.items()})
    for left_out in ("site-packages/numpy.py", "dist-packages/apt.py", "__pycache__/mod001.py",
                     "pkg1/__pycache__/x.py"):
        (root / left_out).parent.mkdir(parents=True, exist_ok=True)
        (root / left_out).write_text("left out")
    (root / "README.txt").write_text("not a module")
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))  # not UTF-8
    (root / "gone.py").symlink_to(root / "nowhere.py")  # unreadable (root reads any file, but not this one)
    return expected


def corpus_documents(path, enc):
    """The texts of the documents of a shard: each begins with <|endoftext|>."""
    tokens = open_shard(path).tolist()
    starts = [i for i, t in enumerate(tokens) if t == enc.eot_token] + [len(tokens)]
    assert starts[0] == 0
    return [enc.decode(tokens[a + 1:b]) for a, b in zip(starts, starts[1:])]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    return root, make_library(root)


def test_corpus_holds_every_module_and_topic_once_split_by_document(library, tmp_path, capsys):
    root, expected = library
    summary = data.build_corpus(tmp_path / "stdlib", str(root), workers=1)
    enc = data.load_encoding()
    val = corpus_documents(tmp_path / "stdlib" / "stdlib_val_000000.bin", enc)
    train = corpus_documents(tmp_path / "stdlib" / "stdlib_train_000001.bin", enc)
    assert len(val) == summary["val_documents"] > 0 and len(train) == summary["train_documents"] > len(val)
    assert not set(val) & set(train)  # no document in both
    assert sorted(val + train) == sorted(expected.values())  # each once; nothing left out, nothing extra
    assert sorted(summary["skipped"]) == ["gone.py", "latin1.py"]
    names = {text: name for name, text in expected.items()}
    assert sorted(names[t] for t in val) == sorted(summary["val_names"])
    assert train != sorted(train)  # the order mixes the library (by the names' hashes), not alphabetical
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"built {tmp_path / 'stdlib'}: {len(expected)} documents of {root} ") and \
        "2 unreadable or not UTF-8 skipped" in line and f"{summary['train_tokens']:,} train" in line
    with pytest.raises(ValueError, match="stdlib: already exists; remove it"):
        data.build_corpus(tmp_path / "stdlib", str(root))


def test_two_corpus_builds_give_the_same_bytes(library, tmp_path, monkeypatch):
    root, _ = library
    monkeypatch.setattr(data, "BATCH_CHARS", 200)  # many small tasks, so that 3 workers interleave
    data.build_corpus(tmp_path / "a" / "stdlib", str(root), workers=1)
    data.build_corpus(tmp_path / "b" / "stdlib", str(root), workers=3)
    files = sorted(os.listdir(tmp_path / "a" / "stdlib"))
    assert files == ["corpus.json", "manifest.json", "stdlib_train_000001.bin", "stdlib_val_000000.bin"]
    for f in files:
        assert (tmp_path / "a" / "stdlib" / f).read_bytes() == (tmp_path / "b" / "stdlib" / f).read_bytes()
    assert sorted(os.listdir(tmp_path / "a")) == ["stdlib"]  # no temporary folder left


BUILD = """import os, signal, sys
from engine import data
real = data.write_shard
def write_then_die(path, tokens):  # killed midway: the validation shard written, the train shard not yet
    real(path, tokens)
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[3] == "die":
    data.write_shard = write_then_die
data.ensure_corpus(sys.argv[1], sys.argv[2])
"""


def test_a_corpus_build_killed_midway_is_never_taken_for_a_whole_one(library, tmp_path):
    root, _ = library
    corpus = tmp_path / "data" / "stdlib"
    here = ROOT
    r = subprocess.run([sys.executable, "-c", BUILD, str(corpus), str(root), "die"], cwd=here, capture_output=True)
    assert r.returncode == -signal.SIGKILL
    staged = [d for d in os.listdir(corpus.parent) if d.startswith("stdlib.tmp")]
    assert not corpus.exists() and len(staged) == 1  # what was written lies in a folder no reader looks at
    assert os.listdir(corpus.parent / staged[0]) == ["stdlib_val_000000.bin"]
    with pytest.raises(FileNotFoundError, match="stdlib: data directory not found"):
        DataLoader(corpus, 1, 8)
    r = subprocess.run([sys.executable, "-c", BUILD, str(corpus), str(root), "live"], cwd=here, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(corpus.parent)) == [".stdlib.lock", "stdlib"]  # the stale folder removed
    assert sorted(os.listdir(corpus)) == ["corpus.json", "manifest.json", "stdlib_train_000001.bin",
                                          "stdlib_val_000000.bin"]


def test_processes_that_start_together_build_the_corpus_once(library, tmp_path):
    root, _ = library
    corpus = tmp_path / "data" / "stdlib"
    here = ROOT
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(corpus), str(root), "live"], cwd=here,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    said = "".join(out for out, _ in outs)
    assert said.count("not there yet; building the built-in corpus") == 1 and said.count("\nbuilt ") == 1
    assert sorted(os.listdir(corpus)) == ["corpus.json", "manifest.json", "stdlib_train_000001.bin",
                                          "stdlib_val_000000.bin"]


def test_the_corpus_is_built_only_for_a_directory_of_its_name(tmp_path):
    data.ensure_corpus(tmp_path / "data" / "mine")  # any other missing data_dir stays the reader's error
    assert not (tmp_path / "data").exists()
    assert data.is_corpus("data/stdlib") and data.is_corpus("/scratch/x/stdlib/") and not data.is_corpus("stdlib2")
    assert data.is_corpus("data/stdlib_small") and data.is_corpus("data/stdlib-3.12") and not data.is_corpus("mystdlib")
