"""eval.py's lm-evaluation-harness model (HarnessLM, eval.py --harness) against the harness itself, offline.

The harness's own YAMLs of the six tasks, pointed at local JSON files (test_eval.small_data's rows), run through
lm_eval.simple_evaluate on a tiny checkpoint must give eval.py's prompts, log-likelihoods and acc / acc_norm exactly;
loglikelihood_rolling must be the model's own loss on the same text; generate_until must stop at a stop sequence.
lm-eval is optional: without it these tests are skipped, except in CI (.ci/run installs it), where they fail.
"""
import json
import os

import pytest
import torch

import eval as ev
from engine.checkpoint import save_checkpoint
from model import GPT, IGNORE, GPTConfig
from test_model import randomize
from tests.test_eval import small_data

if os.environ.get("CI"):
    import lm_eval  # noqa: F401  (CI installs it: a missing harness is a failure there)
else:
    pytest.importorskip("lm_eval")

HARNESS_YAML = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
                "piqa": "piqa/piqa.yaml", "winogrande": "winogrande/default.yaml"}  # in lm_eval/tasks/
N_DOCS = 30  # evaluated docs per task (and as many few-shot docs)
TEXTS = ["the cat sat on the mat", " and ran to his red car " * 9, "a" * 300, "Question: and the"]


def offline_env(hf_home):
    """The harness (its datasets library) offline, with its caches in hf_home."""
    return {"HF_HOME": str(hf_home), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(hf_home / "datasets"), "TRANSFORMERS_OFFLINE": "1"}


def without_env_info(mp):
    """lm_eval's record of the machine in each result (pip list, compilers, GPUs: 2.4 s an evaluation on 2 CPU cores),
    which no test reads, left out (mp: a pytest.MonkeyPatch)."""
    import lm_eval.evaluator
    mp.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)


def write_tasks(folder, data_dir):
    """A YAML per task that includes the harness's own and reads the local JSON lines instead of the Hub; and a
    loglikelihood_rolling task over TEXTS (as the harness's wikitext)."""
    import lm_eval
    tasks = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    os.makedirs(folder, exist_ok=True)
    for task, t in ev.TASKS.items():
        files = {s: os.path.join(data_dir, task, f"{s}.jsonl") for s in (t.split, t.pool_split)}
        splits = "validation_split: null\n" if t.split == "test" else "test_split: null\n"
        with open(os.path.join(folder, f"{task}_local.yaml"), "w") as f:
            f.write(f"include: {os.path.join(tasks, HARNESS_YAML[task])}\ntask: {task}_local\ntag: null\n"
                    f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files: {json.dumps(files)}\n"
                    + splits)
    with open(os.path.join(folder, "missing_local.yaml"), "w") as f:  # a task whose data file is not there
        f.write(f"include: {os.path.join(tasks, HARNESS_YAML['piqa'])}\ntask: missing_local\ndataset_path: json\n"
                f"dataset_kwargs:\n  data_files: {json.dumps({'validation': os.path.join(data_dir, 'none.jsonl')})}\n")
    ev.write_jsonl(os.path.join(data_dir, "text", "test.jsonl"), [{"text": t} for t in TEXTS])
    with open(os.path.join(folder, "text_local.yaml"), "w") as f:
        f.write(f"task: text_local\ndataset_path: json\ndataset_kwargs:\n  data_files: "
                f"{json.dumps({'test': os.path.join(data_dir, 'text', 'test.jsonl')})}\ntest_split: test\n"
                f"output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n"
                f"metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                f"  - metric: bits_per_byte\nmetadata:\n  version: 1.0\n")


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    """(lm_eval, a TaskManager of the local tasks only, their folder, the data folder), offline."""
    root = tmp_path_factory.mktemp("harness")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in offline_env(root / "hf").items():
            mp.setenv(k, v)  # read when the datasets library is imported, below
        import lm_eval
        from lm_eval.tasks import TaskManager
        without_env_info(mp)
        small_data(str(root / "data"), n_eval=N_DOCS, n_pool=N_DOCS)
        write_tasks(str(root / "tasks"), str(root / "data"))
        yield lm_eval, TaskManager(include_path=str(root / "tasks"), include_defaults=False), root


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, enc):
    """A random Dynamic E-ExoFormer checkpoint of block_size 64, trained (as it says) with document masking."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=384, gate=True, anchor="exo",
                       mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True)
    assert enc.max_token_value < config.vocab_size
    model = randomize(GPT(config), seed=3).eval()
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": config.__dict__, "step": 0,
                           "config": {"doc_mask": True}})
    return str(path), model


def our_requests(task, docs, pool, enc, model, shots):
    """eval.py's requests (context, continuation) and log-likelihoods, doc by doc."""
    reqs, _ = ev.build_requests(task, docs, pool, shots)
    pairs = [ev.encode_pair(enc, c, x) for doc_reqs, _, _ in reqs for c, x in doc_reqs]
    lls, out, i = ev.loglikelihoods(model, pairs), [], 0
    for doc_reqs, _, _ in reqs:
        out.append((doc_reqs, lls[i:i + len(doc_reqs)]))
        i += len(doc_reqs)
    return out


