"""The recipes of docs/FORKING.md, each applied as written there (git apply, to a copy of the repository's modules)
and run in this process: the changed run, stopped by a SIGTERM at an evaluation step and resumed, ends bit for bit
as the same changed run unbroken (weights, every resumable part, the log). Beside that, what each recipe promises:
the recipe key refused on resume, the schedule's branch refused, three named optimiser states, the EMA kept on a
resume that leaves its key out and sharded under FSDP at 2 processes, the new metric in every evaluation's entry,
a byte-level vocabulary taken from its data (document masks on its <|endoftext|>, sample.py reading the checkpoint's
tokenizer), a measure of every micro-batch, a teacher whose changed file a resume refuses and whose memory and
missing file the dry run sees, Muon's per-layer rates kept in their ratio through the schedule.
And the page itself: its diffs are today's (`python -m tests.test_fork` takes them again), and each recipe's quick
check, run on a copy of the repository with the recipe applied, fails exactly the tests that the recipe names."""
import argparse
import ast
import contextlib
import glob
import importlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from xml.etree import ElementTree

import numpy as np
import pytest
import torch

from engine import checkpoint, sharding
from engine.data import TOKENIZER, read_tokenizer
from tests.test_faults import ENV, TORCHRUN, finish
from tests.test_train import SMALL, data_dir, read_log, stopped_at  # noqa: F401  (data_dir: the toy shards fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# the repository's modules, by file: the card's at the root, then the engine's and the tools' (packages)
FILES = sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "engine/*.py", "tools/*.py")
               for p in glob.glob(os.path.join(ROOT, pattern))
               if not os.path.basename(p).startswith(("test_", "conftest")))
MODULES = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in FILES]
# one stop at step 3, an evaluation step: the resumed run does the evaluation the stop left (its pending log entry)
STEPS = ["--max_steps=6", "--eval_interval=3", "--ckpt_interval=3"]


PAGE = os.path.join(ROOT, "docs", "FORKING.md")
RECIPE = r"^### (\d+)\. [^\n]*\n.*?^```diff\n(.*?)^```"  # ### N. title, then its ```diff block
QUICK = ["-m", "pytest", "-q", "-n", "0", "-m", "quick", "-p", "no:cacheprovider", "-p", "no:randomly"]


def recipes():
    """{number: the diff} of each recipe of docs/FORKING.md (### N. title, then its ```diff block)."""
    text = open(PAGE, encoding="utf-8").read()
    return {int(n): diff for n, diff in re.findall(RECIPE, text, flags=re.M | re.S)}


def pinned(text=None):
    """{number: the tests (file::name) that recipe changes}, as each recipe's `Tests it changes:` paragraph names
    them (after its diff), and {kind of change: the tests} of the page's list of what pins the recipe."""
    text = text or open(PAGE, encoding="utf-8").read()
    tests = lambda paragraph: re.findall(r"`((?:tests/)?test_\w+\.py::test_\w+)`", paragraph)
    by_recipe = {int(n): tests(p) for n, p in re.findall(r"^### (\d+)\. .*?^Tests it changes: (.*?)\n\n", text,
                                                        flags=re.M | re.S)}
    by_kind = {kind: tests(p) for kind, p in re.findall(r"^- \*\*([^*\n]+)\*\* pins?\s(.*?)(?=\n- \*\*|\n\n)", text,
                                                       flags=re.M | re.S)}
    return by_recipe, by_kind


