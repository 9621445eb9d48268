"""Tests of train.py: Muon, schedules, DDP equivalence, exact resume, checkpoints, errors, end to end."""
import contextlib
import gc
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import weakref
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import model
import optim
import train
from conftest import in_process, spawn
from engine import data, parallel, runlog, sharding
from engine.checkpoint import check_parts, load_checkpoint
from engine.configurator import load_config
from engine.data import write_shard
from model import EOT, GPT, GPTConfig, flops_per_token
from optim import Muon, polar_express
from train import DEFAULTS, TrainConfig, build_optimizers, lr_multiplier, muon_momentum, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
VOCAB = 256
# a small model and batch that train in well under a second per step on a CPU
SMALL = ["configs/dyn_exo.py", "--n_layer=2", "--n_embd=64", "--n_head=2", f"--vocab_size={VOCAB}",
         "--block_size=32", "--batch_size=2", "--total_batch_size=128", "--warmup_steps=2",
         "--eval_tokens=256", "--log_interval=1", "--eval_interval=100", "--ckpt_interval=100",
         "--muon_momentum_steps=2"]


@pytest.fixture(scope="session")
def data_dir(toy_shards):
    """Shards of a learnable toy language (conftest.toy_shards: written once a session, only read)."""
    return toy_shards


@pytest.fixture(scope="session")
def doc_data_dir(tmp_path_factory):
    """The toy language with GPT-2's vocabulary: each sentence opened by <|endoftext|>, as in real shards,
    so that doc_mask (on by default) has documents to keep apart: 2 or 3 per 32-token window."""
    rng = np.random.default_rng(1)
    sentences = rng.integers(1, 256, size=(40, 12))
    tokens = np.concatenate([np.concatenate([[EOT], sentences[i]]) for i in rng.integers(0, 40, size=600)])
    d = tmp_path_factory.mktemp("doc_shards")
    write_shard(d / "docs_val_000000.bin", tokens[:1500])
    write_shard(d / "docs_train_000001.bin", tokens[1500:])
    return str(d)


DOCS = [f"--vocab_size={EOT + 48}"]  # 50304: the model must know <|endoftext|>


def main_output(args, capsys):
    """train.main(args) in this process: (its value, or the SystemExit it raised; its stdout; its stderr)."""
    return in_process(train.main, args, capsys)


def run_cli(args, check=True, cwd=ROOT):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, capture_output=True,
                       text=True)
    if check and r.returncode:
        raise AssertionError(f"train.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def read_log(out_dir, configs=False):
    """The records of log.jsonl; with configs=True only the configuration lines of each (re)start."""
    log = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    return [e for e in log if ("config" in e) == configs]


def cfg(**kw):
    return TrainConfig(**kw)


# ----------------------------------------------------------------------------- Muon

def test_polar_express_gives_singular_values_near_one():
    torch.manual_seed(0)
    for shape in [(64, 32), (32, 96), (3, 48, 16)]:
        G = torch.randn(*shape)
        s = torch.linalg.svdvals(polar_express(G).float())
        assert s.min() > 0.8 and s.max() < 1.2, (shape, s.aminmax())
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)  # the exact polar factor U V^T
        assert torch.nn.functional.cosine_similarity(polar_express(G).float().flatten(), (U @ Vh).flatten(),
                                                     dim=0) > 0.98


def muon_step(params, grads, weight_decay, lr=0.05):
    """One Muon step on copies of params with the given gradients; returns the new values."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    Muon(ps, lr=lr, momentum=0.9, beta2=0.95, weight_decay=weight_decay).step()
    return [p.detach() for p in ps]


@pytest.mark.quick
def test_muon_matches_the_spec_written_out():
    """Pins the recipe: three steps of optim.muon_update (Muon's maths, which every path of Muon gives: the tests
    below) on one tall and one wide matrix against the recipe written out line by line."""
    torch.manual_seed(0)
    lr, mu, beta2, wd = 0.05, 0.9, 0.95, 0.1
    for shape in [(24, 8), (8, 24)]:
        p0, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
        p, buf = p0.clone(), torch.zeros(shape)
        rows, cols = shape
        v = torch.zeros(rows, 1) if rows >= cols else torch.zeros(1, cols)
        for g in grads:
            buf = buf.lerp(g, 1 - mu)  # momentum, EMA form
            o = polar_express(g.lerp(buf, mu)).float()  # Nesterov, then orthogonalise
            v = beta2 * v + (1 - beta2) * o.pow(2).mean(dim=1 if rows >= cols else 0, keepdim=True)
            n = o / v.clamp_min(1e-10).sqrt()
            n = n * (o.norm() / n.norm()) * max(1, rows / cols) ** 0.5
            p = p - lr * wd * (n * p >= 0) * p - lr * n
        param, momentum, second_moment = p0.clone(), torch.zeros(shape), torch.zeros(optim.moment_shape(*shape))
        for g in grads:
            optim.muon_update(param, g.clone(), momentum, second_moment, lr, mu, beta2, wd)
        torch.testing.assert_close(param, p, rtol=1e-5, atol=1e-6)


# tall (15 rows: split 8 + 7 over 2 ranks), wide, square; stacks of 3 (k > 1, shared 2 + 1 over 2 ranks), 2 and 1
MUON_SHAPES = [(15, 8), (15, 8), (15, 8), (8, 24), (8, 24), (12, 12)]
MUON_STEPS = 3
MUON_KEYS = dict(lr=0.05, momentum=0.9, beta2=0.95, weight_decay=0.1)


def muon_problem():
    """The weights and each step's gradients of MUON_SHAPES's matrices: the same in every process (seeded)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in MUON_SHAPES]
    return weights, [[torch.randn(s, generator=gen) for s in MUON_SHAPES] for _ in range(MUON_STEPS)]


def muon_by_matrix(weights, grads):
    """optim.muon_update on each matrix alone, every step: (weights, momentum, second moment) of each."""
    found = []
    for i, w in enumerate(weights):
        p, m, v = w.clone(), torch.zeros_like(w), torch.zeros(optim.moment_shape(*w.shape))
        for step in grads:
            optim.muon_update(p, step[i].clone(), m, v, *MUON_KEYS.values())
        found.append((p, m, v))
    return found


def muon_stepped(weights, grads, exchange=None, place=lambda t: t.clone(), whole=lambda t: t):
    """Muon (with exchange) over the matrices, every step: (weights, momentum, second moment) of each, whole. place:
    a whole tensor as this rank holds it (FSDP: its rows, a DTensor); whole: back."""
    params = [torch.nn.Parameter(place(w)) for w in weights]
    opt = Muon(params, **MUON_KEYS, exchange=exchange)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = place(g)
        opt.step()
    return [tuple(whole(t.detach()) for t in (p, opt.state[p]["momentum"], opt.state[p]["second_moment"]))
            for p in params]


def assert_gives_muon_update(found, path):
    """Every matrix's weights, momentum and second moment, on one path of Muon, equal muon_update's matrix by
    matrix. Equal bit for bit, on a CPU: Polar Express's bf16 bmm over a stack (or over DDP's share of it, padded
    with zero matrices) rounds each matrix as its mm alone does (measured with torch 2.13.0: not one bit differs)."""
    expected = muon_by_matrix(*muon_problem())
    for shape, mine, theirs in zip(MUON_SHAPES, found, expected):
        for what, a, b in zip(("weights", "momentum", "second moment"), mine, theirs):
            assert torch.equal(a, b), (path, shape, what, (a - b).abs().max().item())


@pytest.mark.quick
def test_muon_in_one_process_gives_muon_update_matrix_by_matrix():
    """Muon's stacks in one process (optim.Exchange, and DDP's outside a process group, train.py's plain run), three
    steps, hold to optim.muon_update on each matrix alone."""
    assert_gives_muon_update(muon_stepped(*muon_problem()), "one process")
    assert_gives_muon_update(muon_stepped(*muon_problem(), exchange=parallel.Exchange), "one process, DDP's exchange")


def test_cautious_weight_decay_skips_entries_whose_update_opposes_the_weight():
    torch.manual_seed(0)
    params, grads = [torch.randn(16, 8), torch.randn(8, 24)], [torch.randn(16, 8), torch.randn(8, 24)]
    lr, wd = 0.05, 0.1
    plain = muon_step(params, grads, weight_decay=0.0, lr=lr)
    decayed = muon_step(params, grads, weight_decay=wd, lr=lr)
    for p, a, b in zip(params, plain, decayed):
        update = (p - a) / lr  # p <- p - lr * update
        decay = a - b  # what weight decay took away on top
        clear = update.abs() > 1e-4  # the sign of a tiny update is lost to rounding in p - a
        same_sign, opposed = clear & (update * p > 0), clear & (update * p < 0)
        assert same_sign.sum() > 10 and opposed.sum() > 10  # both cases occur
        torch.testing.assert_close(decay[same_sign], lr * wd * p[same_sign])
        assert torch.all(decay[opposed] == 0)


def test_muon_update_shape_scale():
    """Tall matrices get sqrt(rows/cols) larger updates; wide ones are not scaled down."""
    torch.manual_seed(0)
    for shape, scale in [((64, 16), 2.0), ((16, 64), 1.0), ((32, 32), 1.0)]:
        p, g = torch.zeros(shape), torch.randn(shape)
        (new,) = muon_step([p], [g], weight_decay=0.0, lr=1.0)
        rms = new.pow(2).mean().sqrt().item()  # an orthogonal update has RMS 1/sqrt(max(rows, cols))
        assert abs(rms * max(shape) ** 0.5 / scale - 1) < 0.15, (shape, rms)


