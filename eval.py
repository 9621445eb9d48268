"""
Score a checkpoint on six multiple-choice tasks, 5-shot, exactly the way EleutherAI's
lm-evaluation-harness (0.4.x, `simple_evaluate(num_fewshot=5)`) does, without depending on it:
same data rows, same request strings, same few-shot draws, same acc / acc_norm.

    python eval.py out/ckpt.pt                                  # all six tasks
    python eval.py out/ckpt.pt --tasks piqa,arc_easy --limit 100 --out piqa_arc.json

Data comes from the Hugging Face dataset-viewer JSON API and is cached as one JSON-lines file per
split under --data_dir; a cached (or dropped-in) file is used as is, without any network access.
"""
import argparse
import difflib
import functools
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.checkpoint import check_checkpoint, load_model, trained_tokenizer
from engine.data import load_encoding
from engine.files import atomic_write, read_jsonl
from engine.httpclient import DownloadError, get_json
from engine.parallel import Runtime
from model import generate

# -----------------------------------------------------------------------------
# The tasks: one small function per task turns a dataset row into (question, choices, gold)


def arc(doc):
    return "Question: " + doc["question"] + "\nAnswer:", doc["choices"]["text"], \
        doc["choices"]["label"].index(doc["answerKey"])  # labels are A-E or 1-5, 3 to 5 choices


def openbookqa(doc):
    # the question stem verbatim; a few answer keys carry a leading space
    return doc["question_stem"], doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"].lstrip())


def piqa(doc):
    return "Question: " + doc["goal"] + "\nAnswer:", [doc["sol1"], doc["sol2"]], doc["label"]


