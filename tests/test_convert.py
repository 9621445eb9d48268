"""convert.py: the authors' checkpoint layouts, written out here by hand from random models of ours, must
convert back to the same model (same logits); what we do not implement is refused; downloads resume;
our own checkpoints export to weights-only files that eval.py and train.py --eval_only read."""
import dataclasses
import io
import os
import subprocess
import sys
import urllib.parse

import pytest
import torch

import eval as ev
import train
from engine import httpclient
from engine.checkpoint import load_model
from engine.configurator import load_config
from model import GPT, GPTConfig
from tests.test_eval import small_data
from tests.test_prepare import server  # noqa: F401  (fixture: the local HTTP server with injected faults)
from tests.test_train import SMALL, data_dir  # noqa: F401  (fixture: toy token shards)
from tools import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
V = 57601  # the authors' vocabulary
STEP = 38146


def random_model(**fields):
    """A small model of ours with every parameter random (norms and λ too, so that a weight landing in
    the wrong place changes the logits) and bf16-representable, so that bf16 copies of it are exact."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=64, vocab_size=V, **fields))
    with torch.no_grad():
        for name, p in m.named_parameters():
            centre = 1.0 if "norm" in name or "ln_" in name else 0.5 if ".lam." in name else 0.0
            p.copy_((centre + 0.2 * torch.randn_like(p)).bfloat16().float())
    return m.eval()


# Their ModelConfig, field by field with its defaults: the same in oldmodels/model1..4.py and model.py, which lacks
# only anchor_delta_*. Their train.py's values for a run override these in the file's model_args.
THEIR_DEFAULTS = dict(
    block_size=1024, vocab_size=57601, n_layer=12, n_head=12, n_embd=768, mlp_hidden_dim=None, mlp_ratio=4.0,
    weight_tying=False, act_type="gelu", rope_theta=500000.0, rmsnorm_eps=1e-6, rmsnorm_use_weight=True,
    rmsnorm_use_bias=False, embedding_dropout=0.0, residual_dropout=0.0, attention_dropout=0.0, norm_pos="after",
    qk_norm=True, clip_qkv=None, flash_attention=False, init_std=0.02, init_cutoff_factor=None, yarn_enabled=False,
    yarn_max_seq_len=16384, yarn_alpha=1.0, yarn_beta=32.0, logit_soft_cap=None, smear_gate_enabled=True,
    smear_gate_dim=12, value_res_enabled=True, value_res_lambda_init=0.5, query_res_enabled=True,
    query_res_lambda_init=0.5, key_res_enabled=True, key_res_lambda_init=0.5, per_layer_backout=True,
    residual_mode="elementwise", gated_attention_enabled=True, gate_res_enabled=True, gate_res_lambda_init=0.5,
    decouple_anchor=True, q_residual_norm_enabled=True, k_residual_norm_enabled=True, v_residual_norm_enabled=True,
    g_residual_norm_enabled=True, embedding_layer0_mix_enabled=False, embedding_layer0_alpha_init=0.5,
    dynamic_mixing_enabled=True, dynamic_mixing_hidden_dim=16, anchor_delta_enabled=False, anchor_delta_init=0.0)
LATER = ("model3", "model4", "latest")  # their files that read the residual-norm flags ('latest': model.py)


def their_args(c, layout, flags):
    """The model_args their train.py saved for a run of config c with one of their model files: every field of
    their ModelConfig. model1/model2 never read decouple_anchor, dynamic_mixing_enabled or the residual-norm
    flags, so those are whatever the run's train.py said; here their defaults (True)."""
    args = dict(THEIR_DEFAULTS, block_size=c.block_size, vocab_size=c.vocab_size, n_layer=c.n_layer,
                n_head=c.n_head, n_embd=c.n_embd, act_type="swiglu", norm_pos="before", flash_attention=True,
                init_cutoff_factor=3, smear_gate_enabled=False, per_layer_backout=False,
                value_res_enabled="v" in c.mix, query_res_enabled="q" in c.mix, key_res_enabled="k" in c.mix,
                gate_res_enabled="g" in c.mix, residual_mode=c.granularity if c.mix else "headwise",
                gated_attention_enabled=c.gate, **{f"{s}_residual_norm_enabled": on for s, on in flags.items()})
    if layout in LATER:
        args.update(decouple_anchor=c.anchor == "exo", dynamic_mixing_enabled=c.dynamic or layout == "model3")
    if layout == "latest":
        del args["anchor_delta_enabled"], args["anchor_delta_init"]
    return args


