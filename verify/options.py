"""Options: one frozen dataclass per command, all built on `Options`, one default per knob.

A command's options are a `@dataclass(frozen=True, kw_only=True)` next to the code that owns
them (`ConsistencyOptions` in `checks/consistency.py`, ...). Every field is declared with
`knob()`, which carries what the command line needs: the help line (with its unit), the flag
when it is not the field's name, the constraint. The CLI (`verify/cli/flags.py`) builds every
command's flags from these fields, so a default or a constraint is written once; `__post_init__`
checks the constraints, so options built in code (tests, other tools) fail the same way, with
the same one line, before any rank starts.

    world_size: int = knob(2, "ranks to start", minimum=1)
    timeout_s: float = knob(120.0, "how long the ranks may run", flag="--timeout", unit="s",
                            positive=True)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def knob(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    unit: str | None = None,
    minimum: float | None = None,
    positive: bool = False,
    choices: tuple | None = None,
    negate: str | None = None,
    affirm: str | None = None,
    factory: Any = None,
    repeat: bool = False,
    cli: bool = True,
) -> Any:
    """A field of an options dataclass (see the module docstring).

    Args:
        default: the one default (or `factory` to compute it when the options are built).
        help: one line for `--help`; the unit and the default are appended to it.
        flag: the command-line flag when it is not `--` + the field name with dashes.
        unit: appended to the help ("s", "MB", "M parameters").
        minimum / positive: the value must be >= minimum / > 0.
        choices: the accepted values.
        negate: for a bool that defaults to True, the flag that turns it off
            ("--keep-grads" for set_to_none); the field's own flag is not offered, and
            `help` describes the negated flag.
        affirm: with `negate`, the field's own flag is offered too, with this help: a flag
            that became the default stays accepted ("--sanitize").
        repeat: a tuple field given by repeating the flag (`--impl a --impl b`) rather than
            as one comma-separated value.
        cli: False keeps the field out of the command line (set in code only).
    """
    metadata = {
        "help": help,
        "flag": flag,
        "unit": unit,
        "minimum": minimum,
        "positive": positive,
        "choices": choices,
        "negate": negate,
        "affirm": affirm,
        "repeat": repeat,
        "cli": cli,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The base of every command's options: checks each knob's constraint on construction."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_value(f, getattr(self, f.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError, naming the flag, if `value` breaks the field's constraint."""
    meta, name = f.metadata, flag_of(f)
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is None or isinstance(v, bool):
            continue
        if meta.get("minimum") is not None and v < meta["minimum"]:
            raise ValueError(f"{name} must be >= {meta['minimum']:g}, got {v:g}")
        if meta.get("positive") and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v:g}")
        if meta.get("choices") and v not in meta["choices"]:
            valid = ", ".join(map(str, meta["choices"]))
            close = difflib.get_close_matches(str(v), map(str, meta["choices"]), n=2, cutoff=0.6)
            guess = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"argument {name}: invalid choice: {v!r} ({guess}choose from {valid})")


def default_world_size() -> int:
    """2 ranks, or torchrun's WORLD_SIZE when this process is one of its ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 2


def writable_folder(path: str, flag: str = "--out") -> None:
    """Raise ValueError unless `path` is, or can be made, a folder this process can write in:
    a bad `--out` is a usage error, found before any rank starts."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"{flag} {path}: cannot write there ({reason})") from None


@dataclass(frozen=True, kw_only=True)
class ThreadOptions(Options):
    """Every command that starts ranks takes a thread budget."""

    threads_per_rank: int | None = knob(
        None, "intra-op threads per rank (default: the machine's cores shared among the ranks "
        "running at once; OMP_NUM_THREADS, when set, decides)", minimum=1,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PlacementOptions(Options):
    """Where the ranks' tensors live (`--device`) and what carries their collectives
    (`--backend`); `launching/gpus.py` has the placements. A check runs gloo on CPU ranks
    unless told otherwise; `--device cuda --backend gloo` puts the ranks on the GPUs there
    are, several to a GPU where there are fewer GPUs than ranks."""

    backend: str = knob("gloo", "gloo, or nccl (one GPU per rank)", choices=("gloo", "nccl"))
    device: str | None = knob(
        None, "where the ranks' tensors live (default: cuda with nccl, else cpu); cuda with "
        "--backend gloo runs every rank on the GPUs there are, one GPU enough",
        choices=("cpu", "cuda"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        from verify.launching import gpus

        gpus.check(self.device_type, self.backend)

    @property
    def device_type(self) -> str:
        """cpu or cuda: `--device`, or the one the backend implies (`gpus.device_for`)."""
        from verify.launching import gpus

        return gpus.device_for(self.device, self.backend)


def refuse_on_cpu(on_cpu: bool, backend: str, device: str | None = None) -> None:
    """`--on-cpu` runs the ranks on the CPU over gloo: a GPU placement beside it is a
    contradiction, refused in one line before any rank starts."""
    if not on_cpu:
        return
    if device == "cuda":
        raise ValueError(
            "--on-cpu rehearses a CUDA script on CPU ranks; --device cuda runs it on GPUs: "
            "give one of them"
        )
    if backend == "nccl":
        raise ValueError(
            "--on-cpu rehearses a CUDA script on CPU ranks over gloo (its nccl becomes gloo); "
            "--backend nccl needs GPUs: give one of them"
        )


def launch_knobs(options: Any) -> dict[str, Any]:
    """The launcher's keywords every command's options set alike: the time limit, the backend
    and the device (`PlacementOptions`), the thread budget, whether NCCL waits block (not for
    measurements: `MeasureOptions`) and, where a command takes one (`--stall-timeout`), the
    stall timeout, as `launch(fn, world_size=..., args=..., **launch_knobs(options))`.
    `options`: any command's options that start ranks (a `ThreadOptions` and a
    `PlacementOptions` with `timeout_s`: the checks', `MeasureOptions` and the measurements')."""
    knobs = {
        "timeout_s": options.timeout_s,
        "backend": options.backend,
        "device": options.device_type,
        "threads_per_rank": options.threads_per_rank,
        "nccl_blocking_wait": getattr(options, "nccl_blocking_wait", True),
    }
    if hasattr(options, "stall_timeout_s"):  # the commands that take --stall-timeout
        knobs["stall_timeout_s"] = options.stall_timeout_s
    return knobs


@dataclass(frozen=True, kw_only=True)
class RunOptions(ThreadOptions):
    """The knobs of every command that starts one job of ranks."""

    world_size: int = knob(
        help="ranks to start (under torchrun: its WORLD_SIZE)", minimum=1,
        factory=default_world_size,
    )  # fmt: skip
    timeout_s: float = knob(
        120.0, "how long the ranks may run once all have started", flag="--timeout", unit="s",
        positive=True,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class OutputOptions(Options):
    """Commands that write a run folder under `--out`."""

    out: str = knob("profiles", "folder that receives this run's folder (never reused)")

    def __post_init__(self) -> None:
        super().__post_init__()
        writable_folder(self.out)
