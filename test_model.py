"""Tests of model.py: parameter counts, causality, the paper's equivalences, training signal, compile."""
import glob
import io
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.utils.checkpoint import checkpoint

import model as model_file
from engine.configurator import load_config, read_args
from model import (EOT, GPT, GRANULARITY_SHAPES, GPTConfig, KVCache, compiled, document_mask, flops_per_token, generate,
                   lm_loss, mix_with_anchor, triton_available)
from train import ALL_DEFAULTS, MODEL_KEYS

ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIG_DIR = os.path.join(ROOT, "configs")
# Every file in configs/ gets the generic tests (counts, reference, causality, gradients), a fork's new one too;
# the paper's variants, a fixed list, are also checked against README.md's table.
# A variant file sets what makes a variant (model.py's docstring); a file of sizes (tiny.py, size_7b.py) or of settings
# only (a data_dir, a vocab_size) goes after one, and is none
VARIANT_FIELDS = {"gate", "anchor", "mix", "granularity", "anchor_norm", "dynamic", "anchor_frozen"}
is_variant_file = lambda path: bool(VARIANT_FIELDS & read_args([path], ALL_DEFAULTS).keys())
VARIANT_FILES = sorted(filter(is_variant_file, glob.glob(os.path.join(CONFIG_DIR, "*.py"))))
PAPER_VARIANTS = ["baseline", "gated", "resformer", "nuresformer_s", "nuresformer_h", "nuresformer_e",
                  "exoformer_s", "exoformer_h", "exoformer_e", "dyn_exo", "exoformer_e_nonorm",
                  "nuresformer_e_nonorm", "nkqr_e", "gated_1b", "dyn_exo_1b"]
# the controls the paper's review asks for (not in the paper), a fixed list too
CONTROLS = ["dyn_exo_frozen", "dyn_nuresformer_e", "nuresformer_e_1b", "exoformer_e_1b", "dyn_nuresformer_e_1b"]
TINY = dict(n_layer=3, n_embd=32, n_head=2, block_size=32, vocab_size=64)


def file_config(path, **overrides):
    """The model of a config file (which may set training keys too, as train.py allows)."""
    config = load_config([path], ALL_DEFAULTS)
    return GPTConfig(**{**{k: config[k] for k in MODEL_KEYS}, **overrides})


def variant(name, **size):
    return file_config(os.path.join(CONFIG_DIR, name + ".py"), **{**TINY, **size})


def tiny_variants():
    """Every distinct variant among the config files, at a tiny size: (file name, config)."""
    seen = {}
    for f in VARIANT_FILES:
        cfg = file_config(f, **TINY)
        seen.setdefault(cfg, os.path.basename(f)[:-3])
    return [(name, cfg) for cfg, name in seen.items()]


VARIANTS = tiny_variants()
VARIANT_IDS = [name for name, _ in VARIANTS]


