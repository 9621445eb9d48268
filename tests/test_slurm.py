"""The cluster path under a real Slurm: a one-host cluster of the test's own (Debian's slurm-wlm and munge) runs
train.sbatch with 2 tasks (CPU, gloo), which is preempted (scancel --signal=USR1), reaches its time limit
(--signal=USR1@N) and loses its node (every process of the job and slurmd killed at once); each job ends bit for bit
as an unbroken run, and the log says which steps it redid. sweep.py --slurm submits a sweep with a branched budget,
and its runs and report equal those of the same sweep run here. The cluster needs root, Slurm and MUNGE: without them
its tests are skipped, except in CI (.ci/run installs them), where they fail."""
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import needs
from engine.checkpoint import load_checkpoint
from tests.test_faults import ENV, LIMIT, args, environ, kill_at_once, ranks, wait_for_step
from tests.test_sweep import sweep_args
from tests.test_train import ROOT, assert_same_run, read_log
from tools import sweep

# one pytest-xdist worker runs these tests, in order: its one cluster, started once for them all
pytestmark = pytest.mark.xdist_group("slurm")

DAEMONS = "/usr/sbin"  # where Debian's munge and slurm-wlm put munged, slurmctld and slurmd
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
MISSING = "needs root (it starts munged, slurmctld and slurmd)" if os.geteuid() else next(
    (f"needs Slurm and MUNGE: no {c} (apt-get install slurm-wlm munge)" for c in
     [f"{DAEMONS}/{d}" for d in ("munged", "slurmctld", "slurmd")] + list(COMMANDS) if not shutil.which(c)), None)

