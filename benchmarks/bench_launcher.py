"""What the launcher form (`audit -- torchrun ...`, `launching/command.py`) adds to a run's
wall time over the same script under `audit --nproc 2` (goal: at most 1 s), and, to tell the
tool's share from the launcher's, the same command run with no tool at all.

Each repeat runs the three, in turns (the order rotates, so that a slow moment of a shared
machine does not always fall on the same one), each a fresh `python -m verify` process (or
torchrun alone) timed from its start to its exit: what a user waits. The figures are paired
by repeat, and the median of the differences is reported. Beside the wall time, the CPU
seconds of every process of the run (user + system of the reaped children: the tool, the
launcher and the ranks), which a shared machine's load does not inflate: where the wall
times are a loaded machine's, they say what the tool itself costs.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from verify.options import Options, knob

GOAL_S = 1.0
FORMS = ("--nproc 2", "launcher", "launcher alone")


@dataclass(frozen=True, kw_only=True)
class LauncherBenchOptions(Options):
    """How many repeats, of which script."""

    repeats: int = knob(3, "runs of each form, taken in turns", minimum=1)
    script: str = knob(
        "tests/fixtures/launchers/torchrun_clean.py", "the script every form runs (two ranks)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not os.path.isfile(self.script):
            raise ValueError(f"script {self.script} does not exist")


@dataclass(frozen=True)
class LauncherBenchResult:
    """Wall seconds of each form, per repeat (`FORMS` order), and every run's exit code."""

    options: LauncherBenchOptions
    walls: tuple[tuple[float, float, float], ...]
    codes: tuple[int, ...]
    cpus: tuple[tuple[float, float, float], ...] = ()

    @property
    def added_s(self) -> float:
        """Median over repeats of (launcher form - `--nproc`)."""
        return statistics.median(w[1] - w[0] for w in self.walls)

    @property
    def tool_s(self) -> float:
        """Median over repeats of (launcher form - the launcher alone): the tool's share."""
        return statistics.median(w[1] - w[2] for w in self.walls)

    @property
    def verdict(self) -> str:
        return "pass" if all(c == 0 for c in self.codes) else "fault"

    def to_dict(self) -> dict:
        return {"check": "bench-launcher", "verdict": self.verdict,
                "options": asdict(self.options), "walls": self.walls, "codes": self.codes,
                "cpus": self.cpus, "added_s": self.added_s, "tool_s": self.tool_s,
                "goal_s": GOAL_S}  # fmt: skip


def run_launcher_bench(options: LauncherBenchOptions) -> LauncherBenchResult:
    torchrun = ["torchrun", "--standalone", "--nproc-per-node", "2", options.script]
    tool = [sys.executable, "-m", "verify", "audit", "--out"]
    walls, codes, cpus = [], [], []
    with tempfile.TemporaryDirectory() as out:
        argvs = (
            [*tool, out, "--nproc", "2", "--", options.script],
            [*tool, out, "--", *torchrun],
            torchrun,
        )
        for repeat in range(options.repeats):
            wall, cpu = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
            for i in range(3):
                form = (i + repeat) % 3
                before, start = _children_cpu(), time.perf_counter()
                done = subprocess.run(argvs[form], capture_output=True)
                wall[form] = time.perf_counter() - start
                cpu[form] = _children_cpu() - before
                codes.append(done.returncode)
            walls.append(tuple(wall))
            cpus.append(tuple(cpu))
    return LauncherBenchResult(options, tuple(walls), tuple(codes), tuple(cpus))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def text(result: LauncherBenchResult) -> str:
    o = result.options
    lines = [f"launcher form vs --nproc 2: {o.script}, {o.repeats} repeats, wall seconds",
             f"{'repeat':>6}  {FORMS[0]:>10}  {FORMS[1]:>10}  {FORMS[2]:>14}  {'added':>7}"]  # fmt: skip
    for n, (nproc, launcher, alone) in enumerate(result.walls):
        lines.append(
            f"{n:>6}  {nproc:>10.2f}  {launcher:>10.2f}  {alone:>14.2f}  {launcher - nproc:>+7.2f}"
        )
    for n, (nproc, launcher, alone) in enumerate(result.cpus):
        lines.append(
            f"{'cpu ' + str(n):>6}  {nproc:>10.2f}  {launcher:>10.2f}  {alone:>14.2f}  "
            f"{launcher - nproc:>+7.2f}"
        )
    met = "met" if result.added_s <= GOAL_S else "MISSED"
    lines.append(
        f"median added over --nproc: {result.added_s:+.2f}s (goal at most {GOAL_S:g}s: {met}); "
        f"the tool's share over the launcher alone: {result.tool_s:+.2f}s"
    )
    if result.verdict != "pass":
        lines.append(f"a run failed: exit codes {result.codes}")
    return "\n".join(lines)