def randomize(model, seed=0, keep=()):
    """Random values for every parameter but those whose name contains a string of `keep`: the real
    init zeroes lm_head, c_proj and fc2, which would make every logit 0 and every comparison trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in keep):
                continue
            if ".lam." in name:
                p.copy_(0.25 + 0.75 * torch.rand(p.shape, generator=g))
            elif p.ndim == 1 and name.endswith("weight"):  # norm weights
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def twin(model, config, exclude=()):
    """A model of another variant carrying every weight the two share (but names containing a string
    of `exclude`, which keep their init); returns it and the names it did not receive."""
    other = GPT(config)
    own = other.state_dict()
    shared = {k: v for k, v in model.state_dict().items()
              if k in own and own[k].shape == v.shape and not any(e in k for e in exclude)}
    missing, _ = other.load_state_dict(shared, strict=False)
    return other, missing


def lambdas(model, which):
    """The λ_{n,1} ('1') or λ_{n,2} ('2') parameters of every mixing layer."""
    return [p for n, p in model.named_parameters() if ".lam." in n and n.endswith(which)]


def tokens(config, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (B, config.block_size), generator=g)


# ---------------------------------------------------------------- parameter counts

def spec_param_count(c):
    C, H, L, V = c.n_embd, c.n_head, c.n_layer, c.vocab_size
    D, m = C // H, len(c.mix)
    total = L * (2 * C + 2 * D + 10 * C * C + (C * C if c.gate else 0)) + 2 * V * C + C
    mixing_layers = {"none": 0, "internal": L - 1, "exo": L}[c.anchor]
    total += mixing_layers * 2 * m * math.prod(GRANULARITY_SHAPES[c.granularity](H, D))  # values per λ
    if c.anchor == "exo":
        total += m * C * C + (m * D if c.anchor_norm else 0)
    if c.anchor == "internal" and c.anchor_norm:
        total += D * len(set(c.mix) & {"v", "g"})
    if c.dynamic:
        total += mixing_layers * (16 * C + 16 * 2 * m + 2 * m)
    return total


@pytest.mark.parametrize("path", VARIANT_FILES, ids=os.path.basename)
def test_param_count_matches_spec_formula(path):
    """Pins the recipe: the parameter count of every config file against spec_param_count, the paper's formula
    (a fork's new mechanism adds its parameters there)."""
    config = file_config(path)
    with torch.device("meta"):  # no memory, no time
        model = GPT(config)
    assert model.num_params() == spec_param_count(config)


def test_param_count_spec_examples():
    """Pins the recipe: the paper's four parameter counts (450M and 1B, Gated and Dynamic ExoFormer)."""
    with torch.device("meta"):
        counts = {name: GPT(file_config(os.path.join(CONFIG_DIR, name + ".py"))).num_params()
                  for name in ("gated", "dyn_exo", "gated_1b", "dyn_exo_1b")}
    assert counts == {"gated": 437_582_464, "dyn_exo": 442_493_672,
                      "gated_1b": 985_112_064, "dyn_exo_1b": 995_733_632}
    H, D = 16, 64  # the paper's granularities: one λ value, one per head, one per element
    assert [math.prod(GRANULARITY_SHAPES[g](H, D)) for g in ("scalar", "headwise", "elementwise")] == [1, H, H * D]


def test_config_files_name_their_variant():
    c = {os.path.basename(f)[:-3]: file_config(f) for f in VARIANT_FILES}
    assert (c["gated"].gate, c["gated"].anchor, c["gated"].n_layer) == (True, "none", 29)
    assert (c["baseline"].gate, c["baseline"].n_layer) == (False, 32)
    assert (c["resformer"].anchor, c["resformer"].mix, c["resformer"].gate) == ("internal", "v", False)
    for k, g in (("s", "scalar"), ("h", "headwise"), ("e", "elementwise")):
        assert (c[f"exoformer_{k}"].anchor, c[f"exoformer_{k}"].granularity) == ("exo", g)
        assert (c[f"nuresformer_{k}"].anchor, c[f"nuresformer_{k}"].granularity) == ("internal", g)
    assert c["dyn_exo"].dynamic and not c["exoformer_e"].dynamic
    assert not c["exoformer_e_nonorm"].anchor_norm and c["exoformer_e"].anchor_norm
    assert (c["nkqr_e"].mix, c["nkqr_e"].anchor_norm) == ("vg", False)
    assert (c["dyn_exo_1b"].n_embd, c["dyn_exo_1b"].n_layer) == (1536, 32)
    tiny = load_config([os.path.join(CONFIG_DIR, "dyn_exo.py"), os.path.join(CONFIG_DIR, "tiny.py")], ALL_DEFAULTS)
    assert tiny["dynamic"] and [tiny[k] for k in ("n_layer", "n_embd", "n_head", "block_size")] == [4, 128, 4, 256]


def test_a_file_of_sizes_or_settings_is_no_variant(tmp_path):
    """Only a file that sets what makes a variant gets the generic tests as one: not configs/tiny.py (sizes), nor a
    fork's file of settings (a vocabulary and its data, FORKING.md's recipe 7), which goes after a variant file."""
    (tmp_path / "bytes.py").write_text("vocab_size = 384\ndata_dir = 'data/mytext_bytes'\n")
    assert not is_variant_file(str(tmp_path / "bytes.py")) and not is_variant_file(os.path.join(CONFIG_DIR, "tiny.py"))
    assert is_variant_file(os.path.join(CONFIG_DIR, "dyn_exo.py"))
    assert not [f for f in VARIANT_FILES if f.endswith(("tiny.py", "small.py", "size_3b.py", "size_7b.py"))]


def test_variant_names():
    names = {name: variant(name).name for name in ("gated", "baseline", "resformer", "dyn_exo", "nuresformer_h",
                                                   "nkqr_e", "exoformer_e_nonorm")}
    assert names == {"gated": "Gated Attention", "baseline": "Baseline", "resformer": "ResFormer",
                     "dyn_exo": "Dynamic E-ExoFormer", "nuresformer_h": "H-NuResFormer",
                     "nkqr_e": "E-NuResFormer (mix vg, no anchor norm)",
                     "exoformer_e_nonorm": "E-ExoFormer (no anchor norm)"}


def test_init():
    model = GPT(variant("dyn_exo", n_embd=256, n_head=4))
    zero = ("lm_head", "c_proj", "fc2")
    for n, p in model.named_parameters():
        if any(z in n for z in zero):
            assert torch.all(p == 0), n
        elif ".lam." in n:
            assert torch.all(p == 1.0), n  # dynamic: 1.0, scaled by sigmoid(0) = 0.5
        elif p.ndim == 1:
            assert torch.all(p == 1), n  # RMSNorm weights (the only bias, dyn.fc2's, is zero above)
        else:  # N(0, 0.02) truncated at 3 sigma
            assert p.abs().max() <= 0.06 and abs(p.std().item() - 0.02) < 0.002, n
    static = GPT(variant("exoformer_h"))
    assert all(torch.all(p == 0.5) for p in lambdas(static, "1") + lambdas(static, "2"))


@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_a_model_built_on_the_meta_device_initialises_to_the_same_weights_bit_for_bit(name, config):
    """A model built on the meta device, then given storage (to_empty) and GPT.init_weights, as train.py does, has
    exactly GPT(config)'s parameters and buffers from the same seed, and leaves the generator where GPT(config) leaves
    it: what train.py's runs, resumes and DDP = FSDP checks rely on."""
    torch.manual_seed(3)
    expected, expected_rng = GPT(config), torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(torch.get_rng_state(), expected_rng)
    got, want = dict(model.named_parameters()) | dict(model.named_buffers()), \
        dict(expected.named_parameters()) | dict(expected.named_buffers())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in expected.parameters()]


def test_init_weights_refuses_a_parameter_it_has_no_value_for():
    """A fork's new parameter that init_weights does not know is a one-line error naming it, not garbage weights."""
    with torch.device("meta"):
        model = GPT(variant("gated"))
        model.blocks[0].extra = torch.nn.Parameter(torch.empty(3))
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"no initial value for the parameter blocks\.0\.extra"):
        model.init_weights()


