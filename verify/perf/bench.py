"""`python -m verify bench`: every variant against PyTorch's DDP, ZeRO and FSDP2, side by side.

In ONE launch (the same ranks, the same process group, the same moment of machine noise), on
the transformer workload at one bucket size, every variant trained by the one trainer
(`training/trainer.py`):

1. **Step time.** Every variant, plus `local` (the same model and AdamW with no wrapper and
   no communication), is built up front; after warm-up they take turns, one step each,
   round-robin, the order rotating every round (`timing.interleave`). Each sample is the
   slowest rank's time (a step is as slow as its slowest rank). `step - local` estimates the
   communication left exposed. The sharded rungs are also compared with PyTorch's FSDP2
   (`torch-fsdp`), paired per round the same way.
2. **Bucket sweep.** `bucketed` and `torch-ddp` at several bucket sizes, interleaved the same
   way, beside the alpha-beta prediction (`alphabeta.py`) of the exposed communication,
   fitted from all-reduce times measured in the same launch and the measured backward time.
3. **Memory** (`bench_memory.py`). For the ladder's memory variants (`bucketed`, `zero1`,
   `torch-zero`, `zero2`, `zero3`, `torch-fsdp`): parameter, gradient and optimizer-state
   bytes per rank after construction, before and after the first optimizer step (plus the bytes
   the live tensors requested from CUDA's allocator, on GPUs), and the memory check's measure of each kind against 1/N of the
   unsharded total (`verify/checks/memory.py`). Each is built and stepped once on its own,
   after the timed variants are gone: CUDA's requested bytes count every live tensor of the
   process, so they are measured from what was requested before the variant was built.
4. **Bucket all-reduce bandwidth** (`bandwidth.py`): our bucket all-reduces on ready
   gradients against raw all-reduces of buffers of the same sizes.

The bars and their decisions are in `bench_result.py`; the report in `cli/text_bench.py`. The run
folder holds bench.json, bench.txt, breakdown.png and sweep.png.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

from impls.registry import DEFAULT_BUCKET_MB
from verify.launching import RankContext, launch
from verify.options import OutputOptions, knob, launch_knobs
from verify.perf import charts, collectives
from verify.perf.bandwidth import bucket_bandwidth
from verify.perf.base import (
    ALL,
    MeasureOptions,
    RunFolder,
    model_size,
    next_step,
    parameters,
    resolve_all,
    say,
    set_field,
)
from verify.perf.bench_memory import memory_alone
from verify.perf.bench_result import LOCAL, REFERENCE, BenchResult
from verify.perf.timing import interleave, timed
from verify.training.trainer import Trainer, TrainSpec, spec_from


@dataclass(frozen=True, kw_only=True)
class BenchOptions(MeasureOptions, OutputOptions):
    """What `bench` measures (module docstring)."""

    variants: tuple[str, ...] = knob(
        (ALL,),
        "variants to measure, comma-separated, or all (local, the model with no "
        "wrapper, is always measured)",
        flag="--impls",
    )
    world_size: int = knob(2, "ranks to start", minimum=1)
    model_size_m: float = model_size(10.0)
    local_batch: int = knob(4, "sequences per rank and step", minimum=1)
    bucket_mb: float = knob(
        DEFAULT_BUCKET_MB, "every variant's bucket size", unit="MB", positive=True
    )
    warmup: int = knob(2, "untimed steps of every variant first", minimum=1)
    repeats: int = knob(10, "interleaved rounds, one step of every variant each", minimum=1)
    sweep: bool = knob(True, "skip the bucket sweep", negate="--no-sweep")
    sweep_mb: tuple[float, ...] = knob(
        (1.0, 4.0, 25.0, 64.0), "bucket sizes of the sweep", unit="MB", positive=True
    )
    sweep_repeats: int = knob(5, "interleaved rounds of the sweep", minimum=1)
    sweep_impls: tuple[str, ...] = knob(("bucketed", REFERENCE), "variants swept", cli=False)
    bandwidth_repeats: int = knob(8, "rounds of the bandwidth bar", minimum=1, cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if LOCAL in self.variants:
            raise ValueError(f"{LOCAL!r} is always measured; it is not a variant name")
        set_field(self, "variants", resolve_all(self.variants, "bench"))
        resolve_all(self.sweep_impls, "bench")

    @property
    def sweep_sizes(self) -> tuple[float, ...]:
        return self.sweep_mb if self.sweep else ()

    def train_spec(self, impl: str | None, bucket_mb: float | None = None) -> TrainSpec:
        """The transformer every arm trains: the same weights on every rank and in every arm."""
        steps = self.warmup + self.repeats
        return spec_from(self, impl=impl, bucket_mb=bucket_mb or self.bucket_mb, steps=steps)


NO_FIT = (
    "no alpha-beta fit: the all-reduce times did not grow with size on this run (all latency, "
    "or the machine's noise), so no predicted exposed communication"
)


def run_bench(options: BenchOptions) -> BenchResult:
    """One launch (module docstring); the result, with bench.json, bench.txt and the charts
    in a new run folder."""
    folder = RunFolder.start(options, "bench", options.world_size)
    run = launch(
        bench_on_rank,
        world_size=options.world_size,
        args=(options,),
        **launch_knobs(options),
    )
    machine = folder.machine(run)
    if not run.ok:
        result = BenchResult.from_launch(options, run, run_dir=str(folder.path), machine=machine)
    else:
        values = run.values
        result = BenchResult.from_launch(
            options,
            run,
            memory=tuple(v.pop("memory") for v in values),
            run_dir=str(folder.path),
            machine=machine,
            **values[0],
        )
        notes = [c.note for c in _charts(result, folder) if c.note]
        if result.fit is None and options.world_size > 1:  # as `comm` says it
            notes.append(NO_FIT)
        result = replace(result, notes=tuple(dict.fromkeys(notes)))
    folder.save("bench", result)
    return result


# --- in each rank ---------------------------------------------------------------------------


def _rounds(ctx: RankContext, trainers: dict, rounds: int, what: str) -> dict:
    """`rounds` interleaved rounds of one step of every trainer: seconds, slowest rank."""
    arms = {
        name: (lambda t=t: timed(lambda: next_step(t), ctx.device)) for name, t in trainers.items()
    }
    return interleave(arms, rounds, lambda r: say(ctx, f"bench: {what}, round ", r, rounds))


def bench_on_rank(ctx: RankContext, options: BenchOptions) -> dict:
    """Parts 1-4 of the module docstring, in one process group."""
    say(ctx, f"bench: building {len(options.variants) + 1} variants")
    trainers = {
        name: Trainer(ctx, options.train_spec(None if name == LOCAL else name))
        for name in (LOCAL, *options.variants)
    }
    say(ctx, f"bench: {options.warmup} warm-up steps of every variant")
    for t in trainers.values():
        for _ in range(options.warmup):
            next_step(t)
    steps = _rounds(ctx, trainers, options.repeats, "step time")
    plan = {}
    if "zero1" in trainers:
        p = trainers["zero1"].optimizer.plan
        plan = {"bound": p.bound, "ideal": p.ideal, "loads": list(p.loads), "total": p.total}
    size = parameters(trainers[LOCAL].model)
    del trainers
    gc.collect()
    say(ctx, "bench: memory of each variant alone")
    memory, shards = memory_alone(ctx, options)

    sweep: dict[str, list[float]] = {}
    if options.sweep_sizes:
        trainers = {LOCAL: Trainer(ctx, options.train_spec(None))}
        for mb in options.sweep_sizes:
            for impl in options.sweep_impls:
                trainers[f"{impl}@{mb:g}"] = Trainer(ctx, options.train_spec(impl, mb))
        for t in trainers.values():
            next_step(t)
        sizes = ", ".join(f"{b:g}" for b in options.sweep_sizes)
        sweep = _rounds(ctx, trainers, options.sweep_repeats, f"bucket sweep over {sizes} MB")
        del trainers
        gc.collect()
    say(ctx, "bench: all-reduce fit and backward time")
    grad_bytes, backward_s = collectives.measure_backward(ctx, options.model_size_m)
    fit = collectives.fit_in_launch(ctx, grad_bytes)
    say(ctx, "bench: bucket all-reduce bandwidth")
    bandwidth = bucket_bandwidth(ctx, options.train_spec("bucketed"), options.bandwidth_repeats)
    return {
        "steps": steps,
        "sweep": sweep,
        "memory": memory,
        "shards": shards,
        "plan": plan,
        "fit": fit,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
        "bandwidth": bandwidth,
        "parameters": size,
    }


def _charts(result: BenchResult, folder: RunFolder) -> list[charts.Chart]:
    """breakdown.png (compute vs exposed communication per variant) and sweep.png."""
    o, local = result.options, result.median(LOCAL)
    rows = [
        (
            name,
            {
                "compute (local step)": local * 1e3,
                "exposed communication (step - local)": max(0.0, result.median(name) - local) * 1e3,
            },
        )
        for name in result.steps
    ]
    title = f"median step, world size {o.world_size}, bucket {o.bucket_mb:g} MB"
    out = [charts.step_breakdown(folder.path / "breakdown.png", rows, title=title)]
    if result.sweep:
        series = {
            f"{impl} (measured)": [  # below the noise (negative): not drawn
                _drawn(result.sweep_exposed(f"{impl}@{mb:g}")) for mb in o.sweep_sizes
            ]
            for impl in o.sweep_impls
        }
        if result.fit is not None:
            series["alpha-beta prediction"] = [
                result.predicted_exposed(mb) * 1e3 for mb in o.sweep_sizes
            ]
        out.append(
            charts.sweep(
                folder.path / "sweep.png",
                o.sweep_sizes,
                series,
                ylabel="exposed ms per step (step - local)",
                title=f"bucket-size sweep, world size {o.world_size}",
            )
        )
    return out


def _drawn(seconds: float) -> float | None:
    return None if seconds < 0 else seconds * 1e3
