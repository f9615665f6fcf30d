"""`python -m verify bench`: every variant against PyTorch's DDP and ZeRO, measured side by side.

In ONE launch (the same ranks, the same process group, the same moment of machine noise), on
the transformer workload at one bucket size:

1. **Step time.** Every variant, plus `local` (the same model and AdamW with no wrapper and
   no communication), is built up front; after warm-up they take turns, one step each,
   round-robin (the order rotates every round so none always runs first). Each sample is the
   slowest rank's time (a step is as slow as its slowest rank). Medians and minimums, as
   ratios to `torch-ddp`. `step - local` estimates the communication left exposed.
2. **Bucket sweep.** `bucketed` and `torch-ddp` at several bucket sizes, interleaved the same
   way, beside the alpha-beta prediction (`verify.comm`) of the exposed communication, fitted
   from all-reduce times measured in the same launch and the measured backward time.
3. **ZeRO-1 memory.** For `zero1`, `torch-zero` and unsharded `bucketed` + AdamW: parameter,
   gradient and optimizer-state bytes after construction, before and after the first
   optimizer step (plus CUDA allocated bytes on GPUs), per rank; the largest rank's state
   against the ideal total / N and against the bound whole-parameter sizes allow.
4. **Bucket all-reduce bandwidth.** `BucketedDDP`'s bucket all-reduces on ready gradients,
   from the first launch to the last completion (the copy of each bucket into its buffer
   happens in between, while earlier buckets are on the wire), against raw all-reduces of
   buffers of the same sizes launched the same way: the bus bandwidth our buckets reach as a
   fraction of the raw one. The whole synchronization (plus copy-back and usage map) is
   reported beside it.

The bars (issue 5) are checked in `BenchResult.bars()`; a missed bar is reported, not hidden.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from impls.bucketed import BucketedDDP
from impls.registry import DEFAULT_BUCKET_MB, resolve
from verify import runs
from verify.launching import RankContext, launch
from verify.perf import charts, comm
from verify.perf.comm import MiB, timed
from verify.perf.profiling import all_variants
from verify.training.workloads import get_workload

LOCAL = "local"  # no wrapper, no communication: the compute-only reference
REFERENCE = "torch-ddp"
MEMORY_VARIANTS = ("zero1", "torch-zero", "bucketed")
BAR_DDP, BAR_STATE, BAR_ZERO, BAR_BUSBW = 1.05, 1.01, 1.0, 0.8


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    variants: tuple[str, ...] = tuple(all_variants())
    world_size: int = 2
    model_size_m: float = 10.0
    local_batch: int = 4
    bucket_mb: float = DEFAULT_BUCKET_MB
    warmup: int = 2
    repeats: int = 10
    sweep_mb: tuple[float, ...] = (1.0, 4.0, 25.0, 64.0)
    sweep_impls: tuple[str, ...] = ("bucketed", REFERENCE)
    sweep_repeats: int = 5
    bandwidth_repeats: int = 8
    device: str | None = None
    out: str = runs.DEFAULT_OUT
    timeout_s: float = 3600.0
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "local_batch", "warmup", "repeats", "bandwidth_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sweep_mb and self.sweep_repeats < 1:
            raise ValueError("sweep_repeats must be >= 1")
        if not self.bucket_mb > 0 or any(not b > 0 for b in self.sweep_mb):
            raise ValueError("bucket sizes must be > 0")
        for name in (*self.variants, *self.sweep_impls):
            resolve(name)
        if LOCAL in self.variants:
            raise ValueError(f"{LOCAL!r} is always measured; it is not a variant name")


@dataclass(frozen=True)
class Bar:
    what: str
    value: float | None
    goal: str
    met: bool | None  # None: could not be measured in this run
    detail: str = ""


@dataclass(frozen=True)
class BenchResult:
    options: BenchOptions
    ok: bool
    steps: dict = field(default_factory=dict)  # name -> seconds per sample (slowest rank)
    sweep: dict = field(default_factory=dict)  # "impl@mb" -> seconds; LOCAL -> seconds
    memory: tuple = ()  # per rank: {impl: {phase: {params, grads, optimizer, allocated}}}
    plan: dict = field(default_factory=dict)  # zero1's ShardPlan numbers (parameter bytes)
    fit: comm.AlphaBeta | None = None
    grad_bytes: int = 0
    backward_s: float = 0.0
    bandwidth: dict = field(default_factory=dict)
    parameters: int = 0
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def median(self, name: str, table: str = "steps") -> float:
        return statistics.median(getattr(self, table)[name])

    def state_bytes(self, impl: str) -> list[int]:
        """Optimizer-state bytes on each rank after the first step."""
        return [rank[impl]["after step"]["optimizer"] for rank in self.memory if impl in rank]

    def predicted_exposed(self, bucket_mb: float) -> float | None:
        if self.fit is None or not self.grad_bytes:
            return None
        return comm.predict_exposed(self.fit, self.grad_bytes, self.backward_s, bucket_mb * MiB)

    def paired(self, a: str, b: str) -> float:
        """Median over rounds of a's step / b's step in the same round. The variants of one
        round ran seconds apart, so this cancels the machine's load drifting between rounds,
        which a ratio of two medians does not."""
        return statistics.median(x / y for x, y in zip(self.steps[a], self.steps[b]))

    def sweep_exposed(self, key: str) -> float:
        """Median over the sweep's rounds of (step - local step) in seconds, paired per round."""
        return statistics.median(x - loc for x, loc in zip(self.sweep[key], self.sweep[LOCAL]))

    def exposed_share(self, name: str) -> float:
        """Median over rounds of (step - local step) / step, paired per round."""
        return statistics.median(
            (x - loc) / x for x, loc in zip(self.steps[name], self.steps[LOCAL])
        )

    def bars(self) -> list[Bar]:
        """The issue's bars; step-time ratios are paired per round (see `paired`), with the
        ratio of medians and of minimums beside them."""
        out = []

        def step_bar(what: str, a: str, b: str, goal: float) -> Bar:
            r = self.paired(a, b)
            detail = (
                f"ratio of medians {self.median(a) / self.median(b):.3f}, "
                f"of minimums {min(self.steps[a]) / min(self.steps[b]):.3f}"
            )
            return Bar(what, r, f"<= {goal}", r <= goal, detail)

        if {"bucketed", REFERENCE} <= self.steps.keys():
            out.append(step_bar("bucketed / torch-ddp step time", "bucketed", REFERENCE, BAR_DDP))
        if "zero1" in self.steps and self.memory and self.state_bytes("zero1"):
            state = self.state_bytes("zero1")
            ideal = sum(state) / len(state)
            r, bound = max(state) / ideal, self.plan["bound"] / self.plan["ideal"]
            goal = f"<= {max(BAR_STATE, bound):.4f}" + (" (the bound)" if bound > BAR_STATE else "")
            out.append(
                Bar(
                    "zero1 largest rank's optimizer state / (total / N)",
                    r,
                    goal,
                    r <= max(BAR_STATE, bound * 1.0005),
                    f"bound whole parameters allow: {bound:.4f} (in parameter bytes)",
                )
            )
            unsharded = self.state_bytes("bucketed")
            if unsharded:
                out.append(
                    Bar(
                        "zero1 state summed over ranks / unsharded AdamW state",
                        sum(state) / unsharded[0],
                        "== 1",
                        sum(state) == unsharded[0],
                        f"{sum(state)} vs {unsharded[0]} bytes",
                    )
                )
        if {"zero1", "torch-zero"} <= self.steps.keys():
            out.append(step_bar("zero1 / torch-zero step time", "zero1", "torch-zero", BAR_ZERO))
        if self.bandwidth:
            b = self.bandwidth
            r = statistics.median(raw / ours for raw, ours in zip(b["raw_s"], b["ours_s"]))
            out.append(
                Bar(
                    "bucket all-reduce busbw / raw all_reduce busbw",
                    r,
                    f">= {BAR_BUSBW}",
                    r >= BAR_BUSBW,
                    f"{len(b['buckets'])} buckets, {sum(b['buckets']) / MiB:.1f} MiB; ratio of "
                    f"medians {statistics.median(b['raw_s']) / statistics.median(b['ours_s']):.3f}",
                )
            )
        return out

    def to_dict(self) -> dict:
        d = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("options", "fit", "memory")
        }
        d["options"] = dataclasses.asdict(self.options)
        d["memory"] = list(self.memory)
        d["alpha_beta"] = dataclasses.asdict(self.fit) if self.fit else None
        if self.ok:
            d["medians_s"] = {k: self.median(k) for k in self.steps}
            d["bars"] = [dataclasses.asdict(b) for b in self.bars()]
        return d


