"""Shared test fixtures: a small GPT-2-style tokenizer built here (fast to load, with few enough ids for tiny
models), a closed network, what tests that need root or Debian's packages do without them, and the toy shards and
the unbroken 2-process run that several modules' training tests share, made once per session."""
import base64
import os

import pytest

# Byte-level ranks plus a few English merges, so that tokens span several bytes and
# context/continuation splits are non-trivial. Each merge is reachable from two existing tokens.
_MERGES = [b" t", b"he", b" the", b"in", b" a", b"er", b"on", b" o", b"re", b"an", b"at", b"en",
           b" s", b"ing", b" c", b" w", b"is", b" b", b"or", b"ed", b" f", b"es", b" p", b"ar",
           b" m", b"nd", b" and", b" in", b" of", b" to", b"\n\n", b" is", b"ion", b" Question", b":"]


def write_tiktoken_file(path):
    """Write the test ranks in tiktoken's file format (base64 token, rank) and return the path."""
    tokens = [bytes([i]) for i in range(256)] + [m for m in _MERGES if len(m) > 1]
    with open(path, "w") as f:
        for rank, tok in enumerate(tokens):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    return path


@pytest.fixture(scope="session")
def enc_file(tmp_path_factory):
    """Path of a `.tiktoken` file with the test ranks (for CLI tests: `--tokenizer PATH`)."""
    return write_tiktoken_file(tmp_path_factory.mktemp("tok") / "test.tiktoken")


@pytest.fixture(scope="session")
def enc(enc_file):
    """The test encoding: GPT-2 pattern, test ranks, `<|endoftext|>` right after them."""
    from data import load_encoding  # imported here so that model tests do not need data.py
    return load_encoding(enc_file)


@pytest.fixture
def closed_url():
    """http://127.0.0.1:PORT where nothing listens: every connection to it is refused."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # the port closes as the block ends


@pytest.fixture
def offline(tmp_path, monkeypatch, closed_url):
    """No internet, for real: every requests.get goes to a closed port on 127.0.0.1 (connection refused),
    and tiktoken's cache is an empty folder (so anything that asked tiktoken for its own `gpt2` would have to
    download it, and fail: the tools read tokenizer/gpt2.tiktoken instead)."""
    import requests
    real_get = requests.get
    monkeypatch.setattr(requests, "get", lambda url, *a, **k: real_get(f"{closed_url}/", *a, **k))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))


def needs(missing):
    """For tests that need what .ci/run installs (root, Debian packages), at the top of their module or in their
    fixture: with `missing` (why they cannot run here), skip them with that reason, except in CI (CI=1), where they
    must run, and fail instead."""
    if not missing:
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"{missing}; CI (.ci/run) provides it")
    pytest.skip(missing, allow_module_level=True)


@pytest.fixture(scope="session")
def closed_network():
    """The prefix of a command that runs it with no network at all: `unshare -n` puts it in a network namespace
    of its own, whose only interface is a loopback that is down. It needs root (needs: skipped without it, except
    in CI)."""
    import subprocess
    try:
        works = subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        works = False
    needs(None if works else "closing the network needs unshare -n, which needs root")
    return ["unshare", "-n"]


# ----------------------------------------------------------------------------- shared by the training tests

def in_process(main, argv, capsys):
    """A tool's main(argv) in this process, where no process is the subject: (its value, or the SystemExit it raised;
    its stdout; its stderr)."""
    capsys.readouterr()
    try:
        result = main(argv)
    except SystemExit as e:
        result = e
    out, err = capsys.readouterr()
    return result, out, err


TOY_VOCAB = 256  # the toy language's ids: a model of 256 ids trains in well under a second per step on a CPU


def write_toy_shards(d):
    """Shards of a learnable toy language in folder d: 40 random 'sentences' of 12 tokens, each opened by token 0,
    drawn at random (test_train's data_dir, byte for byte)."""
    import numpy as np
    from data import write_shard
    rng = np.random.default_rng(0)
    sentences = rng.integers(1, TOY_VOCAB, size=(40, 12))
    tokens = np.concatenate([np.concatenate([[0], sentences[i]]) for i in rng.integers(0, 40, size=3000)])
    write_shard(d / "toy_val_000000.bin", tokens[:4000])
    write_shard(d / "toy_train_000001.bin", tokens[4000:22000])
    write_shard(d / "toy_train_000002.bin", tokens[22000:])
    return str(d)


@pytest.fixture(scope="session")
def toy_shards(tmp_path_factory):
    """The toy shards, written once for every module (tests only read them)."""
    return write_toy_shards(tmp_path_factory.mktemp("toy_shards"))


@pytest.fixture(scope="session")
def unbroken(toy_shards, tmp_path_factory):
    """The run of 2 processes under torchrun (test_faults.args: 40 steps, a checkpoint every 5, and a branch point at
    step 16) that every run broken by a fault, on one host, two or a Slurm node, must end up equal to; made once for
    every module that compares with it, and only read."""
    from test_faults import TORCHRUN, args, run  # the fault tests' command and settings, whose runs it anchors
    out = str(tmp_path_factory.mktemp("unbroken"))
    code, _, err = run(TORCHRUN + ["train.py", *args(toy_shards, out, "--keep_full=16")])
    assert code == 0, err[-3000:]
    return out
