"""Faults injected into training runs, one per test: a stop signal (to one rank of two), a killed worker under
torchrun --max-restarts, a worker that hangs, a full disk during a checkpoint write; and --init_from=auto on what
an output directory can hold. Each run that is stopped and continued must end bit for bit where an unbroken run
ends. Every test is bounded in time and leaves no process behind."""
import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import train
from engine import parallel
from engine.checkpoint import WEIGHTS, load_checkpoint, load_model, save_checkpoint
from tests.test_train import ROOT, SMALL, assert_same_run, data_dir, read_log  # noqa: F401  (data_dir: a fixture)
from tools import analyze

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
       "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
LIMIT = 240  # seconds any one process of these tests may take, on a loaded 2-core machine


def args(data_dir, out, *extra):
    return SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=40", "--ckpt_interval=5",
                    "--init_from=auto", *extra]


def start(cmd):
    """A process (torchrun or train.py) in a session of its own, so that the test can end all of it."""
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc):
    """Wait (bounded) for proc; kill its whole session if it is still there; return (returncode, stdout, stderr).
    A process still there at the time limit first dumps every thread's Python stack (faulthandler, on SIGABRT)."""
    try:
        out, err = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err = f"timed out after {LIMIT} s; the stacks then:\n{err}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(), out, err


def run(cmd):
    return finish(start(cmd))


def descendants(pid):
    """Every process below pid, from /proc (Linux)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                found += [child] + descendants(child)
    return found


def kill_at_once(pids):
    """SIGKILL to every process of pids as one event, as a machine that dies: all stopped first, so that none sees
    another one die and reacts (one that ended already is as dead)."""
    for signum in signal.SIGSTOP, signal.SIGKILL:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def environ(pid):
    """The environment of process pid (Linux: /proc), {} once it has gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.decode(errors="replace").split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return {}


def ranks(pids):
    """{rank: pid} of the train.py workers among pids (their environment holds RANK)."""
    return {int(env["RANK"]): pid for pid in pids if "RANK" in (env := environ(pid))}


def workers(torchrun):
    """{rank: pid} of the train.py workers that torchrun started."""
    return ranks(descendants(torchrun.pid))


def wait_for_step(out, step, proc):
    """Block until the run's log.jsonl holds `step` (or the process ends, or the time is up)."""
    deadline = time.time() + LIMIT
    while time.time() < deadline and proc.poll() is None:
        log = os.path.join(out, "log.jsonl")
        if os.path.exists(log) and any(e["step"] >= step for e in map(json.loads, open(log)) if "config" not in e):
            return
        time.sleep(0.05)
    raise AssertionError(f"{out}: step {step} never logged")


# ----------------------------------------------------------------------------- a stop signal

def test_sigterm_to_rank_0_only_stops_both_ranks_at_one_step_and_auto_finishes_the_run(data_dir, unbroken, tmp_path):
    out = str(tmp_path / "run")
    torchrun = start(TORCHRUN + ["train.py", *args(data_dir, out, "--log_interval=1")])
    wait_for_step(out, 3, torchrun)
    os.kill(workers(torchrun)[0], signal.SIGTERM)  # rank 0 only: rank 1 learns it in the step's agreement
    code, _, err = finish(torchrun)
    stops = re.findall(r"train\.py: rank \d: stopped after step (\d+)", err)
    steps = set(stops)
    assert len(stops) == 2 and len(steps) == 1, err[-3000:]  # both ranks, one step
    # torchrun's own status is 1, as for a crash (docs/LONG_RUNS.md; launch.py's is 75); its report of the workers: 75
    assert code == 1 and "ChildFailedError" in err and "exitcode  : 75" in err, err[-3000:]
    step = int(steps.pop())
    assert 3 <= step < 40 and load_checkpoint(f"{out}/ckpt.pt")["step"] == step
    code, _, err = run(TORCHRUN + ["train.py", *args(data_dir, out)])  # the same command continues it
    assert code == 0, err[-3000:]
    assert_same_run(unbroken, out)


