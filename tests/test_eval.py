"""Tests of eval.py: request strings, few-shot draws, scoring, download/cache, and the CLI end to end.
Expected values are written out by hand or derived here independently of eval.py."""
import copy
import dataclasses
import http.server
import json
import math
import os
import random
import subprocess
import sys
import threading
import urllib.parse
from types import SimpleNamespace

import pytest
import requests
import torch
import torch.nn as nn
import torch.nn.functional as F

import eval as ev
from engine import httpclient

# -----------------------------------------------------------------------------
# Golden request strings, one test per task (shots=0: context = the question exactly)


def reqs(task, doc):
    pairs, gold, _ = ev.doc_requests(task, doc)
    return pairs, gold


def test_arc_numeric_labels_three_choices():
    doc = {"id": "a1", "question": "Which is a gas?", "answerKey": "2",
           "choices": {"text": ["rock", "steam", "ice"], "label": ["1", "2", "3"]}}
    q = "Question: Which is a gas?\nAnswer:"
    assert reqs("arc_easy", doc) == ([(q, " rock"), (q, " steam"), (q, " ice")], 1)


def test_arc_letter_labels_five_choices():
    doc = {"id": "a2", "question": "Pick E.", "answerKey": "E",
           "choices": {"text": ["a", "b", "c", "d", "e e"], "label": ["A", "B", "C", "D", "E"]}}
    q = "Question: Pick E.\nAnswer:"
    assert reqs("arc_challenge", doc) == ([(q, " a"), (q, " b"), (q, " c"), (q, " d"), (q, " e e")], 4)


def test_openbookqa_verbatim_stem_and_spaced_answer_key():
    doc = {"id": "o1", "question_stem": "The sun is ", "answerKey": " B",
           "choices": {"text": ["a moon", "a star", "a planet", "a comet"], "label": ["A", "B", "C", "D"]}}
    q = "The sun is "
    assert reqs("openbookqa", doc) == ([(q, " a moon"), (q, " a star"), (q, " a planet"), (q, " a comet")], 1)


def test_piqa_keeps_spaces_of_solutions():
    doc = {"goal": "Open a jar", "sol1": " twist the lid ", "sol2": "hit it", "label": 0}
    q = "Question: Open a jar\nAnswer:"
    assert reqs("piqa", doc) == ([(q, "  twist the lid "), (q, " hit it")], 0)


HS_A = {"ind": 1, "activity_label": "Home and Garden", "source_id": "wikihow~1", "split": "val",
        "split_type": "indomain", "label": "3",
        "ctx_a": "[header] How to plant a tree. [title] Dig a hole.", "ctx_b": "",
        "ctx": "[header] How to plant a tree. [title] Dig a hole.",
        "endings": ["[step] Put the tree in. [title] Water it.", "Fill it [substeps]", "a [x]  b", "Plant seeds."]}
HS_B = {"ind": 2, "activity_label": "Sports", "source_id": "activitynet~2", "split": "train",
        "split_type": "indomain", "label": "0", "ctx_a": "A man runs.", "ctx_b": "then HE jumps",
        "ctx": "A man runs. then HE jumps", "endings": ["high.", "low.", "far.", "near."]}


def test_hellaswag_tags_and_empty_ctx_b():
    # by hand: ctx = ctx_a + " " + "" -> strip -> " [title]" -> ". " -> tags removed -> one pass "  " -> " "
    q = "Home and Garden: How to plant a tree.. Dig a hole."
    assert reqs("hellaswag", HS_A) == ([(q, "  Put the tree in.. Water it."),  # a removed tag leaves a leading space
                                        (q, " Fill it "),  # ... or a trailing one
                                        (q, " a  b"),  # three spaces, one replace pass: two remain
                                        (q, " Plant seeds.")], 3)


def test_hellaswag_capitalize_lowercases_the_rest():
    q = "Sports: A man runs. Then he jumps"
    assert reqs("hellaswag", HS_B) == ([(q, " high."), (q, " low."), (q, " far."), (q, " near.")], 0)


