"""Under torchrun: this process is one rank of a job the tool did not start.

Two ways in:

- `launch(fn, ...)` in a process torchrun started (RANK, WORLD_SIZE and MASTER_ADDR set):
  nothing is spawned; `join` runs fn here, and every rank receives the full result through the
  job's key-value store (not a collective, which a rank still inside fn's collectives could
  mis-pair with), each report sealed with a secret the ranks agreed (`sealed.py`). A rank that failed waits a short grace for the others, then closes its
  process group so peers blocked on it fail and report too.
- `python -m verify.hang_run train.py ARGS` under torchrun: `script_main` runs the user's
  script as a traced rank (the same set-up as a rank the tool spawns, `rank.py`), and the
  process with LOCAL_RANK 0 also runs a node watchdog (`jobwide.NodeWatch`, on one node as on
  several): when the job's ranks meet the watchdog's hang conditions (or one fails) it dumps
  stacks, writes the report into `profiles/hang_torchrun_<run id>_<host>/` (or
  DDP_VERIFY_HANG_DIR), prints the one diagnosis of the job to stderr and ends the ranks, so
  torchrun tears the job down within seconds, not at the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from verify.launching import exchange, job_store, tree
from verify.launching import rank as rank_side
from verify.launching.env import DEFAULT_STALL_TIMEOUT_S, HANG_DIR_ENV, STALL_ENV, joining
from verify.launching.outcome import LaunchResult, RankContext
from verify.launching.rank_job import group_kwargs
from verify.launching.rank_script import script_job
from verify.launching.setups import SetUp
from verify.launching.supervisor import root_cause_order
from verify.launching.threads import apply, thread_budget

_joins = 0
_store: dist.Store | None = None  # `_job_store`


def local_ranks(world_size: int) -> int:
    """How many of a job's `world_size` ranks run on this machine, each needing a GPU of its
    own on NCCL: under torchrun its LOCAL_WORLD_SIZE (2 nodes of 8 GPUs: WORLD_SIZE 16, 8
    here), else all of them (the tool starts every rank on this machine)."""
    if joining():
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return world_size


def join(
    fn, args, world_size, timeout_s, backend, env, threads_per_rank=None, device="cpu"
) -> LaunchResult:
    """Run fn as this torchrun rank; every rank returns every rank's outcome. `device`: cpu,
    or cuda (nccl: the LOCAL_RANK-th GPU; gloo: the node's GPUs shared among its ranks)."""
    if world_size != int(os.environ["WORLD_SIZE"]):
        raise ValueError(
            f"world_size={world_size} but torchrun has WORLD_SIZE={os.environ['WORLD_SIZE']}"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    budget = thread_budget(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), threads_per_rank)
    apply(budget.per_rank)
    if backend == "nccl":
        if not (torch.cuda.is_available() and local_rank < torch.cuda.device_count()):
            raise ValueError(f"backend 'nccl' needs a CUDA device for LOCAL_RANK={local_rank}")
    if device == "cuda":
        gpu = local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ.update(env)  # best effort: this interpreter started long ago
    start = time.monotonic()
    global _joins
    _joins += 1  # every rank calls launch() in the same order: the n-th launch's keys
    prefix = f"ddp-verify/launch{_joins}/"
    created = not dist.is_initialized()
    if created:
        timeout = datetime.timedelta(seconds=timeout_s)  # the only hang guard without a parent
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, _job_store(timeout)),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **group_kwargs(backend, device),
        )
    ctx = RankContext(rank, world_size, local_rank, device, backend, False, budget.per_rank)
    try:
        seal = exchange.agree(prefix, rank, world_size, timeout_s)
        report = rank_side.call(fn, ctx, args)
        reports = exchange.reports(prefix, rank, world_size, report, timeout_s, created, seal)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    outcomes = [rep.outcome(r) for r, rep in enumerate(reports)]
    failures = [
        (reports[o.rank].failed_at or time.time(), o.rank) for o in outcomes if o.status != "ok"
    ]
    order = root_cause_order(failures, outcomes)
    elapsed = time.monotonic() - start
    return LaunchResult(
        world_size, tuple(outcomes), elapsed, False, order, threads=budget.describe()
    )


def _job_store(timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store (MASTER_ADDR:MASTER_PORT, torchrun's agent's), met once and
    kept: each launch's process group lives under a prefix of its own in it (`join`). Why:
    torch names every default group "0" afresh (`destroy_process_group` resets its count), so
    a second group through `init_method="env://"` read the first one's rendezvous keys, a peer's
    old address among them, and a launch after a launch with a failing rank was refused its
    connection or hung (2 of 4 runs of tests/test_launch.py's torchrun job).

    On one node the store is also the attempt's (`torchrun --max-restarts`): the agent keeps
    its store across restarts (torch 2.13), so without it a restarted attempt's first launch
    met the last attempt's keys and hung. Across nodes the attempt is not in the prefix: a
    node restarted for another's membership change keeps its count (torchelastic counts only
    its own failures), and nodes with different counts would never meet.

    The store is the agent's (`job_store.py`): a process whose torchrun environment is stale
    reaches none, and that is a ValueError (exit 2)."""
    global _store
    if _store is None:  # one client for every launch of this process, never its server
        store = job_store.connect(timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        one_node = os.environ.get("GROUP_WORLD_SIZE", "1") == "1"
        _store = dist.PrefixStore(f"attempt{attempt}/", store) if one_node else store
    _store.set_timeout(timeout)
    return _store


# ------------------------------------------------------------ python -m verify.hang_run


def _several_nodes() -> bool:
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


@functools.cache
def script_report_dir() -> str:
    """This node's report folder under torchrun (module docstring): one a run attempt, one a
    node. Its name is `profiles/hang_torchrun_<run id>_<host>[_node<k>]` (or
    DDP_VERIFY_HANG_DIR); where that folder is another attempt's, `-2`, `-3`, ... after it.

    Why a folder an attempt: the watchdog reads the ranks' files there (traces, `rank<r>.failed`,
    `.ended`, `.stack`, `.audit.json`), and an earlier run's would be read as this one's: a
    clean rerun under a fixed `--rdzv-id` was a CRASH naming the last run's error. A run id is
    fixed by `--rdzv-id`, reused by `--max-restarts`, and a static rendezvous has none (its
    agent names it). The node's ranks agree on the folder without talking: each claims it for
    this attempt (`_attempt`), the first one atomically, the others finding their claim there."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    if run_id == "none":
        run_id = f"agent{os.getppid()}"
    node = f"_node{os.environ['GROUP_RANK']}" if _several_nodes() else ""
    base = os.environ.get(HANG_DIR_ENV) or os.path.join(
        "profiles", f"hang_torchrun_{run_id}_{socket.gethostname()}{node}"
    )
    return _claim(os.path.normpath(base), _attempt())


