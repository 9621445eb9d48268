"""hf.py and convert.py --to_hf / --push: the Hugging Face folder of a model, read back by transformers
(AutoModelForCausalLM, its tokenizer, generation, lm-evaluation-harness's own `hf` model) and by our tools
(convert.py, eval.py, sample.py, analyze.py), from a folder or a Hub repository; pushed to a local server that
speaks the Hub's upload API. transformers, safetensors and huggingface_hub are optional: without them these tests
skip, except in CI (.ci/run installs them), where they fail; the tests of what each command says without them run
everywhere (the packages hidden)."""
import base64
import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import pickle
import sys
import tempfile

import pytest
import torch

import eval as ev
import sample
from engine import hf, httpclient
from engine.checkpoint import load_model
from engine.data import TOKENIZER, read_tokenizer
from model import GPT, generate
from test_model import FAMILIES, randomize, variant
from tests.test_convert import EXO, random_model, their_checkpoint
from tests.test_eval import small_data
from tests.test_prepare import Handler, server  # noqa: F401  (fixture: the local Hub, GET side)
from tests.test_train import data_dir, recorded_data  # noqa: F401  (fixtures: toy token shards, and with a tokenizer)
from tools import analyze, convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
PACKAGES = ("transformers", "safetensors", "huggingface_hub")
if os.environ.get("CI"):
    for name in PACKAGES + ("lm_eval", "accelerate"):  # CI installs them: missing is a failure there
        __import__(name)
HAVE = all(importlib.util.find_spec(name) for name in PACKAGES)
needs_hf = pytest.mark.skipif(not HAVE, reason=f"needs {', '.join(PACKAGES)} ({hf.PIP})")
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="hf_modules"))  # transformers' copies of remote
# code: read when transformers is first imported, below, so never the user's ~/.cache
TEXTS = ["The cat sat on the mat.", "  and the  question\n\nis in the end ", "Question: 12 + 30 = 42?", "héllo wörld"]


def tiny(name="dyn_exo", seed=0, **size):
    """A random model of a config file's variant, vocabulary 320: more rows than the test tokenizer's 291 ids."""
    return randomize(GPT(variant(name, **{"vocab_size": 320, "n_layer": 2, **size})), seed=seed).eval()


def save(model, path, step=7, **extra):
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "step": step,
                **extra}, path)
    return str(path)


@pytest.fixture(scope="module")
def tf():
    """transformers, imported once for the module (seconds)."""
    pytest.importorskip("transformers")
    import transformers
    transformers.logging.set_verbosity_error()  # its progress bars and notes
    return transformers


def export(model, folder, enc_file, **extra):
    src = save(model, os.path.join(os.path.dirname(folder), os.path.basename(folder) + ".pt"), **extra)
    convert.main([src, "--to_hf", str(folder), "--tokenizer", str(enc_file)])
    return str(folder)


def from_pretrained(tf, folder):
    return tf.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


# ----------------------------------------------------------------------------- transformers reads the folder

@needs_hf
@pytest.mark.parametrize("name", FAMILIES + ["dyn_nuresformer_e"])
def test_transformers_gives_our_logits_and_loss(name, tf, tmp_path, enc_file):
    model = tiny(name)
    theirs = from_pretrained(tf, export(model, tmp_path / "hf", enc_file))
    idx = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = theirs(idx, labels=idx)
        torch.testing.assert_close(out.logits, model(idx)[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.loss, model(idx[:, :-1], idx[:, 1:])[1], rtol=0, atol=1e-6)
    assert theirs.dtype == torch.float32 and not theirs.config.tie_word_embeddings
    assert theirs.gpt.lm_head.weight.data_ptr() != theirs.gpt.wte.weight.data_ptr()  # loaded untied


@needs_hf
def test_a_head_tied_to_the_embedding_exports_as_two_tensors(tf, tmp_path, enc_file):
    model = tiny("gated")
    model.lm_head.weight = model.wte.weight  # one tensor under two names: safetensors refuses shared memory
    theirs = from_pretrained(tf, export(model, tmp_path / "hf", enc_file))
    idx = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx)[0], rtol=0, atol=1e-6)