def copy_of_repository(to):
    """The repository's files as a user's clone has them (git's tracked and untracked-not-ignored: no data/, out/)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, name)):  # a file deleted but not yet staged is listed too
            os.makedirs(os.path.join(to, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(to, name))
    return to


def regenerated(diff):
    """The diff, applied to today's files (git apply finds each hunk where its context moved) and taken again: the
    same change, with today's line numbers (2 lines of context, the page's)."""
    files = re.findall(r"^\+\+\+ b/(\S+)", diff, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "new"))
        for name in files:
            if os.path.exists(os.path.join(ROOT, name)):
                os.makedirs(os.path.dirname(os.path.join(tmp, "new", name)), exist_ok=True)
                shutil.copy(os.path.join(ROOT, name), os.path.join(tmp, "new", name))
        r = subprocess.run(["git", "apply", "-"], input=diff, cwd=os.path.join(tmp, "new"), capture_output=True,
                           text=True)
        if r.returncode:
            raise ValueError(f"does not apply to today's files: {r.stderr.strip()}")
        out = ""
        for name in files:
            old = os.path.join(ROOT, name) if os.path.exists(os.path.join(ROOT, name)) else "/dev/null"
            taken = subprocess.run(["git", "diff", "--no-index", "-U2", old, os.path.join(tmp, "new", name)],
                                   capture_output=True, text=True).stdout
            body = taken[taken.index("\n@@") + 1:]
            out += f"--- {'a/' + name if old != '/dev/null' else old}\n+++ b/{name}\n{body}"
        return out


def regenerate():
    """docs/FORKING.md with each recipe's diff taken again against today's files (`python -m tests.test_fork`)."""
    text = open(PAGE, encoding="utf-8").read()
    new = re.sub(RECIPE, lambda m: m[0].replace(m[2], regenerated(m[2])), text, flags=re.M | re.S)
    with open(PAGE + ".tmp", "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(PAGE + ".tmp", PAGE)
    return new != text


def fork_of(number, tmp_path):
    """A copy of the repository's modules, configs/ and tokenizer/ with recipe `number` applied as docs/FORKING.md
    writes it."""
    fork = tmp_path / "fork"
    for name in FILES:
        os.makedirs(fork / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), fork / name)
    for folder in ("configs", "tokenizer"):
        shutil.copytree(os.path.join(ROOT, folder), fork / folder)
    r = subprocess.run(["git", "apply", "-"], input=recipes()[number], cwd=fork, capture_output=True, text=True)
    assert r.returncode == 0, f"docs/FORKING.md's recipe {number} does not apply: {r.stderr}"
    return fork


@contextlib.contextmanager
def forked(number, tmp_path):
    """The fork's train module, imported in this process (with the fork's copy of every module it imports); the
    repository's own modules back in place afterwards."""
    fork = fork_of(number, tmp_path)
    saved = {name: sys.modules.pop(name) for name in MODULES if name in sys.modules}
    sys.path.insert(0, str(fork))
    try:
        yield importlib.import_module("train"), fork
    finally:
        sys.path.remove(str(fork))
        for name in MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def assert_equal(a, b, where="checkpoint"):
    """Two checkpoints' contents (nested dicts of tensors and plain values) equal, tensors bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def logged(out):
    return [{k: v for k, v in e.items() if k not in ("step_ms", "tok_per_s")} for e in read_log(out)]


def assert_same_run(a, b):
    """The final checkpoints of two run directories hold the same parts, bit for bit, and their logs the same
    entries (but the step times)."""
    ca, cb = (checkpoint.load_checkpoint(f"{out}/ckpt.pt", ("parts",)) for out in (a, b))
    assert ca["parts"] == cb["parts"]
    assert_equal({k: ca[k] for k in ca["parts"] + ["step"]}, {k: cb[k] for k in cb["parts"] + ["step"]})
    assert logged(a) == logged(b)


def stopped_and_unbroken(train, args, tmp_path, monkeypatch):
    """The run of args unbroken, and again stopped at step 3 and resumed with the same command; their directories."""
    unbroken, resumed = str(tmp_path / "unbroken"), str(tmp_path / "resumed")
    train.main(args + [f"--out_dir={unbroken}"])
    stopped_at(3, args + [f"--out_dir={resumed}"], monkeypatch, train)
    train.main(args + [f"--out_dir={resumed}", "--init_from=auto"])
    assert_same_run(unbroken, resumed)
    return unbroken, resumed


@pytest.mark.quick
def test_every_recipe_touches_one_file_and_names_the_tests_it_changes():
    """Ten recipes; each changes one file, the one its section names, and says which tests it changes (none, or
    tests that pin the recipe). Every test the page names exists and says, in its docstring, that it pins the recipe;
    every test that says so is in the page's list for its kind of change, so that page and tests cannot drift."""
    found = recipes()
    assert sorted(found) == list(range(1, 11))
    for number, diff in found.items():
        files = set(re.findall(r"^\+\+\+ b/(\S+)", diff, flags=re.M))
        assert files == {{5: "configs/exoformer_v.py", 7: "configs/bytes.py"}.get(number, "train.py")}, (number, files)
    by_recipe, by_kind = pinned()
    assert sorted(by_recipe) == sorted(found)
    assert list(by_kind) == ["An optimiser", "The schedule", "A new mechanism", "A resumable part"]
    docstrings = {}
    for name in ["test_model.py"] + sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests"))
                                           if f.startswith("test_") and f.endswith(".py")):
        tree = ast.parse(open(os.path.join(ROOT, name), encoding="utf-8").read())
        docstrings.update({f"{name}::{f.name}": ast.get_docstring(f) or "" for f in tree.body
                           if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")})
    named = {t for tests in [*by_recipe.values(), *by_kind.values()] for t in tests}
    assert set(t for tests in by_recipe.values() for t in tests) <= set(t for tests in by_kind.values() for t in tests)
    for test in named:
        assert "Pins the recipe" in docstrings.get(test, ""), f"docs/FORKING.md names {test}: no such test, or its " \
                                                              f"docstring does not say `Pins the recipe`"
    pins = {t for t, doc in docstrings.items() if "Pins the recipe" in doc}
    assert pins <= named, f"docs/FORKING.md's list of what pins the recipe leaves out {sorted(pins - named)}"


def test_every_recipe_applies_at_its_own_line_numbers():
    """Each recipe's diff is the one that today's files give (git apply would find a moved hunk; a reader of the page
    should not need to): after a change that moves them, `python -m tests.test_fork` takes the diffs again."""
    for number, diff in recipes().items():
        assert regenerated(diff) == diff, f"docs/FORKING.md's recipe {number}: its line numbers are not today's " \
                                          f"files' (python -m tests.test_fork takes every recipe's diff again)"


def failed_tests(junit):
    """(how many tests ran, those that ran, those that failed or erred) of a pytest --junitxml report, each test as
    file::name (its parameters dropped)."""
    cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    name = lambda case: f"{case.get('classname').replace('.', '/')}.py::{case.get('name').split('[')[0]}"
    failed = {name(c) for c in cases if c.find("failure") is not None or c.find("error") is not None}
    return len(cases), {name(c) for c in cases}, failed


@pytest.mark.parametrize("number", range(1, 11))
def test_a_recipes_quick_check_fails_only_the_tests_it_names(number, tmp_path):
    """The quick check (the page's command), run on a copy of the repository with the recipe applied, fails exactly
    the quick tests that the recipe's `Tests it changes:` names: the tests of properties (every trained parameter in
    one optimiser, branch points where schedule() agrees, stop and resume bit for bit) hold on it as they hold here.
    The inner pytest's CPU time is printed (-s)."""
    fork = copy_of_repository(str(tmp_path / "fork"))
    r = subprocess.run(["git", "apply", "-"], input=recipes()[number], cwd=fork, capture_output=True, text=True)
    assert r.returncode == 0, f"docs/FORKING.md's recipe {number} does not apply: {r.stderr}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, *QUICK, f"--junitxml={tmp_path / 'quick.xml'}",
                        f"--basetemp={tmp_path / 'tmp'}"], cwd=fork, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    count, ran, failed = failed_tests(tmp_path / "quick.xml")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"recipe {number}: the quick check of {count} tests took {cpu:.0f} CPU-s")  # -s shows it
    assert count > 100 and failed == set(pinned()[0][number]) & ran, r.stdout[-3000:]


