"""Tests of sharded training: FSDP2 (sharding.fully_shard_model) against DDP, Muon on whole matrices under FSDP
(sharding.Exchange), and sharded checkpoints (DCP, sharding.py): resharding on resume from 2 ranks to 1 and to 4, a
kill -9 under --max-restarts, a full disk mid-write, a swap cut short, the weights-only export. gloo on the CPU,
1 to 4 processes; what needs NCCL and bf16 on a GPU is in test_cuda.py. FSDP equals DDP here bit for bit: the same
gradients (2 ranks: a sum of two, then a halving, in either) and the same Muon update (the owners run the unsharded
code on whole matrices), until the gradient clip acts: torch's clip_grad_norm_ sums the norm from the shards, in
another order, and the last bit of its coefficient then differs."""
import copy
import errno
import importlib.util
import json
import os
import pickle
import shutil
import sys
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # sharding.py imports it only where it is used
from torch.distributed.tensor import DTensor, distribute_tensor

import optim
import train
from conftest import made_once, needs, spawn
from engine import checkpoint, parallel, sharding
from engine.checkpoint import load_checkpoint, load_model, load_resumable
from engine.configurator import read_args
from model import GPT, GPTConfig
from test_model import randomize, tokens, variant
from tests.test_faults import TORCHRUN, finish, run, start, wait_for_step, workers
from tests.test_train import (ROOT, SMALL, data_dir, free_port,  # noqa: F401  (data_dir: a fixture)
                              one_process_torchrun, read_log)
from tools import convert
from train import TrainConfig

STEPS = 20
# runs whose float rounding differs (another number of processes; FSDP's clip norm, summed from shards) drift apart
# as Muon's bf16 orthogonalisation carries the difference on: over these 20 steps, measured, 3e-4 relative in a
# loss and 8e-3 in a weight at most
LOSS_RTOL, WEIGHT_ATOL = 1e-3, 2e-2
# a stand-in for a kill right after the checkpoint of step N (argv[1]; 0: none); with argv[2] == "read", the run
# also writes the checkpoint it resumed from, as this number of processes read it, into <out_dir>/read/, and goes on
STOP = """import os, sys
sys.path.insert(0, {root!r})
import train
stop_at, read, save, restore = int(sys.argv[1]), sys.argv[2] == "read", train.save, train.restore
def save_then_stop(run, *args, **kwargs):
    save(run, *args, **kwargs)
    if run.step == stop_at:
        os._exit(0)
def restore_then_save(run, *args):
    restore(run, *args)
    if read:
        folder = os.path.join(run.cfg.out_dir, "read")
        os.makedirs(folder, exist_ok=True)
        save(run, os.path.join(folder, os.path.basename(run.ckpt_path)), run.pending_log)
train.save, train.restore = save_then_stop, restore_then_save
train.main(sys.argv[3:])
"""


def args(data_dir, out, *extra):
    return SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", f"--max_steps={STEPS}", "--ckpt_interval=5",
                    "--init_from=auto", *extra]


def torchrun(n):
    return TORCHRUN[:-1] + [f"--nproc_per_node={n}"]


def batch(n):
    return ["--batch_size=1"] if n == 4 else []  # SMALL's 128 tokens a step: 4 ranks x 1 x 32


def ok(result):
    code, out, err = result
    assert code == 0, err[-3000:]
    return out


@pytest.fixture(scope="session")
def stop_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "stop.py"
    path.write_text(STOP.format(root=ROOT))
    return str(path)


@pytest.fixture(scope="session")
def fsdp_run(data_dir, tmp_path_factory):
    """The unbroken run at 2 ranks under FSDP that the others must end like (made once, only read)."""
    def make(out):
        assert "2 process(es) x 1 micro-step(s)" in ok(run(torchrun(2) + ["train.py", *args(data_dir, str(out),
                                                                                          "--fsdp=True")]))
    return made_once(tmp_path_factory, "fsdp_run", make)


