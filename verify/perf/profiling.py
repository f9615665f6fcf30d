"""`python -m verify profile`: every variant under torch.profiler, traces for TensorBoard.

Each rank trains the transformer workload under `torch.profiler.profile` with a
wait / warm-up / active schedule (CPU activity always, CUDA activity on GPUs; shapes and memory
recorded) and marks each step's phases with `record_function` ranges: `forward`, `backward`,
`grad_sync` (the wrapper's `finish_gradient_synchronization()`, when it has one) and
`optimizer_step`. The built-in variants add their own ranges inside those (`<Class>.launch[k]`
when bucket k goes on the wire, `<Class>.wait[k]`, `zero1.step`, `zero1.sync_params`), and the
backend adds one range per collective (`gloo:all_reduce`, ...) on its own threads, so a trace
shows which bucket is on the wire while which layer computes.

Layout of a run (never written over; see `runs.new_run_dir`)::

    profiles/<impl>_<world>x<device>_<stamp>/
        metadata.json               command, options, torch version, hardware, date
        summary.json                the numbers printed (see verify/traces.py)
        rank0.<n>.pt.trace.json     one trace per rank (TensorBoard worker "rank0", ...)
        rank1.<n>.pt.trace.json

With `--impl all` the folder is `profiles/all_<world>x<device>_<stamp>/` with one sub-folder
per variant, which TensorBoard lists as runs side by side. Open either with
`tensorboard --logdir <folder>`; the same JSON files open in https://ui.perfetto.dev and
chrome://tracing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    schedule,
    tensorboard_trace_handler,
)

from impls.registry import REGISTRY, resolve
from verify import runs
from verify.launching import RankContext, launch
from verify.perf import charts, traces
from verify.training.workloads import get_workload

DEFAULT_MODEL_M = 5.0
DEFAULT_PROFILE_BUCKET_MB = 4.0  # several buckets in the 5M model, so overlap is visible


def all_variants() -> list[str]:
    """What `--impl all` profiles: the built-in ladder and PyTorch's references."""
    return [n for n, i in REGISTRY.items() if i.source in ("builtin", "reference")]


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    impl: str = "bucketed"  # a registered name, a class spec, or "all"
    world_size: int = 2
    wait: int = 1
    warmup: int = 1
    active: int = 3
    model_size_m: float | None = DEFAULT_MODEL_M  # None: the tiny default GPT
    local_batch: int = 4
    bucket_mb: float = DEFAULT_PROFILE_BUCKET_MB
    device: str | None = None  # None: cuda if every rank gets a GPU, else cpu
    out: str = runs.DEFAULT_OUT
    timeout_s: float = 900.0
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "active", "local_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("wait", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for name in self.variants:
            resolve(name)  # a bad --impl fails here, before any rank starts

    @property
    def variants(self) -> list[str]:
        return all_variants() if self.impl == "all" else [self.impl]


@dataclass(frozen=True)
class ProfileResult:
    options: ProfileOptions
    ok: bool
    run_dir: Path | None = None
    summaries: tuple[traces.VariantSummary, ...] = ()
    trace_dirs: dict = field(default_factory=dict)  # impl -> folder holding its rank traces
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "options": dataclasses.asdict(self.options),
            "run_dir": str(self.run_dir) if self.run_dir else None,
            "trace_dirs": {k: str(v) for k, v in self.trace_dirs.items()},
            "machine": self.machine,
            "summaries": [s.to_dict() for s in self.summaries],
            "failure": self.failure,
            "notes": list(self.notes),
        }


def run_profile(options: ProfileOptions) -> ProfileResult:
    """Profile every requested variant in one launch, then read the traces back."""
    device = options.device or runs.default_device(options.world_size)
    run_dir = runs.new_run_dir(options.out, options.impl, options.world_size, device)
    meta = runs.write_metadata(run_dir, dataclasses.asdict(options))
    machine = runs.describe_machine(meta["machine"])
    several = len(options.variants) > 1
    trace_dirs = {v: (run_dir / _folder(v) if several else run_dir) for v in options.variants}
    progress = runs.Progress(run_dir / "progress.log" if options.progress else None)
    with runs.relay_progress(progress):
        run = launch(
            _rank_main,
            world_size=options.world_size,
            args=(options, {k: str(v) for k, v in trace_dirs.items()}, progress),
            timeout_s=options.timeout_s,
            backend=runs.backend_for(device),
        )
    if not run.ok:
        return ProfileResult(options, False, run_dir, (), trace_dirs, machine, run.summary())
    summaries = tuple(traces.analyze_run(trace_dirs[v], v)[0] for v in options.variants)
    notes = []
    chart = charts.step_breakdown(
        run_dir / "breakdown.png",
        [(s.impl, s.phases_ms) for s in summaries],
        title=f"phases per step (profiled, world size {options.world_size})",
    )
    notes.append(chart.note)
    for impl in options.variants:  # rank 0's first profiled step, as lanes
        rank0 = traces.find_traces(trace_dirs[impl]).get("rank0")
        rows = traces.timeline(traces.load_trace(rank0)) if rank0 else []
        if rows:
            chart = charts.timeline(
                run_dir / f"timeline_{_folder(impl)}.png",
                rows,
                title=f"{impl}: one step on rank 0 (world size {options.world_size})",
            )
            notes.append(chart.note)
    result = ProfileResult(
        options,
        True,
        run_dir,
        summaries,
        trace_dirs,
        machine,
        None,
        tuple(dict.fromkeys(n for n in notes if n)),
    )
    runs.write_json(run_dir / "summary.json", result.to_dict())
    (run_dir / "summary.txt").write_text(format_profile(result) + "\n")
    return result


