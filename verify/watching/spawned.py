"""A script that starts its own ranks: `torch.multiprocessing.spawn` (or `start_processes`)
in a rank the tool started (pytorch/examples' multigpu.py, run as `audit --nproc 1 --
multigpu.py`).

The processes it starts are not the tool's ranks: nothing traces them, watches them or audits
them, and they inherit the rank's environment, the tool's rendezvous variables among them
(MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE), so an env:// `init_process_group`
in them connects, as a client, to a store nobody serves for them, and waits. Until such
scripts are run as their own launcher (`-- python script.py`, `launching/command.py`, which
audits them), the rank says what it started (`install`: a file beside its
trace, written when the call is made, with the user's call site and the number of
processes), and the watchdog gives a diagnosis ("unwatched", exit 2) instead of running to
the deadline: at once when the rank, which never joined a process group itself, and every
process below it have been still for the stall timeout; at the end otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass

from verify import private

# The rendezvous variables a script's rank gets from the tool, which its own processes inherit.
INHERITED = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass(frozen=True)
class OwnRanks:
    """What a rank started: `nprocs` processes from `site` (`path:line (function)`)."""

    rank: int
    nprocs: int
    site: str

    def describe(self) -> str:
        return f"torch.multiprocessing.spawn of {self.nprocs} processes at {self.site}"


def path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.spawned")


def install(folder: str, rank: int) -> None:
    """In a script's rank: note every call of `torch.multiprocessing.start_processes` (which
    `mp.spawn` calls) in `rank<r>.spawned` before the processes start."""
    import torch.multiprocessing

    from verify.watching.stacks import frame_site

    module = sys.modules["torch.multiprocessing.spawn"]
    original = module.start_processes

    @functools.wraps(original)
    def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
        site = frame_site(sys._getframe(1)) or "<unknown>"
        with contextlib.suppress(OSError, private.Untrusted):
            private.write(folder, f"rank{rank}.spawned", f"{int(nprocs)}\t{site}\n".encode())
        return original(fn, args, nprocs, *rest, **kwargs)

    module.start_processes = start_processes
    torch.multiprocessing.start_processes = start_processes


def read(folder: str, rank: int) -> OwnRanks | None:
    """What rank `rank` started, if it called `start_processes` (None: it did not). Raises
    `private.Untrusted` for a file that is not this user's alone."""
    try:
        said = private.read(folder, f"rank{rank}.spawned")
        nprocs, _, site = (said or b"").decode(errors="replace").strip().partition("\t")
        return OwnRanks(rank, int(nprocs), site)
    except private.Untrusted:
        raise
    except (OSError, ValueError):
        return None


def headline(own: OwnRanks, *, stalled: bool) -> str:
    """The diagnosis of a run in which rank `own.rank` started ranks of its own."""
    still = (
        ", and none of its processes used CPU for the stall timeout (they wait: an env:// "
        "init_process_group in them connects to a store nobody serves, since they inherit "
        f"this tool's rendezvous variables, {', '.join(INHERITED)})"
        if stalled
        else ""
    )
    return (
        f"rank {own.rank} started ranks of its own ({own.describe()}), which joined no process "
        f"group the tool watches{still}: under --nproc a script that starts its own ranks is "
        "not watched or audited; run it as its own launcher, without --nproc (`-- python "
        "script.py ARGS`): every process that joins a group is then watched and audited"
    )
