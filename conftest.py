"""Shared test fixtures: a small GPT-2-style tokenizer built here (fast to load, with few enough ids for tiny
models), a closed network, what tests that need root or Debian's packages do without them, and the toy shards and
the unbroken 2-process run that several modules' training tests share, made once per session (made_once: once for
all of pytest-xdist's workers, which pytest.ini starts, one per CPU)."""
import base64
import fcntl
import os
import shutil
import tempfile

import pytest


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: a worker per CPU that this process may use (a container's or a Slurm job's share, which
    sched_getaffinity gives; pytest-xdist would count the machine's)."""
    return len(os.sched_getaffinity(0))


def pytest_configure(config):
    """inductor compiles in the process that asks: its pool of compile processes, each importing torch, costs more to
    start than it saves on the tests' small graphs (12 processes, about 25 CPU-s of the suite on 2 cores). In a worker,
    torch's threads, in it and in every process its tests start (torchrun's, mp.spawn's), are its share of the CPUs:
    N workers would otherwise start N threads a process for N cores, which spin as they wait for each other."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # inductor's on-disk cache does not key its C++ kernels by ATEN_CPU_CAPABILITY: after a run on the native kernels,
    # a run under ATEN_CPU_CAPABILITY=default reused AVX-512 kernels that no longer compile (6 compile tests failed,
    # "'at::vec' has not been declared"; with a cold cache they pass), so a forced capability gets a cache of its own
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{capability}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if workers:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
    from engine.data import load_encoding  # imported here so that model tests do not need data.py
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

def made_once(tmp_path_factory, name, make):
    """The folder `name`, which make(folder) fills once for the whole session: by the first of pytest-xdist's workers
    that asks (the others wait for it, and read the same folder), or in this process without workers. For what tests
    only read; a make that fails leaves no folder, and the next worker that asks tries again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            made.touch()
    return str(folder)


def spawn(fn, args, nprocs):
    """torch.multiprocessing.spawn(fn, args, nprocs=nprocs), its processes forked from a server that imported fn's
    module once (multiprocessing's forkserver), instead of each importing torch and the test modules anew (about 3
    CPU-s a process on 2 cores). The server computes nothing, so a fork of it holds no OpenMP threads (a fork of
    pytest's own process can deadlock in them)."""
    import multiprocessing

    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload([fn.__module__])  # read as the server starts: once a process
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


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

    from engine.data import write_shard
    rng = np.random.default_rng(0)
    sentences = rng.integers(1, TOY_VOCAB, size=(40, 12))
    tokens = np.concatenate([np.concatenate([[0], sentences[i]]) for i in rng.integers(0, 40, size=3000)])
    write_shard(d / "toy_val_000000.bin", tokens[:4000])
    write_shard(d / "toy_train_000001.bin", tokens[4000:22000])
    write_shard(d / "toy_train_000002.bin", tokens[22000:])
    return str(d)


@pytest.fixture(scope="session")
def toy_shards(tmp_path_factory):
    """The toy shards, written once for every module and worker (tests only read them)."""
    return made_once(tmp_path_factory, "toy_shards", write_toy_shards)


@pytest.fixture(scope="session")
def unbroken(toy_shards, tmp_path_factory):
    """The run of 2 processes under torchrun (test_faults.args: 40 steps, a checkpoint every 5, and a branch point at
    step 16) that every run broken by a fault, on one host, two or a Slurm node, must end up equal to; made once for
    every module and worker that compares with it, and only read."""
    from tests.test_faults import TORCHRUN, args, run  # the fault tests' command and settings, whose runs it anchors

    def make(out):
        code, _, err = run(TORCHRUN + ["train.py", *args(toy_shards, str(out), "--keep_full=16")])
        assert code == 0, err[-3000:]

    return made_once(tmp_path_factory, "unbroken", make)
