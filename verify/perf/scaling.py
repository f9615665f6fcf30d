"""`python -m verify scaling`: throughput at world sizes 1..N, speed-up and efficiency.

Weak scaling, as data parallelism is used: every rank keeps its local batch, so N ranks
process N times the examples per step. For each world size one launch trains the transformer
workload with the chosen implementation (the one trainer, `training/trainer.py`); after
warm-up, the median step time (slowest rank, `timing.timed`) gives throughput = N x local
batch x sequence length / step time, speed-up = throughput(N) / throughput(1) and
efficiency = speed-up / N.

Every rank gets the same thread budget at every world size, the machine's cores shared among
the largest world size's ranks (or `--threads-per-rank`), so the curve shows what adding a
rank costs, not what taking threads away from one rank costs. On a machine with fewer cores
than ranks x threads, ranks share cores and efficiency says so. The run folder holds
scaling.json, scaling.txt and scaling.png.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace

from impls.registry import DEFAULT_BUCKET_MB
from verify import progress
from verify.launching import RankContext, launch
from verify.options import OutputOptions, knob, launch_knobs
from verify.perf import charts
from verify.perf.base import Measured, MeasureOptions, RunFolder, model_size, resolve_all, say
from verify.perf.timing import timed
from verify.training.trainer import Trainer, TrainSpec, spec_from


@dataclass(frozen=True, kw_only=True)
class ScalingOptions(MeasureOptions, OutputOptions):
    """What `scaling` trains, and up to how many ranks."""

    impl: str = knob("bucketed", "a registered name, package.module:Class or path/to/file.py:Class")
    max_world_size: int = knob(2, "world sizes 1 to this", flag="--world-size", minimum=1)
    model_size_m: float = model_size(10.0)
    local_batch: int = knob(4, "sequences per rank and step", minimum=1)
    bucket_mb: float = knob(
        DEFAULT_BUCKET_MB, "bucket size given to wrappers that take one", unit="MB", positive=True
    )
    warmup: int = knob(2, "untimed steps first", minimum=1, cli=False)
    repeats: int = knob(8, "timed steps per world size", minimum=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_all((self.impl,), "scaling")

    @property
    def ranks(self) -> int:
        return self.max_world_size

    def train_spec(self) -> TrainSpec:
        return spec_from(self, steps=self.warmup + self.repeats)


@dataclass(frozen=True)
class ScalingPoint:
    world_size: int
    step_s: float  # median, slowest rank
    tokens_per_step: int

    @property
    def throughput(self) -> float:
        return self.tokens_per_step / self.step_s


@dataclass(frozen=True)
class ScalingResult(Measured):
    """One point per world size; `threads` is the thread budget every rank had."""

    options: ScalingOptions
    verdict: str
    points: tuple[ScalingPoint, ...] = ()
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()
    threads: str = ""

    def speedup(self, p: ScalingPoint) -> float:
        return p.throughput / self.points[0].throughput

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "options": self.options.to_dict(),
            "points": [
                {
                    **asdict(p),
                    "tokens_per_s": p.throughput,
                    "speedup": self.speedup(p),
                    "efficiency": self.speedup(p) / p.world_size,
                }
                for p in self.points
            ],
            "run_dir": self.run_dir,
            "machine": self.machine,
            "failure": self.failure,
            "notes": list(self.notes),
            "threads": self.threads,
        }


def run_scaling(options: ScalingOptions) -> ScalingResult:
    """One launch per world size, 1 to `max_world_size`; the result and its run folder."""
    folder = RunFolder.start(options, "scaling", options.max_world_size)
    points, launches = [], []
    for ws in range(1, options.max_world_size + 1):
        progress.say(f"scaling: world size {ws} (", ws, options.max_world_size, ")")
        run = launch(
            scaling_on_rank,
            world_size=ws,
            args=(options,),
            **launch_knobs(options),
            ranks_at_once=options.max_world_size,  # the same budget at every world size
        )
        launches.append(run)
        if not run.ok:
            break
        points.append(run.values[0])
    machine = folder.machine(*launches)
    last = launches[-1]
    result = ScalingResult.from_launch(
        options,
        last,
        points=tuple(points),
        run_dir=str(folder.path),
        machine=machine,
        threads=last.threads,
    )
    if result.ok:
        sizes = [p.world_size for p in points]
        chart = charts.curves(
            folder.path / "scaling.png",
            {"ideal": (sizes, sizes), options.impl: (sizes, [result.speedup(p) for p in points])},
            xlabel="world size",
            ylabel="speed-up (throughput / throughput at 1)",
            title=f"weak scaling, {result.threads}",
        )
        result = replace(result, notes=tuple(n for n in [chart.note] if n))
    folder.save("scaling", result)
    return result


def scaling_on_rank(ctx: RankContext, options: ScalingOptions) -> ScalingPoint:
    """Warm-up, then `repeats` timed steps of the one trainer: the median point."""
    trainer = Trainer(ctx, options.train_spec())
    for step in range(1, options.warmup + 1):
        trainer.step(step)
    times = []
    for i in range(options.repeats):
        say(ctx, f"scaling: world size {ctx.world_size}, step ", i + 1, options.repeats)
        step = options.warmup + i + 1
        times.append(timed(lambda step=step: trainer.step(step), ctx.device))
    tokens = ctx.world_size * options.local_batch * trainer.workload.cfg.block_size
    return ScalingPoint(ctx.world_size, statistics.median(times), tokens)
