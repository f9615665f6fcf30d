"""The options of the two commands that run a user's script or launcher command under the
watchdog, `audit` and `hang`, and the refusals they share (`checks/script.py` runs them).

This module imports no torch, nor anything that does: the CLI builds these options, then
starts a launcher command (`verify/cli/head_start.py`) before the tool imports torch. What a
check needs torch for (`hang --impl`'s registry, `--record`'s folders) is imported where it
is checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from verify.launching.env import DEFAULT_STALL_TIMEOUT_S, joining
from verify.launching.launcher import is_command
from verify.options import (
    OutputOptions,
    PlacementOptions,
    RunOptions,
    ThreadOptions,
    knob,
    refuse_on_cpu,
)

#: the registered kinds `hang --impl` accepts (user classes by path are always accepted)
HANG_KINDS = frozenset({"builtin", "reference", "hang"})


def refuse_under_torchrun(command: str, entry: str, guide: str) -> None:
    """A command that spawns and watches its own ranks, asked from inside a torchrun job:
    `ValueError` (exit 2) naming the entry point to run under torchrun instead."""
    if joining():
        raise ValueError(
            f"under torchrun, run your script as `torchrun ... -m verify.{entry} train.py "
            f"ARGS` (see {guide}); `{command}` spawns and watches its own ranks"
        )


@dataclass(frozen=True, kw_only=True)
class AuditOptions(ThreadOptions, OutputOptions):
    """A script, its ranks, and how often to audit."""

    nproc: int = knob(2, "ranks to run the script in", minimum=1)
    script: tuple[str, ...] = knob((), "the script and its arguments, after --", cli=False)
    audit_every: int = knob(
        1, "audit every N-th optimizer step (steps 0, N, 2N, ...): less cost on large models",
        minimum=1,
    )  # fmt: skip
    stall_timeout_s: float = knob(
        DEFAULT_STALL_TIMEOUT_S, "seconds with no collective progress, while a rank waits and "
        "none works, that make a hang", flag="--stall-timeout", unit="s", positive=True,
    )  # fmt: skip
    timeout_s: float = knob(
        3600.0, "how long the script may run", flag="--timeout", unit="s", positive=True
    )
    backend: str = knob(
        "gloo", "the script's backend: gloo (CPU) or nccl (one GPU per rank); the audit "
        "itself always talks over a gloo group of its own", choices=("gloo", "nccl"),
    )  # fmt: skip
    sanitize: bool = knob(False, "also run the script under the race sanitizer (docs/races.md)")
    on_cpu: bool = knob(
        False, "rehearse a script written for CUDA on CPU ranks over gloo, unmodified: CUDA "
        "devices map to the CPU, nccl to gloo, and the report lists each call mapped "
        "(docs/audit.md)",
    )  # fmt: skip
    console: str = knob("stdout", "where a script's output is echoed", cli=False)
    # Two runs of a script compared step by step (verify/recording/, docs/compare.md).
    record: str | None = knob(None, "record every optimizer step into this new folder "
                              "(compare a later run with it: --against)")  # fmt: skip
    against: str | None = knob(None, "compare this run, step by step, with the recording in "
                               "this folder (written by --record): where it first departs")  # fmt: skip
    align_step: int | None = knob(None, "with --against: this run's step 0 is the recording's "
                                  "step K (default: found from the parameters)", minimum=0)  # fmt: skip
    drill: bool = knob(
        False, "when the replicas diverge, run the script again up to that step and name the "
        "first op where the ranks part (docs/compare.md)",
    )  # fmt: skip
    # "<optimizer index>:<step>": `compare --drill`'s re-run captures that step op by op and
    # ends there (verify/recording/capture.py); not a flag
    drill_at: str | None = knob(None, "the step a drill-down captures", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_under_torchrun("audit", "audit_run", "docs/audit.md")
        if not self.script:
            raise ValueError(
                "audit needs a script or a command: audit --nproc N -- train.py ARGS, or "
                "audit -- torchrun ... train.py ARGS"
            )
        if not is_command(self.script) and not os.path.isfile(self.script[0]):
            raise ValueError(f"script {self.script[0]} does not exist")
        refuse_on_cpu(self.on_cpu, self.backend)
        if self.record or self.against or self.align_step is not None:
            from verify.recording.store import check_options

            check_options(self)

    @property
    def recording(self) -> bool:
        """The run records (`--record`, `--drill`: the re-run's replay is checked against it)
        or is compared with a recording (`--against`)."""
        return bool(self.record or self.against or self.drill)


@dataclass(frozen=True, kw_only=True)
class HangOptions(RunOptions, OutputOptions, PlacementOptions):
    """What to run under the watchdog: `impl`, a `script` (with `nproc`), or `scenarios`."""

    impl: str | None = knob(
        None, "an implementation to train under the watchdog (registered name, hang:<scenario>, "
        "package.module:Class or path/to/file.py:Class)",
    )  # fmt: skip
    scenarios: bool = knob(False, "run every hang:* scenario; print each verdict and how fast")
    jobs: int = knob(2, "with --scenarios: scenarios run at once", minimum=1)
    nproc: int | None = knob(None, "ranks to run the script in (with -- train.py ARGS)", minimum=1)
    script: tuple[str, ...] = knob((), "the script and its arguments, after --", cli=False)
    stall_timeout_s: float = knob(
        DEFAULT_STALL_TIMEOUT_S, "seconds with no collective progress, while a rank waits and "
        "none works, that make a hang", flag="--stall-timeout", unit="s", positive=True,
    )  # fmt: skip
    steps: int = knob(3, "optimizer steps per workload (faults show at step 2)", minimum=2)
    timeout_s: float = knob(
        600.0, "how long the run may take", flag="--timeout", unit="s", positive=True
    )
    sanitize: bool = knob(
        False, "with --nproc: run the script under the race sanitizer (docs/races.md)"
    )
    on_cpu: bool = knob(
        False, "with --nproc: rehearse a script written for CUDA on CPU ranks over gloo, unmodified: CUDA "
        "devices map to the CPU, nccl to gloo, and the report lists each call mapped "
        "(docs/audit.md)",
    )  # fmt: skip
    console: str = knob("stdout", "where a script's output is echoed", cli=False)

    def __post_init__(self) -> None:
        refuse_on_cpu(self.on_cpu, self.backend, self.device)  # before the GPU placement's check
        super().__post_init__()
        refuse_under_torchrun("hang", "hang_run", "docs/debugging.md")
        if self.nproc is not None and not self.script:
            raise ValueError("--nproc needs a script: --nproc N -- train.py ARGS")
        launcher = is_command(self.script)
        if launcher and self.nproc is not None:
            raise ValueError(
                f"--nproc applies to a script (--nproc N -- train.py); {self.script[0]} is a "
                "command, which starts its own ranks: drop --nproc"
            )
        if self.script and self.nproc is None and not launcher:
            raise ValueError(
                f"unexpected arguments {' '.join(self.script)} (did you mean --nproc N --?)"
            )
        if sum([bool(self.impl), bool(self.script), self.scenarios]) != 1:
            raise ValueError(
                "give either --impl NAME, --scenarios, --nproc N -- script.py ARGS, or -- COMMAND"
            )
        if self.sanitize and not self.script:
            raise ValueError("--sanitize applies to a script: --nproc N --sanitize -- train.py")
        if self.on_cpu and not self.script:
            raise ValueError("--on-cpu applies to a script: --nproc N --on-cpu -- train.py")
        if self.impl:
            from impls.registry import resolve  # the implementations, torch: only for --impl

            resolve(self.impl, kinds=HANG_KINDS, command="hang")
        if self.script and not launcher and not os.path.isfile(self.script[0]):
            raise ValueError(f"script {self.script[0]} does not exist")

    @property
    def launcher(self) -> bool:
        """The script is a command that starts its own ranks (`launching/launcher.py`)."""
        return is_command(self.script)

    @property
    def ranks(self) -> int:
        return self.nproc if self.nproc is not None else self.world_size