def test_torch_muon_behind_a_key_resumes_exactly_and_the_key_is_kept(data_dir, tmp_path, monkeypatch, capsys):
    with forked(1, tmp_path) as (train, _):
        args = SMALL + STEPS + [f"--data_dir={data_dir}", "--muon_impl=torch"]
        unbroken, resumed = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        state = checkpoint.load_checkpoint(f"{resumed}/ckpt.pt", ("optimizers",))["optimizers"]["muon"]["state"]
        assert {k for s in state.values() for k in s} == {"momentum_buffer"}  # torch.optim.Muon's
        with pytest.raises(SystemExit, match=r"ckpt.pt: muon_impl='torch' in the checkpoint, muon_impl='ours' given: "
                                             r"a run continues with the recipe it was saved with"):
            train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={resumed}", "--max_steps=8",
                                "--muon_impl=ours", "--init_from=auto"])


def test_a_cosine_schedule_resumes_exactly_and_its_branches_and_budgets_are_refused(data_dir, tmp_path,
                                                                                     monkeypatch):
    with forked(2, tmp_path) as (train, fork):
        args = SMALL + STEPS + [f"--data_dir={data_dir}"]
        unbroken, _ = stopped_and_unbroken(train, args + ["--keep_full=4"], tmp_path, monkeypatch)
        lrs = [e["muon_lr"] for e in read_log(unbroken)[1:]]  # steps 0 to 5
        assert lrs[2] > lrs[3] > lrs[4] > lrs[5]  # the cosine decays from the end of the warmup (2 steps)
        point = f"{unbroken}/ckpt_000004_full.pt"
        with pytest.raises(SystemExit, match=r"cannot branch from it: the schedules of max_steps=6 and max_steps=5 "
                                             r"differ from step 3"):
            train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'branch'}", "--max_steps=5",
                                f"--init_from={point}"])
        assert not os.path.exists(tmp_path / "branch")
        sweep = importlib.import_module("tools.sweep")
        with pytest.raises(ValueError, match=r"--budgets: 0.5 \(10 steps\): its schedule and the full run's differ "
                                             r"from step 3, .* less than 50%; --budgets_from_scratch runs it"):
            sweep.plan([str(fork / "configs" / "gated.py")], [0], [0.5, 1], SMALL[1:] + [
                f"--data_dir={data_dir}", "--max_steps=20"], str(tmp_path / "sweep"))