class DispatchCount(TorchDispatchMode):
    """How many aten ops run inside it (views included): on a GPU, a kernel launch for most of them."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def muon_step_ops(config_file, **keys):
    """(aten ops of one Muon.step, matrices) on a config file's model, on the meta device (no memory, no time)."""
    cfg, model_config = train.split_config({**load_config([config_file], train.ALL_DEFAULTS), **keys})
    with torch.device("meta"):
        net = GPT(model_config)
    muon = build_optimizers(net, cfg)["muon"]
    for p in optim.muon_params(net):
        p.grad = torch.zeros_like(p)
    muon.step()  # its state made
    with DispatchCount() as count:
        muon.step()
    return count.ops, len(optim.muon_params(net))


def test_muon_dispatches_per_shape_not_per_matrix():
    """A Muon step runs one set of ops per stack of same-shaped matrices, so its op count does not grow with depth.
    The 450M dyn_exo layout (175 matrices of 5 shapes): 774 aten ops with torch 2.13.0, from 4,664 when each matrix
    had its own."""
    deep, shallow = muon_step_ops("configs/dyn_exo.py"), muon_step_ops("configs/dyn_exo.py", n_layer=2)
    assert deep[1] == 175 and shallow[1] == 13
    assert deep[0] == shallow[0]  # one set of ops per shape: 175 matrices or 13 alike (one per matrix: 4,664 ops)
    if torch.__version__.split("+")[0] == "2.13.0":
        assert deep[0] == 774  # measured with torch 2.13.0


@pytest.mark.quick
def test_schedules_at_chosen_steps():
    """Pins the recipe: the paper's learning-rate multiplier (linear warmup, constant, a linear cooldown over the last
    20% to a tenth) and Muon's momentum ramps, at chosen steps of the 450M run."""
    c = cfg(max_steps=38_147)  # the paper's run: warmup 1000, decay from step 30517.6 to the end
    assert lr_multiplier(0, c) == pytest.approx(1 / 1000)
    assert lr_multiplier(499, c) == pytest.approx(0.5)
    assert lr_multiplier(999, c) == 1.0 and lr_multiplier(20_000, c) == 1.0
    assert lr_multiplier(30_517, c) == 1.0
    assert lr_multiplier(34_332, c) == pytest.approx(1 - 0.9 * (34_332 - 30_517.6) / 7_629.4)
    assert lr_multiplier(38_146, c) == pytest.approx(0.1 + 0.9 / 7_629.4)
    assert muon_momentum(0, c) == pytest.approx(0.85)
    assert muon_momentum(50, c) == pytest.approx(0.90)
    assert muon_momentum(100, c) == muon_momentum(20_000, c) == pytest.approx(0.95)
    assert muon_momentum(38_147 - 50, c) == pytest.approx(0.90)
    assert muon_momentum(38_146, c) == pytest.approx(0.851)


def _muon_paths_worker(rank, port, result_path):
    """Rank `rank` of 2 (gloo): Muon over muon_problem's matrices under DDP's exchange (every rank holds them all, and
    orthogonalises a share of every stack) and FSDP's (each rank holds some rows of each matrix, a DTensor, and its
    owner runs steps 2 and 3 on it whole); and the one-line error of a Muon over DTensors without FSDP's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    rows = lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])  # FSDP's placement (sharding.chunk_rows)
    found = {"DDP": muon_stepped(*muon_problem(), exchange=parallel.Exchange),
             "FSDP": muon_stepped(*muon_problem(), exchange=sharding.Exchange, place=rows,
                                  whole=lambda t: t.full_tensor())}
    for exchange in (None, parallel.Exchange):
        try:
            muon_stepped(*muon_problem(), exchange=exchange, place=rows)
        except ValueError as e:
            found.setdefault("errors", []).append(str(e))
    torch.save(found, f"{result_path}.{rank}")
    dist.destroy_process_group()


def test_muon_under_ddp_and_fsdp_gives_muon_update_matrix_by_matrix(tmp_path):
    """Muon's DDP path (2 ranks: the stack of 3 shared 2 + 1, the stack of 1 orthogonalised by rank 0 while rank 1
    pads) and its FSDP path (2 ranks: every matrix's rows split, 15 of them unevenly; sharding.Exchange), three steps,
    hold to optim.muon_update on each matrix alone, on every rank. A Muon over FSDP's DTensors without FSDP's exchange
    is refused in one line."""
    spawn(_muon_paths_worker, (free_port(), str(tmp_path / "r")), 2)
    for rank in (0, 1):
        found = torch.load(tmp_path / f"r.{rank}", weights_only=True)
        for path in ("DDP", "FSDP"):
            assert_gives_muon_update(found[path], f"{path}, rank {rank}")
        assert found["errors"] == 2 * ["Muon: FSDP's parameters (DTensors) hold some rows of each matrix, and steps 2 "
                                       "and 3 take whole ones: pass exchange=sharding.Exchange "
                                       "(train.build_optimizers does)"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_torchrun(monkeypatch):
    """torchrun's environment for one process, set in this one (on a free port): train.main joins a group of one."""
    env = dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def every_kind_of_parameter():
    """A small model with every kind of parameter: an exogenous anchor and its norms, elementwise λ, the dynamic
    mixer, gates, norms, biases."""
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, gate=True, anchor="exo",
                         mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True))


@pytest.mark.quick
def test_every_trained_parameter_is_in_exactly_one_optimizer():
    """Holds for any fork, with any number of optimisers: build_optimizers puts each trained parameter in exactly one
    of them and a frozen one in none, and the engine's own check (Optimizers.check_params) accepts it."""
    model = every_kind_of_parameter()
    model.blocks[0].attn.q_norm.weight.requires_grad_(False)  # frozen: in no optimiser
    optimizers = build_optimizers(model, TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    held = [names[id(p)] for opt in optimizers.values() for g in opt.param_groups for p in g["params"]]
    assert sorted(held) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    optimizers.check_params(model)


@pytest.mark.quick
def test_the_recipes_optimizers_are_muon_for_the_linear_weights_and_adamw_for_the_rest():
    """Pins the recipe: two optimisers, Muon for the weights of the linear layers inside the network (the anchor's
    projection and the dynamic mixer's too), AdamW for everything else (embedding, lm_head, λ, biases, norms)."""
    model = every_kind_of_parameter()
    optimizers = build_optimizers(model, TrainConfig())
    assert list(optimizers) == ["muon", "adam"]
    assert type(optimizers["muon"]) is Muon and type(optimizers["adam"]) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names, adam_names = ({names[id(p)] for g in optimizers[k].param_groups for p in g["params"]}
                              for k in ("muon", "adam"))
    assert muon_names == {names[id(p)] for p in optim.muon_params(model)}
    assert muon_names | adam_names == set(names.values()) and not muon_names & adam_names
    assert "anchor_proj.weight" in muon_names and "blocks.1.attn.dyn.fc2.weight" in muon_names
    assert {"wte.weight", "lm_head.weight", "blocks.0.attn.lam.q1", "blocks.0.attn.dyn.fc2.bias",
            "anchor_norms.v.weight", "blocks.1.attn.q_norm.weight"} <= adam_names


def test_optimizers_route_by_role_not_by_shape():
    """A fork's extra 2-D parameter (a λ matrix, a table) is not a linear layer: optim.muon_params leaves it to the
    other optimisers (AdamW's, in the recipe). A linear layer it adds inside the network goes to Muon. The start-up
    line counts what each optimiser holds. Holds for any fork: Muon's share is muon_params', whatever else trains."""
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, gate=True,
                          anchor="exo", mix="v", granularity="elementwise"))
    muon_before = len(optim.muon_params(model))
    model.blocks[0].attn.register_parameter("lam_table", torch.nn.Parameter(torch.ones(2, 32)))  # 2-D
    model.blocks[1].extra = torch.nn.Linear(32, 32, bias=False)
    in_muon = {id(p) for p in optim.muon_params(model)}
    assert id(model.blocks[0].attn.lam_table) not in in_muon
    assert id(model.blocks[1].extra.weight) in in_muon and len(in_muon) == muon_before + 1
    build_optimizers(model, TrainConfig()).check_params(model)  # the table and the layer each in one optimiser
    muon = Muon([p for p in model.parameters() if id(p) in in_muon], lr=0.01, momentum=0.95, beta2=0.95,
                weight_decay=0.1)
    adam = torch.optim.AdamW([p for p in model.parameters() if id(p) not in in_muon])
    n_muon = sum(p.numel() for p in model.parameters() if id(p) in in_muon)
    assert optim.describe_optimizers([muon, adam]) == (
        f"optimisers: Muon {len(in_muon)} tensors ({n_muon:,} parameters), AdamW "
        f"{len(list(model.parameters())) - len(in_muon)} tensors ({model.num_params() - n_muon:,} parameters)")