@pytest.mark.parametrize("task", list(ev.TASKS))
def test_simple_evaluate_gives_eval_py_prompts_scores_and_accuracies(task, harness, tiny, enc, enc_file):
    lm_eval, tasks, root = harness
    ckpt, model = tiny
    lm = ev.HarnessLM(ckpt, tokenizer=str(enc_file), device="cpu")
    out = lm_eval.simple_evaluate(model=lm, tasks=[f"{task}_local"], num_fewshot=5, task_manager=tasks,
                                  log_samples=True)
    got, samples = out["results"][f"{task}_local"], sorted(out["samples"][f"{task}_local"], key=lambda s: s["doc_id"])
    docs = ev.read_rows(os.path.join(root, "data", task, f"{ev.TASKS[task].split}.jsonl"), ev.TASKS[task].fields)
    pool = ev.read_rows(os.path.join(root, "data", task, f"{ev.TASKS[task].pool_split}.jsonl"), ev.TASKS[task].fields)
    ours = ev.evaluate_task(task, docs, pool, enc, model, shots=5, progress=False)[0]
    assert len(samples) == N_DOCS and got["sample_len"] == N_DOCS
    for sample, (doc_reqs, lls) in zip(samples, our_requests(task, docs, pool, enc, model, 5)):
        assert [tuple(a) for a in sample["arguments"]] == doc_reqs  # the same prompts, shots included
        assert [r[0][0] for r in sample["resps"]] == lls  # the same log-likelihoods, to the bit
    assert got["acc,none"] == ours["acc"] and 0 < ours["acc"] < 1
    assert got["acc_stderr,none"] == pytest.approx(ours["acc_stderr"], rel=1e-12)
    if not ev.TASKS[task].partial:
        assert got["acc_norm,none"] == ours["acc_norm"]


def rolling_loss(model, ids, eot, doc_mask):
    """-Σ log p of every token of ids after <|endoftext|>, as the model's own loss (model(idx, targets)) over the
    harness's windows of T = block_size: the first predicts ids[:T] from <|endoftext|> + ids[:T-1]; each next one
    the following T tokens (fewer at the end) with T tokens before each in view, the others' targets ignored."""
    T = model.config.block_size
    n = min(T, len(ids))
    windows = [([eot] + ids[:n - 1], ids[:n])]
    for s in range(T, len(ids), T):
        e = min(s + T, len(ids))
        windows.append((ids[e - T - 1:e - 1], [IGNORE] * (T - (e - s)) + ids[s:e]))
    total = 0.0
    with torch.no_grad():
        for x, y in windows:
            _, loss = model(torch.tensor([x]), torch.tensor([y]), doc_mask=doc_mask)
            total -= loss.item() * sum(t != IGNORE for t in y)
    return total


def test_loglikelihood_rolling_is_the_models_own_loss(harness, tiny, enc, enc_file):
    lm_eval, tasks, _ = harness
    ckpt, model = tiny
    out = lm_eval.simple_evaluate(model=ev.HarnessLM(ckpt, tokenizer=str(enc_file), device="cpu"),
                                  tasks=["text_local"], task_manager=tasks, log_samples=True)
    samples = sorted(out["samples"]["text_local"], key=lambda s: s["doc_id"])
    lengths = [len(enc.encode_ordinary(t)) for t in TEXTS]
    assert min(lengths) < 64 < 2 * 64 < max(lengths)  # one window, and three (the last one short)
    for text, sample in zip(TEXTS, samples):
        ids = enc.encode_ordinary(text)
        # the loss as the checkpoint was trained, with document masking: the same, since the only
        # <|endoftext|> comes first
        assert sample["resps"][0][0] == pytest.approx(rolling_loss(model, ids, enc.eot_token, True), rel=1e-5)