def test_hellaswag_trailing_title_and_context_space(enc):
    doc = {"ind": 3, "activity_label": "Yoga", "source_id": "wikihow~3", "split": "val", "split_type": "zeroshot",
           "label": "2", "ctx_a": "He stops", "ctx_b": "and rests [title]", "ctx": "",
           "endings": ["[title] Breathe in", "Sit [step]", " Stand up. ", "Lie down"]}
    # strip happens before " [title]" -> ". ", so the query keeps a trailing space
    q = "Yoga: He stops And rests. "
    assert reqs("hellaswag", doc) == ([(q, "  Breathe in"), (q, " Sit "),
                                       (q, " Stand up."), (q, " Lie down")], 2)
    # ... which the harness's split moves to the front of the continuation
    ctx, cont = ev.encode_pair(enc, q, " Lie down")
    assert ctx == enc.encode_ordinary("Yoga: He stops And rests.") and enc.decode(cont) == "  Lie down"


WG_S = {"sentence": "The cup fell on Anna's lap because _'s hands slipped.", "option1": "Anna",
        "option2": "Maria", "answer": "2"}
WG_EMPTY = {"sentence": "The winner of the race was _", "option1": "Tom", "option2": "Sue", "answer": "1"}


def test_winogrande_partial_evaluation():
    assert reqs("winogrande", WG_S) == ([("The cup fell on Anna's lap because Anna", " 's hands slipped."),
                                         ("The cup fell on Anna's lap because Maria", " 's hands slipped.")], 1)
    assert reqs("winogrande", WG_EMPTY) == ([("The winner of the race was Tom", " "),
                                             ("The winner of the race was Sue", " ")], 0)


# Few-shot contexts written out in full (one shot, so the draw is forced)

def test_fewshot_context_arc():
    shot = {"id": "s", "question": "2+2?", "answerKey": "B", "choices": {"text": ["3", "4"], "label": ["A", "B"]}}
    doc = {"id": "d", "question": "1+1?", "answerKey": "A", "choices": {"text": ["2", "5"], "label": ["A", "B"]}}
    (pairs, gold, _), = ev.build_requests("arc_easy", [doc], [shot], shots=1)[0]
    ctx = "Question: 2+2?\nAnswer: 4\n\nQuestion: 1+1?\nAnswer:"
    assert (pairs, gold) == ([(ctx, " 2"), (ctx, " 5")], 0)


def test_fewshot_context_hellaswag_drops_the_evaluated_doc():
    # k = 2 from a pool of 2: both drawn, the copy of the evaluated doc is dropped
    (pairs, _, _), = ev.build_requests("hellaswag", [HS_A], [copy.deepcopy(HS_A), HS_B], shots=1)[0]
    ctx = "Sports: A man runs. Then he jumps high.\n\nHome and Garden: How to plant a tree.. Dig a hole."
    assert pairs[3] == (ctx, " Plant seeds.")


def test_fewshot_context_piqa():
    other = {"goal": "Cut bread", "sol1": "use a spoon", "sol2": " use a knife", "label": 1}
    doc = {"goal": "Open a jar", "sol1": " twist the lid ", "sol2": "hit it", "label": 0}
    (pairs, _, _), = ev.build_requests("piqa", [doc], [other, dict(doc)], shots=1)[0]
    ctx = "Question: Cut bread\nAnswer:  use a knife\n\nQuestion: Open a jar\nAnswer:"
    assert pairs == [(ctx, "  twist the lid "), (ctx, " hit it")]


def test_fewshot_context_winogrande_shots():
    # a shot with an empty rest is the filled-in sentence alone: no " ", no "\n\n" (the harness's quirk)
    (pairs, _, _), = ev.build_requests("winogrande", [WG_S], [WG_EMPTY, dict(WG_S)], shots=1)[0]
    assert pairs == [("The winner of the race was TomThe cup fell on Anna's lap because Anna", " 's hands slipped."),
                     ("The winner of the race was TomThe cup fell on Anna's lap because Maria", " 's hands slipped.")]
    (pairs, _, _), = ev.build_requests("winogrande", [WG_EMPTY], [dict(WG_EMPTY), WG_S], shots=1)[0]
    shot = "The cup fell on Anna's lap because Maria 's hands slipped.\n\n"
    assert pairs == [(shot + "The winner of the race was Tom", " "), (shot + "The winner of the race was Sue", " ")]


# -----------------------------------------------------------------------------
# Few-shot sampling: the exact draws of random.Random(1234), derived here independently

def piqa_doc(j):
    return {"goal": f"goal {j}", "sol1": f"left {j}", "sol2": f"right {j}", "label": j % 2}