@pytest.mark.quick
def test_a_parameter_in_two_optimizers_or_a_trained_one_in_none_is_refused_in_one_line(data_dir, tmp_path,
                                                                                       monkeypatch, capsys):
    """A fork's optimisers that share a parameter (it would be updated twice a step) or miss a trained one (never
    updated) stop the run before its first step, in one line naming the parameter and the optimisers. Holds for any
    fork's optimisers: the model's first parameter is given to one more, or its optimiser is left out."""
    real, expected = train.build_optimizers, []
    rule = "each trained parameter belongs to exactly one (train.build_optimizers)"

    def first_and_its_optimizer(model, optimizers):
        name, first = next(iter(model.named_parameters()))
        return name, first, next(k for k, opt in optimizers.items() for g in opt.param_groups for p in g["params"]
                                 if p is first)

    def twice(model, cfg):
        optimizers = real(model, cfg)
        name, first, holder = first_and_its_optimizer(model, optimizers)
        optimizers["extra"] = torch.optim.AdamW([first])
        expected.append(f"parameter {name} is in 2 optimisers, {holder} and extra: {rule}")
        return optimizers

    def none(model, cfg):
        optimizers = real(model, cfg)
        name, _, holder = first_and_its_optimizer(model, optimizers)
        del optimizers[holder]
        expected.append(f"parameter {name} is trained but in no optimiser ({', '.join(optimizers)}): {rule}")
        return optimizers

    for build in (twice, none):
        monkeypatch.setattr(train, "build_optimizers", build)
        out = tmp_path / build.__name__
        result, _, err = main_output(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=2"], capsys)
        assert isinstance(result, SystemExit) and str(result.code) == f"train.py: error: {expected[-1]}", result
        assert not out.exists()  # refused before anything is written


@pytest.mark.quick
def test_param_groups_at_rates_1_and_half_keep_that_ratio_through_the_schedule_or_are_refused():
    """A Muon of two param groups at rates 1 : 0.5 (issue 50's "done when"), the second given the factor
    lr_scale=0.5 where the groups are built: Optimizers.set_schedule keeps the ratio at every step of the schedule
    (warmup, plateau, decay), the log's muon_lr being the first group's. The same group given lr=0.005 instead, which
    the schedule would overwrite at the first step, is refused before it in one line naming the factor; a resume
    whose factors differ from its checkpoint's is refused as a recipe key is."""
    cfg, model = TrainConfig(), every_kind_of_parameter()
    matrices = optim.muon_params(model)
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]

    def optimizers(second):
        return optim.Optimizers(muon=Muon([{"params": matrices[:3]}, {"params": matrices[3:], **second}], cfg.muon_lr,
                                          cfg.muon_momentum, cfg.muon_beta2, cfg.muon_weight_decay),
                                adam=torch.optim.AdamW(rest, lr=cfg.adam_lr))

    halved = optimizers({"lr_scale": 0.5})
    halved.check_params(model, schedule(0, cfg))
    for step in (0, 500, 20_000, 35_000, cfg.max_steps - 1):
        logged = halved.set_schedule(schedule(step, cfg))["muon_lr"]
        first, second = (g["lr"] for g in halved["muon"].param_groups)
        assert first == logged == schedule(step, cfg)["muon_lr"] and second == first * 0.5, step
    with pytest.raises(ValueError, match=r"^optimiser 'muon', param group 1: lr=0.005, which the schedule overwrites "
                                         r"with muon_lr at every step: give the group lr_scale=0.5 \(a factor of "
                                         r"muon_lr\) instead$"):
        optimizers({"lr": cfg.muon_lr / 2}).check_params(model, schedule(0, cfg))
    quartered = optimizers({"lr_scale": 0.25})
    with pytest.raises(ValueError, match=r"^optimiser 'muon', param group 1: lr_scale=0.5 in the checkpoint, "
                                         r"lr_scale=0.25 in this run: a run continues with the recipe it was saved "
                                         r"with$"):
        quartered.load_state_dict(halved.state_dict())


@pytest.mark.quick
def test_a_model_inside_the_model_is_refused_and_what_no_optimiser_updates_is_said_once():
    """A teacher attached inside the student (issue 50's seventh trap) would be trained by both optimisers and saved
    as the student's weights: refused in one line, frozen or not. Held beside the model, frozen, it is no part of
    the start-up line; a module of the model that no optimiser updates is named there once, "frozen at its random
    initialisation" only for anchor_frozen's projection, which is never trained."""
    student, cfg = every_kind_of_parameter(), TrainConfig()
    student.teacher = every_kind_of_parameter().requires_grad_(False)
    with pytest.raises(ValueError, match=r"^model.teacher: a GPT inside the model, which its optimisers would train "
                                         r"\(unless frozen\) and its checkpoints save as its weights: hold it beside "
                                         r"the model \(a Run attribute set in train.build\)$"):
        build_optimizers(student, cfg).check_params(student, schedule(0, cfg))
    del student.teacher
    student.anchor_proj.weight.requires_grad_(False)
    student.wte.requires_grad_(False)  # a fork's: loaded, say
    line = optim.describe_optimizers(build_optimizers(student, cfg), student, ["anchor_proj.weight"])
    assert line.endswith("; frozen at its random initialisation (no gradient, in no optimiser): anchor_proj.weight "
                         "(4,096 parameters); not trained here (no gradient, in no optimiser): wte.weight (2,048 "
                         "parameters)")
    student = every_kind_of_parameter()
    student.blocks.requires_grad_(False)
    line = optim.describe_optimizers(build_optimizers(student, cfg), student)
    n = len(list(student.blocks.parameters()))
    assert line.count("blocks") == 1 and f"blocks: {n} tensors (" in line and "random initialisation" not in line


class Shuffle:
    """A fork's part of its own class: a generator it saves itself."""

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


@pytest.mark.quick
def test_state_that_no_part_saves_is_refused():
    """State a run holds that no part of run.parts saves (issue 50's eighth trap), which a resume would start again:
    a random generator, an object with a state_dict that is not a part, a module with trained parameters that the
    model does not hold, each refused in one line naming where it is. A part of the fork's own class saves what it
    holds; a frozen model beside the model (a teacher) is no state."""
    model = every_kind_of_parameter()
    parts = {"model": model, "loader": None, "rng": train.RNG(), "shuffle": Shuffle()}
    run = lambda **held: types.SimpleNamespace(cfg=TrainConfig(), worker=None, model=model, eval_model=model,
                                               parts=parts, **held)
    check_parts(run(teacher=every_kind_of_parameter().requires_grad_(False)))
    for held, where, what in [({"noise": torch.Generator()}, "run.noise", "a random generator"),
                              ({"table": Shuffle()}, "run.table", "an object with a state_dict"),
                              ({"probe": torch.nn.Linear(2, 2)}, "run.probe", "a module with trained parameters"),
                              ({"extra": {"order": [random.Random(0)]}}, r"run.extra\['order'\]\[0\]",
                               "a random generator")]:
        with pytest.raises(ValueError, match=rf"^{where}: {what} that no part of run.parts saves: a resume would "
                                             rf"start it again \(keep it in a part registered in train.build"):
            check_parts(run(**held))
    model.blocks[1].attn.rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"^run.model.blocks.1.attn.rng: a random generator"):
        check_parts(run())


def test_a_check_added_to_build_fails_the_dry_run_as_it_fails_the_launch(data_dir, tmp_path, monkeypatch, capsys):
    """Issue 50's "done when": a check a fork adds to train.build stops the launch with a one-line error, and the
    dry run of the same launch with the same line; so does the engine's own check as build ends (a generator held
    outside run.parts). The dry run traces an evaluation (log_entry's) after the steps: what it holds is counted."""
    real = train.build

    def build(cfg, model_config, worker, storage=None):
        run = real(cfg, model_config, worker, storage)
        if cfg.batch_size < 4:  # a fork's check
            raise ValueError(f"batch_size={cfg.batch_size}: this fork needs 4 sequences or more")
        return run

    monkeypatch.setattr(train, "build", build)
    args = SMALL + [f"--data_dir={data_dir}", "--max_steps=2"]
    launch, _, _ = main_output(args + [f"--out_dir={tmp_path / 'out'}"], capsys)
    dry, out, _ = main_output(args + ["--dry_run=True"], capsys)
    assert str(launch.code) == "train.py: error: batch_size=2: this fork needs 4 sequences or more"
    assert [line for line in out.splitlines() if "error" in line] == [
        "dry run: error: batch_size=2: this fork needs 4 sequences or more"] and isinstance(dry, SystemExit)
    monkeypatch.setattr(train, "build", real)
    real_model = train.build_model

    def build_model(*args, **kwargs):  # a generator the fork keeps on the model, which no part saves
        built = real_model(*args, **kwargs)
        built[0].noise = torch.Generator()
        return built

    monkeypatch.setattr(train, "build_model", build_model)
    launch, _, _ = main_output(args + [f"--out_dir={tmp_path / 'out'}"], capsys)
    dry, out, _ = main_output(args + ["--dry_run=True"], capsys)
    line = "run.model.noise: a random generator that no part of run.parts saves: a resume would start it again " \
           "(keep it in a part registered in train.build: docs/FORKING.md)"
    assert str(launch.code) == f"train.py: error: {line}" and f"dry run: error: {line}" in out
    monkeypatch.setattr(train, "build_model", real_model)
    real_entry = train.log_entry

    def log_entry(run, measured, evaluating):  # an evaluation that holds more than a step: whole logits, say
        entry = real_entry(run, measured, evaluating)
        if evaluating:
            entry["held"] = torch.zeros(1 << 28, device=run.worker.device).sum().item()
        return entry

    monkeypatch.setattr(train, "log_entry", log_entry)
    _, out, _ = main_output(args + ["--dry_run=True"], capsys)
    assert "the peak, during an evaluation: 1.0" in out and ": fits (" in out