@needs_hf
def test_greedy_generation_through_transformers_is_sample_pys(tf, tmp_path, enc_file, capsys):
    """Past block_size (32) too, with and without the cache; the padded rows (ids 291-319), where this model's
    largest logits are, are never produced, as sample.py never samples them; <|endoftext|> ends transformers'."""
    model = tiny("dyn_exo", seed=2)
    with torch.no_grad():
        model.lm_head.weight[291:] += 3 * model.lm_head.weight[291:].sign()
    folder = export(model, tmp_path / "hf", enc_file)
    theirs = from_pretrained(tf, folder)
    prompt = "the question is"
    ours = sample.main([folder, "--prompt", prompt, "--temperature", "0", "--num_samples", "1", "--max_new_tokens",
                        "40", "--tokenizer", str(enc_file)])[0].tolist()
    ids = tf.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)(prompt, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == ours[:len(ids["input_ids"][0])]
    eot = ours.index(290) + 1 if 290 in ours else len(ours)  # transformers stops after <|endoftext|>
    for use_cache in (True, False):
        got = theirs.generate(**ids, max_new_tokens=40, do_sample=False, use_cache=use_cache)[0].tolist()
        assert got == ours[:eot]
    assert len(ours) > 32 and max(ours) < 291
    unmasked = generate(model, torch.tensor([ours[:5]]), 20, temperature=0)[0].tolist()
    assert max(unmasked) >= 291  # without the suppression, the padded rows would win


@needs_hf
def test_tokenizer_encodes_like_tiktoken(tf, tmp_path, enc, enc_file):
    folder = export(tiny("gated"), tmp_path / "hf", enc_file)
    tok = tf.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    for text in TEXTS:
        ids = enc.encode_ordinary(text)
        assert tok(text)["input_ids"] == ids and tok.decode(ids) == text
    assert tok.eos_token_id == tok.bos_token_id == enc.eot_token == 290
    assert tok("a<|endoftext|>b")["input_ids"] == enc.encode_ordinary("a") + [290] + enc.encode_ordinary("b")


def test_bpe_merges_recover_the_merge_order(enc):
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.eot_token)}
    merges = hf.bpe_merges(ranks)
    assert len(merges) == len(ranks) - 256 - 1  # one per token beyond the bytes, but " Question": no pair of
    # tokens makes it, so only a piece " Question" of its own gives it (tiktoken's lookup, and ignore_merges)
    assert not any(a + b == b" Question" for a, b in merges)
    assert merges[:3] == [(b" ", b"t"), (b"h", b"e"), (b" t", b"he")]  # " the" from " t" + "he", both earlier
    assert all(ranks[a] < ranks[a + b] and ranks[b] < ranks[a + b] for a, b in merges)
    mapping = hf.bytes_to_unicode()
    assert len(set(mapping.values())) == 256 and mapping[ord("!")] == "!" and mapping[ord(" ")] == "Ġ"


@needs_hf
def test_the_model_cards_three_lines_run(tf, tmp_path, enc_file):
    folder = export(tiny("dyn_exo"), tmp_path / "hf", enc_file, config={"total_batch_size": 128})
    card = open(os.path.join(folder, "README.md")).read()
    code = card.split("```python\n")[1].split("```")[0]
    assert len(code.strip().splitlines()) == 3 and f'model="{folder}"' in code
    assert "| training tokens | 896 |" in card and "| steps | 7 |" in card and "arXiv:2601.08131" in card
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue().startswith("The theory of") and len(printed.getvalue()) > len("The theory of\n")


# ----------------------------------------------------------------------------- lm-evaluation-harness's hf model