def hellaswag_pre(text):
    """The harness's clean-up of HellaSwag's WikiHow markup: one pass of each step, in this order."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()  # Python's capitalize lower-cases the rest
    return hellaswag_pre(doc["activity_label"] + ": " + ctx), [hellaswag_pre(e) for e in doc["endings"]], \
        int(doc["label"])


def winogrande(doc):
    """Partial evaluation: the question is the sentence up to the blank, each choice fills the blank,
    and the scored continuation is the rest of the sentence (the same for both choices)."""
    i = doc["sentence"].index("_")
    return doc["sentence"][:i], [doc["option1"], doc["option2"]], 0 if doc["answer"] == "1" else 1


def winogrande_rest(doc):
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


@dataclass(frozen=True)
class Task:
    render: Callable  # row -> (question, choices, gold)
    repo: str  # dataset on the Hugging Face hub
    config: str
    split: str  # the evaluated split ...
    rows: int  # ... and its number of rows
    pool_split: str  # the few-shot pool ...
    pool_rows: int
    fields: tuple  # keys every row must have
    partial: bool = False  # WinoGrande: the choice goes into the context; acc only

    @property
    def extra_shot(self):
        # The harness draws one extra shot, in case the evaluated doc is drawn, whenever the task
        # has no split called "test": its `fewshot_split == test_split` is then None == None.
        return self.split != "test"


ARC = ("id", "question", "choices", "answerKey")
TASKS = {
    "arc_easy": Task(arc, "allenai/ai2_arc", "ARC-Easy", "test", 2376, "train", 2251, ARC),
    "arc_challenge": Task(arc, "allenai/ai2_arc", "ARC-Challenge", "test", 1172, "train", 1119, ARC),
    "hellaswag": Task(hellaswag, "Rowan/hellaswag", "default", "validation", 10042, "train", 39905,
                      ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "openbookqa": Task(openbookqa, "allenai/openbookqa", "main", "test", 500, "train", 4957,
                       ("id", "question_stem", "choices", "answerKey")),
    "piqa": Task(piqa, "baber/piqa", "default", "validation", 1838, "train", 16113, ("goal", "sol1", "sol2", "label")),
    "winogrande": Task(winogrande, "allenai/winogrande", "winogrande_xl", "validation", 1267, "train", 40398,
                       ("sentence", "option1", "option2", "answer"), partial=True),
}
FEWSHOT_SEED = 1234  # the harness's default fewshot_random_seed

# -----------------------------------------------------------------------------
# Requests: context = few-shot prefix + question, continuation = " " + choice


def shot_text(task, doc):
    """A solved example as it appears in the few-shot prefix."""
    question, choices, gold = TASKS[task].render(doc)
    if TASKS[task].partial:
        rest = winogrande_rest(doc)
        # the harness adds " " + target + "\n\n" only when the target is not empty
        return question + choices[gold] + (" " + rest + "\n\n" if rest else "")
    return question + " " + choices[gold] + "\n\n"


def doc_requests(task, doc, prefix=""):
    """(context, continuation) strings for each choice of `doc`, the gold index, and the choices
    (their lengths normalise acc_norm)."""
    question, choices, gold = TASKS[task].render(doc)
    if TASKS[task].partial:
        rest = winogrande_rest(doc)
        return [(prefix + question + c, " " + rest) for c in choices], gold, choices
    return [(prefix + question, " " + c) for c in choices], gold, choices


def fewshot_prefixes(task, docs, pool, shots, seed=FEWSHOT_SEED):
    """The few-shot prefix of every doc, in order, and how many docs got fewer than `shots` shots.
    One RNG per task, consumed doc after doc: a prefix depends on the doc's position, so `--limit`
    keeps the prefixes of the full run."""
    if shots == 0:  # the harness does not touch its sampler then
        return [""] * len(docs), 0
    k = shots + 1 if TASKS[task].extra_shot else shots
    if k > len(pool):
        raise ValueError(f"{task}: {shots}-shot needs {k} few-shot docs but the pool has {len(pool)}")
    rng = random.Random(seed)
    prefixes, short = [], 0
    for doc in docs:
        # the harness drops any drawn copy of the evaluated doc (whatever k); a doc drawn twice
        # (duplicate rows), or drawn once when k = shots, leaves fewer shots: it keeps them fewer too
        kept = [s for s in rng.sample(pool, k) if s != doc][:shots]
        short += len(kept) < shots
        prefixes.append("".join(shot_text(task, s) for s in kept))
    return prefixes, short


def build_requests(task, docs, pool, shots, seed=FEWSHOT_SEED):
    """Per doc: ([(context, continuation) per choice], gold, choices); plus the count of short prefixes."""
    prefixes, short = fewshot_prefixes(task, docs, pool, shots, seed)
    return [doc_requests(task, doc, p) for doc, p in zip(docs, prefixes)], short


def encode_pair(enc, context, continuation):
    """Token ids of context and continuation, split like the harness: trailing whitespace of the
    context moves to the continuation, and the continuation is what `enc(context + continuation)`
    has beyond `enc(context)` (BPE merges across the boundary stay as they would in running text)."""
    if context == "":  # the harness conditions on <|endoftext|> then (unreachable for these tasks)
        return [enc.eot_token], enc.encode_ordinary(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = enc.encode_ordinary(context + continuation)
    ctx = enc.encode_ordinary(context)
    return ctx, whole[len(ctx):]


# -----------------------------------------------------------------------------
# Scoring


@torch.no_grad()
def loglikelihoods(model, pairs, batch_size=32, dtype=torch.float32, desc=None, greedy=False):
    """log p(continuation | context) for each (context_ids, continuation_ids) pair, in input order; with greedy,
    (log p, whether every continuation token is the argmax), the harness's (loglikelihood, is_greedy).

    Each request is left-truncated to the model's block size exactly like the harness:
    input = (ctx + cont)[-(block_size + 1):][:-1], whose last len(cont) positions predict cont.
    Requests run `batch_size` at a time, longest first (little padding, and an out-of-memory error
    shows up at once), padded on the right: the model is causal, so padding never changes the
    logits of earlier positions and a request's result does not depend on its batch (up to float
    rounding, which can differ between batch shapes: ~1e-5 nats on a sum of ~-200 in float32).
    A request is one context with no <|endoftext|> inside, so no document mask is needed (doc_mask=False).
    """
    block_size = model.config.block_size
    device = next(model.parameters()).device
    index, which = {}, []  # distinct requests, and which one each pair is
    for ctx, cont in pairs:
        if not 0 < len(cont) <= block_size:
            raise ValueError(f"a continuation of {len(cont)} tokens cannot be scored with block_size={block_size}")
        key = (tuple((ctx + cont)[-(block_size + 1):][:-1]), tuple(cont))
        which.append(index.setdefault(key, len(index)))
    # identical requests (repeated choices) are scored once: float rounding can differ slightly between
    # batch shapes, and must never break a tie between two identical choices differently
    reqs = list(index)
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i][0]))
    amp = Runtime(str(device), dtype).autocast()
    lls = [None] * len(reqs)
    with tqdm(total=len(reqs), desc=desc, unit="req", disable=desc is None) as bar:
        for s in range(0, len(order), batch_size):
            batch = [reqs[i] for i in order[s:s + batch_size]]
            for i, ll in zip(order[s:s + batch_size], score_batch(model, batch, amp, device, greedy)):
                lls[i] = ll
            bar.update(len(batch))
    return [lls[j] for j in which]


def score_batch(model, batch, amp, device, greedy):
    """loglikelihoods' results for one batch of distinct (input, continuation) requests, longest first: padded on
    the right with token 0, the sum of each continuation's log p in float32 (with greedy, and whether each is the
    argmax)."""
    x = torch.zeros((len(batch), len(batch[0][0])), dtype=torch.long)
    for r, (inp, _) in enumerate(batch):
        x[r, :len(inp)] = torch.tensor(inp)
    with amp:
        h = model.features(x.to(device))
        # lm_head only at the positions that predict a continuation: most of a request is context
        rows = torch.cat([h[r, len(inp) - len(cont):len(inp)] for r, (inp, cont) in enumerate(batch)])
        logits = model.lm_head(rows)
    targets = torch.tensor([t for _, cont in batch for t in cont], device=device)
    logits = logits.float()  # float32, whatever autocast
    logp = F.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    lens = [len(cont) for _, cont in batch]
    sums = torch.stack([part.sum() for part in logp.split(lens)]).tolist()  # float32 sums, as the harness
    if greedy:  # the harness's is_greedy: an argmax over the vocabulary, only when asked for
        hits = [bool(part.all()) for part in (logits.argmax(-1) == targets).split(lens)]
        return list(zip(sums, hits))
    return sums


def mean_stderr(xs):
    """Mean and its standard error (sample std with n - 1, over sqrt(n)); no stderr for n = 1."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def score(lls, golds, choices, partial=False):
    """acc (argmax of ll) and acc_norm (argmax of ll / len(choice) in characters) with stderr.
    numpy's argmax, like the harness: ties (and NaNs) go to the first index."""
    acc, acc_norm = [], []
    for ll, gold, ch in zip(lls, golds, choices):
        ll = np.array(ll)
        acc.append(1.0 if int(np.argmax(ll)) == gold else 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice divides by zero, as in the harness
            acc_norm.append(1.0 if int(np.argmax(ll / np.array([float(len(c)) for c in ch]))) == gold else 0.0)
    res = dict(zip(("acc", "acc_stderr"), mean_stderr(acc)))
    if not partial:  # WinoGrande's partial scoring has no meaningful acc_norm
        res.update(zip(("acc_norm", "acc_norm_stderr"), mean_stderr(acc_norm)))
    res["n"] = len(lls)
    return res


def evaluate_task(task, docs, pool, enc, model, shots=5, batch_size=32, dtype=torch.float32, progress=True):
    """Render, tokenize and score one task; returns its metrics and the number of requests."""
    reqs, short = build_requests(task, docs, pool, shots)
    pairs = [encode_pair(enc, ctx, cont) for doc_reqs, _, _ in reqs for ctx, cont in doc_reqs]
    lls = loglikelihoods(model, pairs, batch_size, dtype, desc=task if progress else None)
    per_doc, i = [], 0
    for doc_reqs, _, _ in reqs:
        per_doc.append(lls[i:i + len(doc_reqs)])
        i += len(doc_reqs)
    res = score(per_doc, [g for _, g, _ in reqs], [c for _, _, c in reqs], TASKS[task].partial)
    res["short_fewshot_docs"] = short
    if short:
        print(f"note: {task}: {short} docs got fewer than {shots} shots because copies of themselves were drawn "
              f"(the harness does the same)", file=sys.stderr)
    return res, len(pairs)


# -----------------------------------------------------------------------------
# lm-evaluation-harness: any of its tasks on a checkpoint. Optional: only HarnessLM needs lm-eval installed.

# the optional packages, lm-eval among them, at the versions tested
HARNESS_PIP = "pip install -r tests/requirements.txt"
MAX_GEN_TOKS = 256  # the harness's default max_gen_toks (lm_eval's HFLM)


def check_options(config, enc, ckpt, drop_anchor=False):
    """A one-line ValueError for a tokenizer with ids the checkpoint has no rows for, or for anchor removal
    (§4.5) on a model without anchors."""
    if enc.max_token_value >= config.vocab_size:
        raise ValueError(f"--tokenizer: token ids up to {enc.max_token_value} but {ckpt} has "
                         f"vocab_size={config.vocab_size}")
    if drop_anchor and config.anchor == "none":
        raise ValueError(f"--drop_anchor: {ckpt} has no anchors (anchor='none')")


class HarnessModel:
    """What HarnessLM adds to lm-evaluation-harness's lm_eval.api.model.LM: a checkpoint of this code as a harness
    model, for lm_eval.simple_evaluate(model=HarnessLM("out/ckpt.pt"), tasks=[...]):
      loglikelihood          eval.py's batched scorer (loglikelihoods), the harness's context/continuation split;
      loglikelihood_rolling  the harness's rolling windows of block_size tokens after <|endoftext|>, same scorer;
      generate_until         model.py's generate with its KV cache, one request at a time, ended by the stop
                             sequences (and <|endoftext|>); greedy unless do_sample with a temperature.
    Every result also goes to the harness's cache hook (its use_cache). Device and autocast dtype as in eval.py
    (parallel.Runtime). Document masking, with which the checkpoint may have been trained
    (checkpoint.trained_doc_mask), changes nothing here: a request's only <|endoftext|> is its first token, the
    harness's prefix, if any, and a window whose only <|endoftext|> comes first is a single document."""

    def __init__(self, ckpt, tokenizer=None, batch_size=32, device=None, dtype=None, drop_anchor=False):
        super().__init__()  # the harness's LM: rank, world size, cache hook
        self.runtime = Runtime.pick(device, dtype)
        self._device = self.runtime.device
        self.model, saved = load_model(ckpt, self.runtime.device)
        self.enc = load_encoding(trained_tokenizer(saved, tokenizer, ckpt))
        check_options(self.model.config, self.enc, ckpt, drop_anchor)
        self.model.drop_anchor = drop_anchor
        self.batch_size = int(batch_size)

    def _score(self, pairs, desc):
        return loglikelihoods(self.model, pairs, self.batch_size, self.runtime.dtype, desc=desc, greedy=True)

    def _cached(self, kind, requests, results):
        for r, result in zip(requests, results):
            self.cache_hook.add_partial(kind, r.args, result)
        return results

    def loglikelihood(self, requests, disable_tqdm=False):
        pairs = [encode_pair(self.enc, context, continuation) for context, continuation in (r.args for r in requests)]
        return self._cached("loglikelihood", requests, self._score(pairs, None if disable_tqdm else "loglikelihood"))

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # there: HarnessLM is its LM
        windows, owners = [], []
        for n, r in enumerate(requests):
            ids = self.enc.encode_ordinary(r.args[0])
            for w in get_rolling_token_windows(ids, self.enc.eot_token, self.model.config.block_size, 1):
                windows.append(make_disjoint_window(w))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owners, self._score(windows, None if disable_tqdm else "loglikelihood_rolling")):
            totals[n] += ll
        return self._cached("loglikelihood_rolling", requests, totals)

    def generate_until(self, requests, disable_tqdm=False):
        texts = [self.generate_one(context, kwargs)
                 for context, kwargs in tqdm([r.args for r in requests], desc="generate_until", disable=disable_tqdm)]
        return self._cached("generate_until", requests, texts)

    def generate_one(self, context, gen_kwargs):
        """The continuation of context up to (not including) the first stop sequence, as the harness's HFLM: the
        context is cut on the left to leave max_gen_toks positions in the block."""
        until = gen_kwargs.get("until") or []
        until = ([until] if isinstance(until, str) else list(until)) + [self.enc.decode([self.enc.eot_token])]
        max_new = int(gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS))
        temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        room = max(1, self.model.config.block_size - max_new)
        ids = self.enc.encode_ordinary(context)[-room:] or [self.enc.eot_token]
        text = lambda out: self.enc.decode(out[0, len(ids):].tolist())
        with self.runtime.autocast():
            out = generate(self.model, torch.tensor([ids], device=self.runtime.device), max_new, temperature,
                           vocab=self.enc.n_vocab, stop=lambda out: any(s in text(out) for s in until))
        result = text(out)
        for s in until:
            result = result.split(s)[0]
        return result


