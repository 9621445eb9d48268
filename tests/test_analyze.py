"""analyze.py: metric definitions against hand-computed values, the JSON schema, the CLI end to end."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.checkpoint import load_model
from engine.data import read_tokenizer, write_shard
from model import EOT, GPT, GPTConfig
from tools import analyze as an

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TINY = dict(n_layer=2, n_head=2, n_embd=8, block_size=16, vocab_size=64)
DYN_EXO = dict(gate=True, anchor="exo", mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True)


def save(path, model, **extra):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), **extra}, path)
    return str(path)


def perturbed(cfg, seed=0):
    """A model whose zero-initialised layers are not zero, so that every metric has something to measure."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_shard(d / "t_val_000000.bin", np.random.default_rng(0).integers(0, 64, 600))
    return str(d)


# ----------------------------------------------------------------------------- metric definitions

def stats(q, k):
    sums = an.attention_sums(q, k, an.attention_mask(torch.zeros(q.shape[0], q.shape[2], dtype=torch.long)))
    return [(sums[k] / sums["queries"]).item() for k in ["sink", "entropy"] + [f"top_{j}" for j in an.TOP_K]]


def test_attention_uniform_three_tokens():
    # q = 0: every query spreads evenly over the keys it sees: rows [1], [1/2, 1/2], [1/3, 1/3, 1/3]
    q = torch.zeros(1, 1, 3, 2)
    k = torch.randn(1, 1, 3, 2)
    sink, ent, top1, top2, top3, top10 = stats(q, k)
    assert sink == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert ent == pytest.approx((0 + math.log(2) + math.log(3)) / 3)
    assert top1 == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert top2 == pytest.approx((1 / 2 + 1 / 2 + 1 / 3) / 3)  # the first row's second weight is 0
    assert top3 == pytest.approx(1 / 3) and top10 == pytest.approx(1 / 10)


def test_attention_peaked_three_tokens():
    # key 0 gets logit ln 2 (scale 1/√D included), the others 0: rows [1], [2/3, 1/3], [1/2, 1/4, 1/4]
    q = torch.tensor([[math.log(2) * math.sqrt(2), 0.0]] * 3).view(1, 1, 3, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]).view(1, 1, 3, 2)
    sink, ent, top1, top2, _, _ = stats(q, k)
    assert sink == pytest.approx((1 + 2 / 3 + 1 / 2) / 3)
    h = lambda *p: -sum(x * math.log(x) for x in p)
    assert ent == pytest.approx((0 + h(2 / 3, 1 / 3) + h(1 / 2, 1 / 4, 1 / 4)) / 3)
    assert top1 == pytest.approx(sink)
    assert top2 == pytest.approx((1 / 2 + 1 / 2 + 3 / 8) / 3)


def test_document_masked_attention_sink_is_the_weight_on_the_document_start():
    idx = torch.zeros(1, 8, dtype=torch.long)
    idx[0, 3] = EOT  # documents [0, 3) and [3, 8)
    q = k = torch.zeros(1, 2, 8, 4)  # equal scores: every query spreads its weight evenly over what it sees
    doc = an.attention_sums(q, k, an.attention_mask(idx, doc_mask=True))
    plain = an.attention_sums(q, k, an.attention_mask(idx))
    assert doc["sink"] / doc["queries"] == pytest.approx(sum(1 / (p + 1) for p in [0, 1, 2, 0, 1, 2, 3, 4]) / 8)
    assert plain["sink"] / plain["queries"] == pytest.approx(sum(1 / (t + 1) for t in range(8)) / 8)
    assert doc["entropy"] < plain["entropy"]  # entropy: fewer keys to spread over


def test_attention_chunks_match_dense_reference(monkeypatch):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    p = (q @ k.mT / 2).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    top = p.sort(-1, descending=True).values
    want = [p[..., 0].mean(), -torch.special.xlogy(p, p).sum(-1).mean()] + \
           [top[..., :min(j, 7)].sum(-1).mean() / j for j in an.TOP_K]
    monkeypatch.setattr(an, "ATTN_CHUNK", 3 * 7 * 2)  # two queries at a time
    assert stats(q, k) == pytest.approx([w.item() for w in want], rel=1e-5)