def test_a_third_optimizer_resumes_exactly_by_name(data_dir, tmp_path, monkeypatch):
    with forked(3, tmp_path) as (train, _):
        unbroken, resumed = stopped_and_unbroken(train, SMALL + STEPS + [f"--data_dir={data_dir}"], tmp_path,
                                                 monkeypatch)
        states = checkpoint.load_checkpoint(f"{resumed}/ckpt.pt", ("optimizers",))["optimizers"]
        assert list(states) == ["muon", "adam", "lam"] and len(states["lam"]["state"]) > 0
        assert all({"muon_lr", "adam_lr", "lam_lr"} <= e.keys() for e in read_log(resumed)[1:])


def test_an_ema_of_the_weights_resumes_exactly_even_when_its_key_is_left_out(data_dir, tmp_path, monkeypatch):
    with forked(4, tmp_path) as (train, _):
        args = SMALL + STEPS + [f"--data_dir={data_dir}", "--ema_decay=0.9"]
        unbroken, resumed = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        ckpt = checkpoint.load_checkpoint(f"{resumed}/ckpt.pt", ("ema",))
        assert ckpt["parts"][-1] == "ema" and ckpt["ema"]["average"].keys() == ckpt["model"].keys()
        assert not all(torch.equal(ckpt["ema"]["average"][k], ckpt["model"][k]) for k in ckpt["model"])
        # the key left out on resume: the checkpoint's, and its average goes on
        train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={resumed}", "--max_steps=7", "--init_from=auto"])
        later = checkpoint.load_checkpoint(f"{resumed}/ckpt.pt", ("ema",))
        assert later["config"]["ema_decay"] == 0.9 and later["step"] == 7
        assert not torch.equal(later["ema"]["average"]["wte.weight"], ckpt["ema"]["average"]["wte.weight"])


