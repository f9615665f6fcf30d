"""`python -m verify profile`: every variant under torch.profiler, traces for TensorBoard.

Each rank trains the transformer workload through the one trainer (`training/trainer.py`)
under `torch.profiler.profile` with a wait / warm-up / active schedule (CPU activity always,
CUDA activity on GPUs; shapes and memory recorded). The trainer marks each step's phases with
`record_function` ranges: `forward`, `backward`, `grad_sync` (the wrapper's
`finish_gradient_synchronization()`, when it has one) and `optimizer_step`. The built-in
variants add their own ranges inside those (`<Class>.launch[k]` when bucket k goes on the
wire, `<Class>.wait[k]`, `zero1.step`, `zero1.sync_params`), and the backend adds one range
per collective (`gloo:all_reduce`, ...) on its own threads, so a trace shows which bucket is
on the wire while which layer computes.

Layout of a run (never written over; see `runs.new_run_dir`)::

    profiles/<impl>_<world>x<device>_<stamp>/
        metadata.json               command, options, torch, hardware, date, thread budget
        summary.json, summary.txt   the numbers printed (see traces.py)
        rank0.<n>.pt.trace.json     one trace per rank (TensorBoard worker "rank0", ...)
        rank1.<n>.pt.trace.json

With `--impl all` the folder is `profiles/all_<world>x<device>_<stamp>/` with one sub-folder
per variant, which TensorBoard lists as runs side by side. Open either with
`tensorboard --logdir <folder>`; the same JSON files open in https://ui.perfetto.dev and
chrome://tracing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from verify.launching import RankContext, launch
from verify.options import OutputOptions, knob, launch_knobs
from verify.perf import charts, traces
from verify.perf.base import ALL, Measured, MeasureOptions, RunFolder, model_size, resolve_all, say
from verify.training.trainer import Trainer, TrainSpec, spec_from

DEFAULT_MODEL_M = 5.0
DEFAULT_PROFILE_BUCKET_MB = 4.0  # several buckets in the 5M model, so overlap is visible


@dataclass(frozen=True, kw_only=True)
class ProfileOptions(MeasureOptions, OutputOptions):
    """Which variants to profile, on what, and the profiler's schedule."""

    impl: str = knob(
        help="a registered name, package.module:Class, path/to/file.py:Class, or all (every "
        "built-in and PyTorch reference, side by side)",
    )
    world_size: int = knob(2, "ranks to start", minimum=1)
    wait: int = knob(1, "steps before the profiler starts", minimum=0)
    warmup: int = knob(1, "profiler warm-up steps (recorded, then discarded)", minimum=0)
    active: int = knob(3, "profiled steps", flag="--steps", minimum=1)
    model_size_m: float | None = model_size(DEFAULT_MODEL_M)
    local_batch: int = knob(4, "sequences per rank and step", minimum=1)
    bucket_mb: float = knob(
        DEFAULT_PROFILE_BUCKET_MB,
        "bucket size given to wrappers that take one",
        unit="MB",
        positive=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_all((self.impl,), "profile")  # a bad --impl fails here, before any rank starts

    @property
    def variants(self) -> tuple[str, ...]:
        return resolve_all((self.impl,), "profile") if self.impl == ALL else (self.impl,)

    def train_spec(self, impl: str) -> TrainSpec:
        return spec_from(self, impl=impl, steps=self.wait + self.warmup + self.active)


@dataclass(frozen=True)
class ProfileResult(Measured):
    """The run folder, each variant's summary read back from its traces, where they are."""

    options: ProfileOptions
    verdict: str
    run_dir: Path | None = None
    summaries: tuple[traces.VariantSummary, ...] = ()
    trace_dirs: dict = field(default_factory=dict)  # impl -> folder holding its rank traces
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "options": self.options.to_dict(),
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "trace_dirs": {k: str(v) for k, v in self.trace_dirs.items()},
            "machine": self.machine,
            "summaries": [s.to_dict() for s in self.summaries],
            "failure": self.failure,
            "notes": list(self.notes),
        }


def run_profile(options: ProfileOptions) -> ProfileResult:
    """Profile every requested variant in one launch, then read the traces back."""
    folder = RunFolder.start(options, options.impl, options.world_size)
    several = len(options.variants) > 1
    trace_dirs = {
        v: (folder.path / _folder(v) if several else folder.path) for v in options.variants
    }
    run = launch(
        profile_on_rank,
        world_size=options.world_size,
        args=(options, {k: str(v) for k, v in trace_dirs.items()}),
        **launch_knobs(options),
    )
    machine = folder.machine(run)
    if not run.ok:
        result = ProfileResult.from_launch(
            options, run, run_dir=folder.path, trace_dirs=trace_dirs, machine=machine
        )
        folder.save("summary", result)
        return result
    summaries = tuple(traces.analyze_run(trace_dirs[v], v)[0] for v in options.variants)
    notes = [
        charts.step_breakdown(
            folder.path / "breakdown.png",
            [(s.impl, s.phases_ms) for s in summaries],
            title=f"phases per step (profiled, world size {options.world_size})",
        ).note
    ]
    for impl in options.variants:  # rank 0's first profiled step, as lanes
        rank0 = traces.find_traces(trace_dirs[impl]).get("rank0")
        rows = traces.timeline(traces.load_trace(rank0)) if rank0 else []
        if rows:
            notes.append(
                charts.timeline(
                    folder.path / f"timeline_{_folder(impl)}.png",
                    rows,
                    title=f"{impl}: one step on rank 0 (world size {options.world_size})",
                ).note
            )
    result = ProfileResult.from_launch(
        options,
        run,
        run_dir=folder.path,
        summaries=summaries,
        trace_dirs=trace_dirs,
        machine=machine,
        notes=tuple(dict.fromkeys(n for n in notes if n)),
    )
    folder.save("summary", result)
    return result


def _folder(impl: str) -> str:
    return "".join(c if c.isalnum() or c in ".+-" else "-" for c in impl)


def profile_on_rank(ctx: RankContext, options: ProfileOptions, trace_dirs: dict) -> None:
    """Each variant in turn: the one trainer's steps under the profiler."""
    for n, impl in enumerate(options.variants, 1):
        say(ctx, f"profile: {impl} (", n, len(options.variants), ")")
        _profile_variant(ctx, options, impl, trace_dirs[impl])


def _profile_variant(ctx: RankContext, options: ProfileOptions, impl: str, out: str) -> None:
    trainer = Trainer(ctx, options.train_spec(impl))
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities,
        schedule=schedule(wait=options.wait, warmup=options.warmup, active=options.active),
        on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{ctx.rank}"),
        record_shapes=True,
        profile_memory=True,
    ) as prof:
        for step in range(1, trainer.spec.steps + 1):
            trainer.step(step)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)  # so each ProfilerStep holds its own kernels
            prof.step()