def piqa_shot(d):  # the rendering of a PIQA shot, by hand
    return f"Question: {d['goal']}\nAnswer: {d['sol2'] if d['label'] else d['sol1']}\n\n"


def test_fewshot_sampling_k6_drops_evaluated_doc():
    n = 30
    rng = random.Random(1234)
    draws = [rng.sample(range(n), 6) for _ in range(3)]  # k = 5 + 1: piqa has no test split
    pool = [piqa_doc(j) for j in range(n)]
    evaluated = [piqa_doc(100), piqa_doc(101), piqa_doc(102)]
    # doc 1 is a copy of a pool doc drawn for it; doc 2 has two copies in the pool, both drawn for it
    m = draws[1][2]
    evaluated[1] = dict(pool[m])
    p, q = [j for j in draws[2] if j not in draws[0] + draws[1]][:2]  # copies drawn for doc 2 only
    pool[p], pool[q] = dict(evaluated[2]), dict(evaluated[2])
    expected_idx = [draws[0][:5], [j for j in draws[1] if j != m][:5], [j for j in draws[2] if j not in (p, q)]]
    assert [len(e) for e in expected_idx] == [5, 5, 4]
    prefixes, short = ev.fewshot_prefixes("piqa", evaluated, pool, shots=5)
    assert prefixes == ["".join(piqa_shot(pool[j]) for j in idx) for idx in expected_idx]
    assert short == 1
    # --limit keeps the RNG stream: the first docs get the same prefixes
    assert ev.fewshot_prefixes("piqa", evaluated[:2], pool, shots=5)[0] == prefixes[:2]


def arc_doc(j):
    return {"id": f"q{j}", "question": f"q {j}?", "answerKey": "B",
            "choices": {"text": [f"no {j}", f"yes {j}"], "label": ["A", "B"]}}


def test_fewshot_sampling_k5_on_test_splits():
    n = 8
    rng = random.Random(1234)
    draws = [rng.sample(range(n), 5) for _ in range(3)]  # k = 5: ARC is evaluated on its test split
    pool = [arc_doc(j) for j in range(n)]
    # doc 1 equals a drawn pool doc: the harness filters copies whatever k, so only 4 shots remain
    evaluated = [arc_doc(50), dict(pool[draws[1][3]]), arc_doc(51)]
    prefixes, short = ev.fewshot_prefixes("arc_challenge", evaluated, pool, shots=5)
    draws[1].pop(3)
    assert prefixes == ["".join(f"Question: q {j}?\nAnswer: yes {j}\n\n" for j in d) for d in draws]
    assert short == 1


def test_zero_shots_and_small_pool():
    assert ev.fewshot_prefixes("piqa", [piqa_doc(1)], [], shots=0) == ([""], 0)
    with pytest.raises(ValueError, match="pool has 5"):
        ev.fewshot_prefixes("piqa", [piqa_doc(1)], [piqa_doc(j) for j in range(5)], shots=5)


# -----------------------------------------------------------------------------
# Tokenisation

def test_encode_pair_moves_trailing_space_and_splits_like_the_harness(enc):
    ctx, cont = ev.encode_pair(enc, "The sun is ", " a star")
    assert ctx == enc.encode_ordinary("The sun is")
    assert enc.decode(cont) == "  a star"
    assert ctx + cont == enc.encode_ordinary("The sun is  a star")
    # across a merge the continuation is whatever enc(context + continuation) has beyond len(enc(context))
    ctx, cont = ev.encode_pair(enc, "Question: t", "he end")
    whole = enc.encode_ordinary("Question: the end")
    assert ctx == enc.encode_ordinary("Question: t") and cont == whole[len(ctx):]
    assert enc.decode(cont) != "he end"  # the " the" merge swallowed the split point
    # an empty context conditions on <|endoftext|>
    assert ev.encode_pair(enc, "", " x") == ([enc.eot_token], enc.encode_ordinary(" x"))


# -----------------------------------------------------------------------------
# Scoring

class TinyCausalLM(nn.Module):
    """A small causal model with the GPT interface: model(idx) -> (logits, None), which is
    lm_head(features(idx)). Records its inputs."""

    def __init__(self, vocab_size, block_size=64, n_embd=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(block_size=block_size, vocab_size=vocab_size)
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.qkv, self.head = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, vocab_size)
        self.inputs = []

    def features(self, idx):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"T={T} > block_size")
        self.inputs.append(idx.tolist())
        x = self.wte(idx) + self.wpe(torch.arange(T))
        q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]

    def lm_head(self, h):
        return 3 * self.head(h)

    def forward(self, idx):
        return self.lm_head(self.features(idx)), None


