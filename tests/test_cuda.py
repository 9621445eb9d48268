"""Tests of the CUDA path, which the CPU tests cannot reach: FlexAttention's document mask and its backward, the
compiled step with a new BlockMask every batch, bf16 autocast against fp32, NCCL under torchrun with a stop and a
resume (DDP, and FSDP with bf16 gathers and compiled blocks), FSDP's mixed precision against fp32, the sharded Muon
step over NCCL (2 GPUs), the KV cache, and a step's peak memory against bench.py's estimate and against the dry
run's. They run only where torch sees a GPU; elsewhere pytest reports them skipped, with the reason. Small sizes: a
few minutes on one GPU."""
import copy
import math
import re
import signal
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optim
import train
from engine import parallel, sharding
from engine.checkpoint import load_checkpoint
from engine.configurator import read_args
from model import GPT, KVCache, document_mask, generate
from test_model import FAMILIES, compiled_graphs, fresh_dynamo, layouts, randomize, tokens, variant  # noqa: F401
from tests.test_faults import finish, run, start, wait_for_step
from tests.test_fsdp import _sharded_step_worker
from tests.test_train import (DOCS, SMALL, assert_same_run, check_process_group_and_ddp, doc_data_dir,  # noqa: F401
                              free_port, one_process_torchrun)
from tools import bench

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA-only: torch.cuda.is_available() is False on this machine")
DEVICE = "cuda"
# Tolerances, from the formats: fp32 paths that differ only in the attention kernel agree to float rounding
# summed over a few layers; bf16 keeps 8 significant bits (relative rounding 2^-9), which a few layers and the
# loss grow to about 1% for the loss and a few % for a gradient tensor.
FP32_REL = 1e-4  # relative L2 error, fp32 against fp32
BF16_REL = 3e-2  # relative L2 error, bf16 against bf16 (two kernels) or against fp32, of a loss or all gradients
BF16_COSINE = 0.98  # the least cosine similarity of any one gradient tensor, bf16 against fp32


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def loss_and_grads(model, x, y, dtype, **kw):
    """(loss, every parameter's gradient) of one forward and backward, in dtype autocast (or fp32)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, y, z_loss=1e-4, **kw)
    loss.backward()
    return loss.detach().float(), [p.grad.detach().float().clone() for p in model.parameters()]


def windows(config, n):
    """n batches of 256-token windows of different document layouts (test_model.layouts) on the GPU, and targets."""
    for idx in layouts(config, n):
        idx = idx.to(DEVICE)
        yield idx, idx.roll(-1, dims=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_flex_document_mask_equals_the_dense_sdpa_mask(name, dtype):
    """FlexAttention with the BlockMask (compiled kernels, called eagerly) against SDPA with the dense mask: loss and
    gradients, for windows without a document boundary, with one on a block boundary (a skipped block), and random."""
    model = randomize(GPT(variant(name, vocab_size=50304, block_size=256))).to(DEVICE)
    tolerance = FP32_REL if dtype == torch.float32 else BF16_REL
    for x, y in windows(model.config, 4):
        flex, dense = document_mask(x), document_mask(x, flex=False)
        assert isinstance(flex, torch.nn.attention.flex_attention.BlockMask), "FlexAttention is CUDA's default"
        assert flex.kv_num_blocks.device == x.device
        loss, grads = loss_and_grads(model, x, y, dtype, mask=flex)
        ref_loss, ref_grads = loss_and_grads(model, x, y, dtype, mask=dense)
        assert relative_error(loss, ref_loss) < tolerance
        assert relative_error(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])) \
            < tolerance


def test_compiled_step_with_a_new_block_mask_each_batch_compiles_once(fresh_dynamo):
    """train.py's step on CUDA (compiled model, bf16 autocast, FlexAttention mask built in the graph, Muon and
    AdamW): 20 batches of different document layouts run the one graph compiled for the first."""
    torch.manual_seed(0)
    model = GPT(variant("dyn_exo", vocab_size=50304, block_size=256)).to(DEVICE)
    optimizers = train.build_optimizers(model, train.TrainConfig())
    compiled = torch.compile(model)
    for x, y in windows(model.config, 20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x, y, z_loss=1e-5, doc_mask=True)
        loss.backward()
        assert math.isfinite(optim.clip_gradients(model, 1.0)) and math.isfinite(loss.item())
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert compiled_graphs() == 1


def test_mask_build_step_and_optimisers_never_wait_for_the_gpu(fresh_dynamo):
    """No host sync (create_block_mask has had some, pytorch #143840; a sync before Muon's hundreds of small kernels
    leaves the GPU idle while they launch) in the eager mask build, the compiled forward and backward, and both
    optimisers' steps: torch.cuda.set_sync_debug_mode("error") raises at any. Compiled first, outside it."""
    model = GPT(variant("dyn_exo", vocab_size=50304, block_size=256)).to(DEVICE)
    optimizers = train.build_optimizers(model, train.TrainConfig())
    compiled = torch.compile(model)
    for i, (x, y) in enumerate(windows(model.config, 3)):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if i else "default")
        try:
            document_mask(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = compiled(x, y, z_loss=1e-5, doc_mask=True)
            loss.backward()
            for opt in optimizers.values():
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", ["gated", "dyn_exo"])
def test_bf16_autocast_loss_and_gradients_against_fp32(name, fresh_dynamo):
    """The compiled bf16-autocast step (train.py's on CUDA: FlexAttention's mask built in the graph) against the
    eager fp32 one with the dense SDPA mask."""
    model = randomize(GPT(variant(name, vocab_size=50304, block_size=256))).to(DEVICE)
    x, y = next(windows(model.config, 3))
    ref_loss, ref_grads = loss_and_grads(model, x, y, torch.float32, mask=document_mask(x, flex=False))
    loss, grads = loss_and_grads(torch.compile(model), x, y, torch.bfloat16, doc_mask=True)
    assert relative_error(loss, ref_loss) < BF16_REL
    assert relative_error(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])) \
        < BF16_REL
    for (n, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0) > BF16_COSINE, n


