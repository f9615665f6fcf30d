"""The knobs the checks share (consistency and equivalence; the matrix plays the same through
`TrainSpec`), and the registered kinds each command accepts."""

from __future__ import annotations

from dataclasses import MISSING, dataclass

import torch

from impls.registry import resolve
from verify.launching import torchrun
from verify.options import PlacementOptions, RunOptions, knob
from verify.training.trainer import TRAIN_DEFAULTS, TrainSpec, spec_from
from verify.training.workloads import WORKLOADS

#: registered kinds a check can run (user classes by path are always accepted)
CHECK_KINDS = frozenset({"builtin", "reference", "faulty"})


@dataclass(frozen=True, kw_only=True)
class CheckOptions(RunOptions, PlacementOptions):
    """What a check trains and how (see `TrainSpec` for the training knobs)."""

    impl: str = knob(
        MISSING, "a registered name, package.module:Class, or path/to/file.py:Class (see "
        "`python -m verify list`)",
    )  # fmt: skip
    steps: int = knob(TRAIN_DEFAULTS.steps, "optimizer steps", minimum=1)
    workload: str = knob(
        TRAIN_DEFAULTS.workload, "the model and data to train", choices=tuple(WORKLOADS)
    )
    model_size_m: float | None = knob(
        None, "transformer workload: millions of parameters (default: a tiny GPT)",
        flag="--model-size", positive=True,
    )  # fmt: skip
    bucket_mb: float = knob(
        TRAIN_DEFAULTS.bucket_mb, "bucket size given to wrappers that take one", unit="MB",
        positive=True,
    )  # fmt: skip
    same_init: bool = knob(
        False, "every rank builds the model from the same seed (for designs that rely on "
        "identical seeding instead of a broadcast from rank 0)",
    )  # fmt: skip
    # On by default: a race on an async collective (a result read before wait(), a work never
    # waited on) gives the right numbers on a CPU almost every time, so without the sanitizer
    # a racy class passes; it costs about 5% of a check (docs/races.md, "Cost").
    sanitize: bool = knob(
        True, "skip the race check on async collectives (docs/races.md): faster by about 5 percent, "
        "blind to a result read before wait() or a work never waited on",
        negate="--no-sanitize",
        affirm="check async collectives for races (the default): every access to a tensor while "
        "a collective on it is in flight, and collectives completed adversarially",
    )  # fmt: skip
    command: str = knob("check", cli=False)  # how errors name the command

    def __post_init__(self) -> None:
        super().__post_init__()
        here = torchrun.local_ranks(self.world_size)  # under torchrun: this node's ranks
        if self.backend == "nccl" and torch.cuda.device_count() < here:
            ranks = f"world size {here}" if here == self.world_size else f"{here} ranks here"
            raise ValueError(
                f"backend nccl needs one GPU per rank: {ranks}, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )
        resolve(self.impl, kinds=CHECK_KINDS, command=self.command)

    def train_spec(self, **overrides) -> TrainSpec:
        """What the ranks train: this check's knobs (`spec_from`), plus `overrides`."""
        return spec_from(self, **overrides)