@functools.cache
def harness_class():
    """HarnessLM: HarnessModel on lm-eval's LM base class, made on first use so that eval.py runs without lm-eval."""
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise ImportError(f"lm-evaluation-harness is not installed ({HARNESS_PIP})") from None

    class HarnessLM(HarnessModel, LM):
        __doc__ = HarnessModel.__doc__

    return HarnessLM


def __getattr__(name):  # `from eval import HarnessLM`
    if name == "HarnessLM":
        return harness_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -----------------------------------------------------------------------------
# Data: the dataset-viewer API, cached as JSON lines

BASE_URL = "https://datasets-server.huggingface.co"
PAGE = 100  # rows per request: the API's maximum
OFFLINE = "copy {} from a machine where eval.py ran once (docs/REFERENCE.md, Evaluation: Data, and running offline)"


def download_split(base_url, repo, config, split, expected_rows, desc=None, offline=OFFLINE.format("data/eval")):
    """All rows of one split, in order, from the dataset-viewer API's paged /rows endpoint (httpclient.get_json)."""
    url = base_url.rstrip("/") + "/rows"
    rows = []
    with tqdm(total=expected_rows, desc=desc, unit="row", disable=desc is None) as bar:
        while len(rows) < expected_rows:
            params = dict(dataset=repo, config=config, split=split, offset=len(rows), length=PAGE)
            try:
                page = get_json(url, params, offline)
            except DownloadError as e:
                if e.status is None:
                    raise
                raise ValueError(f"{e} (GET {base_url.rstrip('/')}/splits?dataset={repo} lists the configs)") from None
            where = f"{url}?dataset={repo}&config={config}&split={split}&offset={len(rows)}"
            if not isinstance(page, dict) or not isinstance(page.get("rows"), list) or "num_rows_total" not in page:
                raise ValueError(f"{where}: expected a JSON object with 'rows' and 'num_rows_total'")
            if page["num_rows_total"] != expected_rows:
                raise ValueError(f"{where}: the server has {page['num_rows_total']} rows, "
                                 f"expected {expected_rows} (the split the harness evaluates)")
            if not page["rows"]:
                raise ValueError(f"{where}: empty page after {len(rows)} of {expected_rows} rows")
            for r in page["rows"]:
                if r.get("truncated_cells"):  # the API shortens very long cells: such a row is not the real one
                    raise ValueError(f"{where}: row {r.get('row_idx')} has truncated cells {r['truncated_cells']}")
                if r.get("row_idx") != len(rows):
                    raise ValueError(f"{where}: got row_idx {r.get('row_idx')}, expected {len(rows)}")
                rows.append(r["row"])
            bar.update(len(page["rows"]))
    if len(rows) != expected_rows:
        raise ValueError(f"{url}: {repo}/{config}/{split} gave {len(rows)} rows, expected {expected_rows}")
    return rows


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_write(path, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def read_rows(path, fields):
    """Rows of a cached (or user-supplied) JSON-lines file, checked to carry `fields`."""
    def check(row):
        missing = [k for k in fields if not isinstance(row, dict) or k not in row]
        return f"missing key(s) {', '.join(missing)}; expected a row with {', '.join(fields)}" if missing else None
    rows = list(read_jsonl(path, check))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def load_split(task, which, data_dir="data/eval", base_url=BASE_URL, progress=True):
    """Rows of the evaluated split (which='eval') or the few-shot pool (which='pool') of a task:
    from <data_dir>/<task>/<split>.jsonl if present, else downloaded and cached there first."""
    t = TASKS[task]
    split, expected = (t.split, t.rows) if which == "eval" else (t.pool_split, t.pool_rows)
    path = os.path.join(data_dir, task, f"{split}.jsonl")
    if not os.path.exists(path):
        rows = download_split(base_url, t.repo, t.config, split, expected, f"{task}/{split}" if progress else None,
                              OFFLINE.format(data_dir))
        write_jsonl(path, rows)
    rows = read_rows(path, t.fields)
    if len(rows) != expected:
        print(f"note: {path} has {len(rows)} rows, the harness's split has {expected}: "
              f"scores are not comparable with published ones", file=sys.stderr)
    return rows


# -----------------------------------------------------------------------------
# Command line


def build_parser():
    """eval.py's command line: its own tasks' options and --harness's."""
    p = argparse.ArgumentParser(description="5-shot multiple-choice evaluation, lm-evaluation-harness compatible; "
                                            "or any harness task through lm-eval itself (--harness)")
    p.add_argument("ckpt", help="checkpoint written by train.py or convert.py, a model folder (convert.py "
                                  "--to_hf) or a Hub repository OWNER/NAME holding one")
    p.add_argument("--tasks", default=None, help="comma-separated subset of: " + ", ".join(TASKS) + " (default: all)")
    p.add_argument("--harness", metavar="TASKS", default=None,
                   help="run these lm-evaluation-harness tasks (comma-separated) with lm-eval itself "
                        "(tests/requirements.txt)")
    p.add_argument("--include_path", metavar="DIR", default=None, help="--harness: a folder of extra task YAMLs")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N docs of each task")
    p.add_argument("--shots", type=int, default=None, help="few-shot examples per request (default 5, the paper's; "
                                                           "with --harness: each task's own)")
    p.add_argument("--batch_size", type=int, default=32, help="requests per forward pass")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype of the forward pass (default: bfloat16 on cuda, float32 on cpu); "
                        "log-softmax is always float32")
    p.add_argument("--data_dir", default=None, help="cache of the data sets: <data_dir>/<task>/<split>.jsonl "
                                                    "(default data/eval)")
    p.add_argument("--base_url", default=None, help=f"root of the Hugging Face dataset-viewer API (or a mirror; "
                                                    f"default {BASE_URL})")
    p.add_argument("--drop_anchor", action="store_true",
                   help="zero every anchor term at inference (the paper's anchor-removal ablation, §4.5)")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    p.add_argument("--tokenizer", default=None, help="a .tiktoken ranks file: the checkpoint's own, which it records "
                                                     "(for one that records none: default GPT-2's)")
    return p