def test_generate_until_stops_at_the_stop_sequence(tiny, enc_file, monkeypatch):
    from lm_eval.api.instance import Instance
    ckpt, _ = tiny
    lm = ev.HarnessLM(ckpt, tokenizer=str(enc_file), device="cpu")
    request = lambda kwargs: Instance("generate_until", {}, ("Question: the cat sat on", kwargs), 0)
    full = lm.generate_until([request({"until": [], "max_gen_toks": 40})])[0]  # stopped by nothing but the length
    assert len(full) > 30
    k = next(k for k in range(8, len(full) - 3) if full.find(full[k:k + 3]) == k)  # a first occurrence, k chars in
    lengths, real_generate = [], ev.generate

    def spy(*args, **kwargs):  # how many tokens generation itself ran to
        out = real_generate(*args, **kwargs)
        lengths.append(out.size(1))
        return out
    monkeypatch.setattr(ev, "generate", spy)
    stopped = lm.generate_until([request({"until": [full[k:k + 3]], "max_gen_toks": 40}),
                                 request({"until": "\x00", "max_gen_toks": 40})])
    assert stopped == [full[:k], full]  # cut before the stop sequence; a stop that never comes changes nothing
    prompt = len(lm.enc.encode_ordinary("Question: the cat sat on"))
    assert prompt < lengths[0] < prompt + 40 and lengths[1] == prompt + 40  # generation itself stopped early
    torch.manual_seed(0)
    sampled = lm.generate_until([request({"until": [], "max_gen_toks": 40, "do_sample": True, "temperature": 1.0})])
    assert sampled[0] != full


def test_cli_runs_harness_tasks_and_writes_their_results(harness, tiny, enc, enc_file, tmp_path, monkeypatch, capsys):
    """eval.py's command line with --harness, run in this process, where the harness is imported already (eval.py's
    own command runs as a process in test_eval.py)."""
    _, _, root = harness
    ckpt, model = tiny
    for k, v in offline_env(root / "hf").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "harness.json"
    ev.main([ckpt, "--harness", "arc_easy_local,piqa_local", "--include_path", str(root / "tasks"), "--limit", "7",
             "--shots", "2", "--tokenizer", str(enc_file), "--out", str(out), "--device", "cpu"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "Tasks" and len(table) == 6  # header, rule, 2 tasks x (acc, acc_norm)
    results = json.loads(out.read_text())
    assert results["n-shot"] == {"arc_easy_local": 2, "piqa_local": 2} and "samples" not in results
    for task in ("arc_easy", "piqa"):
        t = ev.TASKS[task]
        docs = ev.read_rows(os.path.join(root, "data", task, f"{t.split}.jsonl"), t.fields)[:7]
        pool = ev.read_rows(os.path.join(root, "data", task, f"{t.pool_split}.jsonl"), t.fields)
        ours = ev.evaluate_task(task, docs, pool, enc, model, shots=2, progress=False)[0]
        got = results["results"][f"{task}_local"]
        assert (got["acc,none"], got["acc_norm,none"], got["sample_len"]) == (ours["acc"], ours["acc_norm"], 7)


def test_cli_errors_are_one_line(harness, tiny, enc_file, monkeypatch):
    lm_eval, _, root = harness
    real = lm_eval.tasks.TaskManager  # the local tasks only: the harness's own 14,000 take seconds to index
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path: real(include_path=include_path,
                                                                             include_defaults=False))
    local = ["--include_path", str(root / "tasks")]
    for argv, message in [
            (["arc_easy_locale,piqa_local", *local],
             "--harness: unknown task(s) arc_easy_locale (close: arc_easy_local"),
            (["missing_local", *local], "the harness stopped: FileNotFoundError: Unable to find"),
            (["piqa_local", "--include_path", str(root / "none")], f"--include_path {root / 'none'}: no such folder")]:
        with pytest.raises(SystemExit) as e:
            ev.main([tiny[0], "--harness", *argv, "--tokenizer", str(enc_file), "--device", "cpu"])
        assert str(e.value).startswith("eval.py: error: " + message) and "\n" not in str(e.value)
