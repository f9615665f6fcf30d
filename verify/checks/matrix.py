"""The certification matrix: every check on every behaviour, and the detection matrix.

`run_matrix(MatrixOptions(impls=...))` judges implementations on every behaviour of
`BEHAVIOURS` (rows) with every check (columns: consistency, equivalence, and the shard check
for sharded optimizers; see `cells.py`). A behaviour an implementation does not offer (a
wrapper without `no_sync()`, bucket sizes for one without `bucket_size_mb`) is "not
claimed"; one that does not apply (a sharded-optimizer row for a DDP wrapper) is "n/a".
Neither is a pass.

`run_detection()` runs each faulty implementation of `impls.faulty` on the behaviours where
its bug shows, and says whether the check its docstring names caught it.

How it stays fast: one launch per world size runs every cell of that size, one after the other
in the same ranks (spawning costs seconds; a cell costs tens of milliseconds). Rank 0 writes
each cell's result to a journal as soon as every rank agrees on it. When a cell makes the
launch fail (a rank raised, crashed, or the run hung), the journal says which cells finished
and which one was running: that one is recorded as a fault with the launcher's diagnosis, and
the remaining cells run in a fresh launch, so one broken behaviour never hides the others.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from impls.registry import REGISTRY, resolve
from verify.checks.cells import CHECKS, Behaviour, CheckResult, not_applicable, run_check_on_rank
from verify.launching import RankContext, launch

BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(key="world-1", title="world size 1", world_size=1),
    Behaviour(key="world-2", title="world size 2", world_size=2),
    Behaviour(key="world-3", title="world size 3", world_size=3),
    Behaviour(key="world-4", title="world size 4", world_size=4),
    Behaviour(key="frozen", title="frozen parameters", workload="frozen"),
    Behaviour(key="tied", title="tied weights", workload="tied"),
    Behaviour(
        key="unused-everywhere",
        title="parameters unused on all ranks / in some steps",
        workload="unused",
    ),
    Behaviour(
        key="used-on-one-rank",
        title="a parameter used on one rank only (3 ranks)",
        workload="unused",
        world_size=3,
    ),
    Behaviour(key="buffers", title="buffers", workload="buffers"),
    Behaviour(key="no-sync", title="no_sync() accumulation (2 micro-batches)", accumulate=2),
    Behaviour(
        key="no-sync-unused",
        title="no_sync() with a branch used in one micro-batch",
        workload="unused",
        accumulate=2,
    ),
    Behaviour(
        key="keep-grads",
        title="zero_grad(set_to_none=False)",
        workload="unused",
        set_to_none=False,
    ),
    # Bucket sizes on the routed model: buckets that mix used and unused parameters, and (at
    # 4.5 KB) a bucket whose members' gradients do not arrive in reverse registration order.
    Behaviour(key="one-bucket", title="one bucket (25 MB)", workload="unused", bucket_mb=25.0),
    Behaviour(
        key="bucket-per-param",
        title="one bucket per parameter",
        workload="unused",
        bucket_mb=1e-9,
    ),
    Behaviour(
        key="several-buckets",
        title="several multi-parameter buckets (4.5 KB)",
        workload="unused",
        bucket_mb=0.0045,
    ),
    Behaviour(key="bf16", title="a bf16 model", workload="bf16"),
    # The sharded optimizer's own behaviours (every row above already has two groups).
    Behaviour(
        key="param-groups",
        title="parameter groups over 3 ranks (lr, decay)",
        world_size=3,
        sharded_only=True,
    ),
    Behaviour(
        key="add-param-group",
        title="add_param_group after construction",
        add_param_group=True,
        sharded_only=True,
    ),
    Behaviour(key="scheduler", title="an LR scheduler (StepLR)", scheduler=True, sharded_only=True),
    Behaviour(
        key="round-trip",
        title="optimizer state_dict round trip",
        round_trip=True,
        sharded_only=True,
    ),
    Behaviour(
        key="more-ranks-than-params",
        title="more ranks than parameters (3 tensors, 4 ranks)",
        workload="tied",
        world_size=4,
        sharded_only=True,
    ),
)
BEHAVIOUR = {b.key: b for b in BEHAVIOURS}
#: what `--impl all` certifies: the built-ins and PyTorch's references
CERTIFIED = tuple(n for n, i in REGISTRY.items() if i.source in ("builtin", "reference"))


@dataclass(frozen=True, kw_only=True)
class MatrixOptions:
    """Which implementations, behaviours (keys of BEHAVIOUR; empty: all) and checks to run.

    `timeout_s` bounds one launch (every cell of one world size) once its ranks are up.
    """

    impls: tuple[str, ...]
    rows: tuple[str, ...] = ()
    checks: tuple[str, ...] = CHECKS
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.impls:
            raise ValueError("no implementation given")
        for name in self.impls:
            resolve(name)  # raises ImplError (a ValueError) naming the problem
        unknown = [r for r in self.rows if r not in BEHAVIOUR]
        if unknown:
            raise ValueError(
                f"unknown behaviour {unknown[0]!r}; choose from {', '.join(BEHAVIOUR)}"
            )
        if any(c not in CHECKS for c in self.checks):
            raise ValueError(f"checks must be among {', '.join(CHECKS)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def behaviours(self) -> tuple[Behaviour, ...]:
        return tuple(BEHAVIOUR[r] for r in self.rows) if self.rows else BEHAVIOURS


Cell = tuple[str, str, str]  # (implementation, behaviour key, check)


@dataclass(frozen=True)
class MatrixResult:
    """Every cell's result; `passed` when no cell failed (not claimed and n/a are not fails)."""

    options: MatrixOptions
    results: dict[Cell, CheckResult]
    elapsed_s: float
    launches: int

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.results.values())

    def result(self, impl: str, key: str, check: str) -> CheckResult:
        return self.results[(impl, key, check)]

    def checks_for(self, impl: str) -> tuple[str, ...]:
        """The columns worth showing: the shard check only for sharded optimizers."""
        sharded = resolve(impl).sharded
        return tuple(c for c in self.options.checks if c != "shard" or sharded)

    def to_dict(self) -> dict:
        return {
            "check": "matrix",
            "passed": self.passed,
            "elapsed_s": self.elapsed_s,
            "launches": self.launches,
            "options": asdict(self.options),
            "cells": [
                {"impl": i, "behaviour": k, "check": c, **asdict(r)}
                for (i, k, c), r in self.results.items()
            ],
        }