def straight_and_stopped(doc_data_dir, tmp_path, banner, ckpt, *extra):
    """One GPU under torchrun, 20 steps: the run straight through (its start-up line holding banner) in
    tmp_path/straight, and the same command stopped by SIGTERM at step 5 (exit status 75, ckpt written) and run
    again, which resumes it, in tmp_path/stopped."""
    command = lambda out: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           "train.py", *SMALL, *DOCS, f"--data_dir={doc_data_dir}", "--max_steps=20",
                           f"--out_dir={out}", "--init_from=auto", *extra]
    code, stdout, stderr = run(command(tmp_path / "straight"))
    assert code == 0 and banner in stdout, stderr[-3000:]
    stopped = start(command(tmp_path / "stopped"))
    wait_for_step(str(tmp_path / "stopped"), 5, stopped)
    stopped.send_signal(signal.SIGTERM)
    _, _, stderr = finish(stopped)
    assert "(exit status 75)" in stderr and (tmp_path / "stopped" / ckpt).exists(), stderr[-3000:]
    code, stdout, stderr = run(command(tmp_path / "stopped"))
    assert code == 0 and "resuming from" in stdout, stderr[-3000:]


def test_torchrun_nccl_stopped_and_resumed_equals_an_unbroken_run(doc_data_dir, tmp_path):
    """One GPU under torchrun: an NCCL process group and DDP, compiled, bf16, FlexAttention. SIGTERM to torchrun (as
    from a scheduler) stops it after a step with a checkpoint; the same command continues. GPU kernels with atomic
    adds (compiled backward) are not bitwise reproducible, so the end is compared within 1e-3 (losses) and 1e-4
    (weights, states): a resume that lost state or data position would differ by a step's update (~3e-4) or a
    batch's loss."""
    straight_and_stopped(doc_data_dir, tmp_path, "compile=True, nccl process group", "ckpt.pt")
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", close=dict(rtol=1e-3, atol=1e-4))


