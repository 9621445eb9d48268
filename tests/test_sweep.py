"""Tests of sweep.py: the report's numbers on hand-written logs (against values computed here), a sweep stopped
and started again, --print, and the refusals; and of the frozen-anchor control."""
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from conftest import in_process
from engine.checkpoint import load_checkpoint
from model import GPT, GPTConfig
from tests.test_train import ROOT, SMALL, assert_same_run, data_dir, read_log  # noqa: F401  (data_dir: a fixture)
from tools import sweep

GATED = dict(gate=True, anchor="none", mix="", granularity="scalar", anchor_norm=False, dynamic=False)
DYN = dict(gate=True, anchor="exo", mix="qkvg", granularity="elementwise", anchor_norm=True, dynamic=True)
TOKENS = 1000  # total_batch_size of the hand-written runs


def write_run(root, name, model, seed, curve, **keys):
    """A run directory as train.py leaves it: log.jsonl with a configuration record and evaluations
    (curve: {step: val_loss}); max_steps is the last step."""
    d = root / name
    d.mkdir()
    config = {**train.ALL_DEFAULTS, **model, "seed": seed, "out_dir": str(d), "total_batch_size": TOKENS,
              "max_steps": max(curve), **keys}
    lines = [{"step": 0, "config": config}] + [{"step": s, "val_loss": v} for s, v in sorted(curve.items())]
    (d / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return str(d)


def curve(final, mid=4.0):
    return {0: 10.0, 10: mid, 20: final}


def t975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom, from its density integrated here."""
    x = np.linspace(0, 20, 400_001)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = c * (1 + x ** 2 / df) ** (-(df + 1) / 2)
    cdf = np.concatenate([[0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])  # from 0: 0.475 at the quantile
    return float(np.interp(0.475, cdf, x))


def test_t_quantiles():
    for df in list(range(1, 31)) + [40, 60, 120]:
        q = sweep.T975[df - 1] if df <= 30 else 1.96 + 2.4 / df
        assert q == pytest.approx(t975(df), abs=2e-3), df


def test_report_numbers_on_hand_written_logs(tmp_path):
    ref = [write_run(tmp_path, f"g{s}", GATED, s, curve(f)) for s, f in [(0, 3.0), (1, 3.2), (2, 3.1)]]
    var = [write_run(tmp_path, f"d{s}", DYN, s, curve(f)) for s, f in [(0, 2.9), (1, 3.0), (3, 3.2)]]
    rep, _ = sweep.report(ref + var)
    g, d = rep["Gated Attention"], rep["Dynamic E-ExoFormer"]
    assert g["reference"] and not d["reference"] and list(rep) == ["Gated Attention", "Dynamic E-ExoFormer"]
    assert g["seeds"] == [0, 1, 2] and g["final_val_loss"] == [3.0, 3.2, 3.1] and g["runs"] == 3
    assert g["mean"] == pytest.approx(3.1) and g["std"] == pytest.approx(statistics.stdev([3.0, 3.2, 3.1]))
    half = t975(2) * statistics.stdev([3.0, 3.2, 3.1]) / math.sqrt(3)
    assert g["ci95"] == pytest.approx([3.1 - half, 3.1 + half], abs=1e-3)
    # paired by seed: seed 3 has no reference run, so the deltas are those of seeds 0 and 1
    assert d["paired_seeds"] == [0, 1] and d["delta_mean"] == pytest.approx(-0.15)
    half = t975(1) * statistics.stdev([-0.1, -0.2]) / math.sqrt(2)
    assert d["delta_ci95"] == pytest.approx([-0.15 - half, -0.15 + half], abs=1e-3) and d["resolved"] is False
    # tokens to the target 3.1: seed 0 crosses between step 10 (4.0) and 20 (2.9); seed 1 too; seed 3 never
    assert d["target"] == pytest.approx(3.1)
    t0, t1 = (10 + (4.0 - 3.1) / (4.0 - 2.9) * 10) * TOKENS, (10 + (4.0 - 3.1) / (4.0 - 3.0) * 10) * TOKENS
    assert d["tokens_to_target"] == pytest.approx([t0, t1, None])
    assert d["token_ratio"] == pytest.approx(20 * TOKENS / ((t0 + t1) / 2))
    lo, hi = d["token_ratio_ci95"]
    assert lo <= d["token_ratio"] <= hi and (lo, hi) == tuple(sweep.report(ref + var)[0]["Dynamic E-ExoFormer"]
                                                               ["token_ratio_ci95"])  # a fixed RNG
    assert "budget_ratio" not in d and "token_ratio" not in g  # one budget only; the reference is not compared


def test_budgets_and_the_budget_matched_ratio(tmp_path):
    ref = [write_run(tmp_path, f"g{s}", GATED, s, curve(3.1)) for s in range(2)]
    full = [write_run(tmp_path, f"d{s}", DYN, s, curve(f)) for s, f in [(0, 2.95), (1, 3.05)]]  # mean 3.0
    short = [write_run(tmp_path, f"d{s}_b", DYN, s, {0: 10.0, 5: 5.0, 10: f}) for s, f in [(0, 3.25), (1, 3.35)]]
    rep, full_runs = sweep.report(ref + full + short)
    d = rep["Dynamic E-ExoFormer"]
    assert len(rep) == 2 and d["seeds"] == [0, 1] and d["max_steps"] == 20  # budgets are one variant
    assert [r.max_steps for r in full_runs["Dynamic E-ExoFormer"]] == [20, 20]
    assert d["budgets"] == {
        "10000": {"max_steps": 10, "seeds": [0, 1], "mean_final_val_loss": pytest.approx(3.3), "seeds_left_out": []},
        "20000": {"max_steps": 20, "seeds": [0, 1], "mean_final_val_loss": pytest.approx(3.0), "seeds_left_out": []}}
    tokens = 10_000 + (3.3 - 3.1) / (3.3 - 3.0) * 10_000  # where the mean final loss reaches the target 3.1
    assert d["budget_ratio"] == pytest.approx(20_000 / tokens)
    assert d["budget_ratio_ci95"][0] <= d["budget_ratio"] <= d["budget_ratio_ci95"][1]
    # a target below every budget's loss: no ratio, rather than an extrapolation
    worse = [write_run(tmp_path, f"w{s}", DYN, s, {0: 10.0, 20: 3.5}, muon_lr=0.02) for s in range(2)]
    worse += [write_run(tmp_path, f"w{s}_b", DYN, s, {0: 10.0, 10: 3.8}, muon_lr=0.02) for s in range(2)]
    w = sweep.report(ref + worse)[0]["Dynamic E-ExoFormer"]
    assert w["budget_ratio"] is None and w["token_ratio"] is None and w["tokens_to_target"] == [None, None]


def test_the_budget_ratio_uses_only_the_seeds_every_budget_has(tmp_path):
    """Full-budget runs on seeds 0-4, the shorter budget on seeds 0-2 only: the curve (and its bootstrap) uses seeds
    0-2 at every budget; seeds 3 and 4, whatever their losses, change neither the ratio nor its interval. The
    target is the reference's mean over all its seeds. Computed here by hand."""
    ref = [write_run(tmp_path, f"g{s}", GATED, s, curve(f)) for s, f in enumerate([3.10, 3.12, 3.08, 3.16, 3.14])]
    full = [write_run(tmp_path, f"d{s}", DYN, s, curve(f)) for s, f in enumerate([3.00, 3.02, 2.98])]
    short = [write_run(tmp_path, f"d{s}_b", DYN, s, {0: 10.0, 10: f}) for s, f in enumerate([3.30, 3.26, 3.34])]
    rep, _ = sweep.report(ref + full + short)
    extra = [write_run(tmp_path, f"d{s}", DYN, s, curve(f)) for s, f in [(3, 2.50), (4, 3.60)]]
    mixed, _ = sweep.report(ref + full + short + extra)
    target = np.mean([3.10, 3.12, 3.08, 3.16, 3.14])  # 3.12
    tokens = 10_000 + (3.30 - target) / (3.30 - 3.00) * 10_000  # means: 3.30 at 10 steps, 3.00 at 20 (seeds 0-2)
    for d in (rep["Dynamic E-ExoFormer"], mixed["Dynamic E-ExoFormer"]):
        assert d["budget_ratio"] == pytest.approx(20_000 / tokens) and d["target_seeds"] == [0, 1, 2, 3, 4]
        assert d["budget_seeds"] == [0, 1, 2] and d["budgets"]["20000"]["mean_final_val_loss"] == pytest.approx(3.0)
    d, m = rep["Dynamic E-ExoFormer"], mixed["Dynamic E-ExoFormer"]
    assert m["budget_ratio_ci95"] == d["budget_ratio_ci95"] and m["seeds"] == [0, 1, 2, 3, 4]
    assert m["budgets"]["20000"]["seeds_left_out"] == [3, 4]
    assert m["budget_ratio"] != pytest.approx(20_000 / (10_000 + (3.30 - target) / (3.30 - np.mean(
        [3.00, 3.02, 2.98, 2.50, 3.60])) * 10_000))  # what mixing the seed sets would give
    note = sweep.markdown(mixed).splitlines()[-1]
    assert note.startswith("Dynamic E-ExoFormer: the budget curve uses seeds 0, 1, 2, those every budget has (left "
                           "out: seeds 3, 4 of the 20-step runs). Its target is Gated Attention's mean final loss "
                           "over all its seeds (0, 1, 2, 3, 4)"), note


def test_variants_group_by_config_and_labels_tell_twins_apart(tmp_path):
    runs = [write_run(tmp_path, f"a{s}", GATED, s, curve(3.0)) for s in range(2)]
    runs += [write_run(tmp_path, f"b{s}", GATED, s, curve(3.1), muon_lr=0.02, log_interval=1) for s in range(2)]
    runs += [write_run(tmp_path, "c0", DYN, 0, curve(3.0), eval_interval=5)]  # evaluation cadence: no matter
    runs += [write_run(tmp_path, "c1", DYN, 1, curve(2.9))]
    rep, _ = sweep.report(runs)
    assert list(rep) == ["Gated Attention (muon_lr=0.01)", "Gated Attention (muon_lr=0.02)", "Dynamic E-ExoFormer"]
    assert rep["Dynamic E-ExoFormer"]["seeds"] == [0, 1]
    rep, _ = sweep.report(runs, reference="Dynamic E-ExoFormer")
    assert rep["Dynamic E-ExoFormer"]["reference"] and list(rep)[0] == "Dynamic E-ExoFormer"
    with pytest.raises(ValueError, match="--reference='Gated': no such variant; the variants are"):
        sweep.report(runs, reference="Gated")


def test_unfinished_runs_are_left_out_and_the_cli_writes_json_and_table(tmp_path, capsys):
    ref = [write_run(tmp_path, f"g{s}", GATED, s, curve(3.1)) for s in range(2)]
    cut = write_run(tmp_path, "d0", DYN, 0, curve(3.0))
    with open(os.path.join(cut, "log.jsonl"), "a") as f:  # resumed for 10 more steps, cut after step 25
        f.write(json.dumps({"step": 20, "config": {**train.ALL_DEFAULTS, **DYN, "seed": 0, "max_steps": 30,
                                                   "total_batch_size": TOKENS}}) + "\n")
        f.write(json.dumps({"step": 25, "val_loss": 2.8}) + "\n" + '{"step": 26, "val_l')  # a crash mid-line
    out = tmp_path / "r" / "report.json"
    sweep.main(["--report", *ref, cut, f"--out={out}"])
    printed = capsys.readouterr()
    assert "d0: not finished (evaluated up to step 25 of 30), left out" in printed.err
    assert printed.out.splitlines()[0].startswith("| variant | seeds | final val loss")
    assert "| Gated Attention | 2 | 3.1000 ± 0.0000 |" in printed.out
    assert json.loads(out.read_text())["Gated Attention"]["final_val_loss"] == [3.1, 3.1]
    with pytest.raises(SystemExit, match="sweep.py: error: .*nothing: no log.jsonl"):
        sweep.main(["--report", str(tmp_path / "nothing")])


# ----------------------------------------------------------------------------- running

def sweep_args(data_dir, out, *extra, variants=("configs/gated.py", "configs/dyn_exo.py")):
    """sweep.py's arguments for the tests' sweeps: the variants, seeds 0 and 1 (a later --seeds in extra wins), 12
    steps of the small model."""
    common = [a for a in SMALL if not a.startswith("configs/")] + [f"--data_dir={data_dir}", "--max_steps=12",
                                                                    "--ckpt_interval=4", "--eval_interval=4"]
    return [*variants, "--seeds=0,1", f"--out_dir={out}", *common, *extra]


def sweep_cmd(data_dir, out, *extra, **variants):
    """The sweep as a shell runs it."""
    return [sys.executable, "-m", "tools.sweep", *sweep_args(data_dir, out, *extra, **variants)]


def running(name):
    """Whether a process whose command line holds `name` is running (Linux: /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if name.encode() in f.read() and int(pid) != os.getpid():
                    return True
        except OSError:
            pass
    return False


def test_a_sweep_stopped_in_a_run_and_started_again_redoes_nothing(data_dir, tmp_path):
    """Seeds 0 and 1 of one variant: the sweep killed in its second run (gated_s1), which stops at its next step with
    a checkpoint, and started again: the finished run is skipped, untouched, and gated_s1 resumes, ending bit for bit
    as the same run of a sweep never stopped (seed 1 alone: the same command, the same threads). (The order of a
    sweep's runs is test_print_...'s; a run first started by the sweep started again, test_a_sweep_killed_...'s.)"""
    straight, out = str(tmp_path / "straight"), str(tmp_path / "stopped")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gated = ["configs/gated.py"]
    r = subprocess.run(sweep_cmd(data_dir, straight, "--seeds=1", variants=gated), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"\[1/1\] done gated_s1 in \d+\.\d min \(CPU \d+\.\d min\)", r.stdout), r.stdout
    assert "| Gated Attention | 1 |" in r.stdout
    proc = subprocess.Popen(sweep_cmd(data_dir, out, "--log_interval=1", variants=gated), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    second = os.path.join(out, "gated_s1", "log.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(second) and len(read_log(os.path.dirname(second))) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep dies at once; its run is told to stop (SIGTERM), and does
    proc.communicate(timeout=60)
    while time.time() < deadline and running("gated_s1"):
        time.sleep(0.05)
    stopped_at = load_checkpoint(os.path.join(out, "gated_s1", "ckpt.pt"))["step"]
    assert 2 <= stopped_at < 12
    finished = {f: os.stat(f).st_mtime_ns for f in (f"{out}/gated_s0/ckpt.pt", f"{out}/gated_s0/log.jsonl")}
    r = subprocess.run(sweep_cmd(data_dir, out, variants=gated), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "skip gated_s0: finished (step 12)" in lines
    assert [line.split()[2] for line in lines if " start " in line] == ["gated_s1"]
    assert f"resuming from {out}/gated_s1/ckpt.pt at step {stopped_at}" in open(f"{out}/gated_s1/train.out").read()
    assert {f: os.stat(f).st_mtime_ns for f in finished} == finished
    a, b = load_checkpoint(f"{straight}/gated_s1/ckpt.pt"), load_checkpoint(f"{out}/gated_s1/ckpt.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    strip = lambda out: [{k: v for k, v in e.items() if k not in ("step_ms", "tok_per_s")} for e in read_log(out)]
    assert strip(f"{straight}/gated_s1") == strip(f"{out}/gated_s1")  # the log too, but its step times


def test_a_sweep_killed_between_a_full_run_and_its_branch_resumes_without_redoing_the_full_run(data_dir, tmp_path):
    """--budgets=0.5,1 branches the 6-step budget from the 12-step run's step 4. The sweep is killed as the full run
    ends; started again, it skips the full run and runs the branch, which ends bit for bit as a 6-step run of its
    own (same threads: the sweep's slot)."""
    out = str(tmp_path / "sw")
    cmd = sweep_cmd(data_dir, out, "--budgets=0.5,1", "--seeds=0", variants=["configs/gated.py"])
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:  # the sweep dies as soon as it says the full run is done
        seen.append(line)
        if "done gated_s0" in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert any("done gated_s0" in line for line in seen), "".join(seen)
    deadline = time.time() + 120
    while time.time() < deadline and running("gated_b0.5_s0"):
        time.sleep(0.05)
    full = os.path.join(out, "gated_s0", "ckpt.pt")
    before = os.stat(full).st_mtime_ns
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "skip gated_s0: finished (step 12)" in lines and os.stat(full).st_mtime_ns == before
    assert [line.split()[2] for line in lines if " start " in line] == ["gated_b0.5_s0"]
    assert [e["step"] for e in read_log(os.path.dirname(full), configs=True)] == [0]  # started once
    own = str(tmp_path / "own")
    args = [a for a in cmd[3:] if not a.startswith(("--seeds", "--out_dir", "--budgets"))]
    args += ["--max_steps=6", "--seed=0", f"--out_dir={own}"]
    r = subprocess.run([sys.executable, "train.py", "configs/gated.py", *args], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, **sweep.slots(1)[0]}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(own, os.path.join(out, "gated_b0.5_s0"))
    # a budget whose branch point the finished full run never kept (at step 2 of 0.25 x 12): from scratch
    r = subprocess.run([c if c != "--budgets=0.5,1" else "--budgets=0.25,1" for c in cmd], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and load_checkpoint(f"{out}/gated_b0.25_s0/ckpt.pt")["step"] == 3, r.stdout[-2000:]
    assert (f"gated_b0.25_s0: gated_s0 finished without its branch point {out}/gated_s0/ckpt_000002_full.pt: from "
            f"scratch instead") in r.stdout


def sweep_main(argv, capsys):
    """sweep.main(argv) in this process: (its exit status, stdout, stderr): --print and the refusals print, and only
    the printed commands need a shell (the first of them runs in one below)."""
    result, out, err = in_process(sweep.main, argv, capsys)
    if not isinstance(result, SystemExit):
        return 0, out, err
    if isinstance(result.code, int):  # argparse's status 2
        return result.code, out, err
    return 1, out, err + f"{result.code}\n"  # a one-line error: Python prints it and exits with 1


def test_print_gives_runnable_commands_and_bad_input_is_refused_before_any_run(data_dir, tmp_path, capsys):
    out = tmp_path / "sw"
    code, stdout, err = sweep_main(sweep_args(data_dir, out, "--print", "--budgets=0.5,1"), capsys)
    lines = stdout.splitlines()  # 2 variants x 2 seeds: the full runs, then each branch after what it waits for
    assert code == 0 and len(lines) == 4 + 2 * 4 and not out.exists(), err
    full, branch = lines[0], lines[5]
    assert full.endswith(f"--keep_full=5 --seed=0 --out_dir={out}/gated_s0 --init_from=auto")
    point = f"{out}/gated_s0/ckpt_000005_full.pt"  # the 6-step budget's schedule and the full run's part at step 5
    assert lines[4] == f"# waits for {point}" and "--max_steps=6" in branch and "--max_steps=12" not in branch
    assert branch.endswith(f"--seed=0 --out_dir={out}/gated_b0.5_s0 --init_from={point}")
    for command in (full, branch):
        r = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    assert load_checkpoint(f"{out}/gated_b0.5_s0/ckpt.pt")["step"] == 6
    scratch = sweep_main(sweep_args(data_dir, out, "--print", "--budgets=0.5,1", "--budgets_from_scratch"),
                         capsys)[1].splitlines()
    assert len(scratch) == 8 and not any("keep_full" in c or "# waits" in c for c in scratch)
    assert f"--out_dir={out}/gated_b0.5_s0 --init_from=auto" in scratch[1]
    for extra, message in [(["--n_layers=3"], "unknown key 'n_layers' (did you mean n_layer?)"),
                           (["--seed=3"], "--seed=3: the sweep sets it for every run (use --seeds)"),
                           (["--budgets=0.5"], "1 among them"),
                           (["--cooldown_frac=0.9", "--budgets=0.5,1"], "--budgets: 0.5 (6 steps): its schedule and "
                            "the full run's differ from step 2, so a branch would save 2 of its 6 steps, less than "
                            "50%; --budgets_from_scratch runs it on its own"),
                           (["configs/nope.py"], "configs/nope.py: no config file configs/nope.py"),
                           (["--data_dir=/nonexistent"], "/nonexistent: data directory not found")]:
        code, _, err = sweep_main(sweep_args(data_dir, tmp_path / "bad", *extra), capsys)
        assert code == 2 if extra[0].startswith(("--seed", "--budgets")) else code == 1
        assert message in err.strip().splitlines()[-1] and not (tmp_path / "bad").exists(), err
    # the built-in corpus need not be there yet: each run's train.py builds it (once: data.ensure_corpus)
    code, stdout, err = sweep_main(sweep_args(tmp_path / "data" / "stdlib", out, "--print"), capsys)
    assert code == 0 and f"--data_dir={tmp_path / 'data' / 'stdlib'}" in stdout, err


def test_print_with_slurm_gives_the_sbatch_commands_a_branch_after_its_full_runs_job(data_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    """What --slurm submits, printed (test_slurm.py submits it to a real Slurm); and its refusals."""
    out = tmp_path / "sw"
    options = "--time=4:00:00 --gpus-per-node=1 --comment='a b'"
    sweep.main(sweep_args(data_dir, out, "--seeds=0", "--budgets=0.5,1", "--print", "--slurm",
                          f"--sbatch={options}"))
    lines = capsys.readouterr().out.splitlines()
    names = ["gated_s0", "gated_b0.5_s0", "dyn_exo_s0", "dyn_exo_b0.5_s0"]
    assert lines[0] == f"mkdir -p {' '.join(str(out / n) for n in names)}" and len(lines) == 5 and not out.exists()
    for n, (line, name) in enumerate(zip(lines[1:], names), 1):
        sbatch = (f"job{n}=$(PYTHON={sys.executable} TRAIN_PY={ROOT}/train.py sbatch --parsable --job-name={name} "
                  f"--output={out}/{name}/slurm-%j.out --time=4:00:00 --gpus-per-node=1 '--comment=a b' ")
        after = f"--dependency=afterok:$job{n - 1} --kill-on-invalid-dep=yes " if "_b" in name else ""
        assert line.startswith(sbatch + after + f"{ROOT}/tools/train.sbatch configs/"), line
        assert line.endswith(f" --seed=0 --out_dir={out}/{name} --init_from="
                             + (f"{out}/{names[n - 2]}/ckpt_000005_full.pt)" if after else "auto)")), line
    for extra, message in [(["--sbatch=--time=10"], "--sbatch: expected with --slurm"),
                           (["--slurm", "--sbatch=--comment='a"], "No closing quotation")]:
        with pytest.raises(SystemExit):
            sweep.main(sweep_args(data_dir, out, *extra))
        assert message in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm there
    with pytest.raises(SystemExit, match=r"--slurm: no sbatch on PATH \(Slurm's commands"):
        sweep.main(sweep_args(data_dir, out, "--slurm"))
    assert not out.exists()


# ----------------------------------------------------------------------------- the frozen-anchor control

def test_frozen_anchors_stay_at_their_initialisation_and_everything_else_trains(data_dir, tmp_path, capsys):
    out = str(tmp_path / "frozen")
    train.main(["configs/dyn_exo_frozen.py"] + SMALL[1:] + [f"--data_dir={data_dir}", f"--out_dir={out}",
                                                            "--max_steps=4"])
    assert "frozen at its random initialisation (no gradient, in no optimiser): anchor_proj.weight" in \
        capsys.readouterr().out
    ckpt = load_checkpoint(f"{out}/ckpt.pt")
    torch.manual_seed(ckpt["config"]["seed"])  # train.py seeds right before it builds the model
    init = GPT(GPTConfig.from_dict(ckpt["model_config"])).state_dict()
    assert GPTConfig.from_dict(ckpt["model_config"]).name == "Dynamic E-ExoFormer (frozen anchors)"
    assert torch.equal(ckpt["model"]["anchor_proj.weight"], init["anchor_proj.weight"])
    moved = [k for k in init if k != "anchor_proj.weight" and not torch.equal(ckpt["model"][k], init[k])]
    assert sorted(moved) == sorted(k for k in init if k != "anchor_proj.weight")
    assert set(ckpt["model"]) == set(GPT(GPTConfig(**{**ckpt["model_config"], "anchor_frozen": False})).state_dict())