def run_bench(options: BenchOptions) -> BenchResult:
    device = options.device or runs.default_device(options.world_size)
    run_dir = runs.new_run_dir(options.out, "bench", options.world_size, device)
    meta = runs.write_metadata(run_dir, dataclasses.asdict(options))
    progress = runs.Progress(run_dir / "progress.log" if options.progress else None)
    with runs.relay_progress(progress):
        run = launch(
            _rank_main,
            world_size=options.world_size,
            args=(options, progress),
            timeout_s=options.timeout_s,
            backend=runs.backend_for(device),
        )
    machine = runs.describe_machine(meta["machine"])
    if not run.ok:
        return BenchResult(
            options, False, run_dir=str(run_dir), machine=machine, failure=run.summary()
        )
    values = run.values
    result = BenchResult(
        options,
        True,
        memory=tuple(v.pop("memory") for v in values),
        run_dir=str(run_dir),
        machine=machine,
        **values[0],
    )
    notes = [c.note for c in _charts(result, run_dir) if c.note]
    result = dataclasses.replace(result, notes=tuple(dict.fromkeys(notes)))
    runs.write_json(run_dir / "bench.json", result.to_dict())
    (run_dir / "bench.txt").write_text(format_bench(result) + "\n")
    return result


# --- in each rank ---------------------------------------------------------------------------