def their_checkpoint(m, layout, prefix="", flags=None):
    """m as the authors' train.py saved it with one of their model files: layout 'model1' (no anchor norm
    tensors), 'model2' (v_norm, g_norm in every layer, always), or 'model3', 'model4', 'latest' (internal anchor
    norms v_res_norm, g_res_norm in layer 0, exogenous ones anchor_{s}_norm, each where its flag is on).
    flags: their residual-norm flags, one bool for all four or {s: bool}; default True (their default) in
    model1/model2, which ignore them, and m's anchor_norm in the later files (True without anchors).
    Names, shapes and dtypes written out by hand from their code."""
    c = m.config
    H, D, C = c.n_head, c.head_dim, c.n_embd
    slots = "qkvg" if c.gate else "qkv"  # their anchor_proj and dynamic outputs cover every projection
    if flags is None:
        flags = c.anchor_norm or c.anchor == "none" if layout in LATER else True
    flags = {s: flags for s in "qkvg"} if isinstance(flags, bool) else flags
    g = torch.Generator().manual_seed(1)
    junk = lambda *shape: torch.randn(*shape, generator=g)  # tensors their model has and never applies
    bf16 = lambda t: t.detach().to(torch.bfloat16)  # their nn.Linear / nn.Embedding weights (and biases)
    f32 = lambda t: t.detach().clone()
    norm = lambda s, used: f32(m.anchor_norms[s].weight if used and s in m.anchor_norms else junk(D))
    sd = {"transformer.wte.weight": bf16(m.wte.weight), "transformer.final_norm.weight": f32(m.ln_f.weight),
          "lm_head.weight": bf16(m.lm_head.weight)}
    for i, b in enumerate(m.blocks):
        p, a = f"transformer.layers.{i}.", b.attn
        sd[p + "attn_norm.weight"], sd[p + "mlp_norm.weight"] = f32(b.ln_1.weight), f32(b.ln_2.weight)
        sd[p + "attn.c_attn.weight"], sd[p + "attn.c_proj.weight"] = bf16(a.c_attn.weight), bf16(a.c_proj.weight)
        sd[p + "attn.q_norm.weight"], sd[p + "attn.k_norm.weight"] = f32(a.q_norm.weight), f32(a.k_norm.weight)
        shape = {"scalar": (), "headwise": (H,), "elementwise": (H, D)}[c.granularity]
        for s in a.mixed_here:
            sd[p + f"attn.lambda_{s}1"] = f32(a.lam[s + "1"]).reshape(shape)
            sd[p + f"attn.lambda_{s}2"] = f32(a.lam[s + "2"]).reshape(shape)
        if a.dyn is not None:
            sd[p + "attn.dynamic_mixing.fc1.weight"] = bf16(a.dyn.fc1.weight)
            w, bias = junk(2 * len(slots), 16), junk(2 * len(slots))  # outputs q1, q2, k1, k2, v1, v2, g1, g2
            for n, s in enumerate(a.mixed_here):
                j = 2 * slots.index(s)
                w[j:j + 2], bias[j:j + 2] = a.dyn.fc2.weight[2 * n:2 * n + 2], a.dyn.fc2.bias[2 * n:2 * n + 2]
            sd[p + "attn.dynamic_mixing.fc2.weight"], sd[p + "attn.dynamic_mixing.fc2.bias"] = bf16(w), bf16(bias)
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc2.weight"] = bf16(b.mlp.fc1.weight), bf16(b.mlp.fc2.weight)
        for s in slots[2:]:  # internal anchor norms (v, g): only layer 0's copy is ever applied
            if layout == "model2":
                sd[p + f"attn.{s}_norm.weight"] = norm(s, i == 0)
            if layout in LATER and c.anchor != "exo" and i == 0 and flags[s]:
                sd[p + f"attn.{s}_res_norm.weight"] = norm(s, True)
    if c.anchor == "exo":
        w = junk(len(slots) * C, C)
        for n, s in enumerate(c.mixed_projections):
            j = slots.index(s) * C
            w[j:j + C] = m.anchor_proj.weight[n * C:(n + 1) * C]
        sd["anchor_proj.weight"] = bf16(w)
        for s in slots:  # one norm per flag that is on, projection mixed or not
            if flags[s]:
                sd[f"anchor_{s}_norm.weight"] = norm(s, True)
    return {"model": {prefix + k: v for k, v in sd.items()}, "model_args": their_args(c, layout, flags),
            "config": {"lr": 0.01}, "step": STEP, "tokens_processed": STEP * 262144,
            "muon_optimizer": {"state": {}}, "adamw_optimizer": {"state": {}}}