def named_states(ckpt):
    """A checkpoint's optimiser states by parameter name, whatever the optimiser: a sharded one's as they are,
    ckpt.pt's (by index in each optimiser) named."""
    if "sharded" in ckpt:
        return {fqn: s for o in ckpt["optimizers"].values() for fqn, s in o["state"].items()}
    with torch.device("meta"):
        net = GPT(GPTConfig(**ckpt["model_config"]))
    optimizers = train.build_optimizers(net, TrainConfig())
    return {fqn: s for name, state in optimizers.named(ckpt["optimizers"]).items()
            for fqn, s in sharding.named_optimizer_state(net, optimizers[name], state)["state"].items()}


def assert_same_state(a, b):
    """Two checkpoints of any kind hold the same step, weights, optimiser states, data position and RNG, bit for bit."""
    assert a["step"] == b["step"] and a["loader"] == b["loader"]
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = named_states(a), named_states(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].keys() == sb[name].keys(), name
        assert all(torch.equal(torch.as_tensor(sa[name][k]), torch.as_tensor(sb[name][k])) for k in sa[name]), name
    assert torch.equal(torch.as_tensor(a["rng"]["torch"]), torch.as_tensor(b["rng"]["torch"]))


def final(out):
    """The resume checkpoint of a run directory, whichever kind, read whole."""
    return load_checkpoint(load_resumable(out, "auto")[1], ("model", "model_config", "step", "optimizers", "loader",
                                                              "rng"))


def losses(out):
    return [(e["step"], e.get("train_loss"), e.get("val_loss"), e.get("grad_norm")) for e in read_log(out)]


def alike(a, b, rel):
    """Figures of two logs' entries alike: None (a step without that figure) as None, numbers within rel (pytest's
    approx, which takes no None)."""
    return len(a) == len(b) and all(x is None if y is None else x == pytest.approx(y, rel=rel, nan_ok=True)
                                    for x, y in zip(a, b))


def test_fsdp_at_2_ranks_equals_ddp_at_2_ranks(data_dir, fsdp_run, tmp_path):
    """Tiny dyn_exo, fp32, 20 steps: every loss bit for bit until the gradient clip first acts (step 8 here), then
    to float rounding (measured: 1e-4 relative in a loss, 3e-3 in a gradient norm, 5e-3 in a weight)."""
    ddp = str(tmp_path / "ddp")
    ok(run(torchrun(2) + ["train.py", *args(data_dir, ddp)]))
    assert os.listdir(fsdp_run).count("ckpt.dcp") == 1 and "ckpt.pt" not in os.listdir(fsdp_run)
    a, b = losses(ddp), losses(fsdp_run)
    clipped = next(step for step, _, _, norm in a if norm and norm > 1)  # SMALL's grad_clip
    assert 5 <= clipped < STEPS - 5 and [e[:3] for e in a[:clipped + 1]] == [e[:3] for e in b[:clipped + 1]]
    for (_, *x), (_, *y) in zip(a, b):
        assert alike(x[:2], y[:2], LOSS_RTOL), (x, y)
        assert alike(x[2:], y[2:], 10 * LOSS_RTOL), (x, y)  # the norm: 3e-3 measured
    a, b = final(ddp), final(fsdp_run)
    assert a["loader"] == b["loader"] and all(torch.allclose(a["model"][k], b["model"][k], atol=WEIGHT_ATOL)
                                              for k in a["model"])


@pytest.fixture(scope="session")
def stopped(data_dir, stop_script, tmp_path_factory):
    """The FSDP run at 2 ranks, killed right after its checkpoint of step 5 (made once, only read: tests copy it)."""
    def make(out):
        ok(run(torchrun(2) + [stop_script, "5", "-", *args(data_dir, str(out), "--fsdp=True")]))
        assert sharding.read_state(f"{out}/ckpt.dcp")["step"] == 5
    return made_once(tmp_path_factory, "fsdp_stopped", make)