# ---------------------------------------------------------------- an independent reference

def reference_logits(model, idx):
    """The paper's model (the shared architecture and Eqs. 9-12) written out step by step from the raw
    parameters, sharing no code with model.py."""
    c, P = model.config, dict(model.named_parameters())
    B, T = idx.shape
    C, H, D = c.n_embd, c.n_head, c.n_embd // c.n_head
    F = torch.nn.functional

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def heads(x):  # (B, T, C) -> (B, H, T, D)
        return x.reshape(B, T, H, D).transpose(1, 2)

    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, D, 2).float() / D)
    angle = torch.arange(T).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)

    def rope(x):  # rotate-half: x * cos + (-x2, x1) * sin
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    def lam(name):  # stored in its broadcast shape over (B, H, T, D): (), (H, 1, 1), (H, 1, D), ...
        p = P[name]
        assert torch.broadcast_shapes(p.shape, (B, H, T, D)) == (B, H, T, D), (name, p.shape)
        return p

    def anchor_norm(s, a):
        return rms(a, P[f"anchor_norms.{s}.weight"]) if c.anchor_norm and s not in "qk" else a

    h = P["wte.weight"][idx]
    anchors = {}
    if c.anchor == "exo":
        a = h @ P["anchor_proj.weight"].T
        for i, s in enumerate(s for s in "qkvg" if s in c.mix):
            anchors[s] = heads(a[..., i * C:(i + 1) * C])
            if c.anchor_norm:
                anchors[s] = rms(anchors[s], P[f"anchor_norms.{s}.weight"])
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for n in range(c.n_layer):
        pre = f"blocks.{n}."
        x = rms(h, P[pre + "ln_1.weight"])
        qkvg = x @ P[pre + "attn.c_attn.weight"].T
        S = {s: heads(qkvg[..., i * C:(i + 1) * C]) for i, s in enumerate("qkvg"[:qkvg.shape[-1] // C])}
        if c.anchor == "exo" or (c.anchor == "internal" and n > 0):
            if c.dynamic:  # Eq. 12
                d = torch.sigmoid(F.gelu(x @ P[pre + "attn.dyn.fc1.weight"].T) @ P[pre + "attn.dyn.fc2.weight"].T
                                  + P[pre + "attn.dyn.fc2.bias"])
            for j, s in enumerate(s for s in "qkvg" if s in c.mix):
                l1, l2 = lam(pre + f"attn.lam.{s}1"), lam(pre + f"attn.lam.{s}2")
                if c.dynamic:
                    l1, l2 = l1 * d[:, None, :, 2 * j, None], l2 * d[:, None, :, 2 * j + 1, None]
                S[s] = l1 * anchors[s] + l2 * S[s]  # Eq. 10
        q, k = rms(S["q"], P[pre + "attn.q_norm.weight"]), rms(S["k"], P[pre + "attn.k_norm.weight"])
        if c.anchor == "internal" and n == 0:
            own = dict(S, q=q, k=k) if c.anchor_norm else S
            anchors = {s: anchor_norm(s, own[s]) for s in c.mix}
        att = (rope(q) @ rope(k).transpose(-1, -2)) / D ** 0.5
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ S["v"]
        if c.gate:
            y = y * torch.sigmoid(S["g"])
        h = h + y.transpose(1, 2).reshape(B, T, C) @ P[pre + "attn.c_proj.weight"].T
        a, b = (rms(h, P[pre + "ln_2.weight"]) @ P[pre + "mlp.fc1.weight"].T).chunk(2, -1)
        h = h + (F.silu(b) * a) @ P[pre + "mlp.fc2.weight"].T
    return rms(h, P["ln_f.weight"]) @ P["lm_head.weight"].T


@pytest.mark.quick
@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_matches_reference_implementation(name, config):
    """Pins the recipe: the model of every config file against reference_logits, an independent version of
    each mechanism (a fork's new mechanism extends it)."""
    model = randomize(GPT(config))
    idx = tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference_logits(model, idx), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- causality

@pytest.mark.quick
@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_causal(name, config):
    model = randomize(GPT(config)).eval()
    idx = tokens(config)
    t = config.block_size // 2
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % config.vocab_size
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t], b[:, t])  # the change is visible from position t on


# ---------------------------------------------------------------- document masking

FAMILIES = ["baseline", "gated", "resformer", "nuresformer_e", "exoformer_h", "dyn_exo"]


def packed(config, starts, B=2, seed=0):
    """Windows of GPT-2 ids with EOT at the given positions of row 0 (row 1: other positions)."""
    idx = tokens(config, B, seed) % EOT  # no EOT but where we put them
    idx[0, starts] = EOT
    idx[1, [s + 3 for s in starts]] = EOT
    return idx


@pytest.mark.quick
@pytest.mark.parametrize("name", FAMILIES)
def test_doc_mask_equals_each_document_run_alone(name):
    model = randomize(GPT(variant(name, vocab_size=50304))).eval()
    T = model.config.block_size
    starts = [5, 9, 20]  # documents [0,5) [5,9) [9,20) [20,T) in row 0; shifted by 3 in row 1
    idx = packed(model.config, starts)
    with torch.no_grad():
        logits, _ = model(idx, doc_mask=True)
        for row, cuts in ((0, starts), (1, [s + 3 for s in starts])):
            for a, b in zip([0] + cuts, cuts + [T]):
                alone, _ = model(idx[row:row + 1, a:b])  # positions 0..b-a-1: RoPE is relative
                torch.testing.assert_close(logits[row, a:b], alone[0], rtol=1e-5, atol=1e-5 * alone.abs().max())
        plain, _ = model(idx)
    assert torch.equal(logits[:, :5], plain[:, :5])  # the first document sees nothing else either way
    assert not torch.allclose(logits[:, 10:], plain[:, 10:], rtol=1e-3, atol=1e-3)  # later ones differ


@pytest.mark.parametrize("name", ["dyn_exo", "nuresformer_e"])
def test_flex_attention_path_equals_sdpa_mask_path(name):
    model = randomize(GPT(variant(name, vocab_size=50304))).eval()
    idx = packed(model.config, [3, 11, 17])
    with torch.no_grad():  # FlexAttention has no CPU backward; its forward runs here
        flex, _ = model(idx, mask=document_mask(idx, flex=True))
        dense, _ = model(idx, mask=document_mask(idx, flex=False))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert torch.equal(dense, model(idx, doc_mask=True)[0])  # True builds the dense mask on CPU


@pytest.mark.parametrize("name", ["gated", "dyn_exo"])
def test_doc_mask_without_eot_inside_is_plain_causal(name):
    model = randomize(GPT(variant(name, vocab_size=50304))).eval()
    idx = tokens(model.config) % EOT
    with torch.no_grad():
        assert torch.equal(model(idx, doc_mask=True)[0], model(idx)[0])
        idx[:, 0] = EOT  # an EOT opening the window starts the one document there is
        assert torch.equal(model(idx, doc_mask=True)[0], model(idx)[0])


def test_doc_mask_gradients_flow():
    model = randomize(GPT(variant("dyn_exo", vocab_size=50304)))
    idx = packed(model.config, [4, 12, 25])
    _, loss = model(idx[:, :-1], idx[:, 1:], z_loss=1e-4, doc_mask=True)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.ndim > 0)