def test_gate_sums():
    g = torch.logit(torch.tensor([0.1, 0.5, 0.9, 0.15], dtype=torch.float64))
    s, closed, n = (v.item() for v in an.gate_sums(g).values())
    assert s / n == pytest.approx(0.4125) and closed / n == 0.5


@pytest.mark.parametrize("C", [2, 5])  # T > C and T <= C take different routes
def test_token_similarity_orthogonal_states(C):
    e = torch.eye(C)
    s, s2, n = (v.item() for v in an.token_similarity_sums(torch.stack([e[0], 3 * e[1]])[None]).values())
    assert (s, s2, n) == pytest.approx((0, 0, 1))
    # positions e0, 2·e0, e1: pair similarities 1, 0, 0
    s, s2, n = (v.item() for v in an.token_similarity_sums(torch.stack([e[0], 2 * e[0], e[1]])[None]).values())
    assert n == 3 and s / n == pytest.approx(1 / 3) and s2 / n - (s / n) ** 2 == pytest.approx(2 / 9)


def test_layer_similarity_of_orthogonal_and_tilted_states():
    rec = an.Recorder(GPT(GPTConfig(**dict(TINY, n_layer=2))))
    e = torch.eye(8)
    rec.begin(torch.zeros(1, 2, dtype=torch.long))
    rec._hidden(0, torch.stack([e[0], e[1]])[None])
    rec._hidden(1, torch.stack([2 * e[2], e[3]])[None])  # orthogonal to state 0 at both positions
    rec._hidden(2, torch.stack([0.6 * e[0] + 0.8 * e[2], e[3]])[None])  # cos 0.6 / 0.8 with state 0 / 1 at position 0
    sim = rec.results()["layer_similarity"]
    assert np.allclose(sim, [[1, 0, 0.3], [0, 1, 0.9], [0.3, 0.9, 1]])


def test_pca_dims():
    def dims(spread):  # points ±10·e0 and ±spread·e1: variances 100 and spread²
        x = torch.tensor([[10.0, 0, 0], [-10, 0, 0], [0, spread, 0], [0, -spread, 0]], dtype=torch.float64) + 5
        return an.pca_dims(x.sum(0), x.T @ x, len(x))
    assert dims(1.0) == 1  # 100/101 > 0.99
    assert dims(1.5) == 2  # 100/102.25 < 0.99


def test_lambda_ratios_by_hand():
    cfg = GPTConfig(**TINY, gate=True, anchor="internal", mix="vg", granularity="headwise", anchor_norm=True)
    model = GPT(cfg)
    with torch.no_grad():
        model.blocks[1].attn.lam["v1"].copy_(torch.tensor([1.0, 3.0]).view(2, 1, 1))
        model.blocks[1].attn.lam["v2"].copy_(torch.tensor([2.0, 1.0]).view(2, 1, 1))
    ratios = an.lambda_ratios(model)
    assert list(ratios) == ["v", "g"]
    assert ratios["v"] == [None, [0.5, 3.0]] and ratios["g"] == [None, [1.0, 1.0]]