def test_a_checkpoint_of_2_ranks_reads_exactly_at_4_and_at_1_and_continues_as_the_unbroken_run(
        data_dir, stop_script, stopped, fsdp_run, tmp_path):
    """DCP reshards exactly: what 4 ranks under FSDP and 1 process without it read of the 2-rank checkpoint, written
    back (as ckpt.dcp at 4 ranks, as ckpt.pt in 1 process), is the same state; the same command goes on there as the
    unbroken run, the same batches and schedule, its losses to float rounding; and FSDP at 2 ranks continues the
    1-process ckpt.pt bit for bit as the unbroken run."""
    before, unbroken = final(stopped), losses(fsdp_run)
    four, one, two = (str(tmp_path / name) for name in ("four", "one", "two"))
    for out in (four, one):
        shutil.copytree(stopped, out)
    started = [start(torchrun(4) + [stop_script, "0", "read", *args(data_dir, four, "--fsdp=True", *batch(4))]),
               start([sys.executable, stop_script, "0", "read", *args(data_dir, one)])]
    assert "4 process(es) x 1 micro-step(s)" in ok(finish(started[0]))
    assert "1 process(es) x 2 micro-step(s)" in ok(finish(started[1]))
    assert sorted(os.listdir(one)) == ["ckpt.pt", "log.jsonl", "read"]  # the older ckpt.dcp went
    for out in (four, one):
        assert_same_state(before, final(f"{out}/read"))
        resumed = losses(out)
        assert resumed[:6] == unbroken[:6] and [e[0] for e in resumed] == [e[0] for e in unbroken]
        for (_, *a), (_, *b) in zip(resumed[6:], unbroken[6:]):
            assert alike(a[:2], b[:2], LOSS_RTOL), (out, a, b)
    shutil.copytree(stopped, two, ignore=shutil.ignore_patterns("ckpt.dcp"))  # its log, and what 1 process read:
    shutil.copy(f"{one}/read/ckpt.pt", two)
    ok(run(torchrun(2) + ["train.py", *args(data_dir, two, "--fsdp=True")]))
    assert losses(two) == unbroken
    assert_same_state(final(fsdp_run), final(two))


def test_a_killed_worker_under_max_restarts_resumes_from_the_last_sharded_checkpoint(data_dir, fsdp_run, tmp_path):
    out = str(tmp_path / "run")
    job = start(TORCHRUN[:3] + ["--max-restarts=1"] + TORCHRUN[3:] + ["train.py", *args(data_dir, out, "--fsdp=True")])
    wait_for_step(out, 12, job)  # past the checkpoints of steps 5 and 10
    os.kill(workers(job)[1], 9)
    ok(finish(job))
    restarts = [e["step"] for e in read_log(out, configs=True)]
    assert restarts[0] == 0 and len(restarts) == 2 and restarts[1] in (10, 15), restarts
    assert losses(out) == losses(fsdp_run)
    assert_same_state(final(fsdp_run), final(out))


@pytest.fixture
def one_rank_group(monkeypatch):
    """torchrun's environment for one process in this one: train.main joins a process group of its own (FSDP needs
    one), which ends with it, or here after a failed run."""
    yield lambda: one_process_torchrun(monkeypatch)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_full_disk_during_a_sharded_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch,
                                                                        one_rank_group):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_interval=2", "--init_from=auto", "--fsdp=True"]
    straight, out = str(tmp_path / "straight"), str(tmp_path / "full")
    one_rank_group()
    train.main(common + [f"--out_dir={straight}"])
    armed, write_item, save = [], torch.distributed.checkpoint.filesystem._write_item, train.save

    def no_space(transforms, stream, *a, **kw):  # DCP's writer of one tensor into its file
        if armed:
            stream.write(b"\0" * 4096)  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(torch.distributed.checkpoint.filesystem, "_write_item", no_space)
        m.setattr(train, "save", lambda run, *a, **kw: (armed.append(1) if run.step == 4 else None,
                                                        save(run, *a, **kw)))
        one_rank_group()
        with pytest.raises(SystemExit) as e:
            train.main(common + [f"--out_dir={out}"])
    dist.destroy_process_group()  # a failed run leaves its group to die with the process
    message = str(e.value)
    assert message.startswith(f"train.py: error: step 4: {out}/ckpt.dcp: No space left on device (the disk is full)")
    assert "the previous checkpoint, if any, is intact" in message and "\n" not in message
    assert sharding.read_state(f"{out}/ckpt.dcp")["step"] == 2 and sorted(os.listdir(out)) == ["ckpt.dcp", "log.jsonl"]
    one_rank_group()
    train.main(common + [f"--out_dir={out}"])  # room again: the same command goes on from step 2
    assert losses(out) == losses(straight)
    assert_same_state(final(straight), final(out))
    one_rank_group()
    assert train.main(common + [f"--out_dir={out}"]) is None  # finished: says so, does nothing