@needs_hf
def test_lm_eval_hf_model_gives_eval_pys_accuracies(tf, tmp_path, enc, enc_file):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from tests.test_harness import offline_env, without_env_info, write_tasks
    with pytest.MonkeyPatch.context() as mp:
        for k, v in offline_env(tmp_path / "hfhome").items():
            mp.setenv(k, v)
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        without_env_info(mp)
        small_data(str(tmp_path / "data"), n_eval=12, n_pool=12)
        write_tasks(str(tmp_path / "tasks"), str(tmp_path / "data"))
        model = tiny("dyn_exo", seed=3, block_size=64)
        folder = export(model, tmp_path / "hf", enc_file)
        lm = HFLM(pretrained=folder, trust_remote_code=True, backend="causal", device="cpu", batch_size=8)
        tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
        out = lm_eval.simple_evaluate(model=lm, tasks=["arc_easy_local", "piqa_local"], num_fewshot=2,
                                      task_manager=tasks)
    for task in ("arc_easy", "piqa"):
        t = ev.TASKS[task]
        docs = ev.read_rows(os.path.join(tmp_path, "data", task, f"{t.split}.jsonl"), t.fields)
        pool = ev.read_rows(os.path.join(tmp_path, "data", task, f"{t.pool_split}.jsonl"), t.fields)
        ours = ev.evaluate_task(task, docs, pool, enc, model, shots=2, progress=False)[0]
        got = out["results"][f"{task}_local"]
        assert (got["acc,none"], got["acc_norm,none"], got["sample_len"]) == (ours["acc"], ours["acc_norm"], 12)
        assert 0 < ours["acc"] < 1


# ----------------------------------------------------------------------------- back again

@needs_hf
def test_round_trip_to_a_checkpoint_is_bitwise(tmp_path, enc_file, capsys):
    model = tiny("dyn_exo")
    src = save(model, tmp_path / "ckpt.pt", step=9, config={"doc_mask": True, "total_batch_size": 128},
               optimizers=[{}])
    convert.main([src, "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file)])
    convert.main([str(tmp_path / "hf"), "--out", str(tmp_path / "back.pt")])
    back, orig = torch.load(tmp_path / "back.pt", weights_only=True), torch.load(src, weights_only=True)
    assert back["model"].keys() == orig["model"].keys()
    assert all(torch.equal(back["model"][k], v) and back["model"][k].dtype == v.dtype for k, v in
               orig["model"].items())
    assert (back["model_config"], back["step"], back["config"]) == (orig["model_config"], 9, orig["config"])
    assert "Dynamic E-ExoFormer" in capsys.readouterr().out
    # the folder records the tokenizer its tokenizer.json holds (the one given, for a checkpoint that records none),
    # and a checkpoint that records one exports it with no --tokenizer, another refused in one line
    assert back["tokenizer"] == read_tokenizer(enc_file)
    convert.main([str(tmp_path / "back.pt"), "--to_hf", str(tmp_path / "hf2")])
    assert hf.read_folder(str(tmp_path / "hf2"))["tokenizer"] == read_tokenizer(enc_file)
    with pytest.raises(SystemExit, match=r"^convert.py: error: --tokenizer .*gpt2.tiktoken: .*, but .*back.pt was "
                                         r"trained with test.tiktoken"):
        convert.main([str(tmp_path / "back.pt"), "--to_hf", str(tmp_path / "hf3"), "--tokenizer", TOKENIZER])


@needs_hf
def test_the_authors_checkpoint_exports_too(tf, tmp_path, enc_file):
    m = random_model(**EXO, granularity="elementwise", anchor_norm=True, dynamic=True)
    src = tmp_path / "ckpt_step:38146.pt"
    torch.save(their_checkpoint(m, "model4", "_orig_mod."), src)
    card = convert.to_hf(str(src), str(tmp_path / "hf"), str(enc_file))
    assert card["tokens"] == 38146 * 262144 and card["step"] == 38146
    idx = torch.randint(0, 57601, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tf, str(tmp_path / "hf"))(idx).logits, m(idx)[0], rtol=0,
                                   atol=1e-6)


@needs_hf
def test_the_folder_holds_no_pickle_and_loading_unpickles_nothing(tf, tmp_path, enc_file, monkeypatch):
    model = tiny("exoformer_h")
    folder = export(model, tmp_path / "hf", enc_file)
    for name in os.listdir(folder):
        head = open(os.path.join(folder, name), "rb").read(4)
        assert not head.startswith((b"PK", b"\x80")), name  # neither torch.save's zip nor a bare pickle
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "generation_config.json", "model.py",
                                          "model.safetensors", "modeling_exoformer.py", "tokenizer.json",
                                          "tokenizer_config.json"]

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")
    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(torch._weights_only_unpickler, "Unpickler", refuse)
    ours, ckpt = load_model(folder)
    theirs = from_pretrained(tf, folder)
    idx = torch.randint(0, 320, (1, 10))
    with torch.no_grad():
        assert torch.equal(ours(idx)[0], model(idx)[0])
        torch.testing.assert_close(theirs(idx).logits, model(idx)[0], rtol=0, atol=1e-6)
    assert ckpt["step"] == 7