# The cluster's slurm.conf: one node, "localhost" on 127.0.0.1, with 2 CPUs whatever the machine has (config_overrides)
CONF = """ClusterName=exotest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmdParameters=config_overrides
BatchStartTimeout=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
MpiDefault=none
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
# Slurm counts a batch job missing from its node only once it is older than BatchStartTimeout + MessageTimeout (CONF's
# 2 s, the time slurmd may take to start a batch script; slurm.conf's default 10 s); a slurmd that comes back sooner
# reports no job, and the job stays RUNNING
MISSING_AFTER = 2 + 10


def free_ports(n):
    """n TCP ports free on 127.0.0.1 now (they close as the function returns)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def terminate(proc):
    """End a daemon of the test's: SIGTERM, then SIGKILL if it is still there after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Cluster:
    """A one-host Slurm of the test's own: munged, slurmctld and slurmd with their key, ports, state and logs in
    `root` (kept, as pytest keeps its folders, for a look after a failure), MUNGE's socket in a folder of its own
    under /tmp (munged refuses a socket whose folders are not open to all, and pytest's are not), and its slurm.conf
    given to every command by SLURM_CONF."""

    def __init__(self, root):
        self.root, self.conf, self.daemons, self.slurmd = str(root), os.path.join(root, "slurm.conf"), [], None
        self.socket_dir = tempfile.mkdtemp(prefix="exo-munge-")
        os.chmod(self.socket_dir, 0o755)
        # every command here, the jobs too (sbatch exports its environment): this cluster, this Python, gloo on lo
        self.env = {**ENV, "SLURM_CONF": self.conf, "GLOO_SOCKET_IFNAME": "lo",
                    "PATH": os.pathsep.join([os.path.dirname(sys.executable), ENV["PATH"], DAEMONS])}

    def start(self):
        socket_path, key = os.path.join(self.socket_dir, "munge.socket"), os.path.join(self.root, "munge.key")
        for d in ("state", "spool"):
            os.mkdir(os.path.join(self.root, d))
        with open(key, "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as f:
            f.write(os.urandom(1024))  # MUNGE's key size (mungekey's default)
        ctld_port, slurmd_port = free_ports(2)
        with open(self.conf, "w") as f:
            f.write(CONF.format(root=self.root, socket=socket_path, ctld_port=ctld_port, slurmd_port=slurmd_port))
        self.daemon(f"{DAEMONS}/munged", "--foreground", f"--socket={socket_path}", f"--key-file={key}",
                    f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                    f"--seed-file={self.root}/munged.seed")
        self.wait_for(lambda: os.path.exists(socket_path), "munged's socket")
        self.daemon(f"{DAEMONS}/slurmctld", "-D")
        self.wait_for(lambda: "UP" in self.run("scontrol", "ping", check=False), "slurmctld")
        self.start_slurmd()
        self.wait_for(lambda: self.run("sinfo", "--noheader", "--format=%T").strip() == "idle", "the node")

    def daemon(self, *cmd):
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.daemons.append(proc)
        return proc

    def start_slurmd(self):
        """The node's slurmd, started (again, in place of one that was killed), as "localhost"."""
        if self.slurmd in self.daemons:
            self.daemons.remove(self.slurmd)
        self.slurmd = self.daemon(f"{DAEMONS}/slurmd", "-D", "-N", "localhost")

    def wait_for(self, ready, what, limit=60):
        """Block until ready() (bounded); a daemon that ended, or the time up, fails the test."""
        deadline = time.time() + limit
        while not ready():
            if time.time() > deadline or any(p.poll() is not None for p in self.daemons):
                raise AssertionError(f"{what} not ready: see the logs in {self.root}")
            time.sleep(0.2)

    def run(self, *cmd, check=True):
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and r.returncode:
            raise AssertionError(f"{shlex.join(cmd)}: {r.stderr.strip()}")
        return r.stdout

    def submit(self, options, train_args, output):
        """A job of train.sbatch, submitted from the repository as docs/LONG_RUNS.md does; returns its Job."""
        out = subprocess.run(["sbatch", "--parsable", f"--output={output}", *options, "tools/train.sbatch",
                              *train_args],
                             cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return Job(self, out.stdout.strip(), output)

    def stop(self):
        """Cancel every job, then end the daemons and whatever of the jobs is left; remove the socket's folder."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--partition=test")
            self.wait_for(lambda: not self.run("squeue", "--noheader").strip(), "an empty queue", limit=30)
        for proc in reversed(self.daemons):
            terminate(proc)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def processes(self, job=None):
        """The pids of this cluster's jobs (or of one job), slurmstepd and all below it: their environment names
        this cluster's slurm.conf."""
        found = set()
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            env = environ(pid)
            if env.get("SLURM_CONF") == self.conf and pid not in [p.pid for p in self.daemons] and (
                    job is None or env.get("SLURM_JOB_ID") == job or cmdline(pid).startswith(f"slurmstepd: [{job}.")):
                found.add(pid)
        return found


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Job:
    """A Slurm job of the cluster: its state, its output, and poll() as a Popen's (None while Slurm holds it)."""

    def __init__(self, cluster, id, output):
        self.cluster, self.id, self.output, self.polled = cluster, id, str(output), (0, None)

    def show(self):
        """scontrol's fields of the job, {key: value}."""
        return dict(re.findall(r"(\w+)=(\S*)", self.cluster.run("scontrol", "--oneliner", "show", "job", self.id)))

    def poll(self):
        """The job's end state, or None while it is queued; asked of slurmctld at most once a second (wait_for_step
        polls every 50 ms, and each scontrol is a process on a 2-core machine)."""
        if time.time() > self.polled[0] + 1:
            state = self.show()["JobState"]
            self.polled = time.time(), state if state in ENDED else None
        return self.polled[1]

    def finish(self):
        """Wait (bounded) until the job has ended, starting it soon whenever it is requeued: Slurm holds a requeued job
        for about two minutes (reason BeginTime). Returns its fields."""
        deadline, requeued = time.time() + LIMIT, None
        while time.time() < deadline:
            fields = self.show()
            if fields["JobState"] in ENDED:
                return fields
            if fields["JobState"] == "PENDING" and fields["Reason"] == "BeginTime":
                requeued = requeued or time.time()
                # Not before its previous start has left the node, nor in the second slurmd revoked that start's
                # credential (whole seconds): slurmd refuses to launch it then ("already killed"), and the job fails
                if time.time() > requeued + 2 and not self.cluster.processes(self.id):
                    self.cluster.run("scontrol", "update", f"JobId={self.id}", "StartTime=now")
            else:
                requeued = None
            time.sleep(0.5)
        raise AssertionError(f"job {self.id} still {fields['JobState']} after {LIMIT} s:\n{self.text()[-3000:]}")

    def text(self):
        with open(self.output) as f:
            return f.read()

    def workers(self):
        """{rank: pid} of the job's train.py processes."""
        return ranks(self.cluster.processes(self.id))


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory):
    needs(MISSING)  # every test here but the first
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(running_cluster):
    """The module's cluster for one test, which leaves it with no job and with its slurmd, even when it fails."""
    yield running_cluster
    running_cluster.run("scancel", "--partition=test")
    if running_cluster.slurmd.poll() is not None:  # the test killed it
        running_cluster.start_slurmd()


def starts(text):
    """What each start of a job did, from its output (every start appends to it): [(the step it resumed from, the steps
    it logged)], from rank 0's lines."""
    found = []
    for part in text.split("config, where it differs from the defaults")[1:]:  # train.py's first line
        resumed = re.search(r"^resuming from \S+ at step (\d+)", part, re.M)
        logged = re.findall(r"^step (\d+)/\d+ \|", part, re.M)
        found.append((int(resumed.group(1)) if resumed else 0, [int(s) for s in logged]))
    return found


def stops(text):
    """{rank: (the step it stopped after, the signal)} from the lines train.py writes when it stops."""
    lines = re.findall(r"train\.py: rank (\d): stopped after step (\d+) \((\w+)\)", text)
    return {int(rank): (int(step), why) for rank, step, why in lines}


# ----------------------------------------------------------------------------- train.sbatch

def test_the_script_is_the_one_docs_long_runs_shows():
    with open(os.path.join(ROOT, "tools", "train.sbatch")) as f:
        script = f.read()
    with open(os.path.join(ROOT, "docs", "LONG_RUNS.md")) as f:
        shown = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", f.read(), re.S)
    assert shown == [script]
    assert "gpu" not in "".join(line for line in script.splitlines() if line.startswith("#SBATCH")).lower()


def test_preempted_the_job_stops_at_one_step_requeues_itself_and_ends_as_an_unbroken_run(cluster, toy_shards, unbroken,
                                                                                         tmp_path):
    out = str(tmp_path / "run")
    job = cluster.submit(["--ntasks=2"], args(toy_shards, out), tmp_path / "job.out")
    wait_for_step(out, 3, job)
    cluster.run("scancel", "--signal=USR1", job.id)  # a preemption with a warning: to the tasks, not the script
    fields = job.finish()
    text = job.text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
    (step, why), = set(stops(text).values())  # both ranks, after one step
    assert len(stops(text)) == 2 and why == "SIGUSR1" and 3 <= step < 40, text[-3000:]
    # srun's report of the status that requeues the job: "tasks 0-1: ...", or a line for each task when they end apart
    exited = re.findall(r"tasks? ([\d,-]+): Exited with exit code 75", text)
    assert exited in (["0-1"], ["0", "1"], ["1", "0"]), text[-3000:]
    assert text.count("train.sbatch: srun exited 75, every rank stopped with a checkpoint: requeued") == 1, text[-3000:]
    assert starts(text) == [(0, list(range(1, step + 1))), (step, list(range(step + 1, 41)))]  # nothing redone
    assert_same_run(unbroken, out)
    print(f"preempted: both ranks stopped after step {step}; the requeued job went on from step {step}")


def test_near_its_time_limit_the_job_stops_with_a_checkpoint_and_continues_when_requeued(cluster, toy_shards, unbroken,
                                                                                      tmp_path):
    """--signal=USR1@60 and a time limit 10 minutes off; the test holds the ranks (SIGSTOP) at step 3, so that the few
    dozen steps cannot end first, then brings the limit near: Slurm checks time limits every 30 s, warns up to 30 s
    earlier than asked and ends the job at the first check past the limit (slurmstepd sends SIGCONT with the warning;
    the test does, if it does not, once the warning waits in both). The requeued job gets 10 minutes, so that its own
    warning cannot come, on a loaded machine, while the finished run exits."""
    out = str(tmp_path / "run")
    job = cluster.submit(["--ntasks=2", "--time=10", "--signal=USR1@60"], args(toy_shards, out), tmp_path / "job.out")
    wait_for_step(out, 3, job)
    workers = list(job.workers().values())
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        while not all(stopped(pid) for pid in workers):  # the signal takes effect a moment later
            time.sleep(0.01)
        # the limit 35 to 95 s away (whole minutes from the job's start): the next check, at most 30 s off, cannot end
        # the job, and warns it (from 90 s before the limit), or the one after it does
        minutes = int((time.time() - started(job) + 35) // 60) + 1
        cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}")
        near = time.time()
        while all(stopped(pid) for pid in workers) and not all(pending(pid, signal.SIGUSR1) for pid in workers):
            assert time.time() < near + 75, f"no SIGUSR1 from Slurm: {job.show()}"
            time.sleep(0.2)
        warned = time.time() - near
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    deadline = time.time() + LIMIT
    while job.show()["Restarts"] == "0":  # requeued: each start has the time limit, and the warning, of its own
        assert time.time() < deadline and job.poll() is None, job.text()[-3000:]
        time.sleep(0.5)
    cluster.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")  # its rest, however slow, before the next
    fields = job.finish()
    text = job.text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
    (step, why), = set(stops(text).values())
    assert len(stops(text)) == 2 and why == "SIGUSR1" and 3 <= step < 40, text[-3000:]
    assert starts(text) == [(0, list(range(1, step + 1))), (step, list(range(step + 1, 41)))]
    assert_same_run(unbroken, out)
    print(f"time limit: the warning came {warned:.0f} s after the limit was brought near; both ranks stopped after "
          f"step {step}, and the requeued job went on from step {step}")


def started(job):
    """When the job's current start began (scontrol's StartTime: local time, whole seconds)."""
    return time.mktime(time.strptime(job.show()["StartTime"], "%Y-%m-%dT%H:%M:%S"))


def status(pid):
    """/proc's status lines of process pid, {name: value}; {} once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def stopped(pid):
    return status(pid).get("State", "").startswith("T")


def pending(pid, signum):
    """Whether signal signum waits for process pid (a stopped process cannot take it): /proc's ShdPnd mask."""
    return bool(int(status(pid).get("ShdPnd", "0"), 16) >> (signum - 1) & 1)


def test_a_lost_node_requeues_the_job_which_redoes_the_steps_since_the_last_checkpoint(cluster, toy_shards, unbroken,
                                                                                     tmp_path):
    out = str(tmp_path / "run")
    job = cluster.submit(["--ntasks=2"], args(toy_shards, out), tmp_path / "job.out")
    wait_for_step(out, 1, job)
    lost = cluster.processes(job.id) | {cluster.slurmd.pid}  # found now: a look through /proc takes a few steps' time
    assert len(ranks(lost)) == 2
    wait_for_step(out, 11, job)  # past the periodic checkpoints of steps 5 and 10 (ckpt_interval=5), 4 steps before 15
    kill_at_once(lost)  # the node dies (else the script could see srun die, and report it: the job would fail)
    cluster.slurmd.wait()
    logged = [e["step"] for e in read_log(out)][-1]
    saved = load_checkpoint(f"{out}/ckpt.pt")["step"]
    assert saved % 5 == 0 and saved < logged, (saved, logged)
    time.sleep(max(0.0, started(job) + MISSING_AFTER + 3 - time.time()))  # StartTime is in whole seconds
    cluster.start_slurmd()  # the node is back, without the job: Slurm requeues it (--requeue)
    fields = job.finish()
    text = job.text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-3000:]
    assert "exit code 75" not in text and not stops(text)  # no stop signal, no status 75: Slurm requeued it
    with open(os.path.join(cluster.root, "slurmctld.log")) as f:
        assert f"Batch JobId={job.id} missing from batch node localhost" in f.read()
    (first, _), (resumed, after) = starts(text)
    assert first == 0 and resumed == saved and after == list(range(saved + 1, 41)), text[-3000:]
    redone = [s for s in after if s <= logged]  # logged before the node died, and again
    assert redone == list(range(saved + 1, logged + 1)) and redone
    assert [e["step"] for e in read_log(out)] == list(range(41))  # the log holds each step once
    assert_same_run(unbroken, out)
    print(f"lost node: checkpoint of step {saved}, logged up to step {logged}; the requeued job redid steps "
          f"{redone[0]}-{redone[-1]}")


