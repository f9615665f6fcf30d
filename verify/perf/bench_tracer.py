"""Benchmark: what the collective tracer adds to a training step, measured side by side.

In one launch (the launcher's own tracing off), on the transformer workload with the bucketed
implementation (default bucket size; `--bucket-mb 0.1` gives several all-reduces per step, the
hard case for a per-call cost), training steps rotate through three arms: untraced, traced, and
untraced again (the control arm). The order rotates every step and the tracer is switched by
swapping function references, so drifts in machine load hit all arms alike. Reported: median
step time of each arm (the slowest rank's), the overhead (median over steps of traced /
untraced, goal: under 5%), the same statistic between the two untraced arms (the noise floor
of this machine at this moment, with its load average), and the tracer's CPU cost per
collective call (its wrapper around a stand-in that does nothing), the price it is made of.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from tabulate import tabulate

from impls.registry import DEFAULT_BUCKET_MB, resolve
from verify.launching import RankContext, launch
from verify.training.workloads import get_workload
from verify.watching import tracer

GOAL = 0.05


@dataclass(frozen=True, kw_only=True)
class TracerBenchOptions:
    impl: str = "bucketed"
    world_size: int = 2
    model_size_m: float | None = None  # None: the tiny default GPT (the per-call cost shows most)
    bucket_mb: float = DEFAULT_BUCKET_MB  # --bucket-mb 0.1: 8 all-reduces a step, the worst case
    repeats: int = 20
    steps: int = 4
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world size must be >= 2, got {self.world_size}")
        if self.repeats < 1 or self.steps < 1:
            raise ValueError("repeats and steps must be >= 1")
        resolve(self.impl)


@dataclass(frozen=True)
class TracerBenchResult:
    options: TracerBenchOptions
    ok: bool
    parameters: int = 0
    collectives_per_step: int = 0
    plain_step_s: tuple[float, ...] = ()
    traced_step_s: tuple[float, ...] = ()
    control_step_s: tuple[float, ...] = ()  # a second untraced arm: the noise floor
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after
    plain_call_us: float = 0.0
    traced_call_us: float = 0.0
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    @property
    def overhead(self) -> float:
        """Median over adjacent (traced, untraced) pairs of traced / untraced, minus 1: a pair
        shares the machine's load of the moment, which a ratio of medians would not."""
        pairs = zip(self.traced_step_s, self.plain_step_s, strict=True)
        return statistics.median(t / p for t, p in pairs) - 1

    @property
    def noise(self) -> float:
        """The same statistic between the two untraced arms: what the machine alone does."""
        pairs = zip(self.control_step_s, self.plain_step_s, strict=True)
        return statistics.median(c / p for c, p in pairs) - 1

    @property
    def overhead_of_medians(self) -> float:
        return statistics.median(self.traced_step_s) / statistics.median(self.plain_step_s) - 1

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.ok:
            d["overhead"] = self.overhead
            d["overhead_of_medians"] = self.overhead_of_medians
            d["noise"] = self.noise
            d["goal"] = GOAL
        return d


