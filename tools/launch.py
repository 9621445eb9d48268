"""
torchrun, whose own exit status is 75 when its workers stopped with a checkpoint (train.py's status 75), so that a
script or a scheduler can tell a stop from a failure by the launcher's status alone:

    python -m tools.launch --standalone --nproc_per_node=8 train.py configs/dyn_exo.py --init_from=auto

Its arguments are torchrun's. torchrun itself (PyTorch 2.13) exits 1 after a clean stop, as after a crash: workers
that exit 75 end it with a ChildFailedError, a stop signal to torchrun ends it with a SignalException once it has
passed the signal on, waited --shutdown_timeout (30 s) and killed the workers still there, and under --max-restarts
it starts workers that stopped again, so the run goes on. torch has no option for any of these (its run.py); this
runs torchrun's own main with three changes:
- a stop signal to this process (parallel.STOP_SIGNALS) is passed on to the workers, which stop after their step with
  a checkpoint however long that takes; torchrun still handles SIGHUP and SIGQUIT as it does (they end workers that
  do not stop: the signal, then SIGKILL after --shutdown_timeout);
- once a stop signal has come, the workers are not restarted;
- when every worker that ended early exited 75, this process exits 75 (any other failure: torchrun's 1).
"""
import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher import api

from engine.parallel import PREEMPTED, STOP_SIGNALS

agents = []  # torchrun's agent in this process (one): what to tell that no restart may follow a stop


class Agent(api.LocalElasticAgent):
    """torchrun's agent, known to this process."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        agents.append(self)


def children():
    """This process's child processes (torchrun's workers), from /proc (Linux)."""
    found = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            found += [int(pid) for pid in f.read().split()]
    return found


def pass_on(signum, frame):
    """A stop signal: to every worker, and no restart after it (the agent's own count, torch 2.13's attribute)."""
    for agent in agents:
        agent._remaining_restarts = 0
    for pid in children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it ended meanwhile
            pass


def main(argv):
    """torchrun with argv, but for the stop signals, the restarts after a stop and the status after one."""
    handled = [f"--signals_to_handle={','.join(s.name for s in (signal.SIGHUP, signal.SIGQUIT))}"]  # the rest: ours
    args = torchrun.parse_args(handled + argv)  # a --signals_to_handle in argv comes later, and wins; --help exits
    api.LocalElasticAgent = Agent
    for s in STOP_SIGNALS:
        signal.signal(s, pass_on)
    try:
        record(torchrun.run)(args)  # torchrun's main, its arguments read outside record (which swallows --help's exit)
    except ChildFailedError as e:
        if all(f.exitcode == PREEMPTED for f in e.failures.values()):
            sys.exit(PREEMPTED)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