# ----------------------------------------------------------------------------- sweep.py --slurm

def test_a_sweep_submitted_to_slurm_equals_the_same_sweep_run_here(cluster, toy_shards, tmp_path, monkeypatch, capsys):
    """2 variants x 1 seed, each with a budget of half its steps branched from it: 4 jobs, the branches after their
    full runs. Submitted held (an sbatch option of the user's), so that the test sees them queued."""
    for key, value in {**cluster.env, "OMP_NUM_THREADS": sweep.slots(2)[0]["OMP_NUM_THREADS"]}.items():
        monkeypatch.setenv(key, value)  # sbatch exports it to the jobs: their threads are those of a local run's
    there, here = str(tmp_path / "slurm"), str(tmp_path / "here")
    submit = sweep_args(toy_shards, there, "--seeds=0", "--budgets=0.5,1", "--slurm", "--sbatch=--hold")

    def run(argv):
        sweep.main(argv)
        return capsys.readouterr().out.splitlines()

    lines = run(submit)
    jobs = dict(re.findall(r"^submitted (\S+): job (\d+)", "\n".join(lines), re.M))
    full, branch = ("gated_s0", "dyn_exo_s0"), ("gated_b0.5_s0", "dyn_exo_b0.5_s0")
    assert list(jobs) == [full[0], branch[0], full[1], branch[1]], lines
    for name, parent in [*zip(full, [None] * 2), *zip(branch, full)]:
        fields = Job(cluster, jobs[name], None).show()
        assert fields["JobState"] == "PENDING" and fields["Reason"] == "JobHeldUser" and fields["Requeue"] == "1"
        assert fields["Command"] == os.path.join(ROOT, "tools", "train.sbatch") and fields["JobName"] == name
        assert fields["StdOut"] == os.path.join(there, name, f"slurm-{jobs[name]}.out")
        assert fields["Dependency"] == (f"afterok:{jobs[parent]}(unfulfilled)" if parent else "(null)"), fields
    cluster.run("scancel", jobs[branch[1]])
    lines = run(submit)  # only what is neither finished nor queued
    assert lines[:3] == [f"queued {name}: job {jobs[name]}" for name in (full[0], branch[0], full[1])], lines
    again = re.fullmatch(rf"submitted {re.escape(branch[1])}: job (\d+), after job {jobs[full[1]]}", lines[3])
    assert again and len(lines) == 5, lines
    jobs[branch[1]] = again.group(1)
    cluster.run("scontrol", "release", *jobs.values())
    for job in jobs.values():
        assert Job(cluster, job, None).finish()["JobState"] == "COMPLETED"
    lines = run(submit)  # all finished: the report, as a local sweep ends
    assert lines[:4] == [f"skip {name}: finished (step {12 if name in full else 6})" for name in jobs], lines
    run(sweep_args(toy_shards, here, "--seeds=0", "--budgets=0.5,1", "--parallel=2"))
    with open(os.path.join(there, "report.json")) as a, open(os.path.join(here, "report.json")) as b:
        assert json.load(a) == json.load(b)
    for name in jobs:
        assert_same_run(os.path.join(here, name), os.path.join(there, name))