class UniformLM(nn.Module):
    """Every next token has probability 1/V: ll = -len(continuation_ids) * log(V)."""

    def __init__(self, vocab_size, block_size=256):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size, vocab_size=vocab_size)
        self.dummy = nn.Parameter(torch.zeros(1))

    def features(self, idx):
        return torch.zeros(*idx.shape, 1) + 0 * self.dummy

    def lm_head(self, h):
        return h.expand(*h.shape[:-1], self.config.vocab_size)

    def forward(self, idx):
        return self.lm_head(self.features(idx)), None


def direct_ll(model, ctx, cont):
    """One request alone, straight from the model's logits (no padding, no batch)."""
    inp = (ctx + cont)[-(model.config.block_size + 1):][:-1]
    with torch.no_grad():
        logits, _ = model(torch.tensor([inp]))
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    n = len(inp)
    return sum(logp[n - len(cont) + j, t].item() for j, t in enumerate(cont))


def random_pairs(seed, n, vocab, max_ctx=40):
    g = random.Random(seed)
    return [([g.randrange(vocab) for _ in range(g.randint(1, max_ctx))],
             [g.randrange(vocab) for _ in range(g.randint(1, 6))]) for _ in range(n)]


def test_batched_equals_one_at_a_time(enc):
    model = TinyCausalLM(enc.n_vocab, block_size=64).eval()
    pairs = random_pairs(0, 23, enc.n_vocab)
    expected = [direct_ll(model, c, x) for c, x in pairs]
    for bs in (1, 4, 64):
        got = ev.loglikelihoods(model, pairs, batch_size=bs)
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # lengths differ, so the batched run really padded
    assert len({len(r) for r in model.inputs[-1]}) == 1 and len(model.inputs[-1]) == 23


def test_identical_requests_are_scored_once(enc):
    model = TinyCausalLM(enc.n_vocab, block_size=64).eval()
    pairs = random_pairs(1, 9, enc.n_vocab)
    pairs = pairs + [pairs[2], pairs[5], pairs[2]]
    got = ev.loglikelihoods(model, pairs, batch_size=2)
    assert sum(len(x) for x in model.inputs) == 9  # rows the model saw
    assert got[9] == got[2] == got[11] and got[10] == got[5]
    assert got[:9] == pytest.approx([direct_ll(model, c, x) for c, x in pairs[:9]], rel=1e-5, abs=1e-5)


def test_left_truncation_to_block_size(enc):
    model = TinyCausalLM(enc.n_vocab, block_size=8).eval()
    ctx, cont = list(range(10, 30)), [5, 6, 7]  # 23 tokens > block_size + 1
    ll, = ev.loglikelihoods(model, [(ctx, cont)], batch_size=4)
    assert model.inputs[-1] == [[24, 25, 26, 27, 28, 29, 5, 6]]  # (ctx + cont)[-9:][:-1], by hand
    assert ll == pytest.approx(direct_ll(model, ctx, cont), abs=1e-5)
    with pytest.raises(ValueError, match="block_size=8"):
        ev.loglikelihoods(model, [(ctx, list(range(9)))])


def test_score_acc_norm_and_ties():
    # lls given; choice lengths in characters (no leading space)
    lls = [[-1.0, -2.0], [-4.0, -3.0], [-3.0, -3.0], [-2.0, -6.0], [-2.0, -2.0]]
    choices = [["a", "bb"], ["aaaa", "b"], ["ab", "cd"], ["a", "bbbb"], ["", "bb"]]
    golds = [0, 0, 1, 1, 1]
    # acc: argmax -> 0, 1, 0 (tie: first), 0, 0 (tie)    -> right: yes, no, no, no, no
    # norm: -1/1,-2/2 tie -> 0; -1,-3 -> 0; tie -> 0; -2 vs -1.5 -> 1; -2/0 = -inf vs -1 -> 1
    #                                                          -> right: yes, yes, no, yes, yes
    r = ev.score(lls, golds, choices)
    assert r["acc"] == pytest.approx(1 / 5) and r["acc_norm"] == pytest.approx(4 / 5) and r["n"] == 5
    assert r["acc_stderr"] == pytest.approx(math.sqrt(0.8 / 4) / math.sqrt(5))  # sample std: sum((x-m)^2) = 0.8
    assert r["acc_norm_stderr"] == pytest.approx(math.sqrt(0.8 / 4) / math.sqrt(5))
    assert ev.score([[-1.0, -2.0]], [0], [["a", "b"]])["acc_stderr"] is None  # n = 1: no stderr
    assert "acc_norm" not in ev.score(lls, golds, choices, partial=True)


