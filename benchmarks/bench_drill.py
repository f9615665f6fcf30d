"""What `compare --drill` costs (docs/compare.md, "The drill-down"): a drill-down of a 2-rank
run to the op level against the plain runs up to the departing step (goal: at most 3
times), and the capture's cost on the steps before the one drilled into (goal: nothing
beyond the plain re-run).

The script is tests/fixtures/drill_train.py: run B draws step K's dropout mask from another
seed, so B departs from A at step K. Each repeat times, in turns (the order rotates, so that
a slow moment of a shared machine does not always fall on one of them), each a fresh
process from start to exit, as a user waits:

    plain        A and B under torchrun alone, up to step K (K + 1 steps): no tool
    recorded     A and B under `audit --nproc 2 --record`, up to step K: the runs a user
                 records to compare
    drill        `compare --drill A B` of two recordings of N steps: two re-runs to step K,
                 step K captured op by op, compared

and, for the steps before: `drill late`, the drill-down of a pair that departs at the last
of N steps, against `recorded` runs of N steps (both audited and recorded: what differs is
the capture, which waits for step N - 1 and then captures one step). Wall time only: a
drill-down's re-runs fork their ranks from the tool's zygote, whose children are not reaped
into the caller's CPU count, so CPU seconds would undercount it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from verify.options import Options, knob

DRILL_GOAL = 3.0  # drill / plain runs up to the departing step
LATE_GOAL = 1.10  # drill at the last step / the recorded runs: the steps before cost nothing
SCRIPT = "tests/fixtures/drill_train.py"
FORMS = ("plain", "recorded", "drill", "recorded N", "drill late")


@dataclass(frozen=True, kw_only=True)
class DrillBenchOptions(Options):
    """How many repeats; the run's size and where it departs."""

    repeats: int = knob(3, "runs of each form, taken in turns", minimum=1)
    steps: int = knob(60, "N: the steps of the recorded runs", minimum=2)
    part_at: int = knob(10, "K: the step at which the two runs part", minimum=0)
    width: int = knob(512, "the model's hidden width", minimum=1)
    depth: int = knob(4, "its hidden layers of width x width", minimum=0)
    batch: int = knob(512, "the global batch of a step", minimum=2)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.part_at >= self.steps:
            raise ValueError(f"--part-at must be below --steps ({self.steps})")


@dataclass(frozen=True)
class DrillBenchResult:
    """Wall and CPU seconds of each form (`FORMS` order), per repeat, and the exit codes."""

    options: DrillBenchOptions
    walls: tuple[tuple[float, ...], ...]
    codes: tuple[int, ...]

    def ratio(self, of: str, to: str) -> float:
        """The median over repeats of form `of`'s wall time over form `to`'s."""
        i, j = FORMS.index(of), FORMS.index(to)
        return statistics.median(r[i] / r[j] for r in self.walls)

    @property
    def verdict(self) -> str:
        return "pass" if all(c in (0, 1) for c in self.codes) else "fault"

    def to_dict(self) -> dict:
        return {"check": "bench-drill", "verdict": self.verdict, "options": asdict(self.options),
                "forms": FORMS, "walls": self.walls, "codes": self.codes,
                "drill_vs_plain": self.ratio("drill", "plain"),
                "late_vs_recorded": self.ratio("drill late", "recorded N"),
                "goals": {"drill_vs_plain": DRILL_GOAL, "late_vs_recorded": LATE_GOAL}}  # fmt: skip


def run_drill_bench(options: DrillBenchOptions) -> DrillBenchResult:
    o = options
    script = os.path.abspath(SCRIPT)
    size = ["--width", str(o.width), "--depth", str(o.depth), "--batch", str(o.batch)]
    walls, codes = [], []
    with tempfile.TemporaryDirectory() as out:

        def runs(steps: int, part_at: int) -> list[list[str]]:
            """A's and B's script argv, parting at `part_at`, of `steps` steps."""
            base = [script, *size, "--steps", str(steps), "--part-at", str(part_at)]
            return [base, [*base, "--mask-seed", "5"]]

        def record(argv: list[str], folder: str) -> list[str]:
            return [sys.executable, "-m", "verify", "audit", "--nproc", "2", "--out", out,
                    "--record", folder, "--", *argv]  # fmt: skip

        def drill(a: str, b: str) -> list[str]:
            return [sys.executable, "-m", "verify", "compare", "--drill", a, b, "--out", out]

        for name, (steps, part) in {
            "full": (o.steps, o.part_at),
            "late": (o.steps, o.steps - 1),
        }.items():
            for side, argv in zip("AB", runs(steps, part)):
                codes.append(_timed(record(argv, f"{out}/{name}{side}"))[1])
        for repeat in range(o.repeats):
            up_to = runs(o.part_at + 1, o.part_at)
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2"]  # fmt: skip
            forms = (
                [[*torchrun, *argv] for argv in up_to],
                [record(argv, f"{out}/r{repeat}{side}") for side, argv in zip("AB", up_to)],
                [drill(f"{out}/fullA", f"{out}/fullB")],
                [record(argv, f"{out}/n{repeat}{side}") for side, argv in zip("AB", runs(o.steps, o.steps - 1))],
                [drill(f"{out}/lateA", f"{out}/lateB")],
            )  # fmt: skip
            wall = [0.0] * len(FORMS)
            for i in range(len(FORMS)):
                form = (i + repeat) % len(FORMS)
                for argv in forms[form]:
                    w, code = _timed(argv)
                    wall[form] += w
                    codes.append(code)
            walls.append(tuple(wall))
    return DrillBenchResult(o, tuple(walls), tuple(codes))


def _timed(argv: list[str]) -> tuple[float, int]:
    """(wall s, exit code) of one run, from its start to its exit."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True)
    return time.perf_counter() - start, done.returncode


def text(result: DrillBenchResult) -> str:
    o = result.options
    lines = [f"compare --drill: {SCRIPT}, 2 ranks, {o.depth + 2} layers of width {o.width}, "
             f"global batch {o.batch}, parting at step {o.part_at} of {o.steps}, "
             f"{o.repeats} repeats; wall seconds",
             f"{'repeat':>8}  " + "  ".join(f"{f:>10}" for f in FORMS)]  # fmt: skip
    for n, row in enumerate(result.walls):
        lines.append(f"{n:>8}  " + "  ".join(f"{x:>10.2f}" for x in row))
    d, late = result.ratio("drill", "plain"), result.ratio("drill late", "recorded N")
    lines.append(f"drill / plain runs up to step {o.part_at}: {d:.2f}x "
                 f"(goal at most {DRILL_GOAL:g}x: {'met' if d <= DRILL_GOAL else 'MISSED'})")  # fmt: skip
    lines.append(f"drill at step {o.steps - 1} / the recorded runs of {o.steps} steps: "
                 f"{late:.2f}x (the steps before cost nothing: at most {LATE_GOAL:g}x: "
                 f"{'met' if late <= LATE_GOAL else 'MISSED'}; a drill-down's re-runs are "
                 "audited and recorded, as the recorded runs are)")  # fmt: skip
    if result.verdict != "pass":
        lines.append(f"a run failed: exit codes {result.codes}")
    return "\n".join(lines)