def test_an_optimizer_a_sharded_checkpoint_cannot_hold_is_refused_before_any_step(data_dir, tmp_path, monkeypatch,
                                                                                 one_rank_group):
    """Under FSDP each optimiser's state goes to ckpt.dcp by parameter name, which needs a torch.optim.Optimizer over
    the model's parameters: a fork's other kind is refused in one line before the first step."""
    build = train.build_optimizers

    class Lookahead:  # a wrapper of an optimiser, not a torch.optim.Optimizer
        param_groups = []

    monkeypatch.setattr(train, "build_optimizers", lambda model, cfg: optim.Optimizers(**build(model, cfg),
                                                                                    slow=Lookahead()))
    one_rank_group()
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^train.py: error: fsdp=True: the optimiser 'slow' \(Lookahead\) is not a "
                                         r"torch.optim.Optimizer over the model's parameters"):
        train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=2", "--fsdp=True"])
    assert not out.exists()


def test_keep_full_keeps_a_sharded_branch_point_that_branches_bit_for_bit(data_dir, tmp_path, one_rank_group):
    """Under FSDP, keep_full keeps ckpt_<step>_full.dcp; --init_from=<it> with a shorter max_steps ends bit for bit
    as a run of that length from scratch (the branch rule holds: both schedules agree before step 4 of 12 and of 8)."""
    common = SMALL + [f"--data_dir={data_dir}", "--fsdp=True"]
    one_rank_group()
    train.main(common + [f"--out_dir={tmp_path / 'long'}", "--max_steps=12", "--keep_full=4"])
    point = str(tmp_path / "long" / "ckpt_000004_full.dcp")
    assert sharding.read_state(point)["step"] == 4 and os.path.isdir(tmp_path / "long" / "ckpt.dcp")
    one_rank_group()
    train.main(common + [f"--out_dir={tmp_path / 'short'}", "--max_steps=8"])
    one_rank_group()
    train.main(common + [f"--out_dir={tmp_path / 'branch'}", "--max_steps=8", f"--init_from={point}"])
    assert losses(tmp_path / "branch") == losses(tmp_path / "short")
    assert_same_state(final(tmp_path / "short"), final(tmp_path / "branch"))


FIXTURES = os.path.join(ROOT, "tests", "fixtures", "checkpoints_5bd687a")


def resaved(args, path):
    """The checkpoint a train.py run of args starts from, as it reads it (configure, build, restore: one process,
    no FSDP), written back by it to path."""
    given = read_args(args, train.ALL_DEFAULTS)
    cfg = TrainConfig(**{k: v for k, v in given.items() if k in train.DEFAULTS})
    worker = parallel.join(cfg)
    cfg, model_config, ckpt, start = train.configure(given, cfg, worker)
    run = train.build(cfg, model_config, worker)
    train.restore(run, ckpt, start)
    train.save(run, path, run.pending_log)