def test_acc_and_acc_norm_with_a_uniform_model(enc):
    # ll = -(tokens) * log V; " X...X" (no merges for X or Y) is len + 1 tokens.
    # acc prefers the fewest tokens, acc_norm (per character) the longest choice; ties go first.
    def doc(texts, key):
        return {"id": key, "question": "Which?", "answerKey": key,
                "choices": {"text": texts, "label": ["A", "B", "C"][:len(texts)]}}
    docs = [doc(["XX", "X", "XXXX"], "B"),  # acc right, norm wrong (picks XXXX)
            doc(["XX", "X", "XXXX"], "C"),  # acc wrong, norm right
            doc(["XX", "YY", "XXX"], "A"),  # acc tie -> first: right; norm: -3/2, -3/2, -4/3 -> C: wrong
            doc(["YY", "XX"], "B")]  # both tie -> first: both wrong
    res, n = ev.evaluate_task("arc_easy", docs, [], enc, UniformLM(enc.n_vocab), shots=0, progress=False)
    assert n == 11
    assert res["acc"] == 0.5 and res["acc_norm"] == 0.25 and res["n"] == 4
    assert res["acc_stderr"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert res["acc_norm_stderr"] == pytest.approx(0.25)


def test_evaluate_task_equals_direct_scoring(enc):
    # the whole pipeline (5 shots, k = 6, tokenisation, batching) against a direct computation
    model = TinyCausalLM(enc.n_vocab, block_size=48).eval()
    pool = [piqa_doc(j) for j in range(12)]
    docs = [{"goal": "Open a jar", "sol1": " twist the lid ", "sol2": "hit it with a hammer", "label": 0},
            {"goal": "Cut bread", "sol1": "use a spoon", "sol2": "use a knife", "label": 1},
            {"goal": "Boil water", "sol1": "use a pot on the stove", "sol2": "use a fridge", "label": 0}]
    res, n = ev.evaluate_task("piqa", docs, pool, enc, model, shots=5, batch_size=4, progress=False)
    rng = random.Random(1234)
    acc, acc_norm = [], []
    for doc in docs:
        prefix = "".join(piqa_shot(pool[j]) for j in rng.sample(range(12), 6)[:5])
        ctx = prefix + "Question: " + doc["goal"] + "\nAnswer:"
        lls = []
        for sol in (doc["sol1"], doc["sol2"]):
            c = enc.encode_ordinary(ctx)
            lls.append(direct_ll(model, c, enc.encode_ordinary(ctx + " " + sol)[len(c):]))
        acc.append(float(max(range(2), key=lambda i: (lls[i], -i)) == doc["label"]))
        norm = [lls[0] / len(doc["sol1"]), lls[1] / len(doc["sol2"])]
        acc_norm.append(float(max(range(2), key=lambda i: (norm[i], -i)) == doc["label"]))
    assert n == 6 and res["acc"] == sum(acc) / 3 and res["acc_norm"] == sum(acc_norm) / 3


# -----------------------------------------------------------------------------
# Download and cache, against a local imitation of the dataset-viewer API

class FakeAPI:
    """/rows?dataset&config&split&offset&length on 127.0.0.1, fed by the test; `fail` is a list of
    HTTP statuses answered (in order) before the real pages, None hanging up without an answer (a cut
    connection); every request is logged."""

    def __init__(self):
        self.splits, self.fail, self.log, self.truncate_at, self.total = {}, [], [], None, None
        self.ignore_offset = False  # a broken mirror that always serves the first page
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                api.log.append((url.path, q))
                if api.fail:
                    status = api.fail.pop(0)
                    return None if status is None else self.reply(status, {"error": "try later"})
                key = (q.get("dataset"), q.get("config"), q.get("split"))
                if url.path != "/rows" or key not in api.splits:
                    return self.reply(404, {"error": "Not found."})
                rows, off, n = api.splits[key], 0 if api.ignore_offset else int(q["offset"]), int(q["length"])
                page = [{"row_idx": i, "row": rows[i],
                         "truncated_cells": ["endings"] if i == api.truncate_at else []}
                        for i in range(off, min(off + n, len(rows)))]
                self.reply(200, {"features": [], "rows": page, "partial": False,
                                 "num_rows_total": api.total or len(rows), "num_rows_per_page": 100})

            def reply(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api(monkeypatch):
    monkeypatch.setattr(httpclient, "BACKOFF", 0.001)
    monkeypatch.setattr(httpclient, "MAX_TRIES", 4)
    a = FakeAPI()
    yield a
    a.stop()


def obqa_rows(n):
    return [{"id": f"o{i}", "question_stem": f"stem {i} ü", "answerKey": "A",
             "choices": {"text": ["x", "y"], "label": ["A", "B"]}} for i in range(n)]


def test_download_pages_retries_and_cache(api, tmp_path, monkeypatch):
    test_rows, train_rows = obqa_rows(500), obqa_rows(4957)  # the table's row counts
    api.splits[("allenai/openbookqa", "main", "test")] = test_rows
    api.splits[("allenai/openbookqa", "main", "train")] = train_rows
    api.fail = [429, None, 503]  # all three can recover: retried
    rows = ev.load_split("openbookqa", "eval", str(tmp_path), api.url, progress=False)
    assert rows == test_rows
    assert [q["offset"] for _, q in api.log] == ["0", "0", "0", "0", "100", "200", "300", "400"]
    assert all(p == "/rows" and q["length"] == "100" and q["split"] == "test" for p, q in api.log)
    path = tmp_path / "openbookqa" / "test.jsonl"
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == test_rows
    assert ev.load_split("openbookqa", "pool", str(tmp_path), api.url, progress=False) == train_rows
    assert sorted(os.listdir(tmp_path / "openbookqa")) == ["test.jsonl", "train.jsonl"]
    # second run: served from the cache, with the server gone and the network forbidden
    api.stop()
    monkeypatch.setattr(requests, "get", lambda *a, **k: pytest.fail("network used"))
    assert ev.load_split("openbookqa", "eval", str(tmp_path), api.url) == test_rows
    assert ev.load_split("openbookqa", "pool", str(tmp_path), api.url) == train_rows


def test_download_refuses_truncated_cells(api, tmp_path):
    api.splits[("allenai/openbookqa", "main", "test")] = obqa_rows(500)
    api.truncate_at = 234
    with pytest.raises(ValueError, match="offset=200: row 234 has truncated cells"):
        ev.load_split("openbookqa", "eval", str(tmp_path), api.url, progress=False)
    assert not (tmp_path / "openbookqa").exists() or os.listdir(tmp_path / "openbookqa") == []


def test_download_refuses_row_count_mismatch(api, tmp_path):
    api.splits[("allenai/openbookqa", "main", "test")] = obqa_rows(499)
    with pytest.raises(ValueError, match="the server has 499 rows, expected 500"):
        ev.load_split("openbookqa", "eval", str(tmp_path), api.url, progress=False)
    # the server claims the right total but runs out of rows
    api.total = 500
    with pytest.raises(ValueError, match="empty page after 499 of 500 rows"):
        ev.load_split("openbookqa", "eval", str(tmp_path), api.url, progress=False)
    assert not (tmp_path / "openbookqa").exists() or os.listdir(tmp_path / "openbookqa") == []


def test_download_refuses_rows_out_of_order(api, tmp_path):
    api.splits[("allenai/openbookqa", "main", "test")] = obqa_rows(500)
    api.ignore_offset = True
    with pytest.raises(ValueError, match="offset=100: got row_idx 0, expected 100"):
        ev.load_split("openbookqa", "eval", str(tmp_path), api.url, progress=False)
    assert not (tmp_path / "openbookqa").exists() or os.listdir(tmp_path / "openbookqa") == []


def test_download_errors_are_clear(api, tmp_path):
    with pytest.raises(ValueError, match="HTTP 404.*splits\\?dataset=allenai/openbookqa"):
        ev.download_split(api.url, "allenai/openbookqa", "nope", "test", 500)
    assert len(api.log) == 1  # a 4xx is not retried
    api.splits[("r", "c", "s")] = obqa_rows(3)
    api.fail = [500] * 4
    with pytest.raises(httpclient.DownloadError, match="giving up after 4 failed attempts in a row \\(last: HTTP 500"):
        ev.download_split(api.url, "r", "c", "s", 3)


@pytest.mark.parametrize("where", ["refused", "no such host"])
def test_unreachable_server_fails_at_once_with_the_offline_hint(where, closed_url, tmp_path, monkeypatch):
    """No connection at all (offline): no retries, no waiting, and the way out."""
    url = closed_url if where == "refused" else "http://nonexistent.invalid"
    monkeypatch.setattr(httpclient.time, "sleep", lambda s: pytest.fail(f"slept {s}s before retrying"))
    with pytest.raises(httpclient.DownloadError) as e:
        ev.load_split("piqa", "eval", str(tmp_path / "eval"), url, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{url}/rows: cannot connect (") and "\n" not in msg
    assert ("Connection refused" if where == "refused" else "nonexistent.invalid") in msg
    assert f"copy {tmp_path / 'eval'} from a machine where eval.py ran once" in msg
    assert msg.endswith("(docs/REFERENCE.md, Evaluation: Data, and running offline)")
    reference = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                                  "REFERENCE.md")).read()
    assert "\n## Evaluation\n" in reference and "\n**Data, and running offline.**" in reference  # what it points at


def test_cli_offline_loads_the_shipped_tokenizer(offline, tmp_path):
    """With the network closed the default tokenizer loads (tokenizer/gpt2.tiktoken): the first error is the
    missing checkpoint, not the vocabulary."""
    with pytest.raises(SystemExit) as e:
        ev.main([str(tmp_path / "ckpt.pt")])
    message = str(e.value)
    assert message.startswith("eval.py: error: ") and f"{tmp_path / 'ckpt.pt'}: no checkpoint there" in message


def test_cached_file_is_checked(tmp_path):
    d = tmp_path / "piqa"
    d.mkdir()
    (d / "validation.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n{"goal": "g"}\n')
    with pytest.raises(ValueError, match="validation.jsonl:2: missing key\\(s\\) sol1, sol2, label"):
        ev.load_split("piqa", "eval", str(tmp_path), "http://127.0.0.1:9")
    (d / "validation.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n{oops\n')
    with pytest.raises(ValueError, match="validation.jsonl:2: not valid JSON"):
        ev.load_split("piqa", "eval", str(tmp_path), "http://127.0.0.1:9")


# -----------------------------------------------------------------------------
# End to end: the CLI on a tiny checkpoint and a small cached data set

def small_data(data_dir, n_eval=6, n_pool=10):
    """A few rows per split of every task (n_eval evaluated, n_pool few-shot), in the cache layout."""
    g = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "his", "red", "car"]
    s = lambda n: " ".join(g.choice(words) for _ in range(n))
    def arc_row(i):
        k = g.choice([3, 4, 5])
        labels = ["A", "B", "C", "D", "E"][:k] if i % 2 else [str(j + 1) for j in range(k)]
        return {"id": str(i), "question": s(6) + "?", "answerKey": g.choice(labels),
                "choices": {"text": [s(g.randint(1, 4)) for _ in range(k)], "label": labels}}
    make = {
        "arc_easy": arc_row, "arc_challenge": arc_row,
        "hellaswag": lambda i: {"ind": i, "activity_label": "Cooking", "ctx_a": s(5) + ".", "ctx_b": s(3),
                                "ctx": "", "endings": [s(4) + " [title] " + s(2) for _ in range(4)],
                                "source_id": "x", "split": "val", "split_type": "indomain", "label": str(i % 4)},
        "openbookqa": lambda i: {"id": str(i), "question_stem": s(5), "answerKey": " C",
                                 "choices": {"text": [s(2) for _ in range(4)], "label": ["A", "B", "C", "D"]}},
        "piqa": lambda i: {"goal": s(5), "sol1": s(4), "sol2": " " + s(3), "label": i % 2},
        "winogrande": lambda i: {"sentence": s(4) + " _ " + s(3) + ".", "option1": "Tom", "option2": "Sue",
                                 "answer": str(1 + i % 2)},
    }
    for task, t in ev.TASKS.items():
        for split, n in ((t.split, n_eval), (t.pool_split, n_pool)):
            ev.write_jsonl(os.path.join(data_dir, task, f"{split}.jsonl"), [make[task](i) for i in range(n)])


def test_cli_end_to_end(tmp_path, enc, enc_file):
    from engine.checkpoint import load_model, save_checkpoint
    from model import GPT, GPTConfig
    data_dir = tmp_path / "data"
    small_data(str(data_dir))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=384, gate=True, anchor="exo",
                    mix="qkvg", anchor_norm=True)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():  # the zero-initialised layers would make every choice tie
            p.add_(0.1 * torch.randn_like(p))
    ckpt = tmp_path / "ckpt.pt"
    save_checkpoint(str(ckpt), {"model": model.state_dict(), "model_config": dataclasses.asdict(cfg)})
    out = tmp_path / "res" / "eval.json"
    argv = [str(ckpt), "--tokenizer", str(enc_file), "--data_dir", str(data_dir), "--base_url", "http://127.0.0.1:9",
            "--limit", "4", "--batch_size", "5", "--device", "cpu"]
    r = subprocess.run([sys.executable, "eval.py", *argv, "--out", str(out)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(ev.__file__)))
    assert r.returncode == 0, r.stderr
    assert "requests/s" in r.stdout and "average" in r.stdout
    res = json.loads(out.read_text())
    assert list(res["tasks"]) == list(ev.TASKS) and res["shots"] == 5 and res["limit"] == 4
    # the numbers are those of the scoring functions run here on the same checkpoint and data
    m, _ = load_model(str(ckpt))
    for task in ev.TASKS:
        docs = ev.read_rows(data_dir / task / f"{ev.TASKS[task].split}.jsonl", ev.TASKS[task].fields)[:4]
        pool = ev.read_rows(data_dir / task / f"{ev.TASKS[task].pool_split}.jsonl", ev.TASKS[task].fields)
        expected, _ = ev.evaluate_task(task, docs, pool, enc, m, progress=False)
        assert res["tasks"][task] == pytest.approx(expected), task
        assert res["tasks"][task]["n"] == 4
    summary = [res["tasks"][t]["acc" if t == "winogrande" else "acc_norm"] for t in ev.TASKS]
    assert res["average"] == pytest.approx(sum(summary) / 6)
    # the anchor-removal ablation runs on an anchored model and changes its log-likelihoods
    m.drop_anchor = True
    pairs = [(enc.encode_ordinary("Question: a"), enc.encode_ordinary(" b c"))]
    assert ev.loglikelihoods(m, pairs) != ev.loglikelihoods(load_model(str(ckpt))[0], pairs)
    ev.main(argv + ["--tasks", "piqa", "--drop_anchor"])  # in this process: the command ran as one above


def test_cli_refuses_drop_anchor_without_anchors(tmp_path, enc_file):
    from engine.checkpoint import save_checkpoint
    from model import GPT, GPTConfig
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=384)
    ckpt = tmp_path / "base.pt"
    save_checkpoint(str(ckpt), {"model": GPT(cfg).state_dict(), "model_config": dataclasses.asdict(cfg)})
    with pytest.raises(SystemExit, match="^eval.py: error: --drop_anchor: .*anchor='none'"):
        ev.main([str(ckpt), "--drop_anchor", "--tokenizer", str(enc_file), "--data_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="^eval.py: error: .*nothing.pt"):
        ev.main([str(tmp_path / "nothing.pt"), "--tokenizer", str(enc_file)])


def test_harness_is_optional_and_its_options_are_checked(tmp_path, monkeypatch, capsys):
    for name in ["lm_eval", *(m for m in sys.modules if m.startswith("lm_eval."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if lm-eval were not installed: every import of it fails
    ev.harness_class.cache_clear()
    with pytest.raises(ImportError, match=r"lm-evaluation-harness is not installed \(pip install -r tests/requ"):
        ev.HarnessLM
    with pytest.raises(SystemExit, match=r"^eval.py: error: --harness needs lm-evaluation-harness: pip install -r tes"):
        ev.main([str(tmp_path / "none.pt"), "--harness", "piqa"])
    ev.harness_class.cache_clear()
    for argv, message in [(["--harness", "piqa", "--tasks", "piqa"], "--tasks: eval.py's own tasks only"),
                          (["--harness", "piqa", "--data_dir", "d"], "--data_dir: eval.py's own tasks only"),
                          (["--harness", " , "], "--harness (empty)"),
                          (["--include_path", "tasks"], "--include_path: a folder of harness task YAMLs")]:
        with pytest.raises(SystemExit):
            ev.parse_args(["ckpt.pt", *argv])
        assert message in capsys.readouterr().err

