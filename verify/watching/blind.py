"""Where the collective trace is blind: ranks blocked inside torch's C++.

PyTorch DDP's reducer (in backward), its constructor's broadcasts and ZeroRedundancyOptimizer
issue their collectives from C++, where the tracer never sees them: a job of such ranks shows
no collective, whether it trains or hangs. There the stall is timed from the CPU evidence
instead of the trace. A rank is *still* from the start of the first window of its CPU meter
that shows no work (`CpuMeter.quiet_since`) for as long as its meter keeps saying so; once
it has been still for half the stall timeout, its helper thread is asked, once per still
spell, whether its main thread is inside a torch call that blocks waiting for peers
(`stacks.main_thread_in_torch`), so the answer is there when the stall timeout is reached.

Ranks all still for the stall timeout, none working or starting, one of them blocked inside
torch, are hung: the ones blocked wait for a peer, and a peer parked elsewhere (a sleep, a
lock, a queue nobody fills) is the reason. Ranks all still with none inside torch (every rank
sleeping, say) are not: nothing says they wait for each other.

Both watchdogs keep one: the launcher's (`watchdog.py`, every rank of a run on this machine)
and a torchrun job's node watchdog (`launching/node_ranks.py`, one node's ranks, whose
statuses rank 0's node judges together in `launching/jobwide.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from verify.watching.procstat import CpuMeter


class Stillness:
    """Per rank: since when it has been still, and whether it is blocked inside torch.

    Args:
        ask: `ask(rank, ask_first)` returns whether the rank's main thread is blocked inside
            torch (None: no answer yet), asking the rank first when `ask_first` is True; None
            asks nobody (then no rank ever reads as blocked).
        ask_after_s: how long a rank must have been still before it is asked.
    """

    def __init__(self, ask: Callable[[int, bool], bool | None] | None, ask_after_s: float) -> None:
        self.ask = ask
        self.ask_after_s = ask_after_s
        self._since: dict[int, tuple[float, float]] = {}  # rank -> (monotonic, wall)
        self._asked: set[int] = set()

    def sample(self, rank: int, meter: CpuMeter | None, now: float) -> None:
        """After `meter` (the rank's, sampled at monotonic `now`) read the rank's CPU: a
        rank that works ends its still spell; one that has been still long enough is
        asked where it is."""
        quiet = meter.quiet_since() if meter is not None else None
        if quiet is None:
            self.drop(rank)
            return
        if rank not in self._since:
            self._since[rank] = (quiet, time.time() - (now - quiet))
        if self.ask is not None and rank not in self._asked:
            if now - self._since[rank][0] >= self.ask_after_s:
                self._asked.add(rank)
                self.ask(rank, True)

    def drop(self, rank: int) -> None:
        """The rank works, or has exited: its still spell is over."""
        self._since.pop(rank, None)
        self._asked.discard(rank)

    def moved(self) -> None:
        """A collective was issued or completed somewhere: ask again where the ranks are."""
        self._asked.clear()

    def still_s(self, rank: int, now: float) -> float | None:
        """How long the rank has been still at monotonic `now` (None: it is not)."""
        since = self._since.get(rank)
        return None if since is None else now - since[0]

    def since_wall(self, rank: int) -> float | None:
        """Wall clock at which the rank's still spell began (None: it is not still)."""
        since = self._since.get(rank)
        return None if since is None else since[1]

    def blocked(self, rank: int) -> bool | None:
        """Whether the still rank's main thread is blocked inside torch (None: not asked
        yet, or no answer yet)."""
        if self.ask is None or rank not in self._asked:
            return None
        return self.ask(rank, False)