# ----------------------------------------------------------------------------- DDP

def test_ddp_two_processes_equal_one_process_with_twice_the_accumulation(data_dir, tmp_path):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=4"]
    one = str(tmp_path / "one")
    train.main(common + [f"--out_dir={one}"])  # 1 process: 128 / (2 x 32) = 2 micro-steps
    two = str(tmp_path / "two")
    # the DDP run also recomputes its blocks in backward (activation checkpointing): the same result
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *common, f"--out_dir={two}", "--activation_checkpointing=True"], cwd=ROOT,
                       capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es) x 1 micro-step(s)" in r.stdout
    a, b = load_checkpoint(f"{one}/ckpt.pt"), load_checkpoint(f"{two}/ckpt.pt")
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-3, atol=2e-4, msg=k)
    la, lb = read_log(one), read_log(two)
    for ea, eb in zip(la, lb):
        assert ea["step"] == eb["step"]
        for key in ("train_loss", "val_loss"):
            if key in ea:
                assert ea[key] == pytest.approx(eb[key], rel=1e-4), (key, ea, eb)


def check_process_group_and_ddp(monkeypatch, device="cpu", backend="aot_eager", close=None):
    """Under torchrun (one process here): dist_timeout reaches init_process_group; DDP keeps the gradients in its
    buckets (no second copy), syncs no buffers before each forward, and, compiled with backend, splits the graph
    at its bucket size (DDPOptimizer) through higher-order ops (the dynamic variant's checkpointed mixing; on CUDA
    FlexAttention too), the gradients those of the plain model (bitwise, or within close=dict(rtol=, atol=))."""
    from torch._dynamo.utils import counters  # here: importing it loads dynamo
    seen, init = {}, dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.update(k) or init(*a, **k))
    one_process_torchrun(monkeypatch)
    ended_with = []  # whether the DDP wrapper was still alive when the process group ended
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: ended_with.append(freed() is not None) or destroy())
    worker = parallel.join(TrainConfig(dist_timeout=123, device=device))
    with contextlib.ExitStack() as cleanup, worker as env:  # a failed assertion leaves the group: end it anyway
        cleanup.callback(lambda: dist.is_initialized() and destroy())
        assert env.distributed and seen["timeout"] == timedelta(seconds=123)
        assert dist.get_backend() == ("nccl" if env.device.startswith("cuda") else "gloo")
        torch.manual_seed(0)
        net = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=EOT + 48, block_size=256, gate=True,
                            anchor="exo", mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True))
        for p in net.parameters():  # no zero-initialised layer: every gradient is non-zero
            torch.nn.init.normal_(p, std=0.05)
        net.to(env.device)
        idx = torch.randint(0, EOT + 1, (2, 257), generator=torch.Generator().manual_seed(0)).to(env.device)
        net(idx[:, :-1], idx[:, 1:], doc_mask=True)[1].backward()
        plain = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        assert parallel.data_parallel(net, env).bucket_bytes_cap == parallel.DDP_BUCKET_MB * 2**20
        torch._dynamo.reset()
        counters.clear()
        # 1 MiB buckets (DDP's first bucket size, the least DDPOptimizer takes) cut this 12 MiB model in two
        ddp = parallel.data_parallel(torch.compile(net, backend=backend), env, bucket_mb=1)
        freed = weakref.ref(ddp)
        assert ddp.gradient_as_bucket_view and not ddp.will_sync_module_buffers()
        ddp(idx[:, :-1], idx[:, 1:], doc_mask=True)[1].backward()
        assert counters["stats"]["unique_graphs"] == 1 and counters["aot_autograd"]["total"] == 2  # two parts
        same = torch.equal if close is None else lambda a, b: torch.allclose(a, b, **close)
        assert all(same(p.grad, g) for p, g in zip(net.parameters(), plain))
        ddp = None  # what nothing holds any more is freed (a garbage collection: DDP sits in reference cycles)
    # ... before the process group ends, not by the interpreter at exit, after it (the deadlock of a reducer freed late)
    assert ended_with == [False]


def test_process_group_timeout_and_ddp_arguments(monkeypatch):
    """On gloo, with aot_eager: the split, not inductor's kernels, is under test."""
    check_process_group_and_ddp(monkeypatch)


def test_train_frees_its_ddp_wrapper_before_the_process_group_ends(data_dir, tmp_path, monkeypatch):
    """train.main under torchrun (one process here): when the group ends, no DDP wrapper of the run is alive."""
    one_process_torchrun(monkeypatch)
    made, alive_at_end = [], []  # the wrappers' types; the DDP objects still in memory (garbage too) at the end
    wrap = parallel.data_parallel
    monkeypatch.setattr(parallel, "data_parallel", lambda *a, **k: made.append(type(m := wrap(*a, **k))) or m)
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: alive_at_end.append(
        sum(type(o) is parallel.DDP for o in gc.get_objects())) or destroy())
    try:
        train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_steps=2"])
    finally:  # a failed run leaves the group: end it for the tests after this one
        if dist.is_initialized():
            destroy()
    assert made == [parallel.DDP] and alive_at_end == [0]


# ----------------------------------------------------------------------------- resume

def stopped_at(step, args, monkeypatch, trainer=train):
    """trainer.main(args), stopped by a SIGTERM that arrives during step `step`: the real stop (the step finishes, a
    checkpoint of it is written, and the run exits with status 75). trainer: train, or a fork's train module."""
    real = trainer.micro_batches

    def micro_batches(run):  # each step's batches: the step about to run is run.step + 1
        if run.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(run)

    with monkeypatch.context() as m:
        m.setattr(trainer, "micro_batches", micro_batches)
        with pytest.raises(SystemExit) as e:
            trainer.main(args)
    assert e.value.code == parallel.PREEMPTED


@pytest.mark.quick
@pytest.mark.parametrize("data", ["data_dir", "doc_data_dir"])
def test_resume_is_bitwise_identical(data, tmp_path, monkeypatch, request):
    extra = DOCS if data == "doc_data_dir" else []
    common = SMALL + extra + [f"--data_dir={request.getfixturevalue(data)}", "--max_steps=6", "--ckpt_interval=3"]
    straight = str(tmp_path / "straight")
    train.main(common + [f"--out_dir={straight}"])
    # the second run is stopped after step 3 (SIGTERM), with a checkpoint, then resumes
    resumed = str(tmp_path / "resumed")
    stopped_at(3, common + [f"--out_dir={resumed}"], monkeypatch)
    assert load_checkpoint(f"{resumed}/ckpt.pt")["step"] == 3
    train.main(common + [f"--out_dir={resumed}", "--init_from=resume"])
    assert_same_run(straight, resumed)
    assert [e["step"] for e in read_log(resumed)] == list(range(7))
    assert [e["step"] for e in read_log(resumed, configs=True)] == [0, 3]
    assert read_log(resumed, configs=True)[1]["config"]["init_from"] == "resume"


def test_a_cooldown_branched_from_a_longer_run_equals_a_run_of_its_own_length(data_dir, tmp_path, capsys):
    """Pins the recipe (its linear cooldown, at which the 8 and 12-step schedules agree before step 7).
    Branching a cooldown (Hagele et al. 2024, the README's budget-matched measure): the 12-step run keeps a
    resumable checkpoint of step 6 (keep_full), and --init_from=<it> --max_steps=8 into a new directory ends bit for
    bit as an 8-step run from scratch, log included (it begins with the parent's, up to step 6), since both
    schedules are the same before step 6 (they part at step 7, the 8-step run's last). A branch point where they
    differ before it, or a key that changes the computation, is refused in one line."""
    common = SMALL + [f"--data_dir={data_dir}", "--eval_interval=3"]
    train.main(common + [f"--out_dir={tmp_path / 'short'}", "--max_steps=8"])
    train.main(common + [f"--out_dir={tmp_path / 'long'}", "--max_steps=12", "--keep_full=6,8"])
    assert sorted(f for f in os.listdir(tmp_path / "long") if f.endswith("_full.pt")) == [
        "ckpt_000006_full.pt", "ckpt_000008_full.pt"]
    point = str(tmp_path / "long" / "ckpt_000006_full.pt")
    capsys.readouterr()
    train.main(common + [f"--out_dir={tmp_path / 'branch'}", "--max_steps=8", f"--init_from={point}"])
    assert f"resuming from {point} at step 6 (a branch, into {tmp_path / 'branch'})" in capsys.readouterr().out
    assert_same_run(tmp_path / "short", tmp_path / "branch")
    assert [e["step"] for e in read_log(tmp_path / "branch", configs=True)] == [0, 6]  # the parent's start, its own
    train.main(common + [f"--out_dir={tmp_path / 'branch'}", "--max_steps=8", f"--init_from={point}"])  # finished
    late = str(tmp_path / "long" / "ckpt_000008_full.pt")
    with pytest.raises(SystemExit, match=r"^train.py: error: .*ckpt_000008_full.pt: cannot branch from it: the "
                       r"schedules of max_steps=12 and max_steps=8 differ from step 7: a branch point s needs the same "
                       r"schedule at every step before s \(here s <= 7\)$"):
        train.main(common + [f"--out_dir={tmp_path / 'late'}", "--max_steps=8", f"--init_from={late}"])
    with pytest.raises(SystemExit, match="ckpt_000006_full.pt: adam_lr=0.003 in the checkpoint, adam_lr=0.001 "
                                         "given: a branch changes max_steps only"):
        train.main(common + [f"--out_dir={tmp_path / 'lr'}", "--max_steps=8", f"--init_from={point}",
                             "--adam_lr=0.001"])
    assert not os.path.exists(tmp_path / "late") and not os.path.exists(tmp_path / "lr")  # refused before any work


