"""docs/LONG_RUNS.md's multi-node torchrun across two hosts: two network namespaces joined by a veth pair, one
process per host, c10d rendezvous, gloo on the veth. A worker killed on one host under --max-restarts restarts the
group on both hosts; a lost host (its agent and worker killed at once) started again continues from the last
checkpoint; each run ends bit for bit as the unbroken run of 2 processes on one host (conftest's). The namespaces share
the hostname and /etc/hosts, so each host is told its address (--local_addr), the rendezvous host that it holds the
store (--rdzv_conf=is_host=1), and gloo its interface (GLOO_SOCKET_IFNAME); every restart gets a store of its own
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). Needs root, iproute2 and a network namespace that `ip netns add` can make:
skipped without them, except in CI (.ci/run installs them), where they fail."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import needs
from engine.checkpoint import load_checkpoint
from tests.test_faults import LIMIT, args, finish, kill_at_once, start, wait_for_step, workers
from tests.test_train import assert_same_run, read_log

# one pytest-xdist worker runs these tests, in order: its two hosts, made once for them all
pytestmark = pytest.mark.xdist_group("hosts")


def namespace_made():
    """Whether `ip netns add` makes a network namespace here (as root in a container, it needs NET_ADMIN): a
    throwaway one, deleted at once."""
    name = f"exoprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=30).returncode:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return True


@pytest.fixture(scope="module", autouse=True)
def root_and_iproute2():
    """In a fixture, not at import: in CI a missing one fails these tests, not the whole session's collection."""
    needs("needs root (it makes network namespaces)" if os.geteuid() else
          "needs iproute2's ip (apt-get install iproute2)" if not shutil.which("ip") else
          None if namespace_made() else "cannot make a network namespace (ip netns add; a container needs NET_ADMIN)")


NET = "192.0.2"  # RFC 5737's TEST-NET-1: documentation addresses, which no network routes
PORT = 29500  # torchrun's default rendezvous port: free in a namespace of the test's own
# Each rendezvous round a store of its own, which rank 0 holds (docs/LONG_RUNS.md): torch 2.13's shared one keeps its
# first round's address, which a host started again waits for in vain, and lets the hosts count restarts differently
FRESH_STORE = ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
# A host that stops sending its heartbeat to the rendezvous is dropped after 3 missed ones: every 1 s here, not
# torchrun's 5 s, so that a lost host started again joins the next round after 3 s, not 15
KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=3"


class Host:
    """One host: a network namespace with its end of the veth pair, at NET.<n>."""

    def __init__(self, name, n):
        self.name, self.interface, self.addr = name, f"{name}v", f"{NET}.{n}"

    def torchrun(self, *extra):
        """docs/LONG_RUNS.md's multi-node command, run on this host (one process), with what a host of a shared
        hostname must be told: its address, and gloo's interface; the first host holds the rendezvous."""
        holds = [f"--rdzv_conf=is_host={int(self.addr == f'{NET}.1')},{KEEP_ALIVE}"]
        env = [f"GLOO_SOCKET_IFNAME={self.interface}", *FRESH_STORE]
        return ["ip", "netns", "exec", self.name, "env", *env, sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={NET}.1:{PORT}",
                "--rdzv_id=exo", f"--local_addr={self.addr}", *holds, *extra]


def ip(*cmd):
    subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Two hosts joined by a veth pair, made here and removed afterwards (deleting a namespace deletes its end of
    the pair, and with it the other)."""
    tag = f"exo{os.getpid()}"[:12]  # interface names take 15 characters: tag + 'a' + 'v'
    made, pair = [], [Host(f"{tag}a", 1), Host(f"{tag}b", 2)]
    try:
        for h in pair:
            ip("netns", "add", h.name)
            made.append(h)
        a, b = pair
        ip("link", "add", a.interface, "netns", a.name, "type", "veth", "peer", "name", b.interface, "netns", b.name)
        for h in pair:
            ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.interface)
            ip("-n", h.name, "link", "set", h.interface, "up")
            ip("-n", h.name, "link", "set", "lo", "up")
        yield pair
    finally:
        for h in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", h.name)


def namespace(pid):
    return os.readlink(f"/proc/{pid}/ns/net")


def wait_for_starts(out, n, proc):
    """Block until the run's log.jsonl holds n (re)starts (or the process ends, or the time is up)."""
    deadline = time.time() + LIMIT
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(out, "log.jsonl")) and len(read_log(out, configs=True)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{out}: {n} starts never logged")


def test_a_worker_killed_on_one_host_restarts_the_group_on_both_hosts(hosts, toy_shards, unbroken, tmp_path):
    out = str(tmp_path / "run")
    agents = [start(h.torchrun("--max-restarts=1", "train.py", *args(toy_shards, out))) for h in hosts]
    try:
        wait_for_step(out, 12, agents[0])  # past the checkpoints of steps 5 and 10
        before = [workers(a) for a in agents]
        spaces = [namespace(pid) for w in before for pid in w.values()]
        os.kill(next(iter(before[1].values())), signal.SIGKILL)  # host b's worker
        wait_for_starts(out, 2, agents[0])
        after = [workers(a) for a in agents]
    finally:
        ends = [finish(a) for a in agents]
    for code, _, err in ends:
        assert code == 0, err[-3000:]
    # one process per host, each in its host's namespace: the veth is all that joins them
    assert [len(w) for w in before] == [1, 1] and {r for w in before for r in w} == {0, 1}, before
    assert len({*spaces, namespace(os.getpid())}) == 3, spaces
    assert [len(w) for w in after] == [1, 1] and not {*before[0].values(), *before[1].values()} & {
        *after[0].values(), *after[1].values()}, (before, after)  # a new worker on both hosts
    restarts = [e["step"] for e in read_log(out, configs=True)]
    assert restarts[0] == 0 and len(restarts) == 2 and restarts[1] in (10, 15), restarts  # resumed, not rerun
    assert_same_run(unbroken, out)
    print(f"killed worker: both hosts restarted, from the checkpoint of step {restarts[1]}")


def test_a_lost_host_started_again_continues_the_run_from_the_last_checkpoint(hosts, toy_shards, unbroken,
                                                                               tmp_path):
    out = str(tmp_path / "run")
    command = [h.torchrun("--max-restarts=1", "train.py", *args(toy_shards, out)) for h in hosts]
    agents = [start(c) for c in command]
    try:
        wait_for_step(out, 12, agents[0])
        lost = [agents[1].pid, *workers(agents[1]).values()]
        kill_at_once(lost)  # host b dies: its agent and its worker
        code, _, _ = finish(agents[1])
        assert code == -signal.SIGKILL and len(lost) == 2
        logged = [e["step"] for e in read_log(out)][-1]
        saved = load_checkpoint(f"{out}/ckpt.pt")["step"]
        agents[1] = start(command[1])  # host b is back, with the same command, as a scheduler would start it
    finally:
        ends = [finish(a) for a in agents]
    for code, _, err in ends:
        assert code == 0, err[-3000:]
    restarts = [e["step"] for e in read_log(out, configs=True)]
    assert restarts == [0, saved] and saved % 5 == 0 and saved < logged, (restarts, logged)  # redid saved+1..logged
    assert_same_run(unbroken, out)
    print(f"lost host: checkpoint of step {saved}, logged up to step {logged}; steps {saved + 1}-{logged} redone")