def layouts(config, n, B=2):
    """n batches (B, block_size >= 256) of different document layouts: the first without EOT, the second with one
    at 128, FlexAttention's block boundary (a block it skips whole), then random ones, ever denser."""
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        idx = torch.randint(0, EOT, (B, config.block_size), generator=g)
        idx[torch.rand(idx.shape, generator=g) < i / (2 * n)] = EOT
        if i == 1:
            idx[:, 128] = EOT
        yield idx


def compiled_graphs():
    """Graphs dynamo has compiled since the last torch._dynamo.reset() (its own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh_dynamo():
    """No compiled graph of an earlier test: each test's count starts at 0, and no test meets dynamo's recompile
    limit (8 per function), past which it would run eagerly and compare eager with eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_eager_flex_mask_is_one_compiled_graph_on_the_inputs_device(fresh_dynamo, monkeypatch):
    """Called eagerly (compile=False on CUDA), document_mask builds its BlockMask with the compiled
    create_block_mask, exactly as on CUDA: one graph for 20 layouts, the mask of the dense path, skipping the
    blocks without a key, and idx's device given (create_block_mask's default is the current accelerator)."""
    calls, build = [], compiled(create_block_mask)
    monkeypatch.setattr("model.compiled", lambda fn: lambda *a, **k: calls.append((fn, k["device"])) or build(*a, **k))
    config = variant("dyn_exo", vocab_size=50304, block_size=256)
    for idx in layouts(config, 20):
        mask, dense = document_mask(idx, flex=True), document_mask(idx, flex=False)
        assert torch.equal(create_mask(mask.mask_mod, 2, 1, 256, 256, idx.device), dense)
        blocks = dense.view(2, 1, 2, 128, 2, 128).any(5).any(3)  # blocks of 128 (the default) that hold a key
        assert torch.equal(mask.kv_num_blocks + mask.full_kv_num_blocks, blocks.sum(-1, dtype=torch.int32))
    assert calls == [(create_block_mask, idx.device)] * 20 and compiled_graphs() == 1


def test_compiled_flex_forward_is_one_graph_for_every_layout(fresh_dynamo):
    """The CUDA forward on a CPU (inference only: CPU FlexAttention has no backward): the network compiled whole
    (fullgraph=True: no graph break) with the FlexAttention mask forced and built inside the graph; windows of
    different layouts run the one graph compiled for the first, and equal the dense SDPA mask path. (features:
    the forward but lm_head, whose (B, T, 50304) logits would take most of the time; 4 layouts, none, one at the
    block boundary and two random ones, as each costs ~1 s on 2 cores.)"""
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    if not check_cpu_supported():  # torch's own condition: it cannot run here, and says so in an InductorError
        pytest.skip("torch compiles FlexAttention for a CPU only with its AVX2 kernels or wider (not on ARM, nor "
                    "under ATEN_CPU_CAPABILITY=default)")
    model = randomize(GPT(variant("dyn_exo", vocab_size=50304, n_layer=1, block_size=256))).eval()  # exo anchors:
    model.flex = True  # every layer alike, so one shows the path
    compiled = torch.compile(model.features, fullgraph=True)
    with torch.no_grad():
        for idx in layouts(model.config, 4):
            dense = model.features(idx, mask=document_mask(idx, flex=False))
            torch.testing.assert_close(compiled(idx, doc_mask=True), dense, rtol=1e-5, atol=1e-5)
    assert compiled_graphs() == 1