def run_tracer_bench(options: TracerBenchOptions) -> TracerBenchResult:
    run = launch(
        _rank_main,
        world_size=options.world_size,
        args=(options,),
        timeout_s=options.timeout_s,
        stall_timeout_s=None,  # this benchmark switches the tracer itself
    )
    if not run.ok:
        return TracerBenchResult(options, False, failure=run.summary())
    return TracerBenchResult(options, True, **run.values[0])


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank_main(ctx: RankContext, options: TracerBenchOptions) -> dict:
    impl = resolve(options.impl)
    workload = get_workload("transformer", size_m=options.model_size_m)
    torch.manual_seed(0)
    model = workload.build()
    wrapped = impl.wrap(model, bucket_size_mb=options.bucket_mb)
    optimizer = impl.make_optimizer(workload.param_groups(model), torch.optim.AdamW)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    tmp = tempfile.mkdtemp(prefix="ddp-verify-bench-")
    step_no = 0

    def train_step() -> None:
        nonlocal step_no
        step_no += 1
        optimizer.zero_grad()
        batch = workload.batch(step_no, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        finish()
        optimizer.step()

    def timed_step(traced: bool) -> float:
        (tracer.resume if traced else tracer.pause)()
        dist.barrier()
        start = time.perf_counter()
        train_step()
        return _slowest(time.perf_counter() - start)

    train_step()  # warm-up: gradients and optimizer state allocated
    tracer.install(os.path.join(tmp, "trace"), rank=ctx.rank)
    first = tracer._writer.written
    train_step()
    per_step = tracer._writer.written - first
    # Steps rotate through untraced, traced and untraced again (the control arm, whose
    # difference from the first is the noise floor); the order rotates every triple, so drifts in
    # machine load hit both alike; the tracer is switched by swapping function references.
    plain, traced, control = [], [], []
    arms = ("plain", "traced", "control")
    load_before = os.getloadavg()[0]
    for rep in range(options.repeats * options.steps):
        times = {}
        for arm in arms[rep % 3 :] + arms[: rep % 3]:
            times[arm] = timed_step(arm == "traced")
        plain.append(times["plain"])
        traced.append(times["traced"])
        control.append(times["control"])
    tracer.uninstall()

    # The per-call price, without the network: the tracer's wrapper around a stand-in
    # all_reduce that does nothing, against the stand-in itself (CPU time a call costs).
    def stand_in(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    tracer.install(os.path.join(tmp, "calls"), rank=ctx.rank)
    wrapped_stand_in = tracer._make_wrapper("all_reduce", stand_in)
    call = torch.ones(1)
    calls: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(20):
        for mode in (False, True):
            fn = wrapped_stand_in if mode else stand_in
            start = time.process_time()  # CPU time: what the tracer costs, not the machine's load
            for _ in range(1000):
                fn(call)
            calls[mode].append((time.process_time() - start) / 1000 * 1e6)
    tracer.uninstall()
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "collectives_per_step": per_step,
        "plain_step_s": tuple(plain),
        "traced_step_s": tuple(traced),
        "control_step_s": tuple(control),
        "load_avg": (load_before, os.getloadavg()[0]),
        "plain_call_us": statistics.median(calls[False]),
        "traced_call_us": statistics.median(calls[True]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads/rank, "
        f"{platform.node()}",
        "torch_version": torch.__version__,
    }


def format_tracer_bench(result: TracerBenchResult) -> str:
    o = result.options
    if not result.ok:
        return f"bench-tracer failed:\n{result.failure}"
    head = (
        f"tracer benchmark: {o.impl} (bucket {o.bucket_mb:g} MB) on a "
        f"{result.parameters / 1e6:.2f}M-parameter transformer, world size {o.world_size}, "
        f"{result.collectives_per_step} traced collectives per step, {o.repeats} interleaved "
        f"repeats of {o.steps} steps\n(torch {result.torch_version}; {result.machine})\n"
    )
    rows = [
        [name, f"{statistics.median(v) * 1e3:.2f}", f"{min(v) * 1e3:.2f}"]
        for name, v in [
            ("training step, untraced", result.plain_step_s),
            ("training step, traced", result.traced_step_s),
            ("training step, untraced (control arm)", result.control_step_s),
        ]
    ]
    table = tabulate(rows, headers=["what", "median ms", "min ms"])
    calls = (
        f"tracer cost per collective call (CPU, no network): "
        f"{result.traced_call_us - result.plain_call_us:.1f} us"
    )
    verdict = "met" if result.overhead < GOAL else "MISSED"
    return (
        f"{head}\n{table}\n\n{calls}\n"
        f"ratio of the medians: {result.overhead_of_medians * 100:+.2f}%; per call x calls per "
        f"step / median step: "
        f"{(result.traced_call_us - result.plain_call_us) * result.collectives_per_step / 1e4 / statistics.median(result.plain_step_s):.2f}%\n"
        f"noise floor (control arm vs untraced, same statistic): {result.noise * 100:+.2f}%; "
        f"load average {result.load_avg[0]:.1f} -> {result.load_avg[1]:.1f} on "
        f"{os.cpu_count()} cpus\n"
        f"tracer overhead on a step (median of paired ratios): {result.overhead * 100:+.2f}%  "
        f"(goal < {GOAL * 100:g}%: {verdict})"
    )