@pytest.mark.quick
def test_a_branch_point_is_accepted_exactly_where_both_schedules_agree_before_it(monkeypatch):
    """A branch of another max_steps is accepted from step s of its parent run (schedule_differs finds no step
    before s: engine/checkpoint.continued_config) exactly where schedule(t) is the same in both for every t < s:
    shorter and longer branches, warmups, momentum ramps and cooldowns of several lengths, and a cosine schedule
    (train.lr_multiplier replaced, as docs/FORKING.md's recipe does), which agrees only through the warmup. Holds
    for any fork's schedule: each expected step is computed from schedule()."""
    def agree(parent, child, s):
        return all(schedule(t, parent) == schedule(t, child) for t in range(s))

    late = cfg(max_steps=8, warmup_steps=2, muon_momentum_steps=2)
    parted = next((t for t in range(8) if schedule(t, late) != schedule(t, replace(late, max_steps=12))), None)
    assert train.schedule_differs(replace(late, max_steps=12), late, 8) == parted  # any fork's schedule
    for lr in (None, lambda step, c: min((step + 1) / c.warmup_steps, 0.5 * (1 + math.cos(math.pi * step /
                                                                                        c.max_steps)))):
        if lr:
            monkeypatch.setattr(train, "lr_multiplier", lr)
        for parent_steps, child_steps, warmup, ramp, cooldown in [(30, 10, 2, 4, 0.2), (30, 10, 2, 1, 0.2),
                                                                  (10, 30, 2, 1, 0.2), (40, 24, 5, 3, 0.5)]:
            child = cfg(max_steps=child_steps, warmup_steps=warmup, muon_momentum_steps=ramp, cooldown_frac=cooldown)
            parent = replace(child, max_steps=parent_steps)
            accepted = [s for s in range(1, min(parent_steps, child_steps))
                        if train.schedule_differs(parent, child, s) is None]
            exact = [s for s in range(1, min(parent_steps, child_steps)) if agree(parent, child, s)]
            assert accepted == exact and exact, (lr, parent_steps, child_steps)
            assert train.schedule_differs(parent, child, child_steps) == exact[-1]  # sweep.py's branch point
            if lr:  # cosine: the schedules part as soon as the warmup ends
                assert exact[-1] <= warmup + 1


def assert_same_run(a_dir, b_dir, close=None):
    """Two runs' final checkpoints (weights, optimiser states, data position) and logs are bitwise equal, or
    within close=dict(rtol=, atol=) where a GPU's kernels are not deterministic."""
    same = torch.equal if close is None else lambda x, y: torch.allclose(x, y, **close)
    a, b = load_checkpoint(f"{a_dir}/ckpt.pt"), load_checkpoint(f"{b_dir}/ckpt.pt")
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert same(a["model"][k], b["model"][k]), k
    assert a["optimizers"].keys() == b["optimizers"].keys()
    for name in a["optimizers"]:
        sa, sb = a["optimizers"][name]["state"], b["optimizers"][name]["state"]
        assert sa.keys() == sb.keys(), name
        for p in sa:
            assert sa[p].keys() == sb[p].keys() and all(same(sa[p][k], sb[p][k]) for k in sa[p]), (name, p)
    assert a["loader"] == b["loader"]
    strip = lambda log: [{k: v for k, v in e.items() if k not in ("step_ms", "tok_per_s", "mfu")} for e in log]
    if close is None:
        assert strip(read_log(a_dir)) == strip(read_log(b_dir))
    else:
        for ea, eb in zip(strip(read_log(a_dir)), strip(read_log(b_dir)), strict=True):
            assert ea.keys() == eb.keys() and all(ea[k] == pytest.approx(eb[k], rel=close["rtol"]) for k in ea)


def test_activation_checkpointing_trains_bitwise_like_without(doc_data_dir, tmp_path, monkeypatch):
    common = SMALL + DOCS + [f"--data_dir={doc_data_dir}", "--max_steps=3"]
    plain, ckpt = str(tmp_path / "plain"), str(tmp_path / "ckpt")
    train.main(common + [f"--out_dir={plain}"])
    recomputed = []  # blocks run under torch.utils.checkpoint
    monkeypatch.setattr(model, "checkpoint", lambda fn, *a, **kw: (recomputed.append(type(fn).__name__),
                                                                  checkpoint(fn, *a, **kw))[1])
    train.main(common + [f"--out_dir={ckpt}", "--activation_checkpointing=True"])
    assert recomputed.count("Block") == 3 * 2 * 2  # steps x micro-steps x layers
    a, b = load_checkpoint(f"{plain}/ckpt.pt"), load_checkpoint(f"{ckpt}/ckpt.pt")
    assert b["config"]["activation_checkpointing"] is True
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_doc_mask_is_in_effect_and_kept_on_resume(doc_data_dir, tmp_path):
    common = SMALL + DOCS + [f"--data_dir={doc_data_dir}", "--max_steps=4", "--ckpt_interval=2"]
    masked, plain = str(tmp_path / "masked"), str(tmp_path / "plain")
    train.main(common + [f"--out_dir={masked}"])  # doc_mask=True is the default
    train.main(common + [f"--out_dir={plain}", "--doc_mask=False"])
    lm, lp = read_log(masked), read_log(plain)
    assert lm[0]["val_loss"] == lp[0]["val_loss"]  # zero-initialised output layers: every logit is 0 at step 0
    assert lm[-1]["train_loss"] < lm[1]["train_loss"]  # it trains
    assert lm[-1]["train_loss"] != lp[-1]["train_loss"] and lm[-1]["val_loss"] != lp[-1]["val_loss"]
    assert load_checkpoint(f"{plain}/ckpt.pt")["config"]["doc_mask"] is False
    # resuming without the key keeps the checkpoint's masking; an override wins
    train.main(common + [f"--out_dir={plain}", "--init_from=resume", "--max_steps=6"])
    assert read_log(plain, configs=True)[-1]["config"]["doc_mask"] is False
    assert train.main(common + [f"--out_dir={plain}", "--eval_only=True"]) != \
        train.main(common + [f"--out_dir={plain}", "--eval_only=True", "--doc_mask=True"])


@pytest.fixture
def recorded_data(toy_shards, enc_file, tmp_path):
    """The toy shards in a folder whose manifest records a tokenizer (the tests' own, enc_file: 291 tokens, its
    <|endoftext|> 290), as prepare.py records the one that made its shards."""
    folder = tmp_path / "recorded"
    shutil.copytree(toy_shards, folder)
    entry = lambda name: {"bytes": os.path.getsize(folder / name), "sha256": hashlib.sha256((folder / name)
                                                                                           .read_bytes()).hexdigest()}
    data.add_to_manifest(folder, {name: entry(name) for name in os.listdir(folder)}, data.read_tokenizer(enc_file))
    return str(folder)


def test_the_tokenizer_comes_from_the_data_and_goes_into_every_checkpoint(recorded_data, data_dir, enc_file, tmp_path,
                                                                          capsys):
    """train.py takes the data's tokenizer with no flag (issue 50): its <|endoftext|> becomes the model's eot_token,
    what document masking looks for; the start-up line and every checkpoint name it. Refused in one line before any
    work: a vocabulary without room for its tokens, an eot_token given otherwise, a resume on another tokenizer's
    data (here: the same run's on data that records none, which is read as GPT-2's)."""
    args = SMALL + [f"--data_dir={recorded_data}", "--max_steps=2"]
    out = str(tmp_path / "out")
    result, stdout, _ = main_output(args + ["--vocab_size=320", f"--out_dir={out}"], capsys)
    recorded = data.read_tokenizer(enc_file)
    ckpt = load_checkpoint(f"{out}/ckpt.pt")
    assert ckpt["tokenizer"] == recorded and ckpt["model_config"]["eot_token"] == 290
    assert "its tokenizer: test.tiktoken (291 tokens, <|endoftext|> 290)\n" in stdout  # 320 rows: padding only
    sized_for_gpt2 = types.SimpleNamespace(model=GPT(GPTConfig(**{**ckpt["model_config"], "vocab_size": EOT + 48})),
                                           tokenizer=recorded)  # the default vocab_size, on this data: said
    assert runlog.unused_rows(sized_for_gpt2) == ", 50,013 of the model's vocab_size=50,304 rows no token of it uses"
    for given, line in [(["--vocab_size=256"], f"vocab_size=256: {recorded_data}'s tokenizer is test.tiktoken (291 "
                                                f"tokens, <|endoftext|> 290): expected vocab_size >= 291"),
                        (["--vocab_size=320", "--eot_token=5"], f"eot_token=5: {recorded_data}'s tokenizer is "
                         f"test.tiktoken (291 tokens, <|endoftext|> 290) (leave eot_token out: a run takes it from "
                         f"its data)")]:
        result, _, _ = main_output(args + given + [f"--out_dir={tmp_path / 'refused'}"], capsys)
        assert str(result.code) == f"train.py: error: {line}"
    result, _, _ = main_output(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=3",
                                        "--vocab_size=320", "--init_from=auto"], capsys)
    assert str(result.code) == (f"train.py: error: {data_dir}: its tokenizer is none recorded (written before "
                                f"tokenizers were: GPT-2's assumed), {out}/ckpt.pt was trained with test.tiktoken (291 "
                                f"tokens, <|endoftext|> 290): its model reads that one's data")
    assert not os.path.exists(tmp_path / "refused")