def test_triton_available_is_a_constant_of_the_graph():
    """triton_available, asked inside a compiled graph (the CUDA document mask), is a constant there: no graph break
    (model.py marks it so without importing dynamo: test_train.py's import test checks that train loads none)."""
    asked = torch.compile(lambda x: x + triton_available(), fullgraph=True, backend="eager")
    assert asked(torch.zeros(1)).item() == triton_available()


# ---------------------------------------------------------------- equivalences on shared weights

@pytest.mark.parametrize("granularity", ["scalar", "headwise", "elementwise"])
def test_exoformer_with_lambda_1_0_and_2_1_is_gated_attention(granularity):
    exo = randomize(GPT(variant("exoformer_e", granularity=granularity)))
    with torch.no_grad():
        for p in lambdas(exo, "1"):
            p.zero_()
        for p in lambdas(exo, "2"):
            p.fill_(1.0)
    gated, missing = twin(exo, variant("gated"))
    assert missing == []
    idx = tokens(exo.config)
    torch.testing.assert_close(exo(idx)[0], gated(idx)[0])


def test_dynamic_at_init_is_static_with_lambda_half():
    dyn = randomize(GPT(variant("dyn_exo")), keep=(".lam.", "dyn.fc2"))  # λ and fc2 as initialised
    static, missing = twin(dyn, variant("exoformer_e"), exclude=(".lam.",))
    assert sorted(missing) == sorted(n for n, _ in static.named_parameters() if ".lam." in n)
    assert all(torch.all(p == 0.5) for p in lambdas(static, "1") + lambdas(static, "2"))
    idx = tokens(dyn.config)
    torch.testing.assert_close(dyn(idx)[0], static(idx)[0])
    # and the dynamic MLP does act once its output layer is trained away from zero
    with torch.no_grad():
        dyn.blocks[1].attn.dyn.fc2.bias.fill_(2.0)
    assert not torch.allclose(dyn(idx)[0], static(idx)[0])


