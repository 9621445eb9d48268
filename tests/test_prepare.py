"""prepare.py: downloads against a local HTTP server with injected faults, and tokenisation.

Never the internet: the server below runs on 127.0.0.1 in a thread and serves shards this file writes.
"""
import contextlib
import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import prepare
from conftest import in_process
from engine import data, httpclient, parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def shard_bytes(tokens):
    """A shard in the llm.c format, built by hand: 256 int32 header words, then uint16 tokens."""
    tokens = np.asarray(tokens, dtype="<u2")
    return struct.pack("<3i", 20240520, 1, len(tokens)) + bytes(1012) + tokens.tobytes()


# ---------------------------------------------------------------- the local server

def hub_answer(files, name, query):
    """The Hugging Face Hub's JSON API over the files served as OWNER/NAME/resolve/main/QUOTED_FILENAME:
    api/models?author=USER lists USER's repositories, api/models/OWNER/NAME a repository's files (siblings), with
    their sizes only when blobs=true. (status, JSON object)."""
    repos = {}
    for key, body in files.items():
        owner, repo, rest = (key.split("/", 2) + ["", ""])[:3]
        if rest.startswith("resolve/main/"):
            repos.setdefault(f"{owner}/{repo}", {})[urllib.parse.unquote(rest[len("resolve/main/"):])] = len(body)
    params = urllib.parse.parse_qs(query)
    if name == "api/models":
        return 200, [{"id": r, "modelId": r} for r in sorted(repos) if [r.split("/")[0]] == params.get("author")]
    repo = name[len("api/models/"):]
    if repo not in repos:
        return 404, {"error": "Repository not found"}
    blobs = params.get("blobs") == ["true"]
    return 200, {"id": repo, "siblings": [{"rfilename": f, **({"size": n} if blobs else {})}
                                          for f, n in sorted(repos[repo].items())]}