def test_sigkill_mid_run_resumes_from_last_checkpoint_and_finishes(data_dir, tmp_path, capsys):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=40", "--ckpt_interval=5"]
    straight = str(tmp_path / "straight")
    train.main(common + [f"--out_dir={straight}"])
    out = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "train.py", *common, f"--out_dir={out}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = os.path.join(out, "ckpt.pt")
    deadline = time.time() + 120
    while not os.path.exists(ckpt) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere after the first checkpoint, possibly in the middle of writing another
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = load_checkpoint(ckpt)["step"]
    assert 5 <= killed_at < 40, killed_at
    _, stdout, _ = main_output(common + [f"--out_dir={out}", "--init_from=resume"], capsys)
    assert f"resuming from {ckpt} at step {killed_at}" in stdout
    a, b = load_checkpoint(f"{straight}/ckpt.pt"), load_checkpoint(ckpt)
    assert b["step"] == 40
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert [e["step"] for e in read_log(out)] == [e["step"] for e in read_log(straight)]


@pytest.mark.quick
def test_resume_takes_the_model_from_the_checkpoint(data_dir, tmp_path, capsys):
    """A checkpoint written before a GPTConfig field existed means that field's default; resume and eval_only
    need no variant files; a model key that is given must agree with the checkpoint."""
    common = [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--batch_size=2", "--total_batch_size=128",
              "--warmup_steps=2", "--eval_tokens=256", "--eval_interval=100", "--muon_momentum_steps=2"]
    model = ["configs/exoformer_e.py", "--n_layer=2", "--n_embd=64", "--n_head=2", f"--vocab_size={VOCAB}",
             "--block_size=32"]
    train.main(model + common + ["--max_steps=2"])
    ckpt = load_checkpoint(f"{tmp_path}/ckpt.pt")
    del ckpt["model_config"]["dynamic"]  # as written by a model.py without that field
    torch.save(ckpt, f"{tmp_path}/ckpt.pt")
    train.main(model + common + ["--max_steps=3", "--init_from=resume"])  # the same command goes on
    assert load_checkpoint(f"{tmp_path}/ckpt.pt")["step"] == 3
    # no model key at all: the checkpoint's model (n_layer=2, block_size=32, ...), not the defaults
    assert train.main(common + ["--eval_only=True"]) == train.main(model + common + ["--eval_only=True"])
    _, stdout, _ = main_output(common + ["--max_steps=4", "--init_from=resume"], capsys)
    assert "n_layer=2" in stdout and "resuming from" in stdout
    assert "max_steps=4, the run's was 3: the two schedules differ from step 2 on" in stdout  # Muon's ramp-down
    assert load_checkpoint(f"{tmp_path}/ckpt.pt")["model_config"]["n_layer"] == 2
    # a recipe key with another value is one line too, and the checkpoint untouched
    before = os.stat(f"{tmp_path}/ckpt.pt").st_mtime_ns
    with pytest.raises(SystemExit, match=r"ckpt.pt: muon_lr=0.01 in the checkpoint, muon_lr=0.02 given: a run "
                                         r"continues with the recipe it was saved with"):
        train.main(common + ["--muon_lr=0.02", "--max_steps=5", "--init_from=resume"])
    assert os.stat(f"{tmp_path}/ckpt.pt").st_mtime_ns == before
    # a real conflict is one line naming the fields, before anything runs
    conflict = ["--dynamic=True", "--n_layer=3", "--n_head=2"]
    result, _, _ = main_output(conflict + common + ["--init_from=resume"], capsys)
    assert result.code == (
        f"train.py: error: {tmp_path}/ckpt.pt: n_layer=2, dynamic=False in the checkpoint, n_layer=3, dynamic=True "
        f"given: a run continues with the recipe it was saved with (leave the key out to take the checkpoint's)")


# ----------------------------------------------------------------------------- checkpoints and errors

class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.quick
def test_checkpoint_with_pickled_callable_is_refused(tmp_path):
    out = tmp_path / "evil"
    out.mkdir()
    torch.save({"model": {}, "model_config": {}, "payload": Boom()}, out / "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt.pt: not loadable with torch.load\(weights_only=True\)"):
        load_checkpoint(str(out / "ckpt.pt"))
    with pytest.raises(SystemExit, match=r"not loadable with torch.load\(weights_only=True\)"):
        train.main(["--init_from=resume", f"--out_dir={out}"])
    assert not (tmp_path / "PWNED").exists() and not os.path.exists(os.path.join(ROOT, "PWNED"))


def tiny_args(data_dir, tmp_path):
    """The smallest run of the bad-config tests, into tmp_path/out."""
    return [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--block_size=32", "--batch_size=2",
            "--total_batch_size=128", "--n_layer=1", "--n_embd=32", "--n_head=2", "--vocab_size=256"]