def test_nccl_group_and_ddp_split_through_flex_attention(monkeypatch):
    """The CPU test of the process group and DDP's arguments, on NCCL with inductor, where FlexAttention is a
    higher-order op in the split graph too (fp32: the gradients within float rounding of the plain model's)."""
    check_process_group_and_ddp(monkeypatch, "cuda", "inductor", close=dict(rtol=1e-3, atol=1e-5))


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_generation_equals_uncached(name):
    """Greedy text with the KV cache is the text without it, past block_size too, in fp32 (in bf16 two kernels'
    rounding may flip a near-tie of the argmax); in bf16 the cached logits are the full forward's to rounding."""
    model = randomize(GPT(variant(name))).to(DEVICE).eval()
    prompt = tokens(model.config)[:, :5].to(DEVICE)
    n = model.config.block_size + 4
    assert torch.equal(generate(model, prompt, n, temperature=0), generate(model, prompt, n, temperature=0,
                                                                           use_cache=False))
    idx = tokens(model.config).to(DEVICE)
    cache = KVCache(model.config.n_layer)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full = model.features(idx)
        steps = [model.features(idx[:, :8], cache=cache)] + [model.features(idx[:, t:t + 1], cache=cache)
                                                             for t in range(8, idx.size(1))]
    assert relative_error(torch.cat(steps, dim=1), full) < BF16_REL


def test_peak_memory_of_a_step_against_bench_memory_estimate():
    """A step's measured peak (torch.cuda.max_memory_allocated: weights, gradients, optimiser states, activations,
    eager bf16) against bench.py --memory's estimate for the same batch: never above what the estimate leaves
    room for (its HEADROOM), and not so far below it that the estimate says little (half of it at least)."""
    size = ["--n_layer=4", "--n_embd=512", "--n_head=8", "--block_size=2048", "--batch_size=4", "--dtype=bfloat16",
            "--doc_mask=False"]  # activations well above the loss chunk's logits, as at 450M
    row, = bench.main(["configs/dyn_exo.py", "--memory=True"] + size)
    estimate = row.state + row.cfg.batch_size * row.total
    env = parallel.join(row.cfg)
    x, y = bench.synthetic_batch(row.cfg.batch_size, row.config.block_size, row.config.vocab_size, 1000, env.device)
    torch.manual_seed(0)
    model = GPT(row.config).to(DEVICE)
    timed = bench.Row("dyn_exo", row.cfg, row.config, row.bench, model=model, forward=model,
                      optimizers=train.build_optimizers(model, row.cfg))
    bench.step(timed, x, y, env)  # the optimiser states exist from here on
    torch.cuda.reset_peak_memory_stats()
    bench.step(timed, x, y, env)
    peak = torch.cuda.max_memory_allocated()
    assert 0.5 * estimate < peak < estimate / bench.HEADROOM, (peak / 2**30, estimate / 2**30)


def test_bench_gpu_prints_both_models_in_four_settings(capsys):
    """python -m tools.bench --gpu=True, shrunk: both models with compile and doc_mask off and on, each table with its
    MFU and peak memory, and a step-time ratio line."""
    bench.main(["--gpu=True", "--n_layer=2", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=2",
                "--steps=1", "--rounds=1", "--warmup=1"])
    out = capsys.readouterr().out
    assert [line.split(", ")[2:4] for line in out.splitlines() if line.startswith("forward+backward")] == [
        [f"compile={c}", f"doc_mask={d}"] for c in (False, True) for d in (False, True)]
    rows = [line.split() for line in out.splitlines() if line.startswith(("gated ", "dyn_exo "))]
    assert len(rows) == 8 and all(r[4].endswith("%") and r[6] == "GiB" for r in rows)
    assert out.count("Dynamic E-ExoFormer / Gated Attention step time: ") == 4


# ----------------------------------------------------------------------------- FSDP: NCCL, bf16, compiled blocks

def test_fsdp_nccl_bf16_compiled_stopped_and_resumed_equals_an_unbroken_run(doc_data_dir, tmp_path):
    """One GPU under torchrun with --fsdp=True: NCCL, bf16 weights gathered for the forward and fp32 gradients
    reduced (MixedPrecisionPolicy), blocks compiled one by one, FlexAttention; a SIGTERM stops it with a sharded
    checkpoint (ckpt.dcp), the same command continues it, and it ends as the unbroken run within the tolerance of
    the DDP test above."""
    straight_and_stopped(doc_data_dir, tmp_path, "compile=True, nccl process group, FSDP", "ckpt.dcp", "--fsdp=True")
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.dcp")) for d in ("straight", "stopped"))
    assert a["step"] == b["step"] == 20
    assert all(torch.allclose(a["model"][k], b["model"][k], rtol=1e-3, atol=1e-4) for k in a["model"])