@pytest.mark.quick
@pytest.mark.parametrize("granularity", list(GRANULARITY_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_mix_is_the_formula_bit_for_bit(granularity, dtype):
    """DynamicMix, the dynamic mix's lean backward, gives the values and gradients of autograd through
    mix_with_anchor bit for bit, on the model's layouts (S and the anchor (B, H, T, D) views of (B, T, 4, H, D), each
    s a (B, 1, T, 1) view of DynamicScale's output), with λ in fp32 cast to the activations' dtype."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 16, 4, 8
    leaves = [torch.randn(B, T, 4, H, D, generator=g).to(dtype), torch.randn(B, T, 4, H, D, generator=g).to(dtype),
              *(torch.randn(GRANULARITY_SHAPES[granularity](H, D), generator=g) for _ in range(2)),
              torch.rand(B, T, 8, generator=g).to(dtype)]
    grad = torch.randn(B, H, T, D, generator=g).to(dtype)
    results = []
    for mix in (mix_with_anchor, model_file.dynamic_mix):
        own, anchor, lam1, lam2, scales = [t.detach().requires_grad_() for t in leaves]
        s1, s2 = scales.transpose(1, 2)[..., None][:, 2:4].split(1, dim=1)  # the k pair, as DynamicScale splits
        out = mix(own.transpose(1, 3)[:, :, 1], anchor.transpose(1, 3)[:, :, 1], lam1, lam2, s1, s2)
        out.backward(grad)
        results.append([out] + [t.grad for t in (own, anchor, lam1, lam2, scales)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[1][0].grad_fn.name() == "DynamicMixBackward"


def test_dynamic_mix_keeps_for_backward_what_a_checkpoint_of_the_mix_kept(monkeypatch):
    """dyn_exo keeps the mix's inputs for backward, as checkpointing the mix did (the memory tables'), not
    autograd's two products λ·S and λ·N(S_anc) per mixed projection, each (B, T, C)."""
    from tools.bench import saved_bytes
    model = randomize(GPT(variant("dyn_exo", n_layer=2)))
    idx = tokens(model.config, B=1)
    kept = lambda: saved_bytes(model, idx[:, :-1], idx[:, 1:], torch.autocast("cpu", enabled=False), False)
    lean = kept()
    checkpointed_mix = lambda *args: checkpoint(mix_with_anchor, *args, use_reentrant=False)
    monkeypatch.setattr(model_file, "dynamic_mix", checkpointed_mix)
    assert kept() == lean
    monkeypatch.setattr(model_file, "dynamic_mix", mix_with_anchor)
    c = model.config
    assert kept() - lean == c.n_layer * len(c.mix) * 2 * (c.block_size - 1) * c.n_embd * 4  # fp32


@pytest.mark.parametrize("base", ["exoformer_s", "nuresformer_s"])
def test_coarser_granularity_equals_finer_with_equal_values(base):
    """headwise λ all equal to a scalar == scalar; elementwise λ equal along D == headwise."""
    idx = tokens(variant(base))
    coarse = randomize(GPT(variant(base)))
    for finer in ("headwise", "elementwise"):
        fine, missing = twin(coarse, variant(base, granularity=finer))
        assert missing and all(".lam." in k for k in missing)
        with torch.no_grad():
            for (n, p), (m, q) in zip(coarse.named_parameters(), fine.named_parameters()):
                assert n == m
                if ".lam." in n:
                    q.copy_(p.expand_as(q))  # (), (H,1,1) -> (H,1,1), (H,1,D)
        torch.testing.assert_close(fine(idx)[0], coarse(idx)[0])
        with torch.no_grad():  # unequal values along the finer axis do change the output
            lambdas(fine, "2")[0].mul_(torch.linspace(0.5, 1.5, lambdas(fine, "2")[0].numel())
                                       .view_as(lambdas(fine, "2")[0]))
        assert not torch.allclose(fine(idx)[0], coarse(idx)[0])
        coarse = fine


@pytest.mark.parametrize("name", ["resformer", "nuresformer_e", "nuresformer_e_nonorm", "nkqr_e"])
def test_internal_anchor_first_layer_has_no_lambda_and_ignores_mixing(name):
    config = variant(name)
    model = randomize(GPT(config))
    assert len(model.blocks[0].attn.lam) == 0 and model.blocks[0].attn.dyn is None
    assert all(len(b.attn.lam) == 2 * len(config.mix) for b in model.blocks[1:])
    # layer 1 computes exactly what the same layer computes in the anchor-free model
    plain, _ = twin(model, replace(config, anchor="none", mix="", anchor_norm=False, dynamic=False))
    idx = tokens(config)
    h0, rope = model.wte(idx), (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    torch.testing.assert_close(model.blocks[0](h0, rope)[0], plain.blocks[0](h0, rope)[0])
    # ... while the deeper layers do mix: the whole model differs from the anchor-free one
    assert not torch.allclose(model(idx)[0], plain(idx)[0])


@pytest.mark.parametrize("name", ["exoformer_h", "dyn_exo", "nuresformer_e", "resformer", "nkqr_e"])
def test_anchor_removal_equals_zero_lambda_1(name):
    model = randomize(GPT(variant(name)))
    idx = tokens(model.config)
    with torch.no_grad():
        full = model(idx)[0]
        model.drop_anchor = True
        dropped = model(idx)[0]
        model.drop_anchor = False
        for p in lambdas(model, "1"):
            p.zero_()
        zeroed = model(idx)[0]
    torch.testing.assert_close(dropped, zeroed)
    assert not torch.allclose(dropped, full)


# ---------------------------------------------------------------- training signal

@pytest.mark.quick
@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_every_parameter_gets_gradient_after_three_steps(name, config):
    """Zero-init lm_head, then c_proj/fc2, then the dynamic MLP's output layer, each hold back the
    gradient of what lies behind them for one step; after three steps nothing may still be dead, but what is
    frozen (anchor_frozen: anchor_proj), which has no gradient at all."""
    torch.manual_seed(0)
    model = GPT(config)
    frozen = ["anchor_proj.weight"] if config.anchor_frozen else []
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == frozen
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = tokens(config)
    seen = {n: False for n, _ in model.named_parameters()}
    for step in range(4):
        opt.zero_grad()
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        for n, p in model.named_parameters():
            seen[n] |= bool(p.grad is not None and p.grad.abs().sum() > 0)
        if step < 3:
            opt.step()
    assert [n for n, ok in seen.items() if not ok] == frozen


@pytest.mark.quick
@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_tiny_model_fits_a_fixed_batch(name, config):
    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    idx = tokens(config, B=4)
    losses = []
    for _ in range(20):  # every variant halves its loss in 10 steps, and is at 0.05-0.07 of it after 20
        opt.zero_grad()
        _, loss = model(idx[:, :-1], idx[:, 1:], z_loss=1e-5)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.quick
@pytest.mark.parametrize("chunk", [7, 2048])  # uneven chunks, and one chunk for all 62 tokens
def test_loss_and_its_gradients_equal_those_of_the_whole_logits(chunk):
    """The chunked loss, differentiated during the forward pass, against autograd on the whole logits through
    model.lm_loss, mean cross-entropy + z_loss · mean(logsumexp²): values and gradients; without gradients, the same
    value."""
    model = randomize(GPT(variant("dyn_exo")))
    model.loss_chunk = chunk
    idx = tokens(model.config)
    x, y, z_loss = idx[:, :-1], idx[:, 1:], 0.1  # a large z_loss, so that its gradient shows
    logits, loss = model(x, y, z_loss=z_loss)
    assert logits is None  # with targets, no (B, T, V) logits are made
    (3 * loss).backward()  # backward scales by the incoming gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full, _ = model(x)  # the loss written with the whole logits
    lse = torch.logsumexp(full, -1)
    reference = lm_loss(full.flatten(0, 1), y.flatten(), z_loss)
    torch.testing.assert_close(reference, torch.nn.functional.cross_entropy(full.flatten(0, 1), y.flatten())
                               + z_loss * (lse ** 2).mean(), rtol=1e-6, atol=1e-6)  # lm_loss, written out
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    (3 * reference).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    with torch.no_grad():
        assert model(x, y, z_loss=z_loss)[1].item() == loss.item()  # validation takes the same sums
        plain = torch.nn.functional.cross_entropy(full.flatten(0, 1), y.flatten())
        torch.testing.assert_close(model(x, y)[1], plain, rtol=1e-6, atol=1e-6)  # z_loss=0: cross-entropy


def test_a_second_backward_through_the_loss_is_refused():
    """The loss hands over its precomputed lm_head gradient (scaled in place), so it can do so once: a second
    backward (retain_graph) is an error, not a silently doubled gradient."""
    model = randomize(GPT(variant("gated")))
    idx = tokens(model.config)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


# ---------------------------------------------------------------- compile, state dict, generate

# The compiled training step's distinct code paths, one test each (a variant picks pieces; granularity only shapes
# the λ): exogenous anchors (anchor_proj and anchor_norms once, every block mixing) with dynamic λ, whose per-token
# mix runs under torch.utils.checkpoint (a higher-order op inside the graph), and the dense document mask built in
# the graph; internal anchors (layer 1's projections through its QK-norm) with static λ, plain causal attention,
# and layer 1 an anchor-free gated block (Gated Attention's). What is left, the gate off (Baseline, ResFormer),
# only drops ops. Every variant's eager step is checked against the reference and for its gradients above.
COMPILED_PATHS = [("dyn_exo", True), ("nuresformer_e", False)]


@pytest.mark.parametrize("name,doc_mask", COMPILED_PATHS, ids=["dyn_exo-doc_mask", "nuresformer_e-causal"])
def test_compiled_training_step_matches_eager(name, doc_mask, fresh_dynamo):
    """train.py's compiled forward and backward on a CPU (inductor's C++ kernels) for each distinct code path
    (COMPILED_PATHS): one graph (fullgraph=True), eager's loss and gradients."""
    model = randomize(GPT(variant(name, vocab_size=50304, n_layer=1 if name == "dyn_exo" else 2)))  # the fewest
    idx = packed(model.config, [4, 12, 25])  # layers with each path (internal anchors: layer 1 anchors layer 2)
    x, y = idx[:, :-1], idx[:, 1:]
    _, eager_loss = model(x, y, z_loss=1e-4, doc_mask=doc_mask)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, loss = torch.compile(model, fullgraph=True)(x, y, z_loss=1e-4, doc_mask=doc_mask)
    loss.backward()
    assert compiled_graphs() == 1
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for g, p in zip(eager_grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["dyn_exo", "nuresformer_h", "resformer"])
def test_state_dict_round_trip(name):
    model = randomize(GPT(variant(name)))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    torch.manual_seed(123)
    other = GPT(variant(name))
    other.load_state_dict(torch.load(buf, weights_only=True))
    idx = tokens(model.config)
    assert torch.equal(model(idx)[0], other(idx)[0])


def test_generate_greedy_follows_argmax():
    model = randomize(GPT(variant("dyn_exo"))).eval()
    prompt = tokens(model.config)[:, :5]
    out = generate(model, prompt, max_new_tokens=6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    torch.manual_seed(0)  # top_k=1 sampling is greedy too; crops to block_size when the prompt grows
    assert torch.equal(generate(model, prompt, 6, temperature=0.8, top_k=1), out)
    long = generate(model, prompt, model.config.block_size, top_k=5)
    assert long.shape == (2, 5 + model.config.block_size)
    seen = []  # stop: called once per new token, with everything so far; True ends generation there
    stopped = generate(model, prompt, 6, temperature=0, stop=lambda ids: seen.append(ids.size(1)) or len(seen) == 3)
    assert seen == [6, 7, 8] and torch.equal(stopped, out[:, :8])


@pytest.mark.parametrize("name,config", VARIANTS, ids=VARIANT_IDS)
def test_kv_cache_greedy_equals_greedy_without_cache(name, config):
    model = randomize(GPT(config)).eval()
    prompt = tokens(config)[:, :5]
    n = config.block_size + 4  # past block_size the window slides and the cache starts again
    cached = generate(model, prompt, n, temperature=0)
    assert torch.equal(cached, generate(model, prompt, n, temperature=0, use_cache=False))


def test_kv_cache_logits_equal_a_full_forward():
    model = randomize(GPT(variant("dyn_exo"))).eval()
    idx = tokens(model.config)
    cache = KVCache(model.config.n_layer)
    with torch.no_grad():
        full = model.features(idx)
        steps = [model.features(idx[:, :8], cache=cache)] + [model.features(idx[:, t:t + 1], cache=cache)
                                                             for t in range(8, idx.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    config = model.config
    assert len(cache) == idx.size(1) and cache.keys[0].shape == (2, config.n_head, idx.size(1), config.head_dim)
    with pytest.raises(ValueError, match="block_size"):
        model.features(idx[:, :1], cache=cache)  # full: the caller must start again


def test_generate_samples_only_below_vocab():
    model = randomize(GPT(variant("gated"))).eval()
    torch.manual_seed(0)
    out = generate(model, tokens(model.config)[:, :3], 40, temperature=2.0, vocab=10)
    assert out[:, 3:].max() < 10


@pytest.mark.parametrize("name", ["dyn_exo", "nuresformer_e", "gated"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(name):
    model = randomize(GPT(variant(name)))
    idx = tokens(model.config)

    def run():
        _, loss = model(idx[:, :-1], idx[:, 1:], z_loss=1e-4, doc_mask=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return loss, grads

    loss, grads = run()
    model.activation_checkpointing = True
    loss_ckpt, grads_ckpt = run()
    assert loss_ckpt.item() == loss.item()
    assert all(torch.equal(grads[n], grads_ckpt[n]) for n in grads)  # the recomputation is the same computation


def test_activation_checkpointing_compiles_to_one_graph(fresh_dynamo):
    """Each block under torch.utils.checkpoint inside the compiled model (fullgraph=True), with dyn_exo's own
    checkpointed mix nested in it: the loss of the eager model without checkpointing."""
    model = randomize(GPT(variant("dyn_exo", n_layer=1)))  # one block: its checkpoint and the mix's nested in it
    idx = tokens(model.config)
    loss = model(idx[:, :-1], idx[:, 1:], z_loss=1e-4, doc_mask=True)[1]
    model.activation_checkpointing = True
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(idx[:, :-1], idx[:, 1:], z_loss=1e-4, doc_mask=True)[1], loss, rtol=1e-5,
                               atol=1e-5)
    assert compiled_graphs() == 1


def test_activation_checkpointing_keeps_less_for_backward():
    from tools.bench import saved_bytes
    model = randomize(GPT(variant("dyn_exo", n_layer=4)))
    idx = tokens(model.config, B=1)
    plain = saved_bytes(model, idx[:, :-1], idx[:, 1:], torch.autocast("cpu", enabled=False), False)
    model.activation_checkpointing = True
    assert saved_bytes(model, idx[:, :-1], idx[:, 1:], torch.autocast("cpu", enabled=False), False) < plain / 2


# ---------------------------------------------------------------- bad input

@pytest.mark.quick
@pytest.mark.parametrize("kwargs,words", [
    (dict(anchor="external"), ["anchor", "'none'", "'internal'", "'exo'"]),
    (dict(anchor="exo", mix="qkvg", gate=True, granularity="channel"),
     ["granularity", "'scalar'", "'headwise'", "'elementwise'"]),
    (dict(n_embd=100, n_head=16), ["n_head", "n_embd"]),
    (dict(n_embd=96, n_head=32), ["n_head", "even"]),
    (dict(anchor="exo", mix="qkx"), ["mix", "qkvg"]),
    (dict(anchor="exo", mix="qq"), ["mix", "qkvg"]),
    (dict(anchor="exo", mix="qkvg", gate=False), ["mix", "gate"]),
    (dict(anchor="none", mix="v"), ["anchor", "mix"]),
    (dict(anchor="exo"), ["mix", "qkvg"]),
])
def test_bad_config_raises_at_construction(kwargs, words):
    with pytest.raises(ValueError) as e:
        GPTConfig(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_readme_variant_table_is_true():
    """README.md's variant table has a row for each of the paper's variants, with the parameter count its
    config file builds (a fork's new config file needs no row)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    rows = dict(re.findall(r"^\|[^|]*\| `(\w+)\.py` \|.*\| ([\d,]+) \|$", readme, flags=re.M))
    controls = re.findall(r"^\| control \(not in the paper\): [^|]*\| `(\w+)\.py` \|", readme, flags=re.M)
    assert sorted(controls) == sorted(CONTROLS), "README.md: the variant table's controls"
    for name in PAPER_VARIANTS + CONTROLS:
        assert name in rows, f"README.md: the variant table has no row for configs/{name}.py"
        with torch.device("meta"):
            n = GPT(file_config(os.path.join(CONFIG_DIR, name + ".py"))).num_params()
        assert n == int(rows[name].replace(",", "")), \
            f"README.md: configs/{name}.py builds {n:,} parameters, the table says {rows[name]}"
    assert set(rows) <= set(PAPER_VARIANTS + CONTROLS), \
        f"README.md: rows for unknown files {set(rows) - set(PAPER_VARIANTS)}"


def test_a_forked_variant_passes_the_generic_tests(tmp_path):
    """A fork that adds a granularity (one line in GRANULARITY_SHAPES) and a config file using it, with a
    training key in it too, runs the generic tests on it and passes them; README.md needs no change."""
    for name in ("model.py", "optim.py", "train.py", "conftest.py", "pytest.ini", "test_model.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    for folder in ("configs", "engine"):
        shutil.copytree(os.path.join(ROOT, folder), tmp_path / folder)
    model_py = (tmp_path / "model.py").read_text()
    assert "GRANULARITY_SHAPES = {" in model_py
    (tmp_path / "model.py").write_text(model_py.replace(
        "GRANULARITY_SHAPES = {", 'GRANULARITY_SHAPES = {"channelwise": lambda H, D: (1, 1, D), ', 1))
    (tmp_path / "configs" / "fork_c.py").write_text(
        "gate = True\nanchor = 'exo'\nmix = 'qkvg'\ngranularity = 'channelwise'\nanchor_norm = True\n"
        "n_layer = 29\nmax_steps = 1000\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "test_model.py",
                        "-k", "fork_c or readme"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert int(re.search(r"(\d+) passed", r.stdout)[1]) >= 6, r.stdout[-1000:]  # readme + fork_c's generic tests


@pytest.mark.parametrize("name", ["gated", "dyn_exo", "baseline"])
def test_flops_per_token_follows_the_matmul_count(name):
    c = file_config(os.path.join(CONFIG_DIR, name + ".py"))
    C, L, V, T = c.n_embd, c.n_layer, c.vocab_size, 2048
    matmul = L * (11 if c.gate else 10) * C * C + V * C  # blocks and lm_head; wte is a lookup
    if c.anchor == "exo":
        matmul += len(c.mix) * C * C
    if c.dynamic:
        matmul += L * (16 * C + 16 * 2 * len(c.mix))
    with torch.device("meta"):
        assert flops_per_token(GPT(c), T) == 6 * matmul + 6 * L * C * T  # causal: half of 12·L·C·T


@pytest.mark.parametrize("name", ["dyn_exo", "nuresformer_h"])
def test_bf16_autocast_keeps_attention_in_bf16(name):
    """fp32 λ and norm weights must not promote bf16 activations back to fp32 (memory, speed on GPU)."""
    model = randomize(GPT(variant(name)))
    seen = []
    for block in model.blocks:
        block.attn.register_forward_hook(
            lambda m, i, out: seen.extend([out[0].dtype, *(t.dtype for t in out[1].values())]))
    idx = tokens(model.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert set(seen) == {torch.bfloat16} and len(seen) == model.config.n_layer * 5
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, model(idx[:, :-1], idx[:, 1:])[1], rtol=0.02, atol=0.02)  # vs fp32