EXO = dict(gate=True, anchor="exo", mix="qkvg")
NURES = dict(gate=True, anchor="internal", mix="qkvg")
CASES = {  # name: (our config fields, their model file, key prefix, their residual-norm flags or None)
    # model1.py (their README: Baseline, Gated, ResFormer, NKQR, OQKRN): the flags True, no norm tensor, raw anchors
    "baseline-model1": (dict(), "model1", "", None),
    "gated-model1": (dict(gate=True), "model1", "", None),
    "resformer-model1": (dict(anchor="internal", mix="v"), "model1", "", None),
    "nkqr_e-model1-compiled": (dict(NURES, mix="vg", granularity="elementwise"), "model1", "_orig_mod.", None),
    "oqkrn_e-model1": (dict(NURES, granularity="elementwise"), "model1", "", None),
    "oqkrn_e-model1-flags-off": (dict(NURES, granularity="elementwise"), "model1", "", False),
    # model2.py: v_norm, g_norm in every layer: normalised internal anchors, whatever the flags say
    "gated-model2-unused-norms": (dict(gate=True), "model2", "", None),
    "nuresformer_h-model2": (dict(NURES, granularity="headwise", anchor_norm=True), "model2", "", None),
    "nuresformer_e-model2-flags-off": (dict(NURES, granularity="elementwise", anchor_norm=True), "model2", "", False),
    # model3/4.py, model.py: internal norms per flag, v_res_norm and g_res_norm in layer 0
    "nuresformer_s-latest": (dict(NURES, granularity="scalar", anchor_norm=True), "latest", "", None),
    "nuresformer_h-model3-internal": (dict(NURES, granularity="headwise", anchor_norm=True), "model3", "", None),
    "oqkrn_e-latest-flags-off": (dict(NURES, granularity="elementwise"), "latest", "", None),
    "resformer-latest-flags-off": (dict(anchor="internal", mix="v"), "latest", "", None),
    "gated-latest-unused-res-norms": (dict(gate=True), "latest", "", None),
    "internal-qk-latest-normalised": (dict(NURES, mix="qk", granularity="headwise", anchor_norm=True), "latest", "",
                                      None),
    # exogenous anchors (model3/4.py, model.py): anchor_{s}_norm where the flag is on
    "exoformer_e-model3": (dict(EXO, granularity="elementwise", anchor_norm=True), "model3", "", None),
    "exoformer_s-nonorm-model3": (dict(EXO, granularity="scalar"), "model3", "", None),
    "exoformer_h-latest": (dict(EXO, granularity="headwise", anchor_norm=True), "latest", "", None),
    "dyn_exo-compiled": (dict(EXO, granularity="elementwise", anchor_norm=True, dynamic=True), "model4", "_orig_mod.",
                         None),
    "dyn_exo-h-mixing-kv": (dict(EXO, mix="kv", granularity="headwise", anchor_norm=True, dynamic=True), "model4", "",
                            None),
}