def parse_args(argv=None):
    """The command line's options, checked and with their defaults filled in (those that depend on --harness)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.harness is not None:
        given = [f"--{k}" for k in ("tasks", "data_dir", "base_url") if getattr(args, k) is not None]
        if given:
            p.error(f"{', '.join(given)}: eval.py's own tasks only; --harness tasks get their data from the harness")
        args.harness = [t.strip() for t in args.harness.split(",") if t.strip()]
        if not args.harness:
            p.error("--harness (empty): expected a comma list of harness task names")
    elif args.include_path is not None:
        p.error("--include_path: a folder of harness task YAMLs, for --harness only")
    args.tasks = [t.strip() for t in (args.tasks or ",".join(TASKS)).split(",") if t.strip()]
    args.data_dir, args.base_url = args.data_dir or "data/eval", args.base_url or BASE_URL
    if args.harness is None and args.shots is None:
        args.shots = 5
    bad = [t for t in args.tasks if t not in TASKS]
    if bad or not args.tasks:
        p.error(f"--tasks {','.join(bad) or '(empty)'}: expected a comma list of {', '.join(TASKS)}")
    for name, low in (("limit", 1), ("shots", 0), ("batch_size", 1)):
        v = getattr(args, name)
        if v is not None and v < low:
            p.error(f"--{name} {v}: expected an integer >= {low}")
    return args


def writable(path):
    """Fail now rather than after the whole evaluation."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if not os.access(os.path.dirname(path) or ".", os.W_OK):
            raise ValueError(f"--out {path}: directory is not writable")