@needs_hf
def test_every_tool_reads_a_folder_and_a_hub_repository(server, tmp_path, enc_file, capsys, monkeypatch,
                                                        recorded_data):
    model = tiny("dyn_exo")
    folder = export(model, tmp_path / "hf", enc_file)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            server.files[f"me/tiny/resolve/main/{name}"] = f.read()
    server.faults["me/tiny/resolve/main/model.safetensors"] = ["cut"]  # resumed
    monkeypatch.setattr(httpclient, "BACKOFF", 0.0)
    monkeypatch.setattr(hf, "HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    args = ["--prompt", "the", "--temperature", "0", "--num_samples", "1", "--max_new_tokens", "5", "--tokenizer",
            str(enc_file)]
    assert torch.equal(sample.main([folder, *args]), sample.main(["me/tiny", *args]))
    assert sorted(os.listdir(tmp_path / "hub" / "me" / "tiny")) == ["config.json", "model.safetensors"]
    requests_made = len(server.log)
    sample.main(["me/tiny", *args])  # downloaded before: no request
    assert len(server.log) == requests_made and "downloaded before" in capsys.readouterr().out
    small_data(str(tmp_path / "data"))
    for src in (folder, "me/tiny"):
        ev.main([src, "--tokenizer", str(enc_file), "--data_dir", str(tmp_path / "data"), "--limit", "2", "--tasks",
                 "piqa", "--device", "cpu"])
        assert "average" in capsys.readouterr().out
    # the folder records the tokenizer it was exported with: analyze.py reads data that the same one made
    res = analyze.main([folder, "--data_dir", recorded_data, "--tokens", "64", "--out", str(tmp_path / "analysis")])
    assert res[folder]["variant"] == "Dynamic E-ExoFormer" and res[folder]["doc_mask"] is True
    msg = sample_error(["me/none", *args])
    assert msg.startswith("sample.py: error: me/none: no such local file or folder; as a Hub repository: ") and \
        "HTTP 404" in msg


def sample_error(argv):
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    assert "\n" not in str(e.value)
    return str(e.value)