def write(ckpt, path):
    torch.save(ckpt, path)
    return str(path)


@pytest.mark.parametrize("case", CASES)
def test_round_trip_gives_the_same_logits(case, tmp_path, capsys):
    fields, layout, prefix, flags = CASES[case]
    m = random_model(**fields)
    src = write(their_checkpoint(m, layout, prefix, flags), tmp_path / "ckpt_step:38146.pt")
    out = tmp_path / "out" / "ckpt.pt"
    convert.main([src, "--out", str(out)])
    got, ckpt = load_model(str(out))
    assert got.config == m.config
    assert set(ckpt) == {"model", "model_config", "step", "source"} and ckpt["step"] == STEP
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(got(idx)[0], m(idx)[0])
    line = capsys.readouterr().out.splitlines()[0]
    assert f"authors' checkpoint: {m.config.name} (" in line
    assert f"), 3 layers, C=32, vocab {V}, step {STEP}" in line


def test_config_files():
    for name in ("baseline", "gated", "resformer", "nuresformer_h", "nuresformer_e_nonorm", "nkqr_e", "exoformer_s",
                 "exoformer_e_nonorm", "dyn_exo"):
        fields = load_config([os.path.join(ROOT, "configs", f"{name}.py")], dataclasses.asdict(GPTConfig()))
        config = GPTConfig(**{**fields, "vocab_size": V})
        assert convert.config_file(config) == (f"configs/{name}.py", True)
    assert convert.config_file(GPTConfig(n_layer=3, gate=True)) == ("configs/gated.py", False)
    assert convert.config_file(GPTConfig(gate=True, anchor="exo", mix="kv")) == (None, False)


# ----------------------------------------------------------------------------- refusals