STOP = """import os, signal, sys
sys.path.insert(0, os.getcwd())
import train
stop_at, real = int(sys.argv[1]), train.micro_batches
def micro_batches(run):
    if run.step + 1 == stop_at:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(run)
train.micro_batches = micro_batches
train.main(sys.argv[2:])
"""


def test_an_ema_of_the_weights_under_fsdp_is_sharded_and_resumes_exactly(data_dir, tmp_path):
    """The EMA recipe at 2 processes under FSDP: its average goes to ckpt.dcp sharded, as the weights' do, and the
    run stopped by SIGTERM (to both ranks) and resumed ends bit for bit as unbroken."""
    fork = fork_of(4, tmp_path)
    (fork / "stop.py").write_text(STOP)
    args = SMALL + STEPS + [f"--data_dir={data_dir}", "--ema_decay=0.9", "--fsdp=True", "--init_from=auto"]
    unbroken, resumed = str(tmp_path / "unbroken"), str(tmp_path / "resumed")
    for command in (["train.py", *args, f"--out_dir={unbroken}"], ["stop.py", "3", *args, f"--out_dir={resumed}"],
                    ["train.py", *args, f"--out_dir={resumed}"]):
        code, _, err = finish(subprocess.Popen(TORCHRUN + command, cwd=fork, env=ENV, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        assert code == 0 or (command[0] == "stop.py" and sharding.read_state(f"{resumed}/ckpt.dcp")["step"] == 3), err
    metadata = sharding._metadata(f"{resumed}/ckpt.dcp").state_dict_metadata
    assert "ema.average.wte.weight" in metadata and metadata["ema.average.wte.weight"].chunks[1:]  # sharded: 2 chunks
    a, b = (sharding.load_whole(f"{out}/ckpt.dcp", ("optimizers", "ema", "loader", "rng"))
            for out in (unbroken, resumed))
    assert a["parts"] == b["parts"] == ["model", "optimizers", "loader", "rng", "ema"]
    assert_equal({k: a[k] for k in a["parts"] + ["step"]}, {k: b[k] for k in b["parts"] + ["step"]})
    assert logged(unbroken) == logged(resumed)


def test_a_v_only_anchor_variant_resumes_exactly(data_dir, tmp_path, monkeypatch):
    with forked(5, tmp_path) as (train, fork):
        args = [str(fork / "configs" / "exoformer_v.py")] + SMALL[1:] + STEPS + [f"--data_dir={data_dir}"]
        unbroken, _ = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        model = checkpoint.load_checkpoint(f"{unbroken}/ckpt.pt")
        assert model["model_config"]["mix"] == "v" and model["model"]["anchor_proj.weight"].shape == (64, 64)


def test_one_more_logged_metric_is_in_every_evaluation_even_the_one_a_stop_left(data_dir, tmp_path, monkeypatch):
    with forked(6, tmp_path) as (train, _):
        unbroken, resumed = stopped_and_unbroken(train, SMALL + STEPS + [f"--data_dir={data_dir}"], tmp_path,
                                                 monkeypatch)
        evaluated = [e for e in read_log(resumed) if "val_loss" in e]
        assert [e["step"] for e in evaluated] == [0, 3, 6]  # 3: the evaluation the stop left to the resumed run
        assert all(e["val_loss_no_anchor"] != e["val_loss"] for e in evaluated[1:])


BYTES = os.path.join(ROOT, "tokenizer", "bytes.tiktoken")  # recipe 7's tokenizer, shipped


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    """Toy documents of a few words, tokenised byte by byte as recipe 7 says (prepare.py --tokenize with
    tokenizer/bytes.tiktoken, which the folder's manifest records): several documents in each 32-token window."""
    from prepare import tokenize
    folder = tmp_path_factory.mktemp("bytes")
    rng = np.random.default_rng(0)
    words = "the of and to in is was for on that with as by at from it an be".split()
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 8)))})
                                               + "\n" for _ in range(300)))
    tokenize([str(folder / "docs.jsonl")], folder / "data", val_tokens=600, workers=1, tokenizer=BYTES)
    return str(folder / "data")