def run_matrix(options: MatrixOptions) -> MatrixResult:
    """Run every (implementation, behaviour, check) cell; failures come back as results."""
    return _run_matrix(
        options, [(i, b, options.checks) for i in options.impls for b in options.behaviours]
    )


def _run_matrix(
    options: MatrixOptions, plan: list[tuple[str, Behaviour, tuple[str, ...]]]
) -> MatrixResult:
    """Run the checks `plan` names for each (implementation, behaviour), in its order."""
    start = time.perf_counter()
    results: dict[Cell, CheckResult] = {}
    pending: list[Cell] = []
    for impl, b, checks in plan:
        for check in checks:
            why = not_applicable(resolve(impl), b, check)  # decided here: no launch needed
            if why:
                results[(impl, b.key, check)] = CheckResult("n/a", why)
            else:
                pending.append((impl, b.key, check))
    sizes = sorted({BEHAVIOUR[k].world_size for _, k, _ in pending})
    groups = [[c for c in pending if BEHAVIOUR[c[1]].world_size == n] for n in sizes]
    # The world sizes run side by side: a launch spends much of its time starting interpreters
    # and waiting on sockets, which overlaps well even on two cores.
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        runs = [
            pool.submit(_run_cells, cells, n, options.timeout_s) for cells, n in zip(groups, sizes)
        ]
        launches = 0
        for run in runs:
            done, count = run.result()
            results.update(done)
            launches += count
    ordered = {(i, b.key, c): results[(i, b.key, c)] for i, b, checks in plan for c in checks}
    return MatrixResult(options, ordered, time.perf_counter() - start, launches)


def _run_cells(
    cells: list[Cell], world_size: int, timeout_s: float
) -> tuple[dict[Cell, CheckResult], int]:
    """Run `cells` in as few launches as failures allow: their results, and the launches."""
    results: dict[Cell, CheckResult] = {}
    launches = 0
    while cells:
        launches += 1
        with tempfile.TemporaryDirectory(prefix="ddp-verify-matrix-") as journal:
            run = launch(
                run_cells_on_rank, world_size=world_size, args=(cells, journal), timeout_s=timeout_s
            )
            done = _read_journal(journal, len(cells))
        results.update(zip(cells, done))
        if run.ok or len(done) == len(cells):  # (a rank may also fail after the last cell)
            assert len(done) == len(cells), "every rank returned, so every cell was journaled"
            break
        # The cell that was running when the launch failed is the one that broke it.
        broken = cells[len(done)]
        results[broken] = CheckResult("fail", run.summary(), run.elapsed_s)
        # The same implementation's other cells are the likeliest to break the next launch
        # too: run them last, so a crash there ends a launch with nothing left to rerun.
        rest = cells[len(done) + 1 :]
        cells = [c for c in rest if c[0] != broken[0]] + [c for c in rest if c[0] == broken[0]]
    return results, launches


