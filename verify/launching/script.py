"""`run_script`: a user's training script in N ranks, the way torchrun would start it.

Each rank runs `python train.py ARGS` in a process of its own (`rank_script.py`) with
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, so the
script's own `init_process_group()` (env://) works unchanged. The rendezvous cannot collide
with another run: this process hosts the key-value store on a port the OS picked and keeps it
open for the run, and the ranks connect to it as clients (torchrun's agent store,
TORCHELASTIC_USE_AGENT_STORE), where picking a free port and letting rank 0 bind it later
could lose the port to a concurrent run. The store listens on 127.0.0.1 only
(`_loopback_store`), and the ranks' gloo on the loopback interface (`runner.py`).

The supervisor, the watchdog and the diagnosis are the ones every launch uses; the ranks'
output goes to `rank<r>.stdout` / `rank<r>.stderr` in the report folder and, line by line with
a `[rank r]` prefix, to `console` as the training runs.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import socket
import time
from typing import TextIO

import torch.distributed as dist

from verify.launching import gpus, runner
from verify.launching.env import STALL_ENV
from verify.launching.outcome import LaunchResult
from verify.launching.rank_job import RankJob
from verify.launching.rank_script import script_job
from verify.launching.setups import SetUp
from verify.launching.threads import thread_budget
from verify.launching.zygote import Zygote


def run_script(
    argv: tuple[str, ...],
    *,
    nproc: int,
    report_dir: str,
    stall_timeout_s: float,
    timeout_s: float,
    env: dict[str, str] | None = None,
    threads_per_rank: int | None = None,
    console: TextIO | None = None,
    setups: tuple[SetUp, ...] = (),
) -> LaunchResult:
    """Run `python argv[0] argv[1:]` as `nproc` ranks under the watchdog; see the docstring.

    Args:
        argv: the script and its arguments.
        nproc: number of ranks.
        report_dir: an existing folder for the ranks' output, stacks and traces.
        stall_timeout_s: the watchdog's stall timeout.
        timeout_s: the whole run's deadline, from the start.
        env: extra environment variables for the ranks.
        threads_per_rank: intra-op threads per rank; None: the machine's share.
        console: where the ranks' output is echoed with a rank prefix (None: files only).
        setups: what runs around the script in each rank, in order (`setups.py`: the race
            sanitizer, the replica audit, the rehearsal on the CPU, as `verify/plugins.py`
            names them); their files go to the report folder.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if not os.path.isfile(argv[0]):
        raise ValueError(f"script {argv[0]} does not exist")
    budget = thread_budget(nproc, threads_per_rank)
    start = time.monotonic()
    with _rendezvous(nproc, timeout_s + 60) as meet:
        return runner.run(
            _jobs(argv, nproc, budget, report_dir, setups),
            folder=report_dir,
            env={**meet, STALL_ENV: repr(stall_timeout_s), **budget.env(), **(env or {})},
            timeout_s=timeout_s,
            clock_from_up=False,
            stall_timeout_s=stall_timeout_s,
            report_dir=report_dir,
            threads=budget.describe(),
            start=start,
            stream=console,
            zygotes=_zygotes(env, nproc),
        )


@contextlib.contextmanager
def _rendezvous(world_size: int, timeout_s: float):
    """The environment that has a script's `init_process_group` (env://) meet the others at
    this run's store (`_loopback_store`), as torchrun's agent store: the store is held open
    until the block ends, so that its port can only be ours."""
    store = _loopback_store(world_size, timeout_s)
    try:
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    finally:
        del store


def _jobs(argv, nproc, budget, report_dir, setups) -> list[RankJob]:
    """Each rank's job (`script_job`): `argv` on `nproc` ranks, with their share of the cores
    (`budget`), their files in `report_dir`, under the set-ups asked for (`run_script`'s)."""
    return [
        script_job(
            rank=r,
            world_size=nproc,
            local_rank=r,
            ppid=os.getpid(),
            threads=budget.per_rank,
            report_dir=report_dir,
            argv=tuple(argv),
            setups=setups,
        )
        for r in range(nproc)
    ]


# How many script launches this process has made: its first starts fresh interpreters.
_launches = itertools.count()


def _zygotes(env: dict[str, str] | None, nproc: int) -> list:
    """What each rank is forked from: its zygote (`zygote.py`: one a rank, so that the ranks'
    hash seeds differ as fresh interpreters' do), on a machine where the script cannot reach
    a GPU (a fork is CUDA-safe only while nothing initialized CUDA before it, which a zygote
    cannot promise), from this process's second launch of a script on; else fresh
    interpreters. A zygote costs what a fresh rank does, so it pays off only from the launch
    after the one that starts it, and a command line runs one launch (forked there, its ranks
    took 0.4 CPU-s more than fresh ones: `audit --nproc 2`, 8.7 against 8.3)."""
    first = next(_launches) == 0
    if first or gpus.visible():
        return []
    return Zygote.for_launch(env, nproc, script=True)


def _loopback_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The run's rendezvous store, listening on 127.0.0.1 and nowhere else.

    Whatever host name it is given, TCPStore's server binds every interface (`::` or
    `0.0.0.0`, torch 2.13, both backends); the name only tells its own client where to
    connect. The store takes unauthenticated connections, so anyone who could reach the
    machine could read or write the run's rendezvous keys. So the socket is bound to loopback
    here and handed over (`master_listen_fd`): the store listens on it, owns it, and closes
    it when it is deleted or fails to start.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store's from here on: closing it here would close it twice
    return dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd,
    )  # fmt: skip