def test_a_byte_level_vocabulary_trains_from_its_data_and_samples_from_its_checkpoint(byte_data, tmp_path,
                                                                                      monkeypatch, capsys):
    """Recipe 7 (issue 50's first "done when"): byte-level data trains with no tokenizer flag, stopped and resumed
    bit for bit; the checkpoint records the tokenizer and the model masks documents at its <|endoftext|> (256), so
    doc_mask=True and False give other losses; sample.py decodes with it, no --tokenizer, and refuses GPT-2's ranks in
    one line; a vocabulary without room for its 257 tokens is refused in one line."""
    with forked(7, tmp_path) as (train, fork):
        args = [a for a in SMALL if not a.startswith("--vocab_size")] + [str(fork / "configs" / "bytes.py")] + \
            STEPS + [f"--data_dir={byte_data}"]
        unbroken, _ = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        ckpt = checkpoint.load_checkpoint(f"{unbroken}/ckpt.pt")
        assert ckpt["tokenizer"] == read_tokenizer(BYTES) and ckpt["model_config"]["eot_token"] == 256
        assert ckpt["model_config"]["vocab_size"] == 384
        train.main(args + [f"--out_dir={tmp_path / 'no_mask'}", "--doc_mask=False"])
        losses = lambda out: [e.get("train_loss", e.get("val_loss")) for e in read_log(out)]
        assert losses(unbroken)[0] == losses(tmp_path / "no_mask")[0]  # step 0's, before any step: a mask of the
        assert losses(unbroken)[1:] != losses(tmp_path / "no_mask")[1:]  # same windows, then each its own training
        sample = importlib.import_module("sample")
        capsys.readouterr()
        out = sample.main([f"{unbroken}/ckpt.pt", "--prompt", "the of", "--num_samples", "1", "--max_new_tokens",
                           "8"])
        assert out[0, :6].tolist() == list(b"the of") and out.max() < 257 and "the of" in capsys.readouterr().out
        with pytest.raises(SystemExit, match=r"^sample.py: error: --tokenizer .*gpt2.tiktoken: gpt2.tiktoken "
                                             r"\(50,257 tokens, <\|endoftext\|> 50256\), but .*ckpt.pt was trained "
                                             r"with bytes.tiktoken \(257 tokens, <\|endoftext\|> 256\)"):
            sample.main([f"{unbroken}/ckpt.pt", "--tokenizer", TOKENIZER])
        with pytest.raises(SystemExit, match=r"^train.py: error: vocab_size=256: .*'s tokenizer is bytes.tiktoken "
                                             r"\(257 tokens, <\|endoftext\|> 256\): expected vocab_size >= 257$"):
            train.main(args + ["--vocab_size=256", f"--out_dir={tmp_path / 'small'}"])