def run_harness(args):
    """--harness: the tasks through lm_eval.simple_evaluate with HarnessLM; print the harness's table, --out its
    results dict as JSON. Checked first: lm-eval, --include_path, --out, the checkpoint's tensors (memory-mapped)
    against the tokenizer and --drop_anchor, then the task names (the harness indexes its task files: seconds)."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        raise ValueError(f"--harness needs lm-evaluation-harness: {HARNESS_PIP}") from None
    try:
        if args.include_path is not None and not os.path.isdir(args.include_path):
            raise ValueError(f"--include_path {args.include_path}: no such folder")
        writable(args.out)
        saved, config = check_checkpoint(args.ckpt, mmap=True)
        enc = load_encoding(trained_tokenizer(saved, args.tokenizer, args.ckpt))
        check_options(config, enc, args.ckpt, args.drop_anchor)
        tasks = TaskManager(include_path=args.include_path)
        unknown = [t for t in args.harness if t not in tasks.all_tasks]
        if unknown:
            close = lambda t: ", ".join(difflib.get_close_matches(t, tasks.all_tasks, n=3)) or "none"
            where = f" or those in {args.include_path}" if args.include_path else \
                " (--include_path DIR adds a folder of task YAMLs)"
            raise ValueError(f"--harness: unknown task(s) {'; '.join(f'{t} (close: {close(t)})' for t in unknown)}: "
                             f"not among the harness's tasks{where}")
        lm = harness_class()(args.ckpt, args.tokenizer, args.batch_size, args.device, args.dtype, args.drop_anchor)
    except ImportError as e:  # the Hugging Face format's packages
        raise ValueError(str(e)) from None
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=args.harness, num_fewshot=args.shots, limit=args.limit,
                                          task_manager=tasks, log_samples=False)
    except (OSError, ValueError) as e:  # e.g. a data set neither reachable nor cached, more shots than a task has
        hint = "; without internet, fill the harness's cache (~/.cache/huggingface) on a machine with it, or " \
               "point a task YAML at local files (--include_path)" if isinstance(e, ConnectionError) else ""
        raise ValueError(f"the harness stopped: {type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}"
                         f"{hint}") from None
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.out:
        with atomic_write(args.out, "w") as f:
            f.write(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
        print(f"wrote {args.out}")
    return results


def summary_metric(task):
    return "acc" if TASKS[task].partial else "acc_norm"


def print_table(results, average):
    pct = lambda v: "     -" if v is None else f"{100 * v:6.2f}"
    print(f"{'task':<14} {'acc':>6} {'±':>6} {'acc_norm':>8} {'±':>6} {'n':>6}  summary")
    for task, r in results.items():
        print(f"{task:<14} {pct(r['acc'])} {pct(r['acc_stderr'])} {pct(r.get('acc_norm')):>8} "
              f"{pct(r.get('acc_norm_stderr'))} {r['n']:>6}  {summary_metric(task)}")
    print(f"{'average':<14} {pct(average)}  (mean over {len(results)} tasks of the summary metric, in %)")


def main(argv=None):
    args = parse_args(argv)
    if args.harness is not None:
        try:
            return run_harness(args)
        except (ValueError, OSError) as e:  # run_harness's checks, and a harness that stopped: one line each
            raise SystemExit(f"eval.py: error: {e}")
    runtime = Runtime.pick(args.device, args.dtype)
    # cheap checks first: checkpoint, its tokenizer, anchor option; then the data of every task; then scoring
    try:
        model, saved = load_model(args.ckpt, device=runtime.device)
        enc = load_encoding(trained_tokenizer(saved, args.tokenizer, args.ckpt))
        check_options(model.config, enc, args.ckpt, args.drop_anchor)
        writable(args.out)
    except (ValueError, OSError, ImportError) as e:
        raise SystemExit(f"eval.py: error: {e}")
    model.drop_anchor = args.drop_anchor
    try:
        data = {t: (load_split(t, "eval", args.data_dir, args.base_url)[:args.limit],
                    load_split(t, "pool", args.data_dir, args.base_url)) for t in args.tasks}
    except (ValueError, DownloadError, OSError) as e:
        raise SystemExit(f"eval.py: error: {e}")

    results, n_req, t0 = {}, 0, time.time()
    for task, (docs, pool) in data.items():
        results[task], n = evaluate_task(task, docs, pool, enc, model, args.shots, args.batch_size, runtime.dtype)
        n_req += n
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in results[task].items()
                                      if k in ("acc", "acc_norm")) + f" (n={len(docs)})")
    elapsed = time.time() - t0
    average = sum(results[t][summary_metric(t)] for t in results) / len(results)
    print_table(results, average)
    print(f"{n_req} requests in {elapsed:.1f}s: {n_req / elapsed:.1f} requests/s")
    if args.out:
        out = {"checkpoint": args.ckpt, "tasks": results, "average": average,
               "average_of": {t: summary_metric(t) for t in results},
               "shots": args.shots, "limit": args.limit, "drop_anchor": args.drop_anchor,
               "block_size": model.config.block_size, "device": runtime.device,
               "dtype": str(runtime.dtype).removeprefix("torch."),
               "requests": n_req, "seconds": elapsed}
        with atomic_write(args.out, "w") as f:
            f.write(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