@pytest.mark.parametrize("kind", ["one_process", "fsdp_2_ranks"])
def test_a_checkpoint_of_commit_5bd687a_resumes_exactly(kind, data_dir, tmp_path):
    """Checkpoints written by commit 5bd687a (fixtures/checkpoints_5bd687a: its optimisers' states a list, its
    ckpt.dcp's param_groups one list, of a run stopped after step 3, an evaluation step), read into one process
    and written back in today's format, hold the same step, weights, optimiser states, data position, RNG and pending
    log entry, bit for bit. Continued from the old file and from today's, the run logs the evaluation the stop left,
    then ends the same, bit for bit: both continued here, so that no CPU's kernels can part them. What the fixture's
    machine computed (expected.json, that commit's unbroken run) is compared only where no kernel here computes it:
    the entries before the stop, which the continued log carries over, and which figures every entry holds."""
    expected = json.load(open(f"{FIXTURES}/expected.json"))
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    shutil.copytree(f"{FIXTURES}/{kind}", old)
    os.mkdir(new)
    shutil.copy(f"{old}/log.jsonl", new)  # the stopped run's log, which a continued run carries on
    args = expected["args"] + [f"--data_dir={data_dir}", "--init_from=auto"]
    resaved(args + [f"--out_dir={old}"], f"{new}/ckpt.pt")
    before, after = final(old), final(new)
    assert_same_state(before, after)
    assert before["pending_log"] == after["pending_log"] and before["pending_log"]["step"] == 3
    for out in (old, new):
        train.main(args + [f"--out_dir={out}"])
    strip = lambda log: [{k: v for k, v in e.items() if k not in ("step_ms", "tok_per_s")} for e in log]
    from_old, from_new, unbroken = strip(read_log(old)), strip(read_log(new)), strip(expected[kind])
    assert from_old == from_new
    assert [e.keys() for e in from_old] == [e.keys() for e in unbroken]
    assert from_old[:3] == unbroken[:3]  # steps 0 to 2, as that machine logged them


RESUMABLE = {"model_config": {}, "config": {}, "parts": []}  # what a resume checkpoint must hold, as placeholders


def tiny_sharded_checkpoint(path, step):
    """A real DCP directory of one tensor and a state.json, as sharding.save writes them."""
    with warnings.catch_warnings():  # DCP's note that it saves in this one process
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, sharding.STATE_FILE), "w") as f:
        json.dump({"step": step, **RESUMABLE}, f)


def test_resuming_finishes_a_cut_swap_and_takes_the_later_of_two_kinds(tmp_path):
    out = str(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{out}/ckpt.pt: no checkpoint there"):
        load_resumable(out, "resume")
    with pytest.raises(FileNotFoundError, match=f"{out}/ckpt.dcp: no checkpoint there"):
        load_resumable(out, "resume", sharded=True)  # none yet: the kind this run writes
    tiny_sharded_checkpoint(f"{out}/ckpt.dcp.old", 7)  # stopped between sharding.save's two renames
    assert load_resumable(out, "auto")[1] == f"{out}/ckpt.dcp" and sharding.read_state(f"{out}/ckpt.dcp")["step"] == 7
    for full_step, later in ((3, "ckpt.dcp"), (9, "ckpt.pt")):  # stopped before the older kind was removed
        torch.save({"step": full_step, "model": {}, "optimizers": [], **RESUMABLE}, f"{out}/ckpt.pt")
        assert load_resumable(out, "auto")[1] == f"{out}/{later}"


class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused(tmp_path):
    tiny_sharded_checkpoint(str(tmp_path / "ckpt.dcp"), 1)
    with open(tmp_path / "ckpt.dcp" / ".metadata", "wb") as f:
        pickle.dump(Boom(), f)
    os.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"ckpt.dcp: not a sharded checkpoint of train.py \(posix.system is not one "
                                         r"of DCP's metadata classes\)"):
        load_checkpoint(str(tmp_path / "ckpt.dcp"))
    assert not (tmp_path / "PWNED").exists()
    os.chdir(ROOT)


# ----------------------------------------------------------------------------- in the processes themselves

def _join(rank, world, port, dtype=torch.float32, device="cpu"):
    """This spawned process in a group of world (gloo on the CPU, NCCL on its own GPU), as a Worker."""
    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return parallel.Worker(rank, world, parallel.Runtime(device, dtype), compile=False, distributed=True)