class _Trainer:
    """One model + wrapper + optimizer; `step()` is one full training step."""

    def __init__(self, impl_name: str, workload, ctx: RankContext, bucket_mb: float) -> None:
        torch.manual_seed(0)
        self.model = workload.build().to(ctx.device)
        self.workload, self.device = workload, ctx.device
        groups = workload.param_groups(self.model)
        if impl_name == LOCAL:
            self.wrapped, self.optimizer = self.model, torch.optim.AdamW(groups)
        else:
            impl = resolve(impl_name)
            self.wrapped = impl.wrap(self.model, bucket_size_mb=bucket_mb)
            self.optimizer = impl.make_optimizer(groups, torch.optim.AdamW)
        self.finish = getattr(self.wrapped, "finish_gradient_synchronization", None)
        self.on_start = getattr(self.wrapped, "on_train_batch_start", None)

    def step(self, batch, probe: Callable[[str], None] | None = None) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_start is not None:
            self.on_start()
        self.workload.loss(self.wrapped, batch).backward()
        if self.finish is not None:
            self.finish()
        if probe:
            probe("before step")
        self.optimizer.step()
        if probe:
            probe("after step")
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model_state(self) -> dict:
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        params = list(self.model.parameters())
        return {
            "params": nbytes(params),
            "grads": nbytes(p.grad for p in params),
            "optimizer": optimizer_state_bytes(self.optimizer),
            "allocated": torch.cuda.memory_allocated() if self.device.type == "cuda" else None,
        }


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors this rank holds (the local shard of a sharded optimizer)."""
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        inner = getattr(optimizer, "inner", optimizer)  # ours
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _round_robin(trainers: dict, batches: list, repeats: int, say) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for r in range(repeats):
        say(f"round {r + 1}/{repeats}")
        for name in names[r % len(names) :] + names[: r % len(names)]:
            batch = batches[r % len(batches)]
            times[name].append(timed(lambda t=trainers[name], b=batch: t.step(b)))
    return times


def _rank_main(ctx: RankContext, options: BenchOptions, progress: runs.Progress) -> dict:
    def say(msg: str) -> None:
        progress(f"bench: {msg}", rank=ctx.rank)

    workload = get_workload(
        "transformer", size_m=options.model_size_m, local_batch=options.local_batch
    )
    batches = [
        workload.batch(i, ctx.world_size).shard(ctx.rank, ctx.world_size).to(ctx.device)
        for i in range(4)
    ]
    # 1. step time of every variant, and memory of the ZeRO comparison
    say(f"building {len(options.variants) + 1} variants")
    memory: dict[str, dict] = {}
    trainers = {}
    for name in (LOCAL, *options.variants):
        trainers[name] = _Trainer(name, workload, ctx, options.bucket_mb)
        if name in MEMORY_VARIANTS:
            memory[name] = {"after construction": trainers[name].model_state()}
    say("warm-up")
    for name, t in trainers.items():
        for i in range(options.warmup):
            probe = None
            if i == 0 and name in memory:

                def probe(phase, t=t, name=name):
                    memory[name][phase] = t.model_state()

            t.step(batches[i % len(batches)], probe)
    steps = _round_robin(trainers, batches, options.repeats, say)
    plan = {}
    if "zero1" in trainers:
        p = trainers["zero1"].optimizer.plan
        plan = {"bound": p.bound, "ideal": p.ideal, "loads": list(p.loads), "total": p.total}
    parameters = sum(p.numel() for p in trainers[LOCAL].model.parameters())
    del trainers
    gc.collect()

    # 2. bucket sweep, and what the alpha-beta model predicts for it
    sweep: dict[str, list[float]] = {}
    if options.sweep_mb:
        say(f"bucket sweep over {', '.join(f'{b:g}' for b in options.sweep_mb)} MB")
        trainers = {LOCAL: _Trainer(LOCAL, workload, ctx, options.bucket_mb)}
        for mb in options.sweep_mb:
            for impl in options.sweep_impls:
                trainers[f"{impl}@{mb:g}"] = _Trainer(impl, workload, ctx, mb)
        for t in trainers.values():
            t.step(batches[0])
        sweep = _round_robin(trainers, batches, options.sweep_repeats, say)
        del trainers
        gc.collect()
    say("all-reduce fit and backward time")
    grad_bytes, backward_s = comm.measure_backward(ctx, options.model_size_m)
    fit = _fit_all_reduce(ctx, grad_bytes)

    # 3. our bucket all-reduces against raw ones of the same sizes
    say("bucket all-reduce bandwidth")
    bandwidth = _bucket_bandwidth(ctx, workload, options, batches[0])
    return {
        "steps": steps,
        "sweep": sweep,
        "memory": memory,
        "plan": plan,
        "fit": fit,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
        "bandwidth": bandwidth,
        "parameters": parameters,
    }


def _fit_all_reduce(ctx: RankContext, grad_bytes: int, repeats: int = 3) -> comm.AlphaBeta | None:
    if ctx.world_size == 1:
        return None
    sizes = [s for s in (64 * 1024, MiB // 4, MiB, 4 * MiB, 16 * MiB, 64 * MiB)]
    sizes = [s for s in sizes if s <= max(grad_bytes, 4 * MiB)]
    calls = {s: comm.collective_call("all_reduce", s, ctx) for s in sizes}
    for fn in calls.values():
        fn()
    samples = {s: [timed(calls[s], comm._inner(s)) for _ in range(repeats)] for s in sizes}
    try:
        return comm.fit_alpha_beta(sizes, [statistics.median(v) for v in samples.values()])
    except ValueError:  # noise swamped the size dependence: no prediction this run
        return None


def _bucket_bandwidth(ctx: RankContext, workload, options: BenchOptions, batch) -> dict:
    """Our bucket all-reduces on the wire against raw all-reduces of buffers of the same sizes.

    Gradients are made ready under `no_sync()`, then `finish_gradient_synchronization()`
    launches every bucket (copying each in just before its launch), waits, and copies back.
    "On the wire" is measured the same way for both: from the first all-reduce's launch on the
    last rank to launch it, to the last one's completion on the last rank to see it (stamped
    by a callback on its Work's future), so the copy of bucket k+1 while bucket k is in
    flight counts against us, as it does in training; how much later a rank launches its
    first bucket because it copied slower does not (that is the copy's cost, not the
    collective's). The whole synchronization, copies included, is reported beside it.
    Interleaved, paired per round.
    """
    if ctx.world_size == 1:
        return {}
    torch.manual_seed(0)
    model = workload.build().to(ctx.device)
    ddp = BucketedDDP(model, bucket_size_mb=options.bucket_mb)
    raw = [torch.zeros_like(b.buffer) for b in ddp.buckets]
    stamps: list[list[float]] = []

    def stamped(work: dist.Work) -> dist.Work:
        rec = [time.perf_counter(), float("nan")]
        stamps.append(rec)
        work.get_future().add_done_callback(
            lambda _, rec=rec: rec.__setitem__(1, time.perf_counter())
        )
        return work

    launch_bucket = ddp._all_reduce_async
    ddp._all_reduce_async = lambda tensor: stamped(launch_bucket(tensor))

    def ours() -> None:
        ddp.finish_gradient_synchronization()

    def raw_all_reduce() -> None:
        for work in [stamped(dist.all_reduce(t, async_op=True)) for t in raw]:
            work.wait()

    out: dict[str, list[float]] = {"ours_s": [], "raw_s": [], "ours_sync_s": []}
    for r in range(options.bandwidth_repeats + 1):
        with ddp.no_sync():  # gradients ready, nothing launched: the sync alone is timed
            workload.loss(ddp, batch).backward()
        pair = [(ours, "ours"), (raw_all_reduce, "raw")]
        for fn, key in pair if r % 2 else pair[::-1]:
            stamps.clear()
            total = timed(fn)
            # The collectives are on the wire from the moment the LAST rank launched the first
            # one (none can progress before) until the last one completes on every rank.
            # Ranks on one host share perf_counter's clock (CLOCK_MONOTONIC).
            edges = torch.tensor(
                [min(s for s, _ in stamps), max(e for _, e in stamps)], dtype=torch.float64
            )
            dist.all_reduce(edges, op=dist.ReduceOp.MAX)
            wire = float(edges[1] - edges[0])
            if r:  # the first round is warm-up
                out[f"{key}_s"].append(wire)
                if key == "ours":
                    out["ours_sync_s"].append(total)
    out["buckets"] = [b.buffer.numel() * b.buffer.element_size() for b in ddp.buckets]
    return out


# --- charts and formatting ------------------------------------------------------------------


def _charts(result: BenchResult, run_dir) -> list[charts.Chart]:
    local = result.median(LOCAL)
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
    out = [
        charts.step_breakdown(
            run_dir / "breakdown.png",
            rows,
            title=f"median step, world size {result.options.world_size}, "
            f"bucket {result.options.bucket_mb:g} MB",
        )
    ]
    if result.sweep:
        o = result.options
        series = {
            f"{impl} (measured)": [
                result.sweep_exposed(f"{impl}@{mb:g}") * 1e3 for mb in o.sweep_mb
            ]
            for impl in o.sweep_impls
        }
        if result.fit is not None:
            series["alpha-beta prediction"] = [
                result.predicted_exposed(mb) * 1e3 for mb in o.sweep_mb
            ]
        out.append(
            charts.sweep(
                run_dir / "sweep.png",
                o.sweep_mb,
                series,
                ylabel="exposed ms per step (step - local)",
                title=f"bucket-size sweep, world size {o.world_size}",
            )
        )
    return out


def format_bench(result: BenchResult) -> str:
    from tabulate import tabulate

    o = result.options
    if not result.ok:
        return f"bench failed:\n{result.failure}"
    ref = result.median(REFERENCE) if REFERENCE in result.steps else None
    lines = [
        f"bench: {result.parameters / 1e6:.1f}M-parameter transformer, world size "
        f"{o.world_size}, local batch {o.local_batch}, bucket {o.bucket_mb:g} MB; "
        f"{o.repeats} interleaved rounds after {o.warmup} warm-up, slowest rank",
        f"machine: {result.machine}",
        "",
    ]
    rows = []
    for name, samples in result.steps.items():
        med = statistics.median(samples)
        rows.append(
            [
                name,
                f"{med * 1e3:.1f}",
                f"{min(samples) * 1e3:.1f}",
                "-" if ref is None else f"{med / ref:.3f}",
                "-" if ref is None else f"{min(samples) / min(result.steps[REFERENCE]):.3f}",
                "-" if name == LOCAL else f"{100 * result.exposed_share(name):.0f}%",
            ]
        )
    headers = ["variant", "median ms", "min ms", "/ torch-ddp", "min / min", "exposed comm"]
    lines += [tabulate(rows, headers=headers, disable_numparse=True)]
    lines += [
        "(exposed comm = (step - local step) / step, median over rounds of the same round's "
        "steps: the step's share spent in communication not hidden by compute)",
        "",
    ]
    if result.sweep:
        rows = []
        local_sweep = result.median(LOCAL, "sweep")
        for mb in o.sweep_mb:
            row = [f"{mb:g}"]
            for impl in o.sweep_impls:
                key = f"{impl}@{mb:g}"
                med = result.median(key, "sweep")
                row += [f"{med * 1e3:.1f}", f"{result.sweep_exposed(key) * 1e3:.1f}"]
            pred = result.predicted_exposed(mb)
            row.append("-" if pred is None else f"{pred * 1e3:.1f}")
            rows.append(row)
        headers = ["bucket MB"]
        for impl in o.sweep_impls:
            headers += [f"{impl} ms", "exposed ms"]
        headers.append("predicted exposed ms")
        lines += [
            f"bucket sweep ({o.sweep_repeats} rounds; local step {local_sweep * 1e3:.1f} ms; "
            "exposed = step - local step, median over rounds of the same round's pair):",
            tabulate(rows, headers=headers, disable_numparse=True),
        ]
        if result.fit is not None:
            best, exposed = comm.best_bucket(result.fit, result.grad_bytes, result.backward_s)
            lines.append(
                f"alpha-beta fit: alpha {result.fit.alpha_s * 1e6:.0f} us, beta "
                f"{result.fit.beta_Bps / 1e9:.2f} GB/s (algbw); gradients "
                f"{result.grad_bytes / MiB:.1f} MiB, backward {result.backward_s * 1e3:.0f} ms "
                f"-> predicted best bucket {best / MiB:.2g} MiB (exposed {exposed * 1e3:.1f} ms)"
            )
        lines.append("")
    if result.memory and any(MEMORY_VARIANTS[0] in m for m in result.memory):
        rows = []
        for rank, per_impl in enumerate(result.memory):
            for impl, phases in per_impl.items():
                for phase, m in phases.items():
                    rows.append(
                        [impl, rank, phase]
                        + [f"{m[k] / MiB:.2f}" for k in ("params", "grads", "optimizer")]
                        + ["-" if m["allocated"] is None else f"{m['allocated'] / MiB:.1f}"]
                    )
        headers = ["impl", "rank", "when", "params MiB", "grads MiB", "opt state MiB", "alloc MiB"]
        lines += [
            "memory (tensor bytes):",
            tabulate(rows, headers=headers, disable_numparse=True),
            "",
        ]
    if result.bandwidth:
        b = result.bandwidth
        total = sum(b["buckets"])
        factor = comm.bus_factor("all_reduce", o.world_size)
        ours, raw = statistics.median(b["ours_s"]), statistics.median(b["raw_s"])
        sync = statistics.median(b["ours_sync_s"])
        lines += [
            f"bucket all-reduces on the wire ({len(b['buckets'])} buckets, {total / MiB:.1f} "
            f"MiB, from the last rank's first launch to the last completion): ours "
            f"{ours * 1e3:.1f} ms "
            f"({total * factor / ours / 1e9:.2f} GB/s busbw), raw all_reduce "
            f"{raw * 1e3:.1f} ms ({total * factor / raw / 1e9:.2f} GB/s busbw); the whole "
            f"synchronization with copy-in/out and the usage map: {sync * 1e3:.1f} ms",
            "",
        ]
    rows = [
        [
            b.what,
            "-" if b.value is None else f"{b.value:.4f}",
            b.goal,
            {True: "met", False: "MISSED", None: "n/a"}[b.met],
            b.detail,
        ]
        for b in result.bars()
    ]
    lines += [
        "bars (step-time and bandwidth ratios: median over rounds of each round's ratio):",
        tabulate(rows, headers=["what", "value", "goal", "", ""], disable_numparse=True),
        "",
    ]
    lines.append(f"written to {result.run_dir}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
