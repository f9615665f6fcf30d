"""The certification matrix: every check on every behaviour, for one or more implementations.

`run_matrix(MatrixOptions(impls=...))` judges implementations on every behaviour of
`behaviours.BEHAVIOURS` (rows) with every check (columns: consistency, equivalence, and the
shard check for sharded optimizers; see `cells.py`). A behaviour an implementation does not
offer is "not claimed"; one that does not apply is "n/a". Neither is a pass. Every cell runs
under the race sanitizer unless `sanitize=False` (`--no-sanitize`): a race must not make a
verdict depend on timing (`sanitizing.py`).

How it stays fast: one launch per world size runs every cell of that size, one after the other
in the same ranks (spawning costs seconds; a cell costs tens of milliseconds), and the world
sizes run side by side. The ranks agree on each cell's result before any starts the next
(`agreement.py`: a class that raised on some ranks only is a fault, never one rank's
refusal), and rank 0 writes it to a journal. When a cell makes the launch fail (a rank
raised, crashed, or the run hung: every launch is watched), the journal says which cells
finished and which one was running: that one is recorded as a fault with the launcher's
diagnosis (or, when some ranks refused it alone, who raised what and where), and the
remaining cells run in a fresh launch, so one broken behaviour never hides the others.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from impls.registry import names, resolve
from verify import progress
from verify.checks.agreement import CellAgreement, only_some_raised, read_raised
from verify.checks.behaviours import BEHAVIOUR, BEHAVIOURS, Behaviour
from verify.checks.cells import CHECKS, CellResult, not_applicable, run_cell_on_rank
from verify.checks.failures import failure_findings
from verify.checks.options import CHECK_KINDS
from verify.checks.verdict import FAULT, NOTHING, PASS, TIMEOUT, Verdicted
from verify.hints.table import situation_of
from verify.launching import DEFAULT_STALL_TIMEOUT_S, RankContext, check_interrupted, launch
from verify.launching.gpus import visible as gpus_visible
from verify.options import PlacementOptions, ThreadOptions, knob, launch_knobs

#: what `--impl all` certifies: the built-ins and PyTorch's references
CERTIFIED = tuple(names({"builtin", "reference"}))
Cell = tuple[str, str, str]  # (implementation, behaviour key, check)
# The tool's agreement group never times out first: the watchdog calls a rank that waits in
# it for peers that never come (they wait for it inside the cell) at the stall timeout.
_AGREEMENT_TIMEOUT_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class MatrixOptions(ThreadOptions, PlacementOptions):
    """Which implementations, behaviours and checks; see the module docstring."""

    impls: tuple[str, ...] = knob(
        (), "an implementation (as for consistency), or 'all' for the built-ins and the PyTorch "
        "references; repeat the flag for several", flag="--impl", repeat=True,
    )  # fmt: skip
    rows: tuple[str, ...] = knob(
        (), "behaviours to run, comma-separated (default: all): " + ", ".join(BEHAVIOUR)
    )
    checks: tuple[str, ...] = knob(CHECKS, "checks to run, comma-separated")
    timeout_s: float = knob(
        600.0, "how long one launch (every cell of one world size) may run once its ranks are up",
        flag="--timeout", unit="s", positive=True,
    )  # fmt: skip
    same_init: bool = knob(False, "every rank builds the model from the same seed")
    stall_timeout_s: float = knob(
        DEFAULT_STALL_TIMEOUT_S, "seconds with no collective progress, while a rank waits and "
        "none works, that make a hang (a cell that hangs fails within it)",
        flag="--stall-timeout", unit="s", positive=True,
    )  # fmt: skip
    backend: str = knob(
        "gloo", "gloo (CPU) or nccl (one GPU per rank; rows wanting more ranks than GPUs are "
        "n/a)", choices=("gloo", "nccl"),
    )  # fmt: skip
    # On by default, as in consistency and equivalence: without it a race makes the verdicts
    # vary from run to run (cells pass or fail by timing, with hints that point elsewhere);
    # under it every race is named and changes the numbers the same way on every run.
    sanitize: bool = knob(
        True, "skip the race check on async collectives in every cell (docs/races.md): a racy "
        "class's cells then pass or fail by timing, and the race is never named",
        negate="--no-sanitize",
        affirm="check async collectives for races in every cell (the default; docs/races.md)",
    )  # fmt: skip
    command: str = knob("matrix", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.impls:
            raise ValueError("the following arguments are required: --impl")
        for name in self.impl_names:
            resolve(name, kinds=CHECK_KINDS, command=self.command)
        unknown = [r for r in self.rows if r not in BEHAVIOUR]
        if unknown:
            raise ValueError(
                f"unknown behaviour {unknown[0]!r}; choose from {', '.join(BEHAVIOUR)}"
            )
        if any(c not in CHECKS for c in self.checks):
            raise ValueError(f"checks must be among {', '.join(CHECKS)}")

    @property
    def impl_names(self) -> tuple[str, ...]:
        """`impls` with 'all' expanded, each once."""
        out = [n for name in self.impls for n in (CERTIFIED if name == "all" else (name,))]
        return tuple(dict.fromkeys(out))

    @property
    def behaviours(self) -> tuple[Behaviour, ...]:
        return tuple(BEHAVIOUR[r] for r in self.rows) if self.rows else BEHAVIOURS


@dataclass(frozen=True)
class MatrixResult(Verdicted):
    """Every cell's result; "pass" when no cell failed (not claimed and n/a are not fails)."""

    options: MatrixOptions
    results: dict[Cell, CellResult]
    elapsed_s: float
    launches: int

    @property
    def verdict(self) -> str:
        """ "fault" if a cell failed; else "timeout" if a launch ran out of time before some
        cell could decide; else "pass" if some cell passed (not claimed and n/a are not
        fails); else "nothing certified" (exit 2: not a pass either)."""
        if any(r.failed for r in self.results.values()):
            return FAULT
        if any(r.status == "timeout" for r in self.results.values()):
            return TIMEOUT
        if not any(r.status == "pass" for r in self.results.values()):
            return NOTHING
        return PASS

    def result(self, impl: str, key: str, check: str) -> CellResult:
        return self.results[(impl, key, check)]

    def checks_for(self, impl: str) -> tuple[str, ...]:
        """The columns worth showing: the shard check only for sharded optimizers."""
        sharded = resolve(impl).sharded
        return tuple(c for c in self.options.checks if c != "shard" or sharded)

    def to_dict(self) -> dict:
        return {
            "check": "matrix",
            "verdict": self.verdict,
            "passed": self.passed,
            "elapsed_s": self.elapsed_s,
            "launches": self.launches,
            "options": asdict(self.options),
            "cells": [
                {"impl": i, "behaviour": k, "check": c, **asdict(r), "headline": r.headline}
                for (i, k, c), r in self.results.items()
            ],
        }


