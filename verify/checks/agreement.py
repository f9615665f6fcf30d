"""Ranks agree on the outcome of every unit of work before any of them starts the next.

The certification matrix runs many cells one after the other in the same ranks
(`matrix.py`). Most outcomes are reached by collectives, so every rank reaches the same one.
Two are decided by a rank alone: the class under test refused to be constructed on this rank
(`InterfaceError`), or does not claim the behaviour. A constructor that raises on *some* ranks
only (a ZeRO-1 that builds its inner optimizer from an empty list on a rank owning no
parameter) is the commonest bug of sharded optimizers, not an interface problem. If that rank
took its refusal as the cell's outcome and started the next cell, its peers, still training
this cell, would pair their collectives with the next cell's: a hang inside PyTorch's C++
collectives that the trace cannot see, or worse, wrong numbers.

So every cell ends with `CellAgreement.agree(index, outcome)` on every rank:

1. A rank whose outcome it decided alone (a refusal) first journals it (`raised` file), so
   that if its peers never arrive, the parent can still say who raised what and where.
2. Every rank contributes a fixed-size digest of its outcome to one MAX all-reduce of
   `[digest, ~digest]` (the max of `~d` is `~min(d)`: min and max in one reduction, whose
   size does not grow with the world size) on a gloo group of the tool's own, created before
   the first cell. The tool's collectives never enter the class's collective stream, so they
   can never pair with one of its collectives.
3. Equal digests: every rank holds the same outcome. Different ones: the outcomes are
   gathered (only then, and only on the tool's group) and merged, identically on every rank:
   some ranks refused and others did not is a fault of the class ("only rank 2 raised ...");
   ranks that found different things (the race sanitizer's findings are per rank) fail with
   every distinct finding.

A rank whose peers never arrive (they wait for it inside the cell's collectives) waits in the
agreement's traced all-reduce, so the evidence watchdog calls the hang at the stall timeout
and the matrix reads the journaled refusal as the cell's fault.
"""

from __future__ import annotations

import datetime
import os
import pickle
import zlib

import torch
import torch.distributed as dist

from verify.checks.cells import CellResult
from verify.checks.verdict import Refusal, only_some_text, raised_on_some
from verify.hints.table import Situation, with_hints
from verify.replica_audit.group import min_max


def raised_path(journal: str, index: int, rank: int) -> str:
    return os.path.join(journal, f"{index}.raised.{rank}.pkl")


def read_raised(journal: str, index: int, world_size: int) -> list[Refusal]:
    """The refusals journaled for cell `index` by ranks whose peers may never have agreed."""
    found = []
    for rank in range(world_size):
        try:
            with open(raised_path(journal, index, rank), "rb") as f:
                found.append(pickle.load(f))
        except OSError:
            continue
    return found


def only_some_raised(raised: list[Refusal], world_size: int) -> CellResult:
    """The cell's fault when the `raised` ranks refused and the others went on."""
    found = with_hints([raised_on_some(raised, world_size)], Situation(world_size))
    return CellResult("fail", only_some_text(raised, world_size), findings=found)


class CellAgreement:
    """The tool's own channel for agreeing on each cell (module docstring). Construct it on
    every rank, before the first cell: creating the group is a collective of the world."""

    def __init__(self, rank: int, world_size: int, journal: str, timeout_s: float) -> None:
        self.rank, self.world_size, self.journal = rank, world_size, journal
        self.group = None
        if world_size > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def agree(self, index: int, outcome: CellResult | Refusal) -> CellResult:
        """The outcome of cell `index` every rank agrees on (a collective of the tool's
        group: every rank, once per cell, in order)."""
        if isinstance(outcome, Refusal):
            path = raised_path(self.journal, index, self.rank)
            with open(path + ".tmp", "wb") as f:
                pickle.dump(outcome, f)
            os.replace(path + ".tmp", path)
        if self.group is None:
            return _as_result(outcome)
        digest = zlib.crc32(pickle.dumps(_key(outcome)))
        low, high = min_max(torch.tensor([digest]), self.group)
        if bool((low == high).all()):  # every rank holds this outcome
            return _as_result(outcome)
        outcomes: list = [None] * self.world_size
        dist.all_gather_object(outcomes, outcome, group=self.group)
        return merge(outcomes)


def _key(outcome: CellResult | Refusal) -> tuple:
    if isinstance(outcome, Refusal):
        return ("refused", outcome.message)
    return (outcome.status, outcome.detail)


def _as_result(outcome: CellResult | Refusal) -> CellResult:
    """An outcome every rank shares: a refusal made alike everywhere is the class's."""
    if isinstance(outcome, Refusal):
        return CellResult("refused", outcome.message, where=outcome.reason)
    return outcome


def merge(outcomes: list[CellResult | Refusal]) -> CellResult:
    """One result from outcomes that differ between ranks (module docstring, step 3)."""
    raised = [o for o in outcomes if isinstance(o, Refusal)]
    if len(raised) == len(outcomes):  # every rank refused, in different words: the first
        return _as_result(raised[0])
    if raised:
        return only_some_raised(raised, len(outcomes))
    failed = [o for o in outcomes if o.failed]
    if not failed:  # the same verdict in other words (timings in the text): rank 0's
        statuses = {o.status for o in outcomes}
        if len(statuses) == 1:
            return outcomes[0]
        detail = "; ".join(f"rank {r}: {o.status} ({o.detail})" for r, o in enumerate(outcomes))
        return CellResult("fail", f"the ranks reached different outcomes: {detail}")
    lines = list(dict.fromkeys(line for o in failed for line in o.detail.splitlines()))
    where = next((o.where for o in failed if o.where), None)
    found = tuple(dict.fromkeys(f for o in failed for f in o.findings))
    seconds = max(o.seconds for o in outcomes)
    return CellResult("fail", "\n".join(lines), seconds, where, found)