def _sharded_step_worker(rank, world, port, names, result_path, device="cpu"):
    """Per variant: a model and its FSDP copy, one batch (the same on every rank, so that the averaged gradient is
    that batch's): the loss and gradients; then two Muon steps on injected gradients. Records the largest
    differences and the shapes of the matrices stepped."""
    worker, found = _join(rank, world, port, device=device), {}
    for name in names:
        torch.manual_seed(0)
        plain = randomize(GPT(variant(name)))
        sharded = sharding.fully_shard_model(copy.deepcopy(plain), worker)
        plain, idx = plain.to(worker.device), tokens(plain.config).to(worker.device)
        losses = [m(idx[:, :-1], idx[:, 1:])[1] for m in (plain, sharded)]
        for loss in losses:
            loss.backward()
        named = dict(sharded.named_parameters())
        diffs = {"loss": (losses[0] - losses[1]).abs().item(), "grads": max(
            (p.grad - named[n].grad.full_tensor()).abs().max().item() for n, p in plain.named_parameters())}
        muons = [train.build_optimizers(m, TrainConfig())["muon"] for m in (plain, sharded)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            for n, p in plain.named_parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(worker.device)
                named[n].grad = distribute_tensor(p.grad, named[n].device_mesh, named[n].placements)
            for muon in muons:
                muon.step()
        stepped = [(n, p) for n, p in plain.named_parameters() if p in muons[0].state]
        diffs["weights"] = max((p - named[n].full_tensor()).abs().max().item() for n, p in stepped)
        diffs["states"] = max((muons[0].state[p][k] - muons[1].state[named[n]][k].full_tensor()).abs().max().item()
                              for n, p in stepped for k in ("momentum", "second_moment"))
        found[name] = diffs, sorted({tuple(p.shape) for _, p in stepped}), sorted(
            {tuple(p.shape) for p in optim.muon_params(plain)})
    if rank == 0:
        torch.save(found, result_path)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_muon_and_fsdp_gradients_equal_the_unsharded_ones_bit_for_bit(world, tmp_path):
    """Every shape group of dyn_exo and nuresformer_e (internal anchors: layer 1's QK-norm normalises them after
    layer 1 has run), split evenly over 2 ranks and unevenly over 3: the loss, the gradients, and two Muon steps
    (weights, momentum, NorMuon's second moment) on the same injected gradients, equal to the unsharded ones. Bit
    for bit (the gradients at 3 ranks to fp32 rounding): the owner of each matrix runs the unsharded code on it
    whole, and everything else is elementwise."""
    names = ["dyn_exo", "nuresformer_e"]
    spawn(_sharded_step_worker, (world, free_port(), names, str(tmp_path / "r")), world)
    found = torch.load(tmp_path / "r", weights_only=True)
    for name in names:
        diffs, stepped, shapes = found[name]
        assert stepped == shapes and len(shapes) >= 3, (name, stepped)
        # 3 ranks average 3 equal gradients, g + g + g then / 3: not g exactly (3e-8 measured); 2 ranks, exactly
        assert diffs["grads"] <= (0 if world == 2 else 1e-7), (name, diffs)
        assert (diffs["loss"], diffs["weights"], diffs["states"]) == (0, 0, 0), (name, diffs)


def _export_worker(rank, world, port, out, dtype):
    """A sharded model's own logits and its weights-only export (live), and a sharded checkpoint of it."""
    worker = _join(rank, world, port, dtype)
    torch.manual_seed(0)
    # vocabulary 320: more rows than the test tokenizer's 291 ids, which its Hugging Face folder carries
    model = sharding.fully_shard_model(randomize(GPT(variant("dyn_exo", vocab_size=320))), worker)
    gather, gathered, alive = DTensor.full_tensor, [], []  # weak references to every gathered tensor; how many
    #                                                         of them were alive at each gathering

    def full_tensor(t, **kw):
        alive.append(sum(ref() is not None for ref in gathered))
        whole = gather(t, **kw)
        gathered.append(weakref.ref(whole))
        return whole

    DTensor.full_tensor = full_tensor
    with torch.no_grad():
        logits = model(tokens(model.config))[0]
    checkpoint.save_weights(f"{out}/export.pt", model, {"seed": 0}, 7, "test", rank == 0)
    DTensor.full_tensor = gather
    loader = type("Loader", (), {"state_dict": lambda self: {"shard": 0}})()
    parts = {"model": model, "optimizers": train.build_optimizers(model, TrainConfig()), "loader": loader}
    checkpoint.save_resumable(f"{out}/ckpt.dcp", parts, 7, {"seed": 0}, worker)
    if rank == 0:
        torch.save({"logits": logits, "alive": alive, "dtypes": {p.dtype for p in model.parameters()}}, f"{out}/r")
    dist.destroy_process_group()


def test_the_export_of_a_sharded_model_equals_its_own_logits(tmp_path, enc_file):
    """The weights-only file written from the shards (every tensor gathered alone, never the whole model), the
    one convert.py writes from the sharded checkpoint, and its Hugging Face folder (--to_hf) give the sharded
    model's logits; so does the sharded checkpoint itself, which every tool reads. The folder needs safetensors and
    tokenizers."""
    missing = [m for m in ("safetensors", "tokenizers") if not importlib.util.find_spec(m)]
    needs(missing and f"needs {' and '.join(missing)} (pip install -r tests/requirements.txt)")
    spawn(_export_worker, (2, free_port(), str(tmp_path), torch.float32), 2)
    result = torch.load(tmp_path / "r", weights_only=True)
    assert result["dtypes"] == {torch.float32} and len(result["alive"]) > 10 and set(result["alive"]) == {0}
    convert.convert(str(tmp_path / "ckpt.dcp"), str(tmp_path / "converted.pt"))
    convert.main([str(tmp_path / "ckpt.dcp"), "--to_hf", str(tmp_path / "hf"), "--tokenizer", str(enc_file)])
    idx = tokens(variant("dyn_exo", vocab_size=320))
    for path in ("export.pt", "converted.pt", "ckpt.dcp", "hf"):
        model, ckpt = load_model(str(tmp_path / path))
        assert ckpt["step"] == 7 and ckpt["config"] == {"seed": 0}
        with torch.no_grad():
            assert torch.equal(model(idx)[0], result["logits"]), path
    assert set(load_checkpoint(str(tmp_path / "export.pt"), ())) == {"model", "model_config", "step", "config",
                                                                      "tokenizer", "source"}


def test_bf16_gathers_bf16_weights_and_keeps_fp32_shards(data_dir, tmp_path):
    """dtype=bfloat16 under FSDP (CUDA's default; gloo runs it too): weights gathered in bf16 for the forward
    (MixedPrecisionPolicy), gradients reduced and the shards stepped in fp32; it trains."""
    out = str(tmp_path / "bf16")
    ok(run(torchrun(2) + ["train.py", *args(data_dir, out, "--fsdp=True", "--dtype=bfloat16", "--max_steps=8")]))
    log = read_log(out)
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 0.2, log
    assert {v.dtype for v in final(out)["model"].values()} == {torch.float32}
    spawn(_bf16_worker, (free_port(), str(tmp_path / "dtypes")), 2)
    assert torch.load(tmp_path / "dtypes", weights_only=True) == {"forward": {torch.bfloat16},
                                                                  "shards": {torch.float32}, "grads": {torch.float32}}


def _bf16_worker(rank, port, result_path):
    worker = _join(rank, 2, port, torch.bfloat16)
    model = sharding.fully_shard_model(GPT(variant("dyn_exo")), worker)
    seen = set()
    model.blocks[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.add(m.weight.dtype))
    idx = tokens(model.config)
    with worker.runtime.autocast():
        model(idx[:, :-1], idx[:, 1:])[1].backward()
    if rank == 0:
        torch.save({"forward": seen, "shards": {p.dtype for p in model.parameters()},
                    "grads": {p.grad.dtype for p in model.parameters()}}, result_path)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- bench.py: what each rank holds

def test_bench_measures_what_each_rank_holds_and_what_its_collectives_move():
    """torchrun bench.py --compare=fsdp at 2 ranks, from the real tensors: a rank under FSDP holds half of DDP's
    weights, gradients and optimiser states; DDP all-reduces its gradients once (4 bytes a parameter), FSDP
    reduce-scatters the same bytes, gathers the weights (forward and backward) and Muon all-to-alls."""
    size = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--vocab_size=256", "--block_size=32", "--batch_size=2"]
    out = ok(run(torchrun(2) + ["-m", "tools.bench", "configs/dyn_exo.py", *size, "--compare=fsdp", "--steps=1",
                                "--rounds=1", "--warmup=1"]))
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.startswith("dyn_exo") and len(line.split()) == 11}  # the per-rank table
    ddp, fsdp = rows["dyn_exo"], rows["dyn_exo+fsdp"]
    (_, _, weights, grads, muon, adam, all_reduce, all_gather, reduce_scatter, all_to_all) = ddp
    assert weights == grads and all_reduce == pytest.approx(weights * 2**20 / 1e6, rel=1e-2) and all_to_all == 0
    assert fsdp[2:6] == pytest.approx([weights / 2, grads / 2, muon / 2, adam / 2], rel=0.05)
    assert fsdp[6] == 0 and fsdp[8] == pytest.approx(all_reduce, rel=1e-2) and fsdp[9] > 0
    assert 1 < fsdp[7] / all_reduce < 2  # every unit gathered for the forward, all but the root's for the backward