@pytest.mark.parametrize("args,message", [
    (["--n_layers=3"], "unknown key 'n_layers' (did you mean n_layer?)"),
    (["--max_steps=ten"], "max_steps='ten' is str, expected int"),
    (["--total_batch_size=100"], "total_batch_size=100: expected a multiple of batch_size x block_size"),
    (["--init_from=latest"], "init_from='latest': no such file; expected 'scratch', 'resume', 'auto' or a checkpoint "
                               "to branch from"),
    (["--anchor=exo"], "GPTConfig.mix='': anchor='exo'"),
    (["--data_dir=/nonexistent/shards"], "/nonexistent/shards"),
    (["--init_from=resume", "--out_dir=/nonexistent/out"], "/nonexistent/out/ckpt.pt: no checkpoint there"),
])
@pytest.mark.quick
def test_bad_config_fails_before_training(data_dir, args, message, tmp_path, capsys):
    """Each one line, and nothing started; in this process (SystemExit with the line: the shell's exit status and
    stderr are test_a_bad_key_from_a_shell_...'s)."""
    result, _, _ = main_output(tiny_args(data_dir, tmp_path) + args, capsys)
    assert isinstance(result, SystemExit) and str(result.code).startswith("train.py: error:")
    assert message in str(result.code) and "\n" not in str(result.code), result
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.quick
def test_a_bad_key_from_a_shell_exits_1_with_one_line_that_lists_the_keys(data_dir, tmp_path):
    """train.py as a shell runs it: exit status 1, the line last on stderr, and nothing started."""
    r = run_cli(tiny_args(data_dir, tmp_path) + ["--n_layers=3"], check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "train.py: error: " \
        "--n_layers=3: unknown key 'n_layers' (did you mean n_layer?); valid keys: " + \
        ", ".join(sorted(train.ALL_DEFAULTS)), r.stderr
    assert not (tmp_path / "out").exists()


def test_corrupt_shard_fails_before_training(data_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(data_dir):
        (bad / name).write_bytes(open(os.path.join(data_dir, name), "rb").read())
    shard = bad / "toy_train_000002.bin"
    shard.write_bytes(shard.read_bytes()[:-100])  # a truncated copy
    with pytest.raises(SystemExit, match=f"^train.py: error: .*{shard}"):
        train.main(SMALL + [f"--data_dir={bad}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_non_finite_loss_stops_and_keeps_last_checkpoint(data_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    forward = train.GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        out = forward(self, idx, targets, **kw)
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] > 2 * 3:  # 2 micro-steps per step: the 4th step's loss is NaN
                return (out[0], out[1] * float("nan"), *out[2:])
        return out

    monkeypatch.setattr(train.GPT, "forward", poisoned)
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=10", "--ckpt_interval=2"])
    assert "non-finite loss (nan) at step 4" in str(e.value) and "ckpt.pt" in str(e.value)
    assert load_checkpoint(f"{out}/ckpt.pt")["step"] == 2


# ----------------------------------------------------------------------------- end to end

def test_end_to_end_tiny_dyn_exo(data_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    _, stdout, _ = main_output(["configs/dyn_exo.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={out}",
                                f"--vocab_size={VOCAB}", "--block_size=64", "--batch_size=4", "--total_batch_size=512",
                                "--max_steps=30", "--warmup_steps=5", "--eval_interval=15", "--eval_tokens=1024",
                                "--log_interval=5", "--ckpt_interval=15"], capsys)
    log = read_log(out)
    val = [e["val_loss"] for e in log if "val_loss" in e]
    assert [e["step"] for e in log if "val_loss" in e] == [0, 15, 30]
    assert val[-1] < val[0] - 1.0, val
    assert {"step", "train_loss", "muon_lr", "adam_lr", "tok_per_s", "grad_norm", "step_ms"} <= set(log[-1])
    ckpt = load_checkpoint(f"{out}/ckpt.pt")
    assert ckpt["step"] == 30 and ckpt["model_config"]["dynamic"] and ckpt["model_config"]["n_layer"] == 4
    assert ckpt["config"]["max_steps"] == 30
    assert "step 30/30" in stdout
    # start-up: the configuration where it differs from the defaults (one line, not the whole JSON), and
    # what each optimiser updates
    lines = stdout.splitlines()
    config = next(line for line in lines if line.startswith("config, where it differs from the defaults"))
    assert "max_steps=30" in config and "dynamic=True" in config and "n_layer=4" in config
    assert "muon_beta2" not in config and not any(line.startswith(("{", '"')) for line in lines)
    assert any(line.startswith("optimisers: Muon ") and "AdamW" in line for line in lines)
    # eval_only scores the checkpoint on the whole validation shard
    whole, stdout, _ = main_output([f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_only=True"], capsys)
    assert stdout.strip().splitlines()[-1] == f"step 30: val loss {whole:.4f} on the whole validation set"
    assert abs(whole - val[-1]) < 0.5


def test_planned_epochs_are_said_and_each_wrap_around_logged(tmp_path, capsys):
    """One short train shard and more steps than it holds: the start-up says so, and every step whose
    batch starts the data again is logged (printed and in log.jsonl)."""
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "s_val_000000.bin", rng.integers(0, VOCAB, 600))
    write_shard(tmp_path / "s_train_000001.bin", rng.integers(0, VOCAB, 1000))  # 7 windows of 128 + 1 tokens
    out = str(tmp_path / "out")
    _, stdout, _ = main_output(SMALL + [f"--data_dir={tmp_path}", f"--out_dir={out}", "--max_steps=16",
                                        "--log_interval=5"], capsys)
    assert (f"data: 16 steps x 128 tokens = 2,048 tokens planned; {tmp_path} has 896 usable train tokens: "
            f"2.29 epochs (the data repeats)") in stdout
    assert [line for line in stdout.splitlines() if "wrapping around" in line] == [
        "step 8: end of the train data, wrapping around to its start: epoch 2 begins",
        "step 15: end of the train data, wrapping around to its start: epoch 3 begins"]
    assert [(e["step"], e["epoch"]) for e in read_log(out) if "epoch" in e] == [(8, 2), (15, 3)]
    assert [e["step"] for e in read_log(out)] == [0, 5, 8, 10, 15, 16]
    assert load_checkpoint(f"{out}/ckpt.pt")["loader"]["epoch"] == 3


@pytest.mark.quick
def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    _, stdout, _ = main_output(["--help"], capsys)
    assert "applied in the order given" in stdout and "--init_from=resume" in stdout
    for key, default in train.ALL_DEFAULTS.items():
        line = next((l for l in stdout.splitlines() if l.startswith(f"  {key} = {default!r} ")), None)
        assert line is not None and len(line.split(f"{default!r}", 1)[1].strip()) > 5, key
    assert main_output(["-h", "--max_steps=oops"], capsys)[1] == stdout  # help first, nothing else checked


@pytest.mark.quick
def test_every_key_has_exactly_one_meaning():
    """Training keys are explained next to their default in train.py's TrainConfig, model keys next to theirs in
    model.py's GPTConfig: every key once, and --help reads them from there."""
    import model
    from engine.configurator import key_comments
    assert set(key_comments(train.__file__, "TrainConfig")) == set(DEFAULTS)
    assert set(key_comments(model.__file__, "GPTConfig")) == set(train.MODEL_KEYS)
    assert not set(DEFAULTS) & set(train.MODEL_KEYS)


def test_the_trainer_imports_no_network_package_and_no_compiler():
    """train.py and what it imports stay off the network (the HTTP client is httpclient.py's, for the tools that
    download), and load no dynamo or inductor (model.py compiles on first use: every process start would pay ~2
    CPU-s); in a fresh interpreter."""
    modules = "{'requests', 'urllib3', 'httpclient', 'torch._dynamo', 'torch._inductor'}"
    r = subprocess.run([sys.executable, "-c", f"import sys, train; print(sorted({modules} & set(sys.modules)))"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_bench_help(capsys):
    from tools import bench
    assert bench.main(["--help"]) is None
    out = capsys.readouterr().out
    assert "not composed as in train.py" in out and "  rounds = 3  " in out and "  dynamic = False  " in out


def test_bench_prints_time_and_flop_ratios(capsys):
    from tools import bench
    size = ["--n_layer=2", "--n_embd=64", "--n_head=2", f"--vocab_size={VOCAB}", "--block_size=32",
            "--batch_size=2", "--steps=1", "--rounds=2", "--warmup=1"]
    runs = bench.main(["configs/gated.py", "configs/dyn_exo.py"] + size)
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("gated ", "dyn_exo "))}
    assert set(rows) == {"gated", "dyn_exo"} and all(len(r.times) == 2 for r in runs)
    assert rows["gated"][-2:] == ["1.0000", "1.0000"]  # the first config is the reference
    flops = [flops_per_token(r.model, 32) for r in runs]
    assert float(rows["dyn_exo"][-1]) == pytest.approx(flops[1] / flops[0], abs=1e-4) and flops[1] > flops[0]
    assert rows["dyn_exo"][1] == f"{runs[1].model.num_params():,}"
    by_round = [a / b for a, b in zip(runs[1].times, runs[0].times)]  # one step a round: its own median
    assert f"time ratio by round, dyn_exo: {by_round[0]:.4f} {by_round[1]:.4f} " \
           f"(spread {max(by_round) - min(by_round):.4f})" in out.splitlines()
    assert runs[0].model.lm_head.weight.abs().sum() > 0  # the optimisers did step (lm_head starts at 0)
    runs = bench.main(["configs/gated.py"] + size + ["--optimizer=False"])
    assert "forward+backward:" in capsys.readouterr().out
    assert runs[0].model.lm_head.weight.abs().sum() == 0  # forward + backward only


def test_bench_profile_attributes_every_microsecond_of_the_step_to_a_part(capsys):
    """--profile=True: each part of dyn_exo's step (anchors, dynamic scales, mix; recompute under activation
    checkpointing) in its forward and backward, none of them in Gated's, and the parts add up to the profiled
    ranges (self times: nothing counted twice or left out); the wrappers are gone afterwards."""
    from tools import bench
    size = ["--n_layer=2", "--n_embd=64", "--n_head=2", f"--vocab_size={VOCAB}", "--block_size=32", "--batch_size=2",
            "--steps=1", "--rounds=1", "--warmup=1", "--profile=True", "--activation_checkpointing=True"]
    gated, dyn = bench.main(["configs/gated.py", "configs/dyn_exo.py"] + size)
    parts = lambda row: {part for (part, _), us in row.parts.items() if us > 0}
    assert parts(gated) == {"rest", "recompute", "optimizers"}
    assert parts(dyn) == {"anchors", "dynamic scales", "mix", "recompute", "rest", "optimizers"}
    assert {phase for (part, phase) in dyn.parts if part in ("anchors", "mix")} == {"forward", "backward"}
    assert {phase for (part, phase) in dyn.parts if part == "recompute"} == {"backward"}
    rows = {tuple(line[:26].split()): [float(v.rstrip("%")) for v in line[26:].split()]
            for line in capsys.readouterr().out.splitlines()[3:15]}
    assert len(rows) == 12 and all(len(v) == 4 for v in rows.values())  # gated, dyn_exo, what dyn_exo adds, %
    step = rows.pop(("step",))
    for column in range(3):  # each part printed to 0.1 ms
        assert sum(v[column] for v in rows.values()) == pytest.approx(step[column], abs=0.06 * len(rows))
    with torch.profiler.profile() as prof:
        bench.step(dyn, *bench.synthetic_batch(2, 32, VOCAB, 1000, "cpu"), parallel.join(dyn.cfg))
    events = prof.events()
    phases = sum(e.cpu_time_total for e in events if e.cpu_parent is None and e.name in bench.PHASES)
    assert sum(bench.part_times(events).values()) == pytest.approx(phases)
    assert model.mix_with_anchor.__qualname__ == "mix_with_anchor" and "normalize" not in vars(dyn.model)
    assert not any("forward" in vars(m) for m in dyn.model.modules())  # the wrappers gone


def test_bench_compare_and_activation_memory(capsys):
    from tools import bench
    size = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=32", "--batch_size=2", "--steps=1",
            "--rounds=1", "--warmup=0"] + DOCS
    rows = bench.main(["configs/dyn_exo.py"] + size + ["--compare=activation_checkpointing"])
    assert [(r.name, r.model.activation_checkpointing) for r in rows] == \
        [("dyn_exo", False), ("dyn_exo+activation_checkpointing", True)]
    rows = {r.name: r for r in bench.main(["configs/gated.py", "configs/dyn_exo.py"] + size +
                                              ["--memory=True", "--compare=activation_checkpointing"])}
    assert set(rows) == {"gated", "gated+activation_checkpointing", "dyn_exo", "dyn_exo+activation_checkpointing"}
    for name in ("gated", "dyn_exo"):
        assert rows[name + "+activation_checkpointing"].per_layer < rows[name].per_layer / 2
    # the split is linear in depth: a 4-layer model saves the fixed part plus 4 layers' worth
    x, y = bench.synthetic_batch(1, 32, EOT + 48, 1000, "cpu")
    four = bench.saved_bytes(GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=32, vocab_size=EOT + 48,
                                            gate=True)), x, y, contextlib.nullcontext(), True)
    assert four == rows["gated"].fixed + 4 * rows["gated"].per_layer
    ckpt = rows["gated+activation_checkpointing"]  # its peak: 2 block inputs, and 1 block rebuilt in backward
    assert ckpt.total == ckpt.fixed + 2 * ckpt.per_layer + rows["gated"].per_layer
    with pytest.raises(SystemExit, match="--compare=seed: expected a True/False key"):
        bench.main(["configs/gated.py", "--compare=seed"])


def test_bf16_autocast_training_on_cpu(data_dir, tmp_path):
    """The CUDA recipe's mixed precision (bf16 forward, fp32 master weights) runs on CPU too."""
    out = str(tmp_path / "out")
    train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=8", "--dtype=bfloat16",
                        "--adam_lr=0.01"])
    log = read_log(out)
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 0.3, log
    assert all(v.dtype == torch.float32 for v in load_checkpoint(f"{out}/ckpt.pt")["model"].values())