def test_known_model_end_to_end(tmp_path, data_dir):
    """A fresh gated model with c_attn = 0: uniform causal attention, gates σ(0) = 0.5, and blocks that
    are the identity (c_proj, fc2 and lm_head start at zero), so every hidden state is the embedding."""
    model = GPT(GPTConfig(**TINY, gate=True))
    with torch.no_grad():
        for b in model.blocks:
            b.attn.c_attn.weight.zero_()
        # embeddings near a 3-dimensional subspace, off-centre: PCA must centre them to find 3 or 4 dims
        torch.manual_seed(0)
        model.wte.weight.copy_(torch.randn(64, 3) @ torch.randn(3, 8) + 0.05 * torch.randn(64, 8) + 4)
    r = an.analyze(save(tmp_path / "m" / "ckpt.pt", model, step=3), data_dir, tokens=64, batch_size=2)
    T, L = 16, 2
    assert r["tokens"] == 64 and r["step"] == 3 and r["curve"] is None
    assert r["val_loss"] == pytest.approx(math.log(64))  # zero lm_head: uniform over the vocabulary
    assert r["val_loss_no_anchor"] is None and r["lambda_ratio"] == {} and r["lambda_ratio_effective"] is None
    assert r["attention_sink"] == pytest.approx([sum(1 / (t + 1) for t in range(T)) / T] * L)
    assert r["attention_entropy"] == pytest.approx([sum(math.log(t + 1) for t in range(T)) / T] * L)
    assert r["top_k_attention"]["1"] == pytest.approx(r["attention_sink"])
    assert r["gate_mean"] == pytest.approx([0.5] * L) and r["gate_sparsity"] == [0.0] * L
    assert np.allclose(r["layer_similarity"], 1, atol=1e-6)
    # the embeddings of the analysed tokens, measured directly
    x = torch.from_numpy(np.fromfile(os.path.join(data_dir, "t_val_000000.bin"), dtype="<u2", offset=1024)[:64]
                         .astype(np.int64))
    h = model.wte.weight[x].detach().double()
    hn = torch.nn.functional.normalize(h, dim=-1).view(4, T, -1)
    cos = (hn @ hn.mT)[:, *torch.triu_indices(T, T, 1)]
    assert r["token_similarity"] == pytest.approx([cos.mean().item()] * (L + 1), abs=1e-6)
    assert r["token_similarity_std"] == pytest.approx([cos.std(unbiased=False).item()] * (L + 1), abs=1e-5)
    assert r["max_activation"] == pytest.approx([h.abs().max().item()] * (L + 1))
    assert r["hidden_norm"] == pytest.approx([h.norm(dim=-1).mean().item()] * (L + 1))
    var = np.linalg.svd((h - h.mean(0)).numpy(), compute_uv=False) ** 2
    dims = int(np.searchsorted(np.cumsum(var) / var.sum(), 0.99)) + 1
    assert dims in (3, 4) and r["pca_dims"] == [dims] * (L + 1)


def test_dynamic_effective_ratio_and_anchor_removal(tmp_path, data_dir):
    model = perturbed(GPTConfig(**TINY, **DYN_EXO))
    with torch.no_grad():
        for b in model.blocks:  # constant scales σ(bias): s1/s2 = σ(1)/σ(-1) = e for every λ pair
            b.attn.dyn.fc2.weight.zero_()
            b.attn.dyn.fc2.bias.copy_(torch.tensor([1.0, -1.0] * 4))
    path = save(tmp_path / "m" / "ckpt.pt", model)
    r = an.analyze(path, data_dir, tokens=64, batch_size=4)
    for s in "qkvg":
        static = [(b.attn.lam[s + "1"] / b.attn.lam[s + "2"]).flatten().tolist() for b in model.blocks]
        assert np.allclose(r["lambda_ratio"][s], static)
        assert np.allclose(r["lambda_ratio_effective"][s], np.array(static) * math.e, rtol=1e-5)
    m, _ = load_model(path)
    m.drop_anchor = True
    x = torch.from_numpy(np.fromfile(os.path.join(data_dir, "t_val_000000.bin"), dtype="<u2", offset=1024)[:65]
                         .astype(np.int64))
    assert r["val_loss_no_anchor"] == pytest.approx(m(x[:-1].view(4, 16), x[1:].view(4, 16))[1].item(), rel=1e-5)
    assert r["val_loss_no_anchor"] != pytest.approx(r["val_loss"])


