"""What every measurement command shares: its options, its run folder, its verdict, its voice.

- `MeasureOptions`: where the ranks run (`--device`: cuda with NCCL when every rank can have a
  GPU, else cpu with gloo; `--device cuda --backend gloo`: every rank on the GPUs there are), how long they may run (`--timeout`) and their thread budget
  (`--threads-per-rank`). A command's options add their own knobs, say how many ranks run at
  once (`ranks`), and add `OutputOptions` (`--out`) when the command keeps a run folder. What
  the ranks train comes from the options by name (`spec_from`): a knob named as in `TrainSpec`
  is that knob, and `train_spec()` states only what differs (the step count, the arm's impl).
  Unless a command says otherwise, a measurement trains the transformer with every rank, and
  every arm, starting from the same weights.
- `PERF_KINDS`: the implementations a measurement accepts: the built-in ladder, PyTorch's
  references and a user's class; never a `faulty:*` or `hang:*` one (they are built to fail).
- `RunFolder`: `<out>/<name>_<world>x<device>_<stamp>/`, never reused (`runs.new_run_dir`),
  with `metadata.json` written before any rank starts; `save` adds the result as JSON, and
  `machine` the ranks' thread budget to the metadata's machine line. The report as text,
  `<name>.txt` beside the JSON, is the CLI's to write (`cli/command.py`, `report`).
- `Measured`: what every measurement's result shares, from its launch (`from_launch`): the
  verdict, "pass" when every rank finished, whatever the numbers, "fault" when a rank failed,
  "timeout" when the time ran out first (`checks/verdict.py`, the checks' rule with no
  findings); `failure`, the launcher's summary of a run that did not finish; `ok`.
- `say`: one progress line from rank 0 (the parent prints it once; `verify/progress.py`).
- `next_step`, `parameters`: a trainer's next step, whichever arm takes it; a model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from impls.registry import REGISTRY, resolve
from verify import progress, runs
from verify.checks.verdict import Verdicted, failure_text, verdict_of
from verify.launching import LaunchResult, RankContext, torchrun
from verify.options import PlacementOptions, ThreadOptions, knob

if TYPE_CHECKING:
    from verify.training.trainer import Trainer

#: registered kinds a measurement runs (user classes by path are always accepted)
PERF_KINDS = frozenset({"builtin", "reference"})
ALL = "all"  # `--impl all`: every registered name of PERF_KINDS


def all_variants() -> tuple[str, ...]:
    """What `all` stands for: the built-in ladder and PyTorch's references, in registry order."""
    return tuple(name for name, impl in REGISTRY.items() if impl.kind in PERF_KINDS)


def resolve_all(names: tuple[str, ...], command: str) -> tuple[str, ...]:
    """`names` with `all` expanded, each checked (ValueError, one line, before any rank)."""
    expanded = tuple(v for name in names for v in (all_variants() if name == ALL else (name,)))
    for name in expanded:
        resolve(name, kinds=PERF_KINDS, command=command)
    return tuple(dict.fromkeys(expanded))


@dataclass(frozen=True, kw_only=True)
class MeasureOptions(ThreadOptions, PlacementOptions):
    """The knobs of every measurement command (module docstring)."""

    device: str | None = knob(
        None,
        "where the ranks run (default: cuda, with NCCL, when every rank can have a GPU; "
        "else cpu, with gloo)",
        choices=("cpu", "cuda"),
    )
    backend: str | None = knob(
        None, "what carries the collectives (default: nccl on cuda, gloo on cpu); gloo with "
        "--device cuda runs every rank on the GPUs there are, one GPU enough",
        choices=("gloo", "nccl"),
    )  # fmt: skip
    timeout_s: float = knob(
        1800.0,
        "how long the ranks may run once all have started",
        flag="--timeout",
        unit="s",
        positive=True,
    )

    # Read by `spec_from` as the fields are (module docstring); a command may redeclare them.
    workload: ClassVar[str] = "transformer"
    same_init: ClassVar[bool] = True

    # On NCCL a measurement's waits stay as a user's are (they return once the GPU has the
    # collective queued): blocking ones, which a check's ranks use to see a hang, would add a
    # host round trip to every collective timed (`launch`'s nccl_blocking_wait).
    nccl_blocking_wait: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.backend is None:  # the one the device implies (the default device: its help)
            device = self.device or runs.default_device(self.ranks_here)
            set_field(self, "backend", runs.backend_for(device))
        super().__post_init__()
        gpus = torch.cuda.device_count()
        if self.backend == "nccl" and gpus < self.ranks_here:
            where = "" if self.ranks_here == self.ranks else " here"
            raise ValueError(
                f"--device cuda needs one GPU per rank: {self.ranks_here} ranks{where}, "
                f"{gpus} GPU(s) visible"
            )

    @property
    def ranks(self) -> int:
        """The most ranks this command runs at once: `world_size` for the commands that start
        one job (comm and scaling, which start several, override it)."""
        return getattr(self, "world_size", 1)

    @property
    def ranks_here(self) -> int:
        """Of those, the ones on this machine: under torchrun its LOCAL_WORLD_SIZE."""
        return torchrun.local_ranks(self.ranks)


def model_size(default: float | None, help: str = "the transformer's size"):
    """The `--model-size` knob of every measurement (millions of parameters)."""
    return knob(default, help, flag="--model-size", unit="M parameters", positive=True)


def set_field(options: Any, name: str, value: Any) -> None:
    """Normalize a field of frozen options in their `__post_init__` (`all` expanded)."""
    object.__setattr__(options, name, value)


@dataclass(frozen=True)
class RunFolder:
    """A run's folder (module docstring) and the metadata written into it at the start."""

    path: Path
    meta: dict

    @classmethod
    def start(cls, options: Any, name: str, world_size: int) -> RunFolder:
        path = runs.new_run_dir(options.out, name, world_size, options.device_type)
        return cls(path, runs.write_metadata(path, options.to_dict()))

    def machine(self, *launches: LaunchResult) -> str:
        """The machine line with the thread budget the ranks of `launches` used (recorded in
        metadata.json as `threads` and `machine_line`)."""
        threads = "; ".join(dict.fromkeys(r.threads for r in launches if r.threads))
        return runs.write_metadata(self.path, self.meta["options"], threads)["machine_line"]

    def save(self, stem: str, result: Any) -> None:
        """`<stem>.json`: the result's `to_dict()`."""
        runs.write_json(self.path / f"{stem}.json", result.to_dict())


def next_step(trainer: Trainer) -> None:
    trainer.step(trainer.step_no + 1)


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def say(
    ctx: RankContext, task: str, done: int | None = None, total: int | None = None, after: str = ""
) -> None:
    """A progress line (`progress.say`'s arguments), from rank 0 only (every rank saying it
    would print it N times)."""
    if ctx.rank == 0:
        progress.say(task, done, total, after)


class Measured(Verdicted):
    """The verdict tail of a measurement's result (module docstring). A mixin, not fields:
    each result dataclass declares `verdict` (second, after `options`) and `failure` where its
    JSON has always had them, and builds itself with `from_launch`."""

    verdict: str
    failure: str | None

    @classmethod
    def from_launch(cls, options: Any, run: LaunchResult, **fields: Any):
        """The result of `run` (its last launch, for a command that makes several): the
        verdict and failure it ended with, and the other `fields` as given."""
        return cls(options, verdict=verdict_of((), run), failure=failure_text(run), **fields)

    @property
    def ok(self) -> bool:
        """`passed` under the name the measurements' JSON has always used."""
        return self.passed