def test_compiled_training_compiles_once_for_every_layout(doc_data_dir, tmp_path, monkeypatch):
    """--compile=True: 8 steps of 2 micro-steps, every window (16) a different layout of documents under the dense
    mask, run two graphs, compiled once each (training, and the evaluation's without gradients): no graph break, no
    recompilation, and the losses of an eager run. Through dynamo and AOT autograd (backend aot_eager), where graphs
    break and recompile: inductor's kernels, the default backend's, are test_model.py's compiled steps' subject (one
    compile each of the code paths, against eager's loss and gradients), and cost most of a cold start here."""
    from torch._dynamo.utils import counters  # here: importing it loads dynamo
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile(model, backend="aot_eager", **kw))
    common = SMALL + DOCS + [f"--data_dir={doc_data_dir}", "--max_steps=8", "--eval_interval=8"]
    eager = train.main(common + [f"--out_dir={tmp_path / 'eager'}"])
    torch._dynamo.reset()
    counters.clear()
    compiled = train.main(common + [f"--out_dir={tmp_path / 'compiled'}", "--compile=True"])
    assert counters["stats"]["unique_graphs"] == 2
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert read_log(tmp_path / "compiled")[-1]["val_loss"] == pytest.approx(
        read_log(tmp_path / "eager")[-1]["val_loss"], rel=1e-5)


def test_step_times_leave_out_each_starts_first_step():
    """The log's step time (and MFU) leaves out the first step of a (re)start, which holds compilation."""
    assert runlog.step_seconds([50.0, 1.0, 2.0], 10) == 1.5
    assert runlog.step_seconds([50.0, 1.0, 2.0, 4.0], 2) == 3.0  # the last n
    assert runlog.step_seconds([50.0], 10) == 50.0  # unless it is all there is


def test_non_finite_gradient_norm_stops_and_keeps_last_checkpoint(data_dir, tmp_path, monkeypatch):
    """A finite loss with a non-finite gradient (as a miscompiled backward gives) stops the run at that step."""
    steps, clip_norm = [], train.clip_norm

    def poisoned(net, max_norm):
        steps.append(1)
        if len(steps) == 4:
            net.wte.weight.grad[0, 0] = float("nan")
        return clip_norm(net, max_norm)

    monkeypatch.setattr(train, "clip_norm", poisoned)
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match=r"non-finite gradient norm \(nan\) at step 4; the last good checkpoint"):
        train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=10", "--ckpt_interval=2"])
    assert load_checkpoint(f"{out}/ckpt.pt")["step"] == 2


def test_gpu_without_bf16_or_triton_falls_back_in_one_line(monkeypatch, capsys):
    """An old GPU: float32 instead of bf16 autocast (sm < 80), eager instead of compile (no Triton, or sm < 70):
    one line each, no traceback. (CUDA faked: only the choice is under test.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(parallel, "triton_available", lambda: False)
    assert parallel.Runtime.pick("cuda") == parallel.Runtime("cuda", torch.float32)
    assert parallel.Runtime.pick("cuda", quiet=True) == parallel.Runtime("cuda", torch.float32)
    assert parallel.Runtime.pick("cuda", "bfloat16").dtype == torch.bfloat16  # asked for: as asked
    worker = parallel.join(TrainConfig())
    assert (worker.device, worker.runtime.dtype, worker.compile) == ("cuda:0", torch.float32, False)
    assert capsys.readouterr().err.splitlines() == [
        "note: Tesla T4 has no bfloat16 (older than sm80): float32"] * 2 + [
        "note: no Triton for Tesla T4 (not installed, or a GPU older than sm70): compile=False, and document masks "
        "are dense SDPA masks"]


def test_a_cpu_run_keeps_freed_memory_for_its_next_tensor():
    """Runtime.pick("cpu") has glibc's malloc keep a freed 0.4 GB tensor for the next allocation, where by default
    it hands it back to the kernel (and page-faults it in again at the next step). In a fresh process, as malloc's
    settings are the process's: the default first, then the same after Runtime.pick("cpu")."""
    script = ("import os, torch\nfrom engine import parallel\n"
              "resident = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
              "def returned():\n"
              "    t = torch.ones(100_000_000)\n"
              "    held = resident()\n"
              "    del t\n"
              "    return held - resident()\n"
              "default = returned()\n"
              "parallel.Runtime.pick('cpu')\n"
              "print(default, returned())\n")
    default, cpu = map(int, subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, capture_output=True,
                                           text=True).stdout.split())
    assert default >= 4 * 10**8 and cpu < 10**6, (default, cpu)


def test_bench_gpu_refuses_without_a_gpu():
    from tools import bench
    with pytest.raises(SystemExit, match="^bench.py: error: --gpu=True measures the 450M models on a CUDA GPU, and "
                                         "torch sees none here$"):
        bench.main(["--gpu=True"])


# ----------------------------------------------------------------------------- a stranger's first run

def readme_setup():
    """The README's two setup commands, (install and train, install and test): its first code block."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme[readme.index("```bash\n") + len("```bash\n"):].split("```")[0]
    return block.strip().splitlines()


def test_the_readme_setup_is_two_commands_and_ci_runs_the_second_word_for_word():
    train_line, test_line = readme_setup()
    assert train_line == "pip install -r requirements.txt && python train.py configs/dyn_exo.py configs/tiny.py"
    assert test_line in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    requirements = open(os.path.join(ROOT, test_line.split()[3])).read().splitlines()
    assert "-r ../requirements.txt" in requirements  # so CI installs what the first command installs, too


def test_the_quick_start_trains_and_samples_offline_on_a_fresh_machine(closed_network, tmp_path):
    """The README's first command and its sample command, in a fresh copy of the repository with no data/ and the
    network closed: the run builds the built-in corpus from this Python, trains (a few steps here), and sample.py
    reads the shipped tokenizer."""
    for name in os.listdir(ROOT):
        if name.endswith(".py") or name in ("configs", "tokenizer", "engine"):
            (shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy)(
                os.path.join(ROOT, name), tmp_path / name)
    train_command = shlex.split(readme_setup()[0].split("&&")[1])
    sample = next(line for line in open(os.path.join(ROOT, "README.md")).read().splitlines()
                  if line.startswith("python sample.py out/ckpt.pt"))
    python = [sys.executable if word == "python" else word for word in train_command]
    small = ["--max_steps=3", "--eval_tokens=2048", "--batch_size=1", "--total_batch_size=256"]  # one window a step
    r = subprocess.run(closed_network + python + small, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data/stdlib: not there yet; building the built-in corpus from this Python's standard library" in r.stdout
    assert "step 3/3 | loss " in r.stdout and (tmp_path / "data" / "stdlib" / "corpus.json").exists()
    r = subprocess.run(closed_network + [sys.executable] + shlex.split(sample)[1:] + ["--num_samples=1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"---------- sample 1\n{shlex.split(sample)[4]}" in r.stdout, r.stderr[-3000:]


# ----------------------------------------------------------------------------- the dry run (dryrun.py)

def dry_run(args, capsys):
    """train.main's dry run of args: (its exit message or None, what it printed)."""
    try:
        train.main(args + ["--dry_run=True"])
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


def test_a_dry_run_that_does_not_fit_exits_1_and_says_so(capsys):
    """The same launch on a GPU of 80 GB fits; on one of 1 MB it does not: exit status 1 (a message), and the verdict
    line says so. Parameters, gradients, the optimisers' states and steps, activations and collectives are in the
    table, by kind."""
    fits, out = dry_run(SMALL + ["--dry_world_size=4", "--fsdp=True", "--total_batch_size=256"], capsys)
    assert fits is None and "dry run: 4 rank(s), FSDP" in out and ": fits (" in out
    assert all(kind in out for kind in ("parameters", "gradients", "optimiser", "activations", "collectives"))
    code, out = dry_run(SMALL + ["--dry_world_size=4", "--fsdp=True", "--total_batch_size=256", "--gpu_memory=0.001"],
                        capsys)
    assert "dry run" in code and ": does NOT fit (" in out and "dry run: error" not in out


def test_a_dry_run_prints_each_error_the_launch_would_hit_in_one_line(capsys):
    """A batch that does not divide over 3 processes, and FSDP over a model with a 0-d λ (resformer: FSDP2 shards no
    scalar), each one line, exit status 1; nothing traced past an error the build hits."""
    code, out = dry_run(SMALL + ["--dry_world_size=3"], capsys)
    assert code and [line for line in out.splitlines() if "error" in line] == [
        "dry run: error: total_batch_size=128: expected a multiple of batch_size x block_size x processes = 192"]
    code, out = dry_run(SMALL + ["configs/resformer.py", "--dry_world_size=2", "--fsdp=True"], capsys)
    errors = [line for line in out.splitlines() if "error" in line]
    assert code and len(errors) == 1 and "scalar parameters" in errors[0]