class Handler(BaseHTTPRequestHandler):
    """GET /<name> for the files in server.files, and the Hub's JSON API over them (hub_answer). Faults, consumed
    one per request, per file (for the API: per path without the query):
    '503'   answer 503 Service Unavailable
    'cut'   announce the full Content-Length, send 80% of it, then drop the connection
    'short' (206 only) a Content-Range announcing a longer file than the body that comes
    'stall' say nothing for longer than the client's read timeout, then hang up
    A file's answer announces its sha256 as the Hub does (X-Linked-Etag), or server.announce[name] instead."""

    def do_GET(self):
        srv, (name, _, query) = self.server, self.path.lstrip("/").partition("?")
        faults = srv.faults.get(name) or []
        fault = faults.pop(0) if faults else None
        rng = self.headers.get("Range")
        if fault == "stall":  # say nothing until the client has given up
            srv.log.append((name, rng, "stall"))
            time.sleep(0.6)
            return
        if fault == "503":
            srv.log.append((name, rng, 503))
            return self.send_error(503)
        if name.startswith("api/models"):
            status, answer = hub_answer(srv.files, name, query)
            srv.log.append((name, query, status))
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return self.wfile.write(body)
        if name not in srv.files:
            srv.log.append((name, rng, 404))
            return self.send_error(404)
        body, start = srv.files[name], 0
        if rng and srv.ranges:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(body):
                srv.log.append((name, rng, 416))
                return self.send_error(416)
            self.send_response(206)
            total = len(body) + (1000 if fault == "short" else 0)
            self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
        else:
            self.send_response(200)
        srv.log.append((name, rng, 206 if rng and srv.ranges else 200))
        data = body[start:]
        self.send_header("X-Linked-Etag", f'"{srv.announce.get(name) or hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if fault == "cut":
                self.wfile.write(data[:len(data) * 4 // 5])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client hung up first
            pass

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.files, srv.faults, srv.log, srv.ranges, srv.announce = {}, {}, [], True, {}
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(httpclient, "BACKOFF", 0.0)
    monkeypatch.setattr(httpclient, "TIMEOUT", (2, 0.3))


def publish(srv, n_train, big=()):
    """Serve the val shard and n_train train shards of random tokens; `big` train indices get
    1.5M tokens (3 MB, several of the client's 1 MB read chunks), the others 20k."""
    rng = np.random.default_rng(0)
    for i, name in enumerate(prepare.shard_names(n_train)):
        srv.files[name] = shard_bytes(rng.integers(0, 50257, 1_500_000 if i in big else 20_000))
    return dict(srv.files)


def entry(body):
    """A manifest's entry of a file's bytes."""
    return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def assert_same_files(data_dir, files, listed=None):
    """data_dir holds files ({name: bytes}) and its manifest, which lists those downloaded (listed: default all)."""
    assert sorted(os.listdir(data_dir)) == sorted([*files, data.MANIFEST])  # nothing else: no .part, no .tmp
    for name, body in files.items():
        assert (data_dir / name).read_bytes() == body, name
    assert data.read_manifest(data_dir) == {n: entry(files[n]) for n in (files if listed is None else listed)}


# ---------------------------------------------------------------- downloads

def test_download_survives_faults(server, tmp_path):
    files = publish(server, 3, big=(1,))
    names = prepare.shard_names(3)
    server.faults = {names[1]: ["cut"], names[2]: ["503", "503"], names[3]: ["cut"], names[0]: ["stall"]}
    stats = prepare.download_shards(tmp_path, train_shards=3, workers=2, base_url=server.url)
    assert_same_files(tmp_path, files)
    assert stats["downloaded"] == 4 and stats["skipped"] == 0
    log = {n: [(r, s) for name, r, s in server.log if name == n] for n in names}
    # the cut 3 MB file resumed where it broke (at least 2 MB of 2.4 MB had arrived), with a 206
    (r0, s0), (r1, s1) = log[names[1]]
    assert r0 is None and s0 == 200 and s1 == 206 and int(r1[6:-1]) >= 2 * 2**20
    assert [s for _, s in log[names[2]]] == [503, 503, 200]
    # cut before one full read chunk arrived: nothing kept, so the retry starts from byte 0
    assert log[names[3]] == [(None, 200), (None, 200)]
    assert log[names[0]] == [(None, "stall"), (None, 200)]  # timed out, then retried


def test_short_body_is_completed_with_a_range_request(server, tmp_path):
    files = publish(server, 1)
    name = prepare.shard_names(1)[1]
    (tmp_path / (name + ".part")).write_bytes(files[name][:5000])  # left by an interrupted run
    server.faults = {name: ["short"]}  # answers bytes 5000- of a 'longer' file
    httpclient.download_file(f"{server.url}/{name}", str(tmp_path / name), check=prepare.valid_shard)
    assert (tmp_path / name).read_bytes() == files[name]
    assert [(r, s) for n, r, s in server.log if n == name] == [("bytes=5000-", 206),
                                                                (f"bytes={len(files[name])}-", 416),
                                                                (None, 200)]
    assert os.listdir(tmp_path) == [name]


def test_leftover_part_file_is_resumed(server, tmp_path):
    files = publish(server, 1)
    name = prepare.shard_names(1)[1]
    (tmp_path / (name + ".part")).write_bytes(files[name][:12345])
    prepare.download_shards(tmp_path, train_shards=1, workers=1, base_url=server.url)
    assert_same_files(tmp_path, files)
    assert ("bytes=12345-", 206) in [(r, s) for n, r, s in server.log if n == name]


def test_server_without_range_support_starts_over(server, tmp_path):
    files = publish(server, 1, big=(1,))
    server.ranges = False
    name = prepare.shard_names(1)[1]
    server.faults = {name: ["cut", "cut"]}
    prepare.download_shards(tmp_path, train_shards=1, workers=2, base_url=server.url)
    assert_same_files(tmp_path, files)
    requests_made = [(r, s) for n, r, s in server.log if n == name]
    assert len(requests_made) == 3 and requests_made[1][0].startswith("bytes=")
    assert all(s == 200 for _, s in requests_made)


def test_present_files_are_skipped_without_a_request(server, tmp_path):
    files = publish(server, 3)
    names = prepare.shard_names(3)
    (tmp_path / names[0]).write_bytes(files[names[0]])
    (tmp_path / names[2]).write_bytes(files[names[2]])
    (tmp_path / names[3]).write_bytes(files[names[3]][:-2])  # truncated copy: fetched again
    stats = prepare.download_shards(tmp_path, train_shards=3, workers=2, base_url=server.url)
    assert sorted(n for n, _, _ in server.log) == [names[1], names[3]]
    assert stats["downloaded"] == 2 and stats["skipped"] == 2
    assert_same_files(tmp_path, files, listed=[names[1], names[3]])


def test_404_names_the_url(server, tmp_path):
    publish(server, 2)
    del server.files["finewebedu_train_000002.bin"]
    with pytest.raises(FileNotFoundError) as e:
        prepare.download_shards(tmp_path, train_shards=2, workers=2, base_url=server.url)
    msg = str(e.value)
    assert msg.startswith(f"{server.url}/finewebedu_train_000002.bin: HTTP 404") and "\n" not in msg
    assert not (tmp_path / "finewebedu_train_000002.bin").exists()
    assert not (tmp_path / "finewebedu_train_000002.bin.part").exists()


def test_invalid_file_is_never_put_in_place(server, tmp_path, monkeypatch):
    monkeypatch.setattr(httpclient, "MAX_TRIES", 3)
    name = prepare.shard_names(1)[1]
    server.files[name] = shard_bytes(np.arange(100))[:-10]  # header says 100 tokens, body has 95
    with pytest.raises(httpclient.DownloadError, match=r"giving up after 3 .*not a valid shard.*expected 1224"):
        httpclient.download_file(f"{server.url}/{name}", str(tmp_path / name), check=prepare.valid_shard)
    assert os.listdir(tmp_path) == []
    assert len(server.log) == 3


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_shard_unlike_the_one_announced_is_deleted_retried_then_refused_in_one_line(how, server, tmp_path,
                                                                                      monkeypatch, capsys):
    """The server announces the sha256 of the shard (as the Hub does) but sends it with a byte flipped, or cut short:
    each attempt starts again from byte 0 (the part deleted), and the third fails in one line; the val shard, sent
    whole, is in place and in the manifest."""
    monkeypatch.setattr(httpclient, "MAX_TRIES", 3)
    files = publish(server, 1)
    name, out = prepare.shard_names(1)[1], tmp_path / "d"
    server.announce[name] = hashlib.sha256(files[name]).hexdigest()
    body = bytearray(files[name])
    body[len(body) // 2] ^= 1
    server.files[name] = bytes(body) if how == "flip" else files[name][:-2]
    result, _, _ = in_process(prepare.main, ["--data_dir", str(out), "--train_shards", "1", "--workers", "1",
                                             "--base_url", server.url], capsys)
    msg = str(result)
    assert msg.startswith(f"prepare.py: error: {server.url}/{name}: giving up after 3 failed attempts in a row (last: "
                          f"downloaded file is ") and "\n" not in msg
    assert (f"its sha256 {hashlib.sha256(body).hexdigest()[:16]}... differs from the "
            f"{server.announce[name][:16]}... the server announced" if how == "flip" else "not a valid shard") in msg
    assert [(r, s) for n, r, s in server.log if n == name] == [(None, 200)] * 3
    assert sorted(os.listdir(out)) == sorted([prepare.shard_names(0)[0], data.MANIFEST])
    assert data.read_manifest(out) == {prepare.shard_names(0)[0]: entry(files[prepare.shard_names(0)[0]])}


def test_persistent_5xx_gives_up(server, tmp_path, monkeypatch):
    monkeypatch.setattr(httpclient, "MAX_TRIES", 4)
    files = publish(server, 1)
    name = prepare.shard_names(1)[1]
    server.faults = {name: ["503"] * 10}
    with pytest.raises(httpclient.DownloadError, match=f"{server.url}/{name}: giving up after 4 .*503"):
        httpclient.download_file(f"{server.url}/{name}", str(tmp_path / name), check=prepare.valid_shard)
    assert len(server.log) == 4 and os.listdir(tmp_path) == []
    assert name in files


@pytest.mark.parametrize("where", ["refused", "no such host"])
def test_unreachable_host_fails_at_once_with_the_offline_hint(where, closed_url, tmp_path, monkeypatch):
    """No connection at all (offline): no retries, no waiting, one line naming the URL and the way out."""
    url = closed_url if where == "refused" else "http://nonexistent.invalid/shards"
    monkeypatch.setattr(httpclient.time, "sleep", lambda s: pytest.fail(f"slept {s}s before retrying"))
    out = tmp_path / "shards"
    with pytest.raises(SystemExit) as e:
        prepare.main(["--data_dir", str(out), "--train_shards", "1", "--workers", "2", "--base_url", url])
    msg = str(e.value)
    assert msg.startswith(f"prepare.py: error: {url}/finewebedu_") and "\n" not in msg
    assert ": cannot connect (" in msg
    assert ("Connection refused" if where == "refused" else "nonexistent.invalid") in msg
    assert msg.endswith(f"without internet, copy the shards into {out} from a machine with internet")
    assert os.listdir(out) == []


def test_download_cli(server, tmp_path, capsys):
    """The command, as a process; then again, and once more with a file gone from the server, in this process."""
    files = publish(server, 2)
    out = tmp_path / "shards"
    argv = ["--data_dir", str(out), "--train_shards", "2", "--workers", "2", "--base_url", server.url]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "downloaded 3 files" in r.stdout
    assert_same_files(out, files)
    prepare.main(argv)  # second run: nothing to do
    printed = capsys.readouterr().out
    assert "downloaded 0 files" in printed and "3 already present" in printed
    assert len(server.log) == 3
    del server.files["finewebedu_train_000002.bin"]
    (out / "finewebedu_train_000002.bin").unlink()
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert str(e.value) == (f"prepare.py: error: {server.url}/finewebedu_train_000002.bin: "
                            f"HTTP 404 Not Found (no such file; check --base_url)")


# ---------------------------------------------------------------- tokenisation

DOCS_JSONL = ["The cat sat on the mat.", "", "héllo wörld — ünïcode ✓ 你好",
              "A line\nwith newlines\n\nand <|endoftext|> written as text.", "  spaces   at the ends  "]
DOCS_GZ = [f"Question: what is {i} plus {i}?\n\nAnswer: {2 * i}" for i in range(40)]
DOC_TXT = "A whole file is one document.\nIt has two lines and the word the in it.\n"


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(DOCS_JSONL):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
        f.write("\n")  # a trailing blank line is not a document
    with gzip.open(src / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS_GZ)
    (src / "c.txt").write_text(DOC_TXT, encoding="utf-8")
    return [str(src / "a.jsonl"), str(src / "b.jsonl.gz"), str(src / "c.txt")]


def expected_stream(enc):
    eot = enc.encode("<|endoftext|>", allowed_special="all")
    assert eot == [enc.n_vocab - 1]
    out = []
    for doc in DOCS_JSONL + DOCS_GZ + [DOC_TXT]:
        out += eot + enc.encode_ordinary(doc)
    return out


def read_tokens(path):
    raw = open(path, "rb").read()
    magic, version, ntok = struct.unpack("<3i", raw[:12])
    assert (magic, version) == (20240520, 1) and raw[12:1024] == bytes(1012)
    assert len(raw) == 1024 + 2 * ntok
    return np.frombuffer(raw[1024:], dtype="<u2").tolist()


@pytest.mark.parametrize("val_tokens", [20, 10**6])  # exactly 20, or capped at a tenth
def test_tokenize_exact_tokens_and_sharding(inputs, tmp_path, enc, enc_file, val_tokens):
    expected = expected_stream(enc)
    n_val = min(val_tokens, len(expected) // 10)
    out = tmp_path / "mydata"
    res = prepare.tokenize(inputs, out, shard_tokens=150, val_tokens=val_tokens, workers=1,
                           tokenizer=enc_file)
    assert res["documents"] == len(DOCS_JSONL) + len(DOCS_GZ) + 1 and res["tokens"] == len(expected)
    n_train = -(-(len(expected) - n_val) // 150)
    names = ["mydata_val_000000.bin"] + [f"mydata_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    assert sorted(os.listdir(out)) == sorted(names + [data.MANIFEST])  # default name: the data_dir's basename
    assert data.read_manifest(out) == {n: entry((out / n).read_bytes()) for n in names}  # each as it was written
    assert read_tokens(out / names[0]) == expected[:n_val]
    train = [read_tokens(out / n) for n in names[1:]]
    assert all(len(t) == 150 for t in train[:-1]) and 0 < len(train[-1]) <= 150
    assert sum(train, []) == expected[n_val:]


def test_tokenize_bytes_do_not_depend_on_workers(inputs, tmp_path, enc_file, monkeypatch):
    monkeypatch.setattr(data, "BATCH_CHARS", 100)  # many small tasks, so the 3 workers interleave
    for w in (1, 3):
        prepare.tokenize(inputs * 3, tmp_path / f"w{w}", name="x", shard_tokens=200, val_tokens=50,
                         workers=w, tokenizer=enc_file)
    names = sorted(os.listdir(tmp_path / "w1"))
    assert len(names) > 5 and names == sorted(os.listdir(tmp_path / "w3"))
    for n in names:
        assert (tmp_path / "w1" / n).read_bytes() == (tmp_path / "w3" / n).read_bytes()


def test_tokenize_cli(inputs, tmp_path, enc, enc_file):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "prepare.py"), "--tokenize", *inputs, "--data_dir", str(out),
           "--name", "tiny", "--shard_tokens", "1000", "--val_tokens", "30", "--workers", "2",
           "--tokenizer", str(enc_file)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    expected = expected_stream(enc)
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"46 documents, {len(expected):,} tokens (30 val, ") and last.count("tokens/s") == 1
    assert read_tokens(out / "tiny_val_000000.bin") == expected[:30]
    assert read_tokens(out / "tiny_train_000001.bin") == expected[30:1030]
    with pytest.raises(SystemExit) as e:  # refuses to overwrite (in this process)
        prepare.main(cmd[2:])
    assert "already holds tiny_*.bin shards" in str(e.value) and "\n" not in str(e.value)


def _bad_input(tmp_path, kind):
    p = tmp_path / {"missing": "nope.jsonl", "empty": "empty.txt", "ext": "doc.md", "json": "bad.jsonl",
                    "field": "nofield.jsonl", "gzip": "notgz.jsonl.gz", "utf8": "latin1.txt",
                    "blank": "blank.jsonl", "dir": "adir.jsonl"}[kind]
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "ext":
        p.write_text("# hi")
    elif kind == "json":
        p.write_text('{"text": "ok"}\n{"text": oops}\n')
    elif kind == "field":
        p.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    elif kind == "gzip":
        p.write_bytes(b"this is not gzip data")
    elif kind == "utf8":
        p.write_bytes("café".encode("latin-1"))
    elif kind == "blank":
        p.write_text("\n\n  \n")
    elif kind == "dir":
        p.mkdir()
    return str(p)


@pytest.mark.parametrize("kind, exc, match", [
    ("missing", FileNotFoundError, "nope.jsonl: no such file"),
    ("empty", ValueError, "empty.txt: empty file"),
    ("ext", ValueError, "doc.md: unknown input type"),
    ("json", ValueError, "bad.jsonl:2: not valid JSON"),
    ("field", ValueError, 'nofield.jsonl:2: expected a JSON object with a "text" string'),
    ("gzip", ValueError, "notgz.jsonl.gz: unreadable"),
    ("utf8", ValueError, "latin1.txt: not UTF-8 text"),
    ("blank", ValueError, "blank.jsonl: no documents in it"),
    ("dir", ValueError, "adir.jsonl: not a regular file"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_tokenize_bad_input(inputs, tmp_path, enc_file, kind, exc, match, workers):
    """Refused in one line, nothing left; with workers, under train.py's stop-signal handlers (as it builds the
    corpus), which the pool's workers must not inherit: Pool.terminate ends them with SIGTERM."""
    bad = _bad_input(tmp_path, kind)
    out = tmp_path / "out"
    with pytest.raises(exc, match=match) as e, parallel.StopSignals() if workers > 1 else contextlib.nullcontext():
        prepare.tokenize(inputs + [bad], out, shard_tokens=50, val_tokens=10, workers=workers,
                         tokenizer=enc_file)
    assert "\n" not in str(e.value)
    assert not out.exists() or os.listdir(out) == []  # nothing half-done, no staging folder left


def test_tokenize_option_errors(inputs, tmp_path, enc, enc_file):
    with pytest.raises(ValueError, match="--shard_tokens 0"):
        prepare.tokenize(inputs, tmp_path / "o", shard_tokens=0, tokenizer=enc_file)
    with pytest.raises(ValueError, match="--name 'a_val': must be"):
        prepare.tokenize(inputs, tmp_path / "o", name="a_val", tokenizer=enc_file)
    with pytest.raises(ValueError, match="not a readable .tiktoken ranks file"):
        prepare.tokenize(inputs, tmp_path / "o", tokenizer=inputs[2])
    (tmp_path / "one.txt").write_text("the")
    n = 1 + len(enc.encode_ordinary("the"))
    with pytest.raises(ValueError, match=f"only {n} tokens in the inputs"):
        prepare.tokenize([str(tmp_path / "one.txt")], tmp_path / "o", tokenizer=enc_file)
    assert os.listdir(tmp_path / "o") == []


def test_tokenize_offline_takes_the_shipped_gpt2_tokenizer(inputs, tmp_path, offline):
    """With the network closed, the default tokenizer is tokenizer/gpt2.tiktoken: GPT-2's ids, nothing downloaded."""
    prepare.tokenize(inputs, tmp_path / "o", val_tokens=10, workers=2)
    written = read_tokens(tmp_path / "o" / "o_val_000000.bin") + read_tokens(tmp_path / "o" / "o_train_000001.bin")
    assert written == expected_stream(data.load_encoding(data.TOKENIZER)) and max(written) == 50256


def test_stdlib_cli_builds_the_corpus_from_a_library_folder(tmp_path, capsys):
    from tests.test_data import make_library
    (tmp_path / "lib").mkdir()
    documents = make_library(tmp_path / "lib")
    prepare.main(["--stdlib", str(tmp_path / "lib"), "--data_dir", str(tmp_path / "d" / "stdlib"), "--workers", "1"])
    assert capsys.readouterr().out.startswith(f"built {tmp_path / 'd' / 'stdlib'}: {len(documents)} documents")
    assert sorted(os.listdir(tmp_path / "d" / "stdlib")) == ["corpus.json", "manifest.json",
                                                             "stdlib_train_000001.bin", "stdlib_val_000000.bin"]
    with pytest.raises(SystemExit, match="stdlib: already exists; remove it to build the corpus again"):
        prepare.main(["--stdlib", str(tmp_path / "lib"), "--data_dir", str(tmp_path / "d" / "stdlib")])
    with pytest.raises(SystemExit, match=f"{tmp_path / 'none'}: no such Python library folder"):
        prepare.main(["--stdlib", str(tmp_path / "none"), "--data_dir", str(tmp_path / "e" / "stdlib")])
    assert not (tmp_path / "e" / "stdlib").exists()


def test_the_built_in_corpus_takes_a_tokenizer_and_records_it(tmp_path, capsys):
    """prepare.py --stdlib --tokenizer: the corpus of another tokenizer (here the 256 bytes), into a folder of any
    name, its manifest naming the tokenizer, which train.py then takes."""
    from tests.test_data import make_library
    (tmp_path / "lib").mkdir()
    make_library(tmp_path / "lib")
    ranks = os.path.join(os.path.dirname(data.TOKENIZER), "bytes.tiktoken")
    prepare.main(["--stdlib", str(tmp_path / "lib"), "--data_dir", str(tmp_path / "stdlib_bytes"), "--workers", "1",
                  "--tokenizer", ranks])
    assert data.data_tokenizer(tmp_path / "stdlib_bytes") == data.read_tokenizer(ranks)
    tokens = read_tokens(tmp_path / "stdlib_bytes" / "stdlib_bytes_train_000001.bin")
    assert max(tokens) == 256 and tokens[0] == 256  # each document opened by <|endoftext|>, the bytes below it


@pytest.mark.parametrize("argv, message", [
    (["--tokenize", "a.txt"], "--tokenize needs --data_dir"),
    (["--tokenizer", "t.tiktoken"], "--tokenizer only applies with --tokenize or --stdlib"),
    (["--name", "x"], "--name only applies with --tokenize"),
    (["--tokenize", "a.txt", "--data_dir", "d", "--base_url", "http://x"], "--base_url is for downloads"),
    (["--stdlib", "--tokenize", "a.txt"], "--stdlib builds the built-in corpus; --tokenize does not apply to it"),
    (["--stdlib", "--train_shards", "2"], "--stdlib builds the built-in corpus; --train_shards does not apply"),
    (["--verify"], "--verify takes --data_dir alone"),
    (["--verify", "--data_dir", "d", "--tokenize", "a.txt"], "--verify takes --data_dir alone"),
])
def test_cli_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        prepare.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--train_shards", "100"], "--train_shards 100: the dataset has 0 to 99"),
    (["--base_url", "ftp://mirror"], "--base_url ftp://mirror: expected an http:// or https:// URL"),
    (["--workers", "0"], "--workers 0: need at least 1"),
])
def test_cli_download_option_errors(argv, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        prepare.main(argv + ["--data_dir", str(tmp_path / "d")])
    assert str(e.value) == f"prepare.py: error: {message}"
    assert not (tmp_path / "d").exists()