def test_bench_memory_with_ranks_gives_each_gpus_share():
    from tools import bench
    size = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=32", "--vocab_size=256", "--doc_mask=False"]
    bench.main(["configs/dyn_exo.py", *size, "--memory=True", "--ranks=1,4"])
    with torch.device("meta"):
        net = GPT(variant("dyn_exo", n_layer=2, n_embd=64, n_head=2, vocab_size=256))
    one, four = bench.sharded_bytes(net, 1, TrainConfig()), bench.sharded_bytes(net, 4, TrainConfig())
    assert one[0] == 4 * net.num_params() and one[0] == one[1]
    assert one[0] / 4 <= four[0] < one[0] / 4 * 1.1 and four[2] < one[2] / 3 and four[3] < one[3] / 3
    assert four[4] < one[4]  # Muon's owned share shrinks; the gathered units do not


def _meta_init_worker(rank, world, port, names, result_path):
    """Per variant, DDP's and FSDP's model as train.build_model makes it (on the meta device, then each rank's part
    initialised): whether every weight, whole again, and the generator after it equal GPT(config)'s, bit for bit."""
    worker, found = _join(rank, world, port), {}
    for name in names:
        torch.manual_seed(TrainConfig.seed)
        expected, expected_rng = GPT(variant(name)).state_dict(), torch.get_rng_state()
        for fsdp in (False, True):
            model = train.build_model(TrainConfig(fsdp=fsdp), variant(name), worker)[0]
            got = {k: sharding.full_value(v) for k, v in model.state_dict().items()}
            found[name, fsdp] = (got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got),
                                 torch.equal(torch.get_rng_state(), expected_rng),
                                 all(sharding.is_sharded(p) == fsdp for p in model.parameters()))
    torch.save(found, f"{result_path}.{rank}")
    dist.destroy_process_group()


def test_each_rank_initialises_only_its_part_to_the_weights_of_a_whole_model_bit_for_bit(tmp_path):
    """train.build_model builds on the meta device and each rank initialises what it holds (DDP: a replica; FSDP: its
    rows): the weights, gathered, and the generator's state after
    them are those of GPT(config) in one process, bit for bit, so that runs, resumes and the DDP = FSDP checks stay
    exact. Elementwise and headwise λ, biases, a frozen projection."""
    names = ["dyn_exo", "exoformer_h", "dyn_exo_frozen"]
    spawn(_meta_init_worker, (2, free_port(), names, str(tmp_path / "r")), 2)
    for rank in range(2):
        found = torch.load(f"{tmp_path / 'r'}.{rank}", weights_only=True)
        assert found == {(name, fsdp): (True, True, True) for name in names for fsdp in (False, True)}, rank
