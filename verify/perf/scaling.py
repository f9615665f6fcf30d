"""`python -m verify scaling`: throughput at world sizes 1..N, speed-up and efficiency.

Weak scaling, as data parallelism is used: every rank keeps its local batch, so N ranks
process N times the examples per step. For each world size one launch trains the transformer
workload with the chosen implementation; after warm-up, the median step time (slowest rank)
gives throughput = N * local batch * sequence length / step time, speed-up = throughput(N) /
throughput(1) and efficiency = speed-up / N.

Every rank gets the same number of compute threads at every world size (cores / N_max), so
the curve shows what adding a rank costs, not what taking threads away from one rank costs.
On a machine with fewer cores than N_max * threads, ranks share cores and efficiency says so.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from dataclasses import dataclass

import torch

from verify import runs
from verify.launching import RankContext, launch
from verify.perf import charts
from verify.perf.bench import _Trainer
from verify.perf.comm import timed
from verify.training.workloads import get_workload


@dataclass(frozen=True, kw_only=True)
class ScalingOptions:
    impl: str = "bucketed"
    max_world_size: int = 2
    model_size_m: float = 10.0
    local_batch: int = 4
    bucket_mb: float = 25.0
    warmup: int = 2
    repeats: int = 8
    threads_per_rank: int | None = None  # None: cores // max_world_size (at least 1)
    device: str | None = None
    out: str = runs.DEFAULT_OUT
    timeout_s: float = 1800.0
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("max_world_size", "local_batch", "warmup", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def threads(self) -> int:
        if self.threads_per_rank:
            return self.threads_per_rank
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return max(1, (cores or os.cpu_count() or 1) // self.max_world_size)


@dataclass(frozen=True)
class ScalingPoint:
    world_size: int
    step_s: float  # median, slowest rank
    tokens_per_step: int

    @property
    def throughput(self) -> float:
        return self.tokens_per_step / self.step_s


@dataclass(frozen=True)
class ScalingResult:
    options: ScalingOptions
    ok: bool
    points: tuple[ScalingPoint, ...] = ()
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def speedup(self, p: ScalingPoint) -> float:
        return p.throughput / self.points[0].throughput

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "options": dataclasses.asdict(self.options),
            "points": [
                {
                    **dataclasses.asdict(p),
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
        }


def run_scaling(options: ScalingOptions) -> ScalingResult:
    device = options.device or runs.default_device(options.max_world_size)
    run_dir = runs.new_run_dir(options.out, "scaling", options.max_world_size, device)
    meta = runs.write_metadata(run_dir, dataclasses.asdict(options))
    machine = runs.describe_machine(meta["machine"])
    points = []
    for ws in range(1, options.max_world_size + 1):
        if options.progress:
            print(f"scaling: world size {ws}", file=sys.stderr, flush=True)
        run = launch(
            _rank_main,
            world_size=ws,
            args=(options,),
            timeout_s=options.timeout_s,
            backend=runs.backend_for(device),
        )
        if not run.ok:
            return ScalingResult(
                options, False, tuple(points), str(run_dir), machine, run.summary()
            )
        points.append(run.values[0])
    result = ScalingResult(options, True, tuple(points), str(run_dir), machine)
    chart = charts.curves(
        run_dir / "scaling.png",
        {
            "ideal": ([p.world_size for p in points], [p.world_size for p in points]),
            options.impl: ([p.world_size for p in points], [result.speedup(p) for p in points]),
        },
        xlabel="world size",
        ylabel="speed-up (throughput / throughput at 1)",
        title=f"weak scaling, {options.threads} thread(s) per rank",
    )
    result = dataclasses.replace(result, notes=tuple(n for n in [chart.note] if n))
    runs.write_json(run_dir / "scaling.json", result.to_dict())
    (run_dir / "scaling.txt").write_text(format_scaling(result) + "\n")
    return result


def _rank_main(ctx: RankContext, options: ScalingOptions) -> ScalingPoint:
    torch.set_num_threads(options.threads)
    workload = get_workload(
        "transformer", size_m=options.model_size_m, local_batch=options.local_batch
    )
    trainer = _Trainer(options.impl, workload, ctx, options.bucket_mb)
    batches = [
        workload.batch(i, ctx.world_size).shard(ctx.rank, ctx.world_size).to(ctx.device)
        for i in range(4)
    ]
    for i in range(options.warmup):
        trainer.step(batches[i % 4])
    times = [timed(lambda b=batches[i % 4]: trainer.step(b)) for i in range(options.repeats)]
    tokens = ctx.world_size * options.local_batch * workload.cfg.block_size
    return ScalingPoint(ctx.world_size, statistics.median(times), tokens)


def format_scaling(result: ScalingResult) -> str:
    from tabulate import tabulate

    o = result.options
    if not result.ok:
        return f"scaling failed:\n{result.failure}"
    rows = [
        [
            p.world_size,
            f"{p.step_s * 1e3:.1f}",
            f"{p.throughput:.0f}",
            f"{result.speedup(p):.2f}",
            f"{100 * result.speedup(p) / p.world_size:.0f}%",
        ]
        for p in result.points
    ]
    lines = [
        f"scaling: {o.impl}, {o.model_size_m:g}M-parameter transformer, local batch "
        f"{o.local_batch}, {o.threads} thread(s) per rank, median of {o.repeats} steps",
        f"machine: {result.machine}",
        "",
        tabulate(
            rows,
            headers=["world", "step ms", "tokens/s", "speed-up", "efficiency"],
            disable_numparse=True,
        ),
        "",
        f"written to {result.run_dir}",
    ]
    return "\n".join(lines + [f"note: {n}" for n in result.notes])