def test_metrics_stay_float32_under_bf16_autocast():
    """The hooks run inside the model's autocast region: their matmuls must not drop to bfloat16."""
    torch.manual_seed(0)
    q, k, h = torch.randn(2, 2, 16, 4), torch.randn(2, 2, 16, 4), torch.randn(2, 16, 8)
    sums = []
    for amp in (False, True):
        rec = an.Recorder(GPT(GPTConfig(**TINY)))
        rec.begin(torch.zeros(2, 16, dtype=torch.long))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            rec.model.blocks[0].attn.inspect(q=q, k=k, g=None, scales=None)
            rec._state_hook(0)(rec.model.wte, (), h)  # what the hook on wte calls
        sums.append(torch.cat([torch.stack(list(rec.attn[0].values())), torch.stack(list(rec.tok_sim[0].values())),
                               rec.sum_xx[0].flatten()]))
    assert torch.equal(sums[0], sums[1])


def test_hooks_are_removed(tmp_path):
    model = GPT(GPTConfig(**TINY, **DYN_EXO))
    rec = an.Recorder(model)
    assert model.blocks[0].attn.inspect is not None and model.wte._forward_hooks
    rec.remove()
    assert all(b.attn.inspect is None and not b._forward_hooks for b in model.blocks)
    assert not model.wte._forward_hooks


# ----------------------------------------------------------------------------- command line

def two_checkpoints(tmp_path):
    gated = save(tmp_path / "gated" / "ckpt.pt", perturbed(GPTConfig(**TINY, gate=True)), step=20)
    dyn = perturbed(GPTConfig(**TINY, **DYN_EXO), seed=1)
    with torch.no_grad():
        dyn.blocks[1].attn.lam["v2"][0, 0, 0] = 0.0  # λ1/λ2 = ±inf there: must become null, not Infinity
    dyn = save(tmp_path / "dyn" / "ckpt.pt", dyn, step=20)
    with open(tmp_path / "dyn" / "log.jsonl", "w") as f:
        for line in ({"step": 0, "config": {}}, {"step": 0, "val_loss": 4.2}, {"step": 10, "train_loss": 4.0},
                     {"step": 20, "train_loss": 3.9, "val_loss": 3.8}):
            f.write(json.dumps(line) + "\n")
        f.write('{"step": 30, "val_lo')  # a line cut by a crash: skipped with a note
    return gated, dyn


def run_cli(args):
    return subprocess.run([sys.executable, "-m", "tools.analyze", *args], capture_output=True, text=True, cwd=ROOT)


def check_schema(res, gated, dyn):
    assert list(res) == [gated, dyn]  # keyed by the paths as given
    L = TINY["n_layer"]
    for path, e in res.items():
        assert e["config"]["n_layer"] == L and e["tokens"] == 96 and isinstance(e["val_loss"], float)
        for key in ("attention_sink", "attention_entropy", "gate_mean", "gate_sparsity"):
            assert len(e[key]) == L and all(isinstance(v, float) for v in e[key]), key
        assert sorted(e["top_k_attention"], key=int) == ["1", "2", "3", "10"]
        assert all(len(v) == L for v in e["top_k_attention"].values())
        for key in ("token_similarity", "token_similarity_std", "max_activation", "hidden_norm", "pca_dims"):
            assert len(e[key]) == L + 1, key
        assert np.array(e["layer_similarity"]).shape == (L + 1, L + 1)
    g, d = res[gated], res[dyn]
    assert g["variant"] == "Gated Attention" and d["variant"] == "Dynamic E-ExoFormer"
    assert g["lambda_ratio"] == {} and g["lambda_ratio_effective"] is None and g["val_loss_no_anchor"] is None
    assert g["curve"] is None and d["curve"] == [[0, 4.2], [20, 3.8]]
    assert isinstance(d["val_loss_no_anchor"], float)
    C = TINY["n_embd"]
    for key in ("lambda_ratio", "lambda_ratio_effective"):
        assert list(d[key]) == list("qkvg") and all(len(rows) == L and all(len(r) == C for r in rows)
                                                    for rows in d[key].values())
        assert d[key]["v"][1][0] is None and d[key]["v"][1][1] is not None