def run_cells_on_rank(ctx: RankContext, cells: list[Cell], journal: str) -> None:
    """Run `cells` one after the other; rank 0 journals each result as soon as it is known
    (every rank computes the same result, so rank 0's is everyone's)."""
    for index, (impl, key, check) in enumerate(cells):
        start = time.perf_counter()
        result = run_check_on_rank(ctx, impl, BEHAVIOUR[key], check)
        result = CheckResult(result.status, result.detail, time.perf_counter() - start)
        if ctx.rank == 0:
            path = os.path.join(journal, f"{index}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(result, f)
            os.replace(path + ".tmp", path)  # complete or absent, never half-written


def _read_journal(journal: str, count: int) -> list[CheckResult]:
    """The results of the cells that finished, in order (they finish in order)."""
    done = []
    for index in range(count):
        path = os.path.join(journal, f"{index}.pkl")
        if not os.path.exists(path):
            break
        with open(path, "rb") as f:
            done.append(pickle.load(f))
    return done


# --- the detection matrix ------------------------------------------------------------------


@dataclass(frozen=True)
class Detection:
    """One faulty implementation: what each check said on the behaviours where it shows."""

    name: str
    bug: str
    symptom: str
    caught_by: str
    shows_on: tuple[str, ...]
    # per check: its result on the first of `shows_on` where it failed (else on the first)
    checks: dict[str, CheckResult] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # per check: that behaviour's key

    @property
    def caught(self) -> bool:
        return self.checks[self.caught_by].failed


@dataclass(frozen=True)
class DetectionResult:
    """The detection matrix, and the controls: correct implementations run on the same
    behaviours, which must pass every check."""

    detections: tuple[Detection, ...]
    matrix: MatrixResult
    controls: tuple[str, ...] = ()

    @property
    def false_alarms(self) -> list[tuple[Cell, CheckResult]]:
        return [
            (c, r) for c, r in self.matrix.results.items() if c[0] in self.controls and r.failed
        ]

    @property
    def passed(self) -> bool:
        """Every fault caught by its check, and no correct implementation flagged."""
        return all(d.caught for d in self.detections) and not self.false_alarms

    def to_dict(self) -> dict:
        return {
            "check": "faults",
            "passed": self.passed,
            "elapsed_s": self.matrix.elapsed_s,
            "launches": self.matrix.launches,
            "faults": [
                {
                    **{k: v for k, v in asdict(d).items() if k != "checks"},
                    "caught": d.caught,
                    "checks": {c: asdict(r) for c, r in d.checks.items()},
                }
                for d in self.detections
            ],
            "controls": list(self.controls),
            "false_alarms": [
                {"impl": i, "behaviour": k, "check": c, **asdict(r)}
                for (i, k, c), r in self.false_alarms
            ],
        }


def run_detection(
    names: tuple[str, ...] = (),
    *,
    controls: tuple[str, ...] = (),
    control_rows: tuple[str, ...] | None = None,
    named_check_only: bool = False,
    timeout_s: float = 600.0,
) -> DetectionResult:
    """Run each faulty implementation (all, or `names`) on the behaviours where it shows, and
    the `controls` (correct implementations) on `control_rows` (default: all of those
    behaviours), in one matrix: the controls share the faults' launches.

    The faults run every check, or with `named_check_only` only the one that must catch them
    (fewer cells, and a fault that crashes its launch does it once). The controls run first:
    a fault that crashes a launch then leaves few cells to rerun.
    """
    from impls.faulty import FAULTS

    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faulty implementation {unknown[0]!r}; see `verify faults`")
    faults = [FAULTS[n] for n in names] if names else list(FAULTS.values())
    rows = tuple(dict.fromkeys(k for f in faults for k in f.shows_on))
    control_rows = rows if control_rows is None else control_rows
    options = MatrixOptions(
        impls=tuple(controls) + tuple(f.name for f in faults),
        rows=tuple(dict.fromkeys(rows + control_rows)),
        timeout_s=timeout_s,
    )
    plan = [(c, BEHAVIOUR[k], CHECKS) for c in controls for k in control_rows]
    for f in faults:
        checks = (f.caught_by,) if named_check_only else CHECKS
        plan += [(f.name, BEHAVIOUR[k], checks) for k in f.shows_on]
    matrix = _run_matrix(options, plan)
    detections = []
    for f in faults:
        checks, where = {}, {}
        for check in CHECKS:
            found = [
                (k, matrix.results[(f.name, k, check)])
                for k in f.shows_on
                if (f.name, k, check) in matrix.results
            ]
            if found:
                where[check], checks[check] = next((kr for kr in found if kr[1].failed), found[0])
        detections.append(
            Detection(f.name, f.bug, f.symptom, f.caught_by, f.shows_on, checks, where)
        )
    return DetectionResult(tuple(detections), matrix, tuple(controls))