def _folder(impl: str) -> str:
    return "".join(c if c.isalnum() or c in ".+-" else "-" for c in impl)


def _rank_main(ctx: RankContext, options: ProfileOptions, trace_dirs: dict, progress) -> None:
    for n, impl_name in enumerate(options.variants, 1):
        progress(f"profile: {impl_name} ({n}/{len(options.variants)})", rank=ctx.rank)
        _profile_variant(ctx, options, impl_name, trace_dirs[impl_name])


def _profile_variant(ctx: RankContext, options: ProfileOptions, impl_name: str, out: str):
    impl = resolve(impl_name)
    workload = get_workload(
        "transformer", size_m=options.model_size_m, local_batch=options.local_batch
    )
    torch.manual_seed(0)
    model = workload.build().to(ctx.device)
    wrapped = impl.wrap(model, bucket_size_mb=options.bucket_mb, find_unused_parameters=False)
    optimizer = impl.make_optimizer(workload.param_groups(model), torch.optim.AdamW)
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    on_start = getattr(wrapped, "on_train_batch_start", None)
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = options.wait + options.warmup + options.active
    with profile(
        activities=activities,
        schedule=schedule(wait=options.wait, warmup=options.warmup, active=options.active),
        on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{ctx.rank}"),
        record_shapes=True,
        profile_memory=True,
    ) as prof:
        for step in range(steps):
            batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
            batch = batch.to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            if on_start is not None:
                on_start()
            with record_function("forward"):
                loss = workload.loss(wrapped, batch)
            with record_function("backward"):
                loss.backward()
            if finish is not None:
                with record_function("grad_sync"):
                    finish()
            with record_function("optimizer_step"):
                optimizer.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()  # so each ProfilerStep range holds its own kernels
            prof.step()


# --- formatting -----------------------------------------------------------------------------


def format_profile(result: ProfileResult) -> str:
    from tabulate import tabulate

    o = result.options
    if not result.ok:
        return f"profile failed:\n{result.failure}"
    size = f"{o.model_size_m:g}M-parameter" if o.model_size_m else "tiny"
    lines = [
        f"profile: {', '.join(o.variants)} on a {size} transformer, world size "
        f"{o.world_size}, bucket {o.bucket_mb:g} MB, {o.active} active steps "
        f"(after {o.wait} wait + {o.warmup} warm-up)",
        f"machine: {result.machine}",
        "",
    ]
    rows = []
    for s in result.summaries:
        overlap = "-" if s.overlap is None else f"{100 * s.overlap:.0f}%"
        rows.append(
            [
                s.impl,
                f"{s.step_ms:.1f}",
                f"{s.compute_ms:.1f}",
                f"{s.comm_ms:.1f}",
                f"{s.exposed_ms:.1f}",
                overlap,
                f"{s.collectives:g}",
                f"{s.bytes / 2**20:.1f}",
            ]
        )
    headers = ["impl", "step ms", "compute ms", "comm ms", "exposed ms", "overlap", "colls", "MiB"]
    lines.append(tabulate(rows, headers=headers, disable_numparse=True))
    lines.append("")
    rows = [[s.impl] + [f"{s.phases_ms[p]:.1f}" for p in traces.PHASES] for s in result.summaries]
    lines.append(
        tabulate(rows, headers=["impl", *(f"{p} ms" for p in traces.PHASES)], disable_numparse=True)
    )
    lines += [
        "",
        "means per step and rank, from the written traces; comm = union of gloo/NCCL "
        "collective ranges, exposed = comm while the training thread ran no operator",
        f"traces: {result.run_dir}",
        f"open:   tensorboard --logdir {result.run_dir}   (or load a .pt.trace.json file "
        "in https://ui.perfetto.dev)",
    ]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