def test_launch_py_passes_a_stop_on_restarts_nothing_after_it_and_exits_75(data_dir, tmp_path):
    """launch.py is torchrun but for what a stop returns: a SIGTERM to it (alone) reaches both workers, which stop
    after one step with a checkpoint; --max-restarts=1 starts none again; its own status is 75. A worker that fails
    otherwise still ends it with torchrun's 1."""
    out = str(tmp_path / "run")
    launch = [sys.executable, "-m", "tools.launch", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    proc = start(launch + ["train.py", *args(data_dir, out, "--log_interval=1")])
    wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    stops = re.findall(r"train\.py: rank \d: stopped after step (\d+) \(SIGTERM\)", err)
    assert code == parallel.PREEMPTED and len(stops) == 2 and len(set(stops)) == 1, err[-3000:]
    assert len(read_log(out, configs=True)) == 1 and load_checkpoint(f"{out}/ckpt.pt")["step"] == int(stops[0])
    code, _, err = run(launch[:-1] + ["train.py", *args(data_dir, out, "--n_layers=2")])  # a bad key: workers exit 1
    assert code == 1 and "unknown key 'n_layers'" in err, err[-3000:]


def test_sigusr1_to_one_process_stops_it_with_status_75_and_a_checkpoint(data_dir, tmp_path):
    out = str(tmp_path / "run")
    proc = start([sys.executable, "train.py", *args(data_dir, out, "--log_interval=1")])
    wait_for_step(out, 2, proc)
    proc.send_signal(signal.SIGUSR1)  # SLURM's --signal=USR1@seconds
    code, _, err = finish(proc)
    assert code == train.PREEMPTED, err[-3000:]
    assert "SIGUSR1: stopping after this step" in err and "continues the run (exit status 75)" in err
    step = load_checkpoint(f"{out}/ckpt.pt")["step"]
    assert f"stopped after step {step} (SIGUSR1)" in err
    assert [e["step"] for e in read_log(out)] == list(range(step + 1))  # nothing lost, nothing logged twice


LATE_SIGNAL = """import atexit, os, runpy, signal, sys
atexit.register(lambda: os.kill(os.getpid(), signal.SIGUSR1))  # as the finished run exits, a time-limit warning
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_stop_signal_as_a_finished_run_exits_does_not_fail_it(data_dir, tmp_path):
    """Slurm's USR1 before the time limit can come while a run that has just finished exits: the process still ends
    with status 0, not killed by the signal (which would mark its job failed)."""
    r = run([sys.executable, "-c", LATE_SIGNAL, *args(data_dir, str(tmp_path / "run"))])
    assert r[0] == 0, r[2][-3000:]


@pytest.mark.quick
def test_a_stop_at_an_evaluation_step_leaves_the_evaluation_to_the_resumed_run(data_dir, tmp_path, monkeypatch):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=6", "--eval_interval=3", "--init_from=auto"]
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    train.main(common + [f"--out_dir={straight}"])
    calls = []  # the stop agreement is asked after every step: say 'stop' after step 3, an evaluation step
    monkeypatch.setattr(train.StopSignals, "agreed", lambda self, env: calls.append(1) or len(calls) == 3)
    with pytest.raises(SystemExit) as e:
        train.main(common + [f"--out_dir={stopped}"])
    assert e.value.code == train.PREEMPTED
    ckpt = load_checkpoint(f"{stopped}/ckpt.pt")
    assert ckpt["step"] == 3 and ckpt["pending_log"]["step"] == 3 and "val_loss" not in ckpt["pending_log"]
    assert [e["step"] for e in read_log(stopped)] == [0, 1, 2]  # step 3's entry waits for its evaluation
    monkeypatch.undo()
    train.main(common + [f"--out_dir={stopped}"])
    strip = lambda out: [{k: v for k, v in e.items() if k not in ("step_ms", "tok_per_s")} for e in read_log(out)]
    assert strip(stopped) == strip(straight)
    assert_same_run(straight, stopped)


def test_a_branch_under_torchrun_equals_a_run_of_its_length_from_scratch(data_dir, unbroken, tmp_path):
    """Two gloo ranks: the unbroken 40-step run's step-16 checkpoint (keep_full) continued with --max_steps=20 ends
    bit for bit as a 20-step run of two ranks from scratch: weights, optimiser states, data position, the log."""
    branch, scratch = str(tmp_path / "branch"), str(tmp_path / "scratch")
    point = os.path.join(unbroken, "ckpt_000016_full.pt")
    for out, extra in ((branch, [f"--init_from={point}"]), (scratch, [])):
        code, _, err = run(TORCHRUN + ["train.py", *args(data_dir, out, "--max_steps=20", *extra)])
        assert code == 0, err[-3000:]
    assert_same_run(scratch, branch)


# ----------------------------------------------------------------------------- dead and hung workers

def test_a_killed_worker_under_max_restarts_restarts_from_the_last_checkpoint(data_dir, unbroken, tmp_path):
    out = str(tmp_path / "run")
    torchrun = start(TORCHRUN[:3] + ["--max-restarts=1"] + TORCHRUN[3:] + ["train.py", *args(data_dir, out)])
    wait_for_step(out, 12, torchrun)  # past the checkpoints of steps 5 and 10
    os.kill(workers(torchrun)[1], signal.SIGKILL)
    code, _, err = finish(torchrun)
    assert code == 0, err[-3000:]
    restarts = [e["step"] for e in read_log(out, configs=True)]
    assert restarts[0] == 0 and len(restarts) == 2 and restarts[1] in (10, 15), restarts  # resumed, not rerun
    assert_same_run(unbroken, out)


def test_torchrun_on_several_hosts_with_its_shared_store_is_warned_of(monkeypatch, capsys):
    """On one host the workers' store keys are per restart (parallel.attempt_store); across hosts torchrun's shared
    store breaks restarts (test_multinode.py runs them with a store per restart instead): rank 0 says so."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # as torchrun's agent holds it
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(key, value)
    for hosts, warned in (("1", False), ("2", True)):
        monkeypatch.setenv("GROUP_WORLD_SIZE", hosts)
        parallel.attempt_store(2, timedelta(seconds=10))
        assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every host" in capsys.readouterr().err) == warned


HANG = """import signal, sys, time
sys.path.insert(0, {root!r})
import train
micro_batches = train.micro_batches
def hang(run):  # rank 1 stops calling collectives before step 3, and dies on SIGTERM like a stuck process
    if run.worker.rank == 1 and run.step == 2:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(600)
    return micro_batches(run)
train.micro_batches = hang
train.main(sys.argv[1:])
"""


def test_a_hung_worker_fails_the_other_within_the_timeout(data_dir, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG.format(root=ROOT))
    t0 = time.time()
    code, _, err = run(TORCHRUN + [str(script), *args(data_dir, str(tmp_path / "run"), "--dist_timeout=5")])
    elapsed = time.time() - t0
    assert code != 0 and elapsed < LIMIT, err[-3000:]
    line = next(line for line in err.splitlines() if line.startswith("train.py: error: rank 0: a collective failed"))
    assert "another process died or stopped answering (dist_timeout=5 s)" in line, line


# ----------------------------------------------------------------------------- a full disk

@pytest.mark.quick
def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_one(data_dir, tmp_path, monkeypatch):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_interval=2", "--init_from=auto"]
    straight, out = str(tmp_path / "straight"), str(tmp_path / "full")
    train.main(common + [f"--out_dir={straight}"])
    real_save = torch.save

    def no_space_at_step_4(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("step") == 4:
            f.write(b"\0" * 4096)  # part of it reached the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", no_space_at_step_4)
    with pytest.raises(SystemExit) as e:
        train.main(common + [f"--out_dir={out}"])
    message = str(e.value)
    assert message.startswith(f"train.py: error: step 4: {out}/ckpt.pt: No space left on device (the disk is full)")
    assert "the previous checkpoint, if any, is intact" in message and "\n" not in message
    assert load_checkpoint(f"{out}/ckpt.pt")["step"] == 2 and sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    monkeypatch.setattr(torch, "save", real_save)
    train.main(common + [f"--out_dir={out}"])  # room again: the same command goes on from step 2
    assert_same_run(straight, out)


# ----------------------------------------------------------------------------- --init_from=auto

def test_auto_on_an_empty_directory_a_finished_run_and_another_models_checkpoint(data_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=3", "--init_from=auto"]
    train.main(common)  # nothing there: a new run
    assert [e["step"] for e in read_log(out, configs=True)] == [0]
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    capsys.readouterr()
    assert train.main(common) is None  # finished: exits at once and says so
    assert f"{out}/ckpt.pt: this run is finished (step 3 of max_steps=3); nothing to do" in capsys.readouterr().out
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before
    # another model's checkpoint: refused in one line, never overwritten
    code, _, err = run([sys.executable, "train.py", *common[1:], "configs/gated.py", "--max_steps=6"])
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith(f"train.py: error: {out}/ckpt.pt: ") and " in the checkpoint, " in last
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before
    # a weights-only copy in its place cannot be resumed: refused too
    save_checkpoint(f"{out}/ckpt.pt", {k: v for k, v in load_checkpoint(f"{out}/ckpt.pt", ()).items() if k in WEIGHTS})
    with pytest.raises(SystemExit, match="no resumable parts in this checkpoint; a run resumes from"):
        train.main(common[:-1] + ["--max_steps=6", "--init_from=auto"])


# ----------------------------------------------------------------------------- checkpoint history

def test_keep_every_keeps_weights_only_checkpoints_that_every_tool_reads(data_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=4", "--keep_every=2",
                        "--eval_interval=1"])
    assert "; 2 weights-only ckpt_<step>.pt of ~" in capsys.readouterr().out  # the disk use, at start-up
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt_")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    kept = load_checkpoint(f"{out}/ckpt_000002.pt", ())
    assert set(kept) == {"model", "model_config", "step", "config", "tokenizer", "source"} and kept["step"] == 2
    final = load_checkpoint(f"{out}/ckpt.pt")
    assert all(torch.equal(load_checkpoint(f"{out}/ckpt_000004.pt")["model"][k], v) for k, v in final["model"].items())
    load_model(f"{out}/ckpt_000002.pt")
    history = analyze.analyze(f"{out}/ckpt_000002.pt", data_dir, tokens=64, batch_size=2)
    assert history["step"] == 2 and [s for s, _ in history["curve"]] == [0, 1, 2]  # the curve up to itself
