"""`python -m verify train`: end-to-end training, with each implementation's loss curve drawn
beside the single-process curve of the same data.

The data is a synthetic language the model can actually learn (the `markov` workload,
`training/workloads.py`): sequences of a fixed random Markov chain in which every token has
4 possible successors, so the loss falls from ln(vocab) towards ln(4). Each rank trains on
what its `torch.utils.data.DistributedSampler` yields (one shuffled permutation per epoch,
rank r taking every N-th index from r), exactly as a real job splits data, through the one
trainer (`training/trainer.py`).

The single-process reference trains on N x the local batch, so at every step it reads the
same examples as all ranks together; its mean loss is the mean of the ranks' mean losses
(equal local batches). A correct data-parallel implementation therefore follows the reference
curve up to float rounding (a different summation order), which grows slowly over steps as
training amplifies tiny differences: the report gives the largest gap. The run folder holds
train.json, train.txt and loss.png.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch.distributed as dist

from impls.registry import DEFAULT_BUCKET_MB
from verify import progress
from verify.launching import RankContext, launch
from verify.options import OutputOptions, knob, launch_knobs
from verify.perf import charts
from verify.perf.base import (
    Measured,
    MeasureOptions,
    RunFolder,
    model_size,
    resolve_all,
    say,
    set_field,
)
from verify.training.trainer import Trainer, TrainSpec, spec_from
from verify.training.workloads import GPTConfig, Markov

REFERENCE = "single process"


@dataclass(frozen=True, kw_only=True)
class TrainOptions(MeasureOptions, OutputOptions):
    """What `train` trains, and for how long."""

    impls: tuple[str, ...] = knob(
        help="a registered name, package.module:Class or path/to/file.py:Class; "
        "comma-separated, or all",
        flag="--impl",
    )
    world_size: int = knob(2, "ranks to start", minimum=1)
    steps: int = knob(200, "optimizer steps", minimum=1)
    local_batch: int = knob(8, "sequences per rank and step", minimum=1)
    model_size_m: float | None = model_size(
        None, "the GPT's size (default: a tiny GPT, 256 tokens, 2 layers, 64 wide)"
    )
    lr: float = knob(3e-3, "AdamW's learning rate", positive=True)
    bucket_mb: float = knob(
        DEFAULT_BUCKET_MB, "bucket size given to wrappers that take one", unit="MB", positive=True
    )
    seed: int = knob(0, "data and initialization seed", cli=False)
    log_every: int = knob(25, "steps between progress lines", minimum=1, cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        set_field(self, "impls", resolve_all(self.impls, "train"))
        if self.world_size * self.local_batch > Markov.examples:
            raise ValueError(
                f"a global batch of {self.world_size} x {self.local_batch} "
                f"sequences is more than the {Markov.examples} examples"
            )

    workload: ClassVar[str] = "markov"

    def train_spec(self, impl: str | None) -> TrainSpec:
        """`impl` on the ranks' shards, or (None) the single process on the whole batch."""
        local_batch = self.local_batch if impl else self.world_size * self.local_batch
        return spec_from(self, impl=impl, local_batch=local_batch)

    @property
    def config(self) -> GPTConfig:
        """The GPT trained (the `markov` workload's)."""
        m = self.model_size_m
        return GPTConfig() if m is None else GPTConfig.with_params(m)


@dataclass(frozen=True)
class TrainResult(Measured):
    """Every run's loss per step (the global batch's mean) and wall time."""

    options: TrainOptions
    verdict: str
    losses: dict = field(default_factory=dict)  # name -> loss per step
    seconds: dict = field(default_factory=dict)  # name -> wall time of the training loop
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()
    reference: ClassVar[str] = REFERENCE  # the single process's name among `losses`

    def max_gap(self, name: str) -> float:
        return max(abs(a - b) for a, b in zip(self.losses[name], self.losses[REFERENCE]))

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "options"}
        d["ok"] = self.ok
        d["options"] = self.options.to_dict()
        if self.ok:
            d["max_gap_to_single_process"] = {
                n: self.max_gap(n) for n in self.losses if n != REFERENCE
            }
        return d


def run_training(options: TrainOptions) -> TrainResult:
    """The single process, then every implementation on `world_size` ranks; the curves."""
    impls = options.impls
    name = "train-" + ("+".join(impls) if len(impls) <= 3 else f"{len(impls)}-impls")
    folder = RunFolder.start(options, name, options.world_size)
    losses, seconds, launches = {}, {}, []
    for i, (names, ws) in enumerate([((REFERENCE,), 1), (impls, options.world_size)], 1):
        progress.say(f"train: {', '.join(names)} on {ws} rank{'s' * (ws > 1)} (", i, 2, ")")
        run = launch(
            train_on_rank,
            world_size=ws,
            args=(options, names),
            **launch_knobs(options),
            # The same thread budget per process in both launches: a lone rank given every
            # core spins OpenMP threads on a tiny GPT's ops, 10x slower on a loaded machine.
            ranks_at_once=options.world_size,
        )
        launches.append(run)
        if not run.ok:
            break
        for n, (curve, s) in run.values[0].items():
            losses[n], seconds[n] = curve, s
    machine = folder.machine(*launches)
    last = launches[-1]
    result = TrainResult.from_launch(
        options, last, losses=losses, seconds=seconds, run_dir=str(folder.path), machine=machine
    )
    if result.ok:
        steps = list(range(1, options.steps + 1))
        chart = charts.loss_curves(folder.path / "loss.png", steps, losses, REFERENCE)
        result = replace(result, notes=tuple(n for n in [chart.note] if n))
    folder.save("train", result)
    return result


def train_on_rank(ctx: RankContext, options: TrainOptions, names: tuple[str, ...]) -> dict:
    """Each of `names` trained in turn: {name: (loss per step, seconds)}."""
    return {name: _train(ctx, options, name) for name in names}


def _train(ctx: RankContext, options: TrainOptions, name: str) -> tuple[list[float], float]:
    trainer = Trainer(ctx, options.train_spec(None if name == REFERENCE else name))
    losses = []
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        loss = trainer.step(step)
        if ctx.world_size > 1:  # the global batch's mean loss: the mean of the ranks' means
            dist.all_reduce(loss)
            loss /= ctx.world_size
        losses.append(float(loss))
        if step % options.log_every == 0 or step == options.steps:
            rate = step / (time.perf_counter() - start)
            after = f"  loss {losses[-1]:.4f}  ({rate:.1f} steps/s)"
            say(ctx, f"train {name}: step ", step, options.steps, after)
    return losses, time.perf_counter() - start