def test_a_measure_of_every_micro_batch_is_in_every_step_entry_and_on_the_console(data_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    """Recipe 8: the hook's measure, the step's highest micro-batch loss, in every step's log entry (at least the
    mean of the step's micro-batches, train_loss, in one process), on the console line, and resumed bit for bit."""
    with forked(8, tmp_path) as (train, _):
        unbroken, _ = stopped_and_unbroken(train, SMALL + STEPS + [f"--data_dir={data_dir}"], tmp_path, monkeypatch)
        steps = [e for e in read_log(unbroken) if "train_loss" in e]
        assert len(steps) == 6 and all(e["worst_micro_loss"] >= e["train_loss"] for e in steps)
        assert any(e["worst_micro_loss"] > e["train_loss"] for e in steps)
        assert "| worst_micro_loss " in capsys.readouterr().out


def test_a_teacher_resumes_exactly_and_a_changed_teacher_file_is_refused(data_dir, tmp_path, monkeypatch, capsys):
    """Recipe 9 (issue 50's "done when": a teacher file changed between a stop and a resume is refused in one line):
    distillation from a frozen teacher, stopped and resumed bit for bit, its file's sha256 in the checkpoint (the
    part inputs); once the teacher is trained further, resuming the student is refused, naming the file. The dry
    run builds the teacher: its weights count towards the peak, and a missing teacher file fails the dry run with
    the line that stops the launch."""
    with forked(9, tmp_path) as (train, _):
        teacher = str(tmp_path / "teacher")
        teacher_args = SMALL + [f"--data_dir={data_dir}", f"--out_dir={teacher}", "--seed=7"]
        train.main(teacher_args + ["--max_steps=2"])
        args = SMALL + STEPS + [f"--data_dir={data_dir}", f"--teacher={teacher}/ckpt.pt"]
        unbroken, resumed = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        ckpt = checkpoint.load_checkpoint(f"{resumed}/ckpt.pt", ("inputs",))
        assert list(ckpt["inputs"]["sha256"]) == [f"{teacher}/ckpt.pt"]
        assert not [k for k in ckpt["model"] if "teacher" in k]  # beside the model, never saved
        train.main(teacher_args + ["--max_steps=3", "--init_from=auto"])  # the teacher trained one step further
        with pytest.raises(SystemExit, match=rf"^train.py: error: {resumed}/ckpt.pt: input {teacher}/ckpt.pt: "
                                             rf"sha256 \w+\.\.\. when the checkpoint was written, sha256 \w+\.\.\. "
                                             rf"now: a run continues with the inputs it was saved with$"):
            train.main(args + [f"--out_dir={resumed}", "--max_steps=8", "--init_from=auto"])
        peaks = []  # the dry run's parameters, without the teacher and with it
        monkeypatch.setattr(train.dryrun, "report", lambda p, *_, **__: peaks.append(p[0]["parameters"]) or ([], True))
        for teacher_key in ([], [f"--teacher={teacher}/ckpt.pt"]):
            train.main(SMALL + [f"--data_dir={data_dir}", "--dry_run=True", *teacher_key])
        assert peaks[1] > peaks[0]
        missing = str(tmp_path / "missing.pt")
        capsys.readouterr()
        with pytest.raises(SystemExit, match="would not fit, or would fail"):
            train.main(SMALL + [f"--data_dir={data_dir}", "--dry_run=True", f"--teacher={missing}"])
        assert f"dry run: error: {missing}: no such file (an input this run reads)" in capsys.readouterr().out
        with pytest.raises(SystemExit, match=rf"^train.py: error: {missing}: no such file \(an input this run "
                                             rf"reads\)$"):
            train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'x'}", f"--teacher={missing}"])


def test_per_layer_learning_rates_keep_their_ratio_and_resume_exactly(data_dir, tmp_path, monkeypatch):
    """Recipe 10: a Muon param group per block, block i's rate muon_lr times muon_layer_decay ** i at every step of
    the schedule (its lr_scale), stopped and resumed bit for bit; the factors are in the checkpoint."""
    with forked(10, tmp_path) as (train, _):
        args = SMALL + STEPS + [f"--data_dir={data_dir}", "--muon_layer_decay=0.5"]
        unbroken, _ = stopped_and_unbroken(train, args, tmp_path, monkeypatch)
        saved = checkpoint.load_checkpoint(f"{unbroken}/ckpt.pt", ("optimizers",))["optimizers"]
        groups = saved["muon"]["param_groups"]
        last_lr = read_log(unbroken)[-1]["muon_lr"]  # the schedule's rate of the last step
        assert [g["lr_scale"] for g in groups] == [1.0, 0.5] and [g["lr"] for g in groups] == [last_lr, last_lr / 2]


def main(argv):
    """`python -m tests.test_fork`: docs/FORKING.md's diffs taken again against today's files."""
    argparse.ArgumentParser(description=main.__doc__).parse_args(argv)
    print("docs/FORKING.md: " + ("recipes' diffs taken again" if regenerate() else "every diff is today's already"))


if __name__ == "__main__":
    main(sys.argv[1:])
