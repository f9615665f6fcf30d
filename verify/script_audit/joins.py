"""What PyTorch's `join()` tells the audit: does every rank take this step?

Under `with model.join():` (DDP's fix for uneven inputs, or `Join([model, optimizer])`), a
rank that runs out of data leaves its loop and *joins*: it takes no more steps, and its join
hooks shadow the collectives of the ranks still training (DDP's gradient all-reduces), so no
one hangs. The audit's own collectives at a step are not shadowed: a rank still training
must know, before it issues one, whether every rank takes this step, or it waits for a rank
that has joined. It cannot ask with a collective of its own (the joined rank never reaches
it), and a key in a store would race with the rank that is about to join.

So it reads the answer from a collective that join() already makes every rank reach. At each
forward the first joinable (DDP) calls `Join.notify_join_context`: an all-reduce of a 1 from
every rank still training, which every joined rank matches with a 0 (`Join.__exit__`'s
`_get_num_nonjoined_procs`, once per iteration of the ranks still training). Its result is
the number of ranks still training in this iteration, the same on every rank that reads it:
one number, whatever the world size. `Joins` wraps `notify_join_context` to keep the handle
of that all-reduce, and at a step waits for it (DDP's reducer already did, in backward) and
reads the count: every rank of the join's group -> a step every rank takes (audited);
fewer -> a step only the ranks still training take (counted for the report, never audited).

A joined rank may step too: `ZeroRedundancyOptimizer`'s join hook steps it once per
iteration of the others, to shadow its broadcasts. Such a step, taken inside `Join.__exit__`,
is the others' partial step seen from the joined rank: never audited, and not counted as a
step of the script.

A join whose first joinable is an optimizer (`Join([zero, model])`) notifies inside the
optimizer's step, after the audit's point before it: the audit cannot know in time, so the
steps inside such a join are counted, not audited; so are those inside a join over a process
group that is not the whole world (its count says nothing of the ranks outside it, which the
audit's group holds too). When a join exits, every rank has left
it: later steps are every rank's again. Without join() nothing changes (a rank that leaves
early without it is the watchdog's "left early" hang).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verify.patching import Patches

PARTIAL = "partial"  # a step only the ranks still training take: some rank has joined
UNSEEN = "unseen"  # a step in a join the audit cannot read in time: whether all take it unknown
SHADOW = "shadow"  # a joined rank's join hook steps the optimizer (ZeRO): not the script's step


class Joins:
    """The join contexts of the script, as the audit needs them (module docstring)."""

    def __init__(self) -> None:
        self._work = None  # the last notify all-reduce of a join's first joinable
        self._group = None  # its process group
        self._unseen = 0  # joins led by an optimizer, entered and not yet exited
        self._exiting = 0  # inside Join.__exit__: this rank has joined and shadows the others
        self.fewest: tuple[int, int] | None = None  # (ranks still training, of) at a partial step
        self._patches = Patches()

    def install(self) -> None:
        if not dist.is_available():  # a torch built without distributed: no join() to watch
            return
        from torch.distributed.algorithms.join import Join

        notify, enter, leave = Join.notify_join_context, Join.__enter__, Join.__exit__
        joins = self

        def notify_join_context(joinable):
            work = notify(joinable)
            if work is not None:
                joins._work, joins._group = work, joinable.join_process_group
            return work

        def __enter__(join):
            out = enter(join)
            joins._unseen += _led_by_optimizer(join)
            return out

        def __exit__(join, *exc):
            joins._exiting += 1
            try:
                return leave(join, *exc)
            finally:  # every rank has left this join: no count of it holds any longer
                joins._exiting -= 1
                joins._work = joins._group = None
                joins._unseen = max(0, joins._unseen - _led_by_optimizer(join))

        self._patches.apply(Join, "notify_join_context", staticmethod(notify_join_context))
        self._patches.apply(Join, "__enter__", __enter__)
        self._patches.apply(Join, "__exit__", __exit__)

    def remove(self) -> None:
        self._patches.restore()

    def step(self) -> str | None:
        """Before a step: None when every rank takes it, PARTIAL when some rank has joined,
        SHADOW when this rank has joined and its join hook steps, UNSEEN when the join cannot
        tell in time (led by an optimizer, or over a subgroup). Every rank still training
        answers alike: the count is the result of one all-reduce they all took part in."""
        if self._exiting:
            return SHADOW
        if self._unseen:
            return UNSEEN
        work, group = self._work, self._group
        if work is None:
            return None
        size = dist.get_world_size(group)
        if size != dist.get_world_size():  # a count of a subgroup says nothing of the others
            return UNSEEN
        work.wait()  # done already when DDP's backward ran; the joined ranks shadow it anyway
        try:  # its future's value, not `Work.result()` (deprecated: torch warns on stderr)
            count = int(work.get_future().value()[0].item())
        except (RuntimeError, IndexError, TypeError):  # a backend that keeps no result
            return UNSEEN
        if count >= size:
            return None
        if self.fewest is None or count < self.fewest[0]:
            self.fewest = (count, size)
        return PARTIAL


def _led_by_optimizer(join) -> bool:
    """An enabled join whose first joinable (the one that notifies) is an optimizer. Read from
    torch's private fields, never failing the script's `with` if they change."""
    try:
        return bool(join._enable) and isinstance(join._joinables[0], torch.optim.Optimizer)
    except (AttributeError, IndexError, TypeError):
        return False