def refused(argv, tmp_path):
    """Run convert.py, expect a one-line error, and check that nothing was written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        convert.main([*argv, "--out", str(out / "ckpt.pt")])
    msg = str(e.value)
    assert msg.startswith("convert.py: error: ") and "\n" not in msg
    assert not out.exists() or os.listdir(out) == []
    return msg


@pytest.mark.parametrize("field,value", [("norm_pos", "after"), ("act_type", "gelu"), ("weight_tying", True),
                                         ("smear_gate_enabled", True), ("logit_soft_cap", 30.0),
                                         ("per_layer_backout", True), ("anchor_delta_enabled", True)])
def test_refuses_what_model_py_does_not_implement(field, value, tmp_path):
    ckpt = their_checkpoint(random_model(gate=True), "model4")
    ckpt["model_args"][field] = value
    msg = refused([write(ckpt, tmp_path / "c.pt")], tmp_path)
    assert f"model_args.{field}={value!r}: model.py implements only {field}=" in msg


def test_refuses_anchors_normalised_for_some_projections_only(tmp_path):
    # model.py with g_residual_norm_enabled=False: the flags disagree with each other
    flags = dict(q=True, k=True, v=True, g=False)
    ckpt = their_checkpoint(random_model(**NURES, anchor_norm=True), "latest", flags=flags)
    assert "transformer.layers.0.attn.g_res_norm.weight" not in ckpt["model"]
    assert "g_residual_norm_enabled=False: model.py normalises" in refused([write(ckpt, tmp_path / "c.pt")], tmp_path)
    # the flags agree, the tensors do not: a norm for v only
    ckpt = their_checkpoint(random_model(**NURES, anchor_norm=True), "model4")
    del ckpt["model"]["transformer.layers.0.attn.g_res_norm.weight"]
    assert "anchor norms for qkv only, of mixed qkvg" in refused([write(ckpt, tmp_path / "c.pt")], tmp_path)
    ckpt = their_checkpoint(random_model(**EXO, anchor_norm=True), "model3", flags=dict(flags, k=False, g=True))
    assert "anchor norms for qvg only, of mixed qkvg" in refused([write(ckpt, tmp_path / "c.pt")], tmp_path)


def test_exo_norm_flags_without_norm_tensors_mean_raw_anchors(tmp_path):
    """The tensors win over the flags: flags on, anchor_{s}_norm gone, so the anchors are raw."""
    m = random_model(**EXO, granularity="elementwise")
    ckpt = their_checkpoint(m, "model3", flags=True)
    for s in "qkvg":
        del ckpt["model"][f"anchor_{s}_norm.weight"]
    convert.main([write(ckpt, tmp_path / "c.pt"), "--out", str(tmp_path / "out.pt")])
    got = load_model(str(tmp_path / "out.pt"))[0]
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(2))
    assert got.config == m.config and torch.equal(got(idx)[0], m(idx)[0])


@pytest.mark.parametrize("change,message", [
    (lambda sd: sd.pop("transformer.layers.1.attn.c_proj.weight"), "missing tensor(s) blocks.1.attn.c_proj.weight"),
    (lambda sd: sd.pop("transformer.layers.2.attn.dynamic_mixing.fc2.bias"),
     "missing tensor(s) blocks.2.attn.dyn.fc2.bias"),
    (lambda sd: sd.update({"transformer.layers.0.attn.smear.weight": torch.ones(2)}),
     "unexpected tensor transformer.layers.0.attn.smear.weight"),
    (lambda sd: sd.update({"transformer.layers.2.mlp.fc1.weight": torch.ones(64, 32)}),
     "tensor blocks.2.mlp.fc1.weight has shape (64, 32), expected (128, 32)"),
    (lambda sd: sd.update({"transformer.layers.0.attn.lambda_v1": torch.ones(2)}),
     "tensor transformer.layers.0.attn.lambda_v1 has shape (2,), expected (2, 16)"),
    (lambda sd: sd.update({"anchor_proj.weight": torch.ones(96, 32)}), "anchor_proj.weight has 96 rows, expected 128"),
])
def test_refuses_missing_unexpected_and_misshapen_tensors(change, message, tmp_path):
    ckpt = their_checkpoint(random_model(**EXO, granularity="elementwise", anchor_norm=True, dynamic=True), "model4")
    change(ckpt["model"])
    assert message in refused([write(ckpt, tmp_path / "c.pt")], tmp_path)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_refuses_files_that_are_not_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = their_checkpoint(random_model(), "model1")
    evil = write({**ckpt, "payload": Boom()}, tmp_path / "evil.pt")
    assert "not loadable with torch.load(weights_only=True)" in refused([evil], tmp_path)
    assert not (tmp_path / "PWNED").exists()
    (tmp_path / "text.pt").write_text("hello")
    assert "text.pt: not loadable" in refused([str(tmp_path / "text.pt")], tmp_path)
    assert "neither 'model_config'" in refused([write({"model": {}}, tmp_path / "a.pt")], tmp_path)
    args = dict(ckpt["model_args"])
    del args["n_layer"]
    assert "model_args has no n_layer" in refused([write({**ckpt, "model_args": args}, tmp_path / "b.pt")], tmp_path)
    assert "no such file, and not a Hugging Face repository" in refused([str(tmp_path / "none.pt")], tmp_path)
    (tmp_path / "out").mkdir()
    src = write(ckpt, tmp_path / "out" / "ckpt.pt")
    with pytest.raises(SystemExit, match="that is the checkpoint being converted"):
        convert.main([src, "--out", src])


# ----------------------------------------------------------------------------- the Hub and downloads

@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(httpclient, "BACKOFF", 0.0)
    monkeypatch.setattr(httpclient, "TIMEOUT", (2, 1))


def saved(ckpt):
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return buf.getvalue()


def publish(server, repo, files):
    """Serve files {filename: body} of a Hub repository, at their URLs (quoted: ':' is %3A)."""
    for name, body in files.items():
        server.files[f"{repo}/resolve/main/{urllib.parse.quote(name)}"] = body


def test_download_resumes_after_a_cut_and_is_cached(server, fast, tmp_path):
    m = random_model(gate=True)
    body = saved(their_checkpoint(m, "model1"))
    name = "Jonnester/Tiny/resolve/main/ckpt_step%3A38146.pt"  # the ':' percent-encoded
    server.files[name], server.faults[name] = body, ["cut"]
    cache, out = tmp_path / "cache", tmp_path / "a" / "ckpt.pt"
    argv = ["Jonnester/Tiny", "--out", str(out), "--cache_dir", str(cache), "--base_url", server.url]
    convert.main(argv)
    assert server.log[0] == ("api/models/Jonnester/Tiny", "blobs=true", 200)  # the listing, then the file
    (r0, s0), (r1, s1) = [(r, s) for n, r, s in server.log if n == name]
    assert (r0, s0) == (None, 200) and s1 == 206 and int(r1[6:-1]) > 0  # resumed where the cut left it
    assert os.listdir(cache / "Jonnester" / "Tiny") == ["ckpt_step:38146.pt"]  # no .part left
    assert (cache / "Jonnester" / "Tiny" / "ckpt_step:38146.pt").read_bytes() == body
    idx = torch.randint(0, V, (1, 8))
    assert torch.equal(load_model(str(out))[0](idx)[0], m(idx)[0])
    convert.main(argv)  # cached: no second listing, no second download
    assert len(server.log) == 3
    server.files["Jonnester/Tiny/resolve/main/other%20name.pt"] = body  # REPO/FILENAME
    convert.main(["Jonnester/Tiny/other name.pt", *argv[1:]])
    assert (cache / "Jonnester" / "Tiny" / "other name.pt").read_bytes() == body
    msg = refused(["Jonnester/Tiny/missing.pt", "--cache_dir", str(cache), "--base_url", server.url], tmp_path)
    assert f"{server.url}/Jonnester/Tiny/resolve/main/missing.pt: HTTP 404" in msg
    msg = refused(["Jonnester/Missing", "--cache_dir", str(cache), "--base_url", server.url], tmp_path)
    assert f"{server.url}/api/models/Jonnester/Missing?blobs=true: HTTP 404" in msg


def test_the_checkpoint_is_picked_as_their_loader_does(server, fast, tmp_path):
    m = random_model(anchor="internal", mix="v")
    body = saved(their_checkpoint(m, "model1"))
    # by the number, not as strings ("9999" > "38146" > "100000")
    publish(server, "J/Steps", {"ckpt_step:9999.pt": b"x", "ckpt_step:100000.pt": body, "ckpt_step:38146.pt": b"x",
                                "README.md": b"x"})
    publish(server, "J/Named", {"checkpoint.pt": b"x", "final_model.pt": body, "ckpt_step:38146.pt": b"x"})
    publish(server, "J/Checkpoint", {"checkpoint.pt": body, "ckpt_step:38146.pt": b"x"})
    for repo, expected in [("J/Steps", "ckpt_step:100000.pt"), ("J/Named", "final_model.pt"),
                           ("J/Checkpoint", "checkpoint.pt")]:
        out = tmp_path / repo / "ckpt.pt"
        convert.main([repo, "--out", str(out), "--cache_dir", str(tmp_path / "cache"), "--base_url", server.url])
        assert os.listdir(tmp_path / "cache" / repo) == [expected]
        assert torch.load(out, weights_only=True)["source"] == \
            f"the authors' checkpoint {repo}/{expected}, converted by convert.py"


def test_a_repository_without_checkpoints_is_one_line_listing_its_files(server, fast, tmp_path):
    publish(server, "J/Notes", {"README.md": b"# notes", "weights.safetensors": b"x", "ckpt_step:latest.pt": b"x"})
    msg = refused(["J/Notes", "--cache_dir", str(tmp_path / "cache"), "--base_url", server.url], tmp_path)
    assert msg == ("convert.py: error: J/Notes: no checkpoint (final_model.pt, checkpoint.pt or ckpt_step:N.pt) "
                   "among its files: README.md, ckpt_step:latest.pt, weights.safetensors")
    assert not (tmp_path / "cache" / "J" / "Notes").exists()  # nothing downloaded


def test_list_shows_repositories_checkpoints_sizes_and_variants(server, fast, tmp_path, capsys):
    cache = tmp_path / "cache"
    publish(server, "Jonnester/Baseline", {"ckpt_step:38146.pt": bytes(1_754_600), ".gitattributes": b"x"})
    publish(server, "Jonnester/NuResFormer-OQKRN-E", {"ckpt_step:1000.pt": bytes(2000),
                                                      "ckpt_step:38146.pt": bytes(3000)})
    publish(server, "Jonnester/run7", {"ckpt_step:38146.pt": b"x"})  # a name that says nothing ...
    (cache / "Jonnester" / "run7").mkdir(parents=True)  # ... and a copy downloaded before, which does
    write(their_checkpoint(random_model(**EXO, granularity="headwise", anchor_norm=True), "model3"),
          cache / "Jonnester" / "run7" / "ckpt_step:38146.pt")
    publish(server, "Jonnester/Notes", {"README.md": b"x"})
    publish(server, "Someone/Baseline", {"ckpt_step:1.pt": b"x"})  # another user's
    server.faults["api/models/Jonnester/Notes"] = ["503"]  # retried
    found = convert.main(["--list", "Jonnester", "--cache_dir", str(cache), "--base_url", server.url])
    assert [(r["repo"], r["pick"], r["variant"]) for r in found] == [
        ("Jonnester/Baseline", "ckpt_step:38146.pt", "Baseline (configs/baseline.py)"),
        ("Jonnester/Notes", None, None),
        ("Jonnester/NuResFormer-OQKRN-E", "ckpt_step:38146.pt",
         "E-NuResFormer (no anchor norm) (configs/nuresformer_e_nonorm.py)"),
        ("Jonnester/run7", "ckpt_step:38146.pt", "H-ExoFormer (configs/exoformer_h.py)")]
    assert found[2]["files"] == {"ckpt_step:38146.pt": 3000, "ckpt_step:1000.pt": 2000}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Jonnester/Baseline: Baseline (configs/baseline.py), by its name"
    assert out[1].split() == ["ckpt_step:38146.pt", "1.8", "MB", "<-", "convert.py", "Jonnester/Baseline", "takes",
                              "this", "one"]
    assert out[2:4] == ["Jonnester/Notes: variant ?", "    no checkpoint; its files: README.md"]
    assert out[7] == (f"Jonnester/run7: H-ExoFormer (configs/exoformer_h.py), read from "
                      f"{cache / 'Jonnester' / 'run7' / 'ckpt_step:38146.pt'}")
    assert out[-1] == "4 repositories of Jonnester, 3 with a checkpoint"


def test_truncated_download_is_never_used(server, fast, tmp_path, monkeypatch):
    monkeypatch.setattr(httpclient, "MAX_TRIES", 2)
    server.files["J/T/resolve/main/ckpt_step%3A38146.pt"] = saved(their_checkpoint(random_model(), "model1"))[:-100]
    cache = tmp_path / "cache"
    msg = refused(["J/T", "--cache_dir", str(cache), "--base_url", server.url], tmp_path)
    assert "giving up after 2 failed attempts" in msg and "not a complete torch.save file" in msg
    assert os.listdir(cache / "J" / "T") == []


@pytest.mark.parametrize("src,url,hint", [
    ("J/T/ckpt_step:38146.pt", "/J/T/resolve/main/ckpt_step%3A38146.pt", "copy {cache}/J/T/ckpt_step:38146.pt from"),
    ("J/T", "/api/models/J/T", "copy a checkpoint of J/T into {cache}/J/T from"),
])
def test_unreachable_host_fails_at_once_with_the_offline_hint(src, url, hint, closed_url, tmp_path, monkeypatch):
    monkeypatch.setattr(httpclient.time, "sleep", lambda s: pytest.fail(f"slept {s}s before retrying"))
    cache = tmp_path / "cache"
    msg = refused([src, "--cache_dir", str(cache), "--base_url", closed_url], tmp_path)
    assert msg.startswith(f"convert.py: error: {closed_url}{url}: cannot connect (") and "Connection refused" in msg
    assert msg.endswith(f"without internet, {hint.format(cache=cache)} a machine with internet")


# ----------------------------------------------------------------------------- end to end

def test_eval_py_scores_a_converted_file(tmp_path, enc_file, capsys):
    src = write(their_checkpoint(random_model(**EXO, granularity="elementwise", anchor_norm=True, dynamic=True),
                                 "model4", "_orig_mod."), tmp_path / "ckpt_step:38146.pt")
    out = tmp_path / "authors_dyn_exo" / "ckpt.pt"
    r = subprocess.run([sys.executable, "-m", "tools.convert", src, "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "authors' checkpoint: Dynamic E-ExoFormer" in r.stdout and f"wrote {out}" in r.stdout
    small_data(str(tmp_path / "data"))
    capsys.readouterr()
    ev.main([str(out), "--tokenizer", str(enc_file), "--data_dir", str(tmp_path / "data"), "--base_url",
             "http://127.0.0.1:9", "--limit", "3", "--tasks", "arc_easy,winogrande", "--device", "cpu"])
    printed = capsys.readouterr().out  # in this process: eval.py's command runs as a process in test_eval.py
    assert "average" in printed and "requests/s" in printed


def test_export_of_our_checkpoint_is_weights_only(data_dir, tmp_path, enc_file, capsys):
    run, export = tmp_path / "run", tmp_path / "export"
    cfg = SMALL + [f"--data_dir={data_dir}", "--vocab_size=384"]  # 384: above the test tokenizer's ids
    train.main(cfg + [f"--out_dir={run}", "--max_steps=2"])
    full = torch.load(run / "ckpt.pt", weights_only=True)
    assert {"optimizers", "loader", "rng"} <= set(full)
    summary = convert.main([str(run / "ckpt.pt"), "--out", str(export / "ckpt.pt")])
    small = torch.load(export / "ckpt.pt", weights_only=True)
    assert set(small) == {"model", "model_config", "step", "source", "config", "tokenizer"} and small["step"] == 2
    assert all(torch.equal(small["model"][k], v) for k, v in full["model"].items())
    assert summary["bytes_out"] < summary["bytes_in"] / 2  # the optimiser state was most of it
    # train.py --eval_only and eval.py read the export as they read the training checkpoint
    assert train.main(cfg + [f"--out_dir={export}", "--eval_only=True"]) == \
        train.main(cfg + [f"--out_dir={run}", "--eval_only=True"])
    small_data(str(tmp_path / "data"))
    capsys.readouterr()
    ev.main([str(export / "ckpt.pt"), "--tokenizer", str(enc_file), "--data_dir", str(tmp_path / "data"),
             "--limit", "2", "--tasks", "piqa", "--device", "cpu"])
    assert "average" in capsys.readouterr().out
    # resuming needs what the export dropped: one line, not a KeyError
    with pytest.raises(SystemExit, match=r"ckpt.pt: no resumable parts in this checkpoint; a run resumes from"):
        train.main(cfg + [f"--out_dir={export}", "--init_from=resume", "--max_steps=4"])