def run_matrix(options: MatrixOptions) -> MatrixResult:
    """Run every (implementation, behaviour, check) cell; failures come back as results."""
    plan = [(i, b, options.checks) for i in options.impl_names for b in options.behaviours]
    return run_plan(options, plan)


def run_plan(
    options: MatrixOptions,
    plan: list[tuple[str, Behaviour, tuple[str, ...]]],
    sanitized: frozenset[str] = frozenset(),
):
    """Run the checks `plan` names for each (implementation, behaviour), in its order; the
    implementations in `sanitized` (every one with `options.sanitize`) under the race
    sanitizer."""
    if options.sanitize:
        sanitized = frozenset(options.impl_names) | sanitized
    start = time.perf_counter()
    results: dict[Cell, CellResult] = {}
    pending: list[Cell] = []
    gpus = gpus_visible() if options.backend == "nccl" else 0
    for impl, b, checks in plan:
        for check in checks:
            why = not_applicable(resolve(impl), b, check)  # decided here: no launch needed
            if why is None and options.backend == "nccl" and b.world_size > gpus:
                why = f"{b.world_size} ranks need {b.world_size} GPUs for nccl ({gpus} here)"
            if why:
                results[(impl, b.key, check)] = CellResult("n/a", why)
            else:
                pending.append((impl, b.key, check))
    sizes = sorted({BEHAVIOUR[k].world_size for _, k, _ in pending})
    groups = [[c for c in pending if BEHAVIOUR[c[1]].world_size == n] for n in sizes]
    # The world sizes run side by side: a launch spends much of its time starting interpreters
    # and waiting on sockets, which overlaps well even on two cores. Their ranks share the
    # machine's threads.
    at_once = sum(sizes)
    launches = 0
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        runs = [
            pool.submit(_run_cells, cells, n, options, at_once, sanitized)
            for cells, n in zip(groups, sizes)
        ]
        for run in runs:
            done, count = run.result()
            results.update(done)
            launches += count
    _settle_refusals(results)
    ordered = {(i, b.key, c): results[(i, b.key, c)] for i, b, checks in plan for c in checks}
    return MatrixResult(options, ordered, time.perf_counter() - start, launches)


