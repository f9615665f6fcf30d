"""The detection matrix: is every deliberately broken implementation caught by its check?

`run_detection()` runs each faulty implementation of `impls.faulty` on the behaviours where
its bug shows, and says whether the check its docstring names caught it. The races on async
collectives (`impls/faulty/race_faults.py`) run under the race sanitizer, as their catalogue
entry says: on a CPU they would pass most runs without it. The controls (the
built-ins and PyTorch's references) run on the same behaviours and must pass every check:
a tool that flags them raises false alarms, the worst defect it can have.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from verify.checks.behaviours import BEHAVIOUR
from verify.checks.cells import CHECKS, CellResult
from verify.checks.matrix import CERTIFIED, Cell, MatrixOptions, MatrixResult, run_plan
from verify.checks.verdict import Verdicted
from verify.options import PlacementOptions, ThreadOptions, knob

if TYPE_CHECKING:
    from impls.faulty import Fault


@dataclass(frozen=True, kw_only=True)
class DetectionOptions(ThreadOptions, PlacementOptions):
    """Which faulty implementations, and whether the controls run beside them."""

    faults: tuple[str, ...] = knob(
        (), "a faulty:<name> implementation (repeat the flag; default: all)", flag="--fault",
        repeat=True,
    )  # fmt: skip
    controls: bool = knob(
        True, "skip running the built-ins and the references on the same behaviours",
        negate="--no-controls",
    )  # fmt: skip
    timeout_s: float = knob(
        600.0, "how long one launch may run once its ranks are up", flag="--timeout", unit="s",
        positive=True,
    )  # fmt: skip
    backend: str = knob(
        "gloo", "gloo (CPU) or nccl (one GPU per rank; rows wanting more ranks than GPUs are "
        "n/a)", choices=("gloo", "nccl"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        from impls.faulty import FAULTS

        unknown = [n for n in self.faults if n not in FAULTS]
        if unknown:
            raise ValueError(
                f"unknown faulty implementation {unknown[0]!r}; choose from {', '.join(FAULTS)}"
            )


@dataclass(frozen=True)
class Detection:
    """One faulty implementation: what each check said on the behaviours where it shows."""

    name: str
    bug: str
    symptom: str
    caught_by: str
    shows_on: tuple[str, ...]
    # per check: its result on the first of `shows_on` where it failed (else on the first)
    checks: dict[str, CellResult] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)  # per check: that behaviour's key

    @property
    def caught(self) -> bool:
        return self.checks[self.caught_by].failed


@dataclass(frozen=True)
class DetectionResult(Verdicted):
    """The detection matrix, and the controls: correct implementations run on the same
    behaviours, which must pass every check."""

    detections: tuple[Detection, ...]
    matrix: MatrixResult
    controls: tuple[str, ...] = ()

    @property
    def false_alarms(self) -> list[tuple[Cell, CellResult]]:
        return [
            (c, r) for c, r in self.matrix.results.items() if c[0] in self.controls and r.failed
        ]

    @property
    def verdict(self) -> str:
        """ "pass": every fault caught by its check, and no correct implementation flagged."""
        ok = all(d.caught for d in self.detections) and not self.false_alarms
        return "pass" if ok else "fault"

    def to_dict(self) -> dict:
        return {
            "check": "faults",
            "verdict": self.verdict,
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


def detect(options: DetectionOptions) -> DetectionResult:
    """`python -m verify faults`: the catalogue (or `options.faults`) with the controls."""
    return run_detection(
        options.faults,
        controls=CERTIFIED if options.controls else (),
        timeout_s=options.timeout_s,
        threads_per_rank=options.threads_per_rank,
        backend=options.backend,
        device=options.device,
    )


def run_detection(
    names: tuple[str, ...] = (),
    *,
    controls: tuple[str, ...] = (),
    control_rows: tuple[str, ...] | None = None,
    named_check_only: bool = False,
    timeout_s: float = 600.0,
    threads_per_rank: int | None = None,
    backend: str = "gloo",
    device: str | None = None,
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
        threads_per_rank=threads_per_rank,
        backend=backend,
        device=device,
        sanitize=False,  # which cells run sanitized is the catalogue's choice, below
        command="faults",
    )
    plan = [(c, BEHAVIOUR[k], CHECKS) for c in controls for k in control_rows]
    for f in faults:
        checks = (f.caught_by,) if named_check_only else CHECKS
        plan += [(f.name, BEHAVIOUR[k], checks) for k in f.shows_on]
    # Races are caught on every run under the sanitizer; the controls run sanitized beside
    # them, so "no correct implementation is flagged" holds under it too.
    sanitized = {f.name for f in faults if f.sanitize}
    if sanitized:
        sanitized |= set(controls)
    matrix = run_plan(options, plan, frozenset(sanitized))
    detections = tuple(_detection(f, matrix) for f in faults)
    return DetectionResult(detections, matrix, tuple(controls))


def _detection(fault: Fault, matrix: MatrixResult) -> Detection:
    """What each check that ran on `fault` (a catalogue entry) said: its result on the first
    of the fault's behaviours where it failed, else on the first where it ran."""
    checks, where = {}, {}
    for check in CHECKS:
        found = [
            (k, matrix.results[(fault.name, k, check)])
            for k in fault.shows_on
            if (fault.name, k, check) in matrix.results
        ]
        if found:
            where[check], checks[check] = next((kr for kr in found if kr[1].failed), found[0])
    return Detection(
        fault.name, fault.bug, fault.symptom, fault.caught_by, fault.shows_on, checks, where
    )
