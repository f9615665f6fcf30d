"""Inside a process a launcher command started (`audit -- torchrun ...`, `command.py`): the
moment it becomes a rank, and how it tells the tool it ended.

The bootstrap (`bootstrap/sitecustomize.py`) wraps `init_process_group` in every Python
process of the command; nothing happens in a process that never calls it. When the call
returns, the process is rank `get_rank()` of `get_world_size()`, and is adopted: it gets the
set-up of a rank of the tool's own (`rank.adopt`: stack file, collective trace, helper
thread, the sanitizer and the audit when asked), its files in the run's report folder under
its rank, as a torchrun job's rank under `verify.hang_run` (`node_ranks.py`): `rank<r>.up`,
then `rank<r>.failed` or `rank<r>.ended`. The tool reads them (`command.py`). The folder must
be this user's alone (`verify/private.py`): a process that finds it is not says so on stderr and is
not adopted; and once the tool has its verdict (the seal), a rank's end is not told, nor its
set-ups finished, and a process that joins is not adopted.

The script is the launcher's to run, so its end is seen from inside: an exception that
reaches the top (`sys.excepthook`), or `sys.exit` with a non-zero code (how `mp.spawn`'s
worker wrapper leaves after a raise, inside its `except`), is the rank's failure, reported
before the traceback is printed; any other exit that runs `atexit` is a clean end. A rank
that dies without either (a signal, `os._exit`) is seen dead by its process id, as a crash.
The set-ups (`setups.py`) are the ones the front end named in the environment
(LAUNCHED_SETUPS_ENV, `launcher.py`), made and started at the adoption in their order, as in a
rank of the tool's own; this module names none of them. A set-up that starts earlier (`early`:
the rehearsal on the CPU, `verify/oncpu/setup.py`) is started at the import of torch, long
before the rank is known (`start_early`, from the bootstrap under `--on-cpu`).

Collectives the script bound before joining (`from torch.distributed import all_reduce`
at the top) are not traced; `dist.all_reduce(...)` is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
from dataclasses import replace

from verify.launching.env import LAUNCHED_ENV, LAUNCHED_SETUPS_ENV

_adopted: dict = {}  # this process's job and its set-ups running, once it joined


def start_early() -> None:
    """From the bootstrap once torch is imported: the set-ups of the run that start then
    (`early`, `setups.py`), in their order. A set-up says its own failure to install (`say`:
    the rehearsal's); one that cannot even be made is said here. Never raises: the script's
    `import torch` runs on, unmapped."""
    from verify.launching import setups

    try:
        for setup in setups.from_env(os.environ.get(LAUNCHED_SETUPS_ENV)):
            if setup.early:
                setup.made().early()
    except Exception as exc:
        say(f"setup.{os.getpid()}.error", exc)


def joined() -> bool:
    """Whether this process joined a process group (and is a rank of the run, or a later
    attempt's process left unwatched)."""
    return bool(_adopted)


def init_process_group(original, args: tuple, kwargs: dict):
    """`torch.distributed.init_process_group` in a launched process: the call, then the
    adoption (once a process; a failure to adopt never fails the script's call).

    A process the launcher started again is not adopted (`_again`)."""
    out = original(*args, **kwargs)
    if not _adopted:
        try:
            if _again():
                _adopted["again"] = True  # runs on unwatched, ended with the launcher
                _tell_again()
            else:
                _adopt()
        except Exception as exc:  # the script runs on unwatched: say so where the tool looks
            say(f"adopt.{os.getpid()}.error", exc)
    elif "job" in _adopted:  # a new default group: the audit's roll call is in its store
        with contextlib.suppress(Exception):
            from verify.launching import roll_call

            roll_call.answer(_adopted["job"].rank)
    return out


def say(name: str, exc: Exception) -> None:
    """Say `exc` in the run folder's file `name`; in a folder that is not this user's alone
    (`private.Untrusted`), on stderr, writing nothing there."""
    from verify import private

    line = f"{type(exc).__name__}: {exc}\n"
    try:
        private.write(os.environ[LAUNCHED_ENV], name, line.encode())
    except private.Untrusted as untrusted:
        print(f"verify: this process is not watched: {untrusted}", file=sys.stderr)
    except (OSError, KeyError):
        pass


def _again() -> bool:
    """This process joined after the run's verdict, or as a rank another process of the run
    joined as: the launcher started the workers again (torchrun `--max-restarts`, a script
    that retries `mp.spawn`). Adopted, its files would be written over the first attempt's,
    and the tool would judge a mix: a verdict on the failed attempt reported with the next
    one's audit, or, where a rank died by a signal (no verdict until the launcher ends), the
    next attempt's pass in place of the crash. Left unwatched, it is ended with the launcher."""
    import torch.distributed as dist

    from verify import private

    folder = os.environ[LAUNCHED_ENV]
    joined = read_joined(folder, dist.get_rank())
    return private.sealed(folder) or joined is not None


def _tell_again() -> None:
    """Leave `again.<pid>` in the run folder, after the seal too (`started_again`): the tool
    then ends a failed run's launcher, busy with its next attempt, without waiting for it to
    end by itself (`command.py`)."""
    from verify import private

    private.write(os.environ[LAUNCHED_ENV], f"again.{os.getpid()}", b"", asked=True)


_AGAIN = re.compile(r"again\.\d+")


def started_again(folder: str) -> bool:
    """Whether a process of the launcher's next attempt joined (`_again`). Raises
    `private.Untrusted` for a folder that is not this user's alone."""
    from verify import private

    return any(_AGAIN.fullmatch(name) for name in private.names(folder))


def _adopt() -> None:
    import torch.distributed as dist

    from verify import private
    from verify.launching import node_ranks, roll_call, setups
    from verify.launching import rank as rank_side
    from verify.launching.rank_script import script_job

    folder = os.environ[LAUNCHED_ENV]
    rank, world = dist.get_rank(), dist.get_world_size()
    job = script_job(
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        ppid=os.getppid(),
        threads=0,  # the launcher's to decide
        report_dir=folder,
        argv=tuple(sys.argv),
        setups=setups.from_env(os.environ.get(LAUNCHED_SETUPS_ENV)),
    )
    job = replace(job, on_failing=node_ranks.rank_failing(folder, rank))
    running = rank_side.adopt(job)  # the rehearsal's report named under the rank now known
    _adopted.update(job=job, running=running, failed=False)
    roll_call.answer(rank)  # a rank of the tool's, audited: the audit's group may wait for it
    if not private.write(folder, _joined(rank), f"{world} {os.getpid()}\n".encode()):
        return  # the verdict came meanwhile: not the run's, and its end is not told
    node_ranks.rank_up(folder, rank)()
    _hook_exits()


def _joined(rank: int) -> str:
    return f"rank{rank}.joined"


_JOINED = re.compile(r"rank(\d+)\.joined")


def joined_ranks(folder: str) -> list[int]:
    """The ranks whose join is noted in `folder`, in rank order (their files unread: a name
    read by `read_joined` is checked then). Raises `private.Untrusted` for a folder that is not
    this user's alone."""
    from verify import private

    found = (_JOINED.fullmatch(name) for name in private.names(folder))
    return sorted(int(m.group(1)) for m in found if m)


def read_joined(folder: str, rank: int) -> tuple[int, int] | None:
    """(world size, process id) of rank `rank`, once it joined (None: not yet). Raises
    `private.Untrusted` for a file that is not this user's alone."""
    from verify import private

    try:
        world, pid = (private.read(folder, _joined(rank)) or b"").split()
        return int(world), int(pid)
    except (OSError, ValueError) as exc:
        if isinstance(exc, private.Untrusted):
            raise
        return None


def _hook_exits() -> None:
    excepthook, exit_ = sys.excepthook, sys.exit

    def on_uncaught(kind, exc, tb):
        _fail(exc)
        excepthook(kind, exc, tb)

    def on_exit(code=None):
        if code not in (None, 0):
            exc = sys.exc_info()[1]  # mp.spawn's worker exits 1 inside its `except`
            _fail(exc if exc is not None else SystemExit(code))
        exit_(code)

    sys.excepthook, sys.exit = on_uncaught, on_exit
    atexit.register(_at_exit)
    _say_when_terminated()


def _say_when_terminated() -> None:
    """Where the script leaves SIGTERM at its default (the process ends), the rank says it
    was ended from outside, then ends as it would have: a launcher ends the other ranks as
    soon as one died, and this is how the tool tells the first death from the ones it caused
    (`node_ranks.rank_terminated`). A script's own handler, set before or after, is left be."""
    import signal

    def on_term(signum, frame):
        from verify.launching import node_ranks

        with contextlib.suppress(Exception):
            node_ranks.rank_terminated(_adopted["job"].helper_dir, _adopted["job"].rank, signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    with contextlib.suppress(ValueError):  # (not the main thread: signals are the main's)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, on_term)


def _fail(exc: BaseException) -> None:
    """The rank failed: its failure told, unless the run's verdict is out already (then
    nothing of this rank's end is written: the seal, `verify/private.py`)."""
    from verify import private
    from verify.launching import node_ranks, setups
    from verify.launching.rank_job import error_report

    if _adopted["failed"]:
        return
    _adopted["failed"] = True
    job = _adopted["job"]
    with private.unsealed(job.helper_dir) as open_:
        if open_ is None:
            return
        job.on_failing()  # at once: what follows takes a while
        # what they found so far; the rehearsal the call it could not map, when that is what
        # the rank died of
        setups.finish(_adopted["running"], exc)
        node_ranks.leave_failure(job.helper_dir, job.rank, error_report(exc))
    node_ranks.await_diagnosis(job.helper_dir)  # (bounded) the tool's diagnosis first


def _at_exit() -> None:
    """The rank ended: its set-ups finished and its end told, unless the verdict is out."""
    from verify import private
    from verify.launching import node_ranks, setups

    if _adopted["failed"]:
        return
    job = _adopted["job"]
    try:
        with private.unsealed(job.helper_dir) as dir_fd:
            if dir_fd is None:
                return
            setups.finish(_adopted["running"])
            try:
                node_ranks.rank_ended(job.helper_dir, job.rank, 0)
            except OSError:  # a full disk still takes the empty mark (`mark_ended`)
                node_ranks.mark_ended(job.helper_dir, job.rank)
    except OSError:  # a removed run folder takes nothing: no traceback at the exit of a
        pass  # script that ended well (the tool says the folder was removed)