@needs_hf
def test_a_hub_repository_without_a_folder_is_one_line(server, tmp_path, monkeypatch, enc_file):
    server.files["me/pt/resolve/main/ckpt.pt"] = b"x"
    monkeypatch.setattr(hf, "HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    msg = sample_error(["me/pt", "--tokenizer", str(enc_file)])
    assert "me/pt: no model.safetensors or config.json among its files (ckpt.pt)" in msg
    assert not os.path.exists(tmp_path / "hub" / "me" / "pt")


# ----------------------------------------------------------------------------- errors, and the packages missing

@needs_hf
def test_export_errors_are_one_line_and_write_nothing(tmp_path, enc_file, monkeypatch, capsys):
    src = save(tiny("gated", vocab_size=200), tmp_path / "small.pt")  # fewer rows than the tokenizer's 291 ids
    with pytest.raises(SystemExit, match=r"^convert.py: error: --tokenizer has 291 tokens, the model only "
                                         r"vocab_size=200$"):
        convert.main([src, "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file)])
    assert os.listdir(tmp_path) == ["small.pt"]  # no folder, no temporary one
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("x")
    src = save(tiny("gated"), tmp_path / "ok.pt")
    capsys.readouterr()
    with pytest.raises(SystemExit, match="exists and is not a folder written by --to_hf"):
        convert.main([src, "--to_hf", str(tmp_path / "notes"), "--tokenizer", str(enc_file)])
    assert os.listdir(tmp_path / "notes") == ["mine.txt"] and capsys.readouterr().out == ""  # before any reading
    for argv, message in [([src, "--push", "a/b"], "--push and --tokenizer go with --to_hf"),
                          ([src, "--to_hf", "x", "--push", "ab"], "--push ab: expected a Hub repository OWNER/NAME")]:
        with pytest.raises(SystemExit):
            convert.main(argv)
    convert.main([src, "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file)])
    convert.main([src, "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file)])  # replaced whole
    assert sorted(os.listdir(tmp_path)) == ["hf", "notes", "ok.pt", "small.pt"]
    assert all(os.stat(tmp_path / "hf" / n).st_mode & 0o777 == os.stat(tmp_path / "hf" / "config.json").st_mode
               & 0o777 for n in os.listdir(tmp_path / "hf"))  # the weights as readable as the other files


@needs_hf  # each one hidden, the others there
@pytest.mark.parametrize("hidden", ["safetensors", "tokenizers", "huggingface_hub"])
def test_without_the_packages_each_command_says_what_to_install(hidden, tmp_path, enc_file, monkeypatch):
    src = save(tiny("gated"), tmp_path / "ckpt.pt")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "exoformer", **dataclasses.asdict(tiny().config)}))
    (folder / "model.safetensors").write_bytes(b"")
    hide(monkeypatch, hidden)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    runs = {"safetensors": [lambda: convert.main([src, "--to_hf", str(tmp_path / "o")]),
                            lambda: sample.main([str(folder), "--tokenizer", str(enc_file)])],
            "tokenizers": [lambda: convert.main([src, "--to_hf", str(tmp_path / "o")])],
            "huggingface_hub": [lambda: convert.main([src, "--to_hf", str(tmp_path / "o"), "--push", "me/m"])]}
    for run in runs[hidden]:
        with pytest.raises(SystemExit) as e:
            run()
        assert str(e.value).endswith(f"needs {hidden}, which is not installed: {hf.PIP}") and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "o")


def hide(monkeypatch, package):
    """import package (and its submodules) fails from now on, as if it were not installed."""
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@needs_hf
def test_our_tools_need_no_transformers(tmp_path, enc_file, monkeypatch):
    model = tiny("exoformer_h")
    hide(monkeypatch, "transformers")
    folder = export(model, tmp_path / "hf", enc_file)
    idx = torch.randint(0, 320, (1, 10))
    assert torch.equal(load_model(folder)[0](idx)[0], model(idx)[0])


# ----------------------------------------------------------------------------- --push

class HubUpload(Handler):
    """The Hub's upload API as huggingface_hub speaks it (without Xet): create a repository, preupload (which files
    go to LFS), the LFS batch API and its PUTs (each checked against its sha256), the commit (NDJSON: a header,
    regular files inline in base64, LFS files by oid). A commit whose every file has arrived whole becomes a
    revision, whose files are then served for download like the GET side's. Faults (server.faults), per endpoint:
    'cut' reads the request and drops the connection without answering."""

    def do_POST(self):
        srv, path = self.server, self.path.lstrip("/").split("?")[0]
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        srv.log.append(("POST", path, self.headers.get("Authorization")))
        faults = srv.faults.get(path) or []
        if faults and faults.pop(0) == "cut":
            self.close_connection = True
            return
        if path == "api/repos/create":
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            srv.revisions.setdefault(repo, [])
            return self.answer(200, {"url": f"{srv.url}/{repo}", "name": repo})
        if path == "api/validate-yaml":
            return self.answer(200, {"errors": [], "warnings": []})
        if path.endswith("/preupload/main"):
            files = json.loads(body)["files"]
            return self.answer(200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                                "uploadMode": "lfs" if f["path"].endswith(".safetensors")
                                                else "regular"} for f in files]})
        if path.endswith(".git/info/lfs/objects/batch"):
            objs = json.loads(body)["objects"]
            return self.answer(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "actions": {"upload": {"href": f"{srv.url}/lfs/{o['oid']}"}}}
                for o in objs]})
        if path.endswith("/commit/main"):
            return self.commit(path[len("api/models/"):-len("/commit/main")], body)
        self.answer(404, {"error": f"no such endpoint {path}"})

    def commit(self, repo, body):
        srv, files = self.server, {}
        for line in body.decode().splitlines():
            entry = json.loads(line)
            value = entry["value"]
            if entry["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif entry["key"] == "lfsFile":
                if value["oid"] not in srv.lfs:
                    return self.answer(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = srv.lfs[value["oid"]]
        srv.revisions[repo].append(files)
        for name, data in files.items():
            srv.files[f"{repo}/resolve/main/{name}"] = data
        self.answer(200, {"commitUrl": f"{srv.url}/{repo}/commit/{len(srv.revisions[repo])}",
                          "commitOid": f"{len(srv.revisions[repo]):040x}"})

    def do_PUT(self):
        srv, oid = self.server, self.path.rsplit("/", 1)[1]
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        srv.log.append(("PUT", oid, None))
        if hashlib.sha256(body).hexdigest() == oid:
            srv.lfs[oid] = body
        self.answer(200, {})

    def answer(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def hub(server, monkeypatch, tmp_path):
    """The local server with the upload API, huggingface_hub on its LFS path (no Xet) and without any token."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    server.RequestHandlerClass = HubUpload
    server.revisions, server.lfs = {}, {}
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # .ci/run sets it: this Hub is local
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no_tokens"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    return server


@needs_hf
def test_push_uploads_every_file_whole_in_one_revision(hub, tmp_path, enc_file, monkeypatch, capsys):
    src = save(tiny("dyn_exo"), tmp_path / "ckpt.pt")
    argv = [src, "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file), "--push", "me/tiny",
            "--base_url", hub.url]
    with pytest.raises(SystemExit, match=r"^convert.py: error: --push needs a Hub token with write access: set "
                                         r"HF_TOKEN or run `hf auth login`$"):
        convert.main(argv)
    assert hub.log == [] and not os.path.exists(tmp_path / "hf")  # checked before any work
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.faults["api/models/me/tiny/commit/main"] = ["cut"]
    with pytest.raises(SystemExit, match=r"the upload failed, and the Hub holds no new revision .* the same command"):
        convert.main(argv)
    assert hub.revisions == {"me/tiny": []} and ("PUT", hashlib.sha256(
        (tmp_path / "hf" / "model.safetensors").read_bytes()).hexdigest(), None) in hub.log
    convert.main(argv)  # again: one revision, every file as it is in the folder
    (revision,) = hub.revisions["me/tiny"]
    folder = tmp_path / "hf"
    assert revision == {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    assert all(auth == "Bearer hf_secret" for method, _, auth in hub.log if method == "POST")
    card = (folder / "README.md").read_text()
    assert 'pipeline("text-generation", model="me/tiny", trust_remote_code=True)' in card
    assert f"pushed {folder} to me/tiny: {hub.url}/me/tiny/commit/1" in capsys.readouterr().out
    monkeypatch.setattr(hf, "HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    assert load_model("me/tiny")[1]["step"] == 7  # and back from the Hub


@needs_hf
def test_push_refuses_an_incomplete_folder(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no model.safetensors; push a folder that convert.py --to_hf wrote whole"):
        hf.push(str(tmp_path / "hf"), "me/m", "hf_token")