def strict_json(path):
    def refuse(name):
        raise ValueError(f"{name} in {path}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_cli_with_matplotlib(tmp_path, data_dir):
    pytest.importorskip("matplotlib")
    gated, dyn = two_checkpoints(tmp_path)
    out = tmp_path / "analysis"
    r = run_cli([gated, dyn, "--data_dir", data_dir, "--tokens", "96", "--batch_size", "4", "--out", str(out),
                 "--device", "cpu"])
    assert r.returncode == 0, r.stderr
    assert "Gated Attention" in r.stdout and "Dynamic E-ExoFormer" in r.stdout and "figures" in r.stdout
    assert gated in r.stderr and dyn in r.stderr  # one progress bar per model
    check_schema(strict_json(out / "analysis.json"), gated, dyn)
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    expected = {"lambda_ratio_q.png", "lambda_ratio_g.png", "lambda_ratio_layers.png", "attention_sink.png",
                "attention_entropy.png", "top_k_attention.png", "gate_mean.png", "gate_sparsity.png",
                "token_similarity.png", "max_activation.png", "hidden_norm.png", "pca_dims.png",
                "layer_similarity.png", "val_loss_curves.png", "anchor_removal.png"}
    assert expected <= set(pngs)
    for p in pngs:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p


def test_cli_without_matplotlib(tmp_path, data_dir, monkeypatch, capsys):
    """In this process (analyze.py's command runs as a process above), as if matplotlib were not installed."""
    for name in ["matplotlib", *(m for m in sys.modules if m.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)  # every import of it fails
    gated, dyn = two_checkpoints(tmp_path)
    out = tmp_path / "analysis"
    an.main([gated, dyn, "--data_dir", data_dir, "--tokens", "96", "--batch_size", "4", "--out", str(out)])
    assert "plots skipped" in capsys.readouterr().out
    check_schema(strict_json(out / "analysis.json"), gated, dyn)
    assert os.listdir(out) == ["analysis.json"]


@pytest.mark.parametrize("case", ["missing_ckpt", "bad_ckpt", "missing_data", "no_val_shard", "bad_shard",
                                  "few_tokens", "another_tokenizer"])
def test_bad_input_fails_before_any_work(tmp_path, data_dir, enc_file, case):
    good = save(tmp_path / "good" / "ckpt.pt", GPT(GPTConfig(**TINY)))
    ckpts, data, tokens = [good], data_dir, "64"
    if case == "missing_ckpt":  # the second checkpoint is bad: the first one is not analysed either
        ckpts.append(name := str(tmp_path / "nope.pt"))
    elif case == "bad_ckpt":
        ckpts.append(name := str(tmp_path / "bad.pt"))
        open(name, "wb").write(b"not a checkpoint")
    elif case == "missing_data":
        data = name = str(tmp_path / "nodata")
    elif case == "no_val_shard":
        data = name = str(tmp_path / "empty")
        os.makedirs(data)
    elif case == "bad_shard":
        data = str(tmp_path / "trunc")
        os.makedirs(data)
        name = os.path.join(data, "t_val_000000.bin")
        open(name, "wb").write(open(os.path.join(data_dir, "t_val_000000.bin"), "rb").read()[:-2])
    elif case == "another_tokenizer":  # trained on data of the tests' tokenizer: data that records none is GPT-2's
        ckpts.append(name := save(tmp_path / "mine" / "ckpt.pt", GPT(GPTConfig(**TINY)),
                                  tokenizer=read_tokenizer(enc_file)))
    else:
        tokens, name = "8", "--tokens 8"
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        an.main([*ckpts, "--data_dir", data, "--tokens", tokens, "--out", str(out)])
    msg = str(e.value)
    assert msg.startswith("analyze.py: error:") and name in msg and "\n" not in msg
    assert not out.exists()  # nothing written, nothing analysed