def _settle_refusals(results: dict[Cell, CellResult]) -> None:
    """A user's class the tool cannot construct in any cell cannot be certified: a usage
    error. One that refuses some behaviours only, or a registered implementation (PyTorch's
    ZeroRedundancyOptimizer and a model of several dtypes), does not claim them."""
    for impl in dict.fromkeys(i for i, _, _ in results):
        cells = [(c, r) for c, r in results.items() if c[0] == impl and r.status != "n/a"]
        refused = [(c, r) for c, r in cells if r.status == "refused"]
        if refused and len(refused) == len(cells) and resolve(impl).kind == "user":
            raise ValueError(refused[0][1].detail)
        for cell, r in refused:
            results[cell] = CellResult("not claimed", f"the class refused it: {r.where}")


def _run_cells(cells: list[Cell], world_size: int, options: MatrixOptions, at_once: int, sanitized):
    """Run `cells` in as few launches as failures allow: their results, and the launches."""
    results: dict[Cell, CellResult] = {}
    launches = 0
    while cells:
        check_interrupted()
        launches += 1
        with tempfile.TemporaryDirectory(prefix="ddp-verify-matrix-") as journal_dir:
            run = launch(
                run_cells_on_rank,
                world_size=world_size,
                args=(cells, journal_dir, options.same_init, sanitized, options.command),
                **launch_knobs(options),
                ranks_at_once=at_once,
            )
            done = _read_journal(journal_dir, len(cells))
            raised = read_raised(journal_dir, len(done), world_size)
        results.update(zip(cells, done))
        if run.ok or len(done) == len(cells):  # (a rank may also fail after the last cell)
            assert len(done) == len(cells), "every rank returned, so every cell was journaled"
            break
        # The cell that was running when the launch failed is the one that broke it.
        broken = cells[len(done)]
        rest = cells[len(done) + 1 :]
        if raised:  # some ranks refused it alone and waited for the others, who never came
            results[broken] = replace(only_some_raised(raised, world_size), seconds=run.elapsed_s)
            # The other checks of this behaviour construct and drive the class exactly alike
            # (the check only adds the tool's hooks): the same ranks would raise the same way,
            # and each would cost another stall timeout to find out.
            same = [c for c in rest if c[:2] == broken[:2]]
            for cell in same:
                detail = f"{results[broken].detail} (as in the {broken[2]} cell of this row)"
                results[cell] = replace(results[broken], detail=detail, seconds=0.0)
            rest = [c for c in rest if c not in same]
        else:
            root = run.first_failure
            where = root.where() if root is not None else None
            status = "timeout" if run.timed_out else "fail"  # out of time is no verdict
            found = failure_findings(run, situation_of(BEHAVIOUR[broken[1]]))
            results[broken] = CellResult(status, run.summary(), run.elapsed_s, where or None, found)
        # The same implementation's other cells are the likeliest to break the next launch
        # too: run them last, so a crash there ends a launch with nothing left to rerun.
        cells = [c for c in rest if c[0] != broken[0]] + [c for c in rest if c[0] == broken[0]]
    return results, launches


def run_cells_on_rank(
    ctx: RankContext,
    cells: list[Cell],
    journal: str,
    same_init: bool,
    sanitized: frozenset,
    label: str = "matrix",
) -> None:
    """Run `cells` one after the other; the ranks agree on each cell's result before any
    starts the next (`agreement.py`), and rank 0 journals it as soon as it is known."""
    agreement = CellAgreement(ctx.rank, ctx.world_size, journal, _AGREEMENT_TIMEOUT_S)
    for index, (impl, key, check) in enumerate(cells):
        if ctx.rank == 0:
            progress.say(f"{label}, world size {ctx.world_size}: cell ", index + 1, len(cells),
                     f": {impl} / {key} / {check}")  # fmt: skip
        start = time.perf_counter()
        result = run_cell_on_rank(
            ctx, impl, BEHAVIOUR[key], check, same_init, sanitize=impl in sanitized
        )
        result = agreement.agree(index, result)
        result = replace(result, seconds=time.perf_counter() - start)
        if ctx.rank == 0:
            path = os.path.join(journal, f"{index}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(result, f)
            os.replace(path + ".tmp", path)  # complete or absent, never half-written


def _read_journal(journal: str, count: int) -> list[CellResult]:
    """The results of the cells that finished, in order (they finish in order)."""
    done = []
    for index in range(count):
        path = os.path.join(journal, f"{index}.pkl")
        if not os.path.exists(path):
            break
        with open(path, "rb") as f:
            done.append(pickle.load(f))
    return done