def test_fsdp_bf16_mixed_precision_against_fp32(monkeypatch):
    """FSDP on one GPU (NCCL): the weights are gathered in bf16 for the forward, the shards and their gradients
    stay fp32, and the loss and gradients are the fp32 model's to bf16's tolerance (as bf16 autocast's)."""
    one_process_torchrun(monkeypatch)
    worker = parallel.join(train.TrainConfig(fsdp=True))
    try:
        assert worker.runtime.dtype == torch.bfloat16 and dist.get_backend() == "nccl"
        plain = randomize(GPT(variant("dyn_exo", vocab_size=50304, block_size=256))).to(DEVICE)
        sharded = sharding.fully_shard_model(copy.deepcopy(plain).cpu(), worker)
        seen = set()
        sharded.blocks[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.add(m.weight.dtype))
        x, y = next(windows(plain.config, 1))
        ref_loss, ref_grads = loss_and_grads(plain, x, y, torch.float32)
        loss, grads = loss_and_grads(sharded, x, y, torch.bfloat16)
        grads = [g.full_tensor() for g in grads]  # FSDP's gradients: DTensors
        assert seen == {torch.bfloat16} and {p.dtype for p in sharded.parameters()} == {torch.float32}
        assert relative_error(loss, ref_loss) < BF16_REL
        assert relative_error(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])) \
            < BF16_REL
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the sharded Muon step over NCCL")
def test_sharded_muon_over_nccl_equals_the_unsharded_step(tmp_path):
    """test_fsdp's exactness test on 2 GPUs: the all-to-alls over NCCL (loss, gradients, two Muon steps)."""
    names = ["dyn_exo", "nuresformer_e"]
    mp.spawn(_sharded_step_worker, args=(2, free_port(), names, str(tmp_path / "r"), "cuda"), nprocs=2)
    for name, (diffs, stepped, shapes) in torch.load(tmp_path / "r", weights_only=True).items():
        assert stepped == shapes and (diffs["weights"], diffs["states"]) == (0, 0), (name, diffs)


def test_the_dry_runs_peak_against_the_real_steps(capsys):
    """The dry run's peak (train.py --dry_run=True: fake tensors, torch's MemTracker, one process) against
    torch.cuda.max_memory_allocated of the same two optimiser steps run on the GPU (train.build_model, then
    train.train_step twice; eager bf16, causal attention as the dry run traces it): within a quarter either way. Both
    are
    printed (pytest -s): docs/GPU.md and docs/MEMORY.md wait for them."""
    args = ["configs/dyn_exo.py", "--n_layer=4", "--n_embd=512", "--n_head=8", "--block_size=2048", "--batch_size=4",
            "--total_batch_size=16384", "--doc_mask=False", "--compile=False", "--device=cuda"]  # 2 micro-steps
    try:
        train.main(args + ["--dry_run=True"])
    except SystemExit as e:
        pytest.fail(f"the dry run failed: {e.code}")
    out = capsys.readouterr().out
    dry = float(re.search(r"the peak, during [^:]+: ([\d.]+) GiB", out)[1]) * 2**30
    given = read_args(args, train.ALL_DEFAULTS)
    cfg = train.TrainConfig(**{k: v for k, v in given.items() if k in train.DEFAULTS})
    worker = parallel.join(cfg)
    cfg, config, _, _ = train.configure(given, cfg, worker)
    model, eval_model, train_model, optimizers = train.build_model(cfg, config, worker)
    accum = cfg.total_batch_size // (cfg.batch_size * config.block_size)
    run = train.Run(cfg, worker, accum, model, eval_model, train_model, optimizers, None, {})
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        batches = [(torch.randint(config.vocab_size, (cfg.batch_size, config.block_size), device=DEVICE),
                    torch.randint(config.vocab_size, (cfg.batch_size, config.block_size), device=DEVICE),
                    i == accum - 1) for i in range(accum)]
        train.train_step(run, batches)
    real = torch.cuda.max_memory_allocated()
    with capsys.disabled():
        print(f"\ndry run's peak {dry / 2**30:.2f} GiB, the GPU's max_memory_allocated {real / 2**30:.2f} GiB")
    assert 0.75 * real < dry < 1.25 * real, (dry / 2**30, real / 2**30)