def _attempt() -> str:
    """This attempt, the same in every local rank, the watchdog's too: torchrun's log folder
    of the attempt (`<log dir>/<run id>_<random>/attempt_<restart>`, made afresh by each
    agent, given to every rank through a wrapper too), else the ranks' parent, the agent,
    with its start time (a reused pid is another agent) and the restart count."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file:  # <attempt folder>/<local rank>/error.json
        return os.path.dirname(os.path.dirname(os.path.abspath(error_file)))
    agent = os.getppid()
    started = tree.start_time(agent)  # seconds after boot: the same in every rank
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{agent}.{'?' if started is None else started}.{restart}"


def _claim(base: str, attempt: str) -> str:
    """The first of `base`, `base-2`, ... that is this attempt's: claimed by it (a file
    `attempt` holding it), or claimed now. A folder claimed by another attempt, or holding
    the files of a run older than claims, is passed over (a user's own files are not ours:
    DDP_VERIFY_HANG_DIR may name a folder that holds them)."""
    for n in itertools.count(1):
        folder = base if n == 1 else f"{base}-{n}"
        os.makedirs(folder, mode=0o700, exist_ok=True)  # its ranks' messages: `verify/private.py`
        claim = os.path.join(folder, "attempt")
        if not os.path.exists(claim) and not _has_reports(folder):
            _put(claim, attempt)
        if _read_claim(claim) == attempt:
            return folder
    raise AssertionError("unreachable: the folders are counted without end")


_OURS = re.compile(r"rank\d+\.|report\.(json|txt)$|job\.diagnosed$")


def _has_reports(folder: str) -> bool:
    """The folder holds what a rank or a watchdog writes (`node_ranks.py`)."""
    return any(_OURS.match(name) for name in os.listdir(folder))


def _put(claim: str, attempt: str) -> None:
    """The claim `attempt` at `claim`, unless one is there: written whole under a name of its
    own, then linked into place (a link fails where the name is taken), so no rank reads it
    half written; where links are refused, written in place (`_read_claim` waits for its
    end of line)."""
    fd, mine = tempfile.mkstemp(prefix=".attempt-", dir=os.path.dirname(claim))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(attempt + "\n")
        os.link(mine, claim)
    except FileExistsError:
        pass  # another rank claimed it first
    except OSError:  # a file system without hard links
        with contextlib.suppress(FileExistsError), open(claim, "x") as f:
            f.write(attempt + "\n")
    finally:
        with contextlib.suppress(OSError):
            os.remove(mine)


def _read_claim(claim: str) -> str | None:
    """The attempt that claimed the folder; None if none did (2.5 s at most for a claim
    written in place to be whole)."""
    for _ in range(50):
        try:
            with open(claim) as f:
                text = f.read()
        except OSError:
            return None
        if text.endswith("\n"):
            return text[:-1]
        time.sleep(0.05)
    return None


def script_main(
    argv: list[str], *, setups: tuple[SetUp, ...] = (), tool: str = "verify.hang_run"
) -> str:
    """One traced rank of a torchrun job running the user's script (module docstring), under
    the `setups` its front end names (`setups.py`: the replica audit of `verify.audit_run`,
    the race sanitizer, the rehearsal on the CPU), as the module `tool` (`-m tool` on every
    rank: what a node's watch names). Returns the report folder."""
    rank = int(os.environ.get("RANK", "0"))
    report_dir = script_report_dir()
    os.makedirs(report_dir, exist_ok=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    job = script_job(
        rank=rank,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        ppid=os.getppid(),
        threads=thread_budget(local).per_rank,
        report_dir=report_dir,
        argv=tuple(argv),
        setups=setups,
    )
    stall = float(os.environ.get(STALL_ENV, repr(DEFAULT_STALL_TIMEOUT_S)))
    # One verdict for the whole job (`jobwide.py`), one node or several.
    from verify.launching import jobwide, node_ranks

    watch = jobwide.NodeWatch(report_dir, stall, tool) if job.local_rank == 0 else None
    if watch is not None:
        threading.Thread(target=watch.run, name="ddp-verify-watchdog", daemon=True).start()
    job = replace(
        job,
        on_failure=node_ranks.rank_failed(report_dir, rank),
        on_up=node_ranks.rank_up(report_dir, rank),
        on_failing=node_ranks.rank_failing(report_dir, rank),
    )
    try:
        rank_side.run_job(job, None)
        code = 0
    except SystemExit as exc:
        code = exc.code
    code = node_ranks.rank_ended(report_dir, rank, code)
    raise SystemExit(watch.wait(code) if watch is not None else code)
