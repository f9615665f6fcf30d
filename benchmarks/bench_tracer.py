"""`python benchmarks/tracer_cost.py` (a maintainer's script): what the collective tracer adds
to a training step.

In one launch (the launcher's own tracing off: this benchmark switches the tracer itself), the
one trainer (`training/trainer.py`) trains the transformer workload with the bucketed
implementation (default bucket size; `--bucket-mb 0.1` gives several all-reduces per step,
the hard case for a per-call cost), its steps alternating between two arms, untraced and
traced, the order swapping every round (the skeleton of `costs.py`). The tracer is switched by
swapping function references, before either arm's step alike (a swap slows the next step a
little, and the tracer in use is never swapped), so nothing else differs. Each sample is the
slowest rank's step.

The overhead is traced / untraced paired per round, with a 95% interval (`timing.paired`),
and the decision against the goal (overhead under 5%) is three-way (`timing.decide`): "met"
when the whole interval is below 5%, "missed" when it is wholly above, "undecided" when the
machine's noise (the interval's half-width) is wider than the margin; more rounds
(`--repeats`) narrow it as one over the square root of their number. Beside it: the tracer's
CPU cost per collective call (its wrapper around a stand-in that does nothing), the price the
overhead is made of, and that price times the calls per step over the step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from benchmarks.costs import CostOptions, run_cost, take_turns
from impls.registry import DEFAULT_BUCKET_MB
from verify.launching import RankContext
from verify.options import knob
from verify.perf.base import Measured, model_size, next_step, parameters
from verify.perf.timing import Ratio, decide, paired, timed_with_cpu
from verify.training.trainer import Trainer, TrainSpec, spec_from
from verify.watching import tracer

GOAL = 0.05  # the tracer may add at most 5% to a step


@dataclass(frozen=True, kw_only=True)
class TracerBenchOptions(CostOptions):
    """What the tracer is measured on, and for how long."""

    model_size_m: float | None = model_size(
        None, "the transformer's size (default: a tiny GPT, where a per-call cost shows most)"
    )
    bucket_mb: float = knob(
        DEFAULT_BUCKET_MB,
        "bucket size (0.1: 8 all-reduces a step, the hard case)",
        unit="MB",
        positive=True,
    )
    repeats: int = knob(
        80, "repeats of 4 interleaved rounds (one untraced and one traced step each)", minimum=1
    )
    steps: int = knob(4, "rounds per repeat", minimum=1, cli=False)

    command: ClassVar[str] = "bench-tracer"

    @property
    def rounds(self) -> int:
        return self.repeats * self.steps

    def train_spec(self) -> TrainSpec:
        # `steps` here counts rounds per repeat, not optimizer steps: overridden, never read.
        return spec_from(self, steps=2 + 2 * self.rounds)


@dataclass(frozen=True)
class TracerBenchResult(Measured):
    """Every step's time in both arms, the per-call price, and the machine's load."""

    options: TracerBenchOptions
    verdict: str
    parameters: int = 0
    collectives_per_step: int = 0
    plain_step_s: tuple[float, ...] = ()
    traced_step_s: tuple[float, ...] = ()
    plain_cpu_s: tuple[float, ...] = ()  # the training thread's CPU time of the same steps
    traced_cpu_s: tuple[float, ...] = ()
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after
    plain_call_us: float = 0.0
    traced_call_us: float = 0.0
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    @property
    def ratio(self) -> Ratio:
        """traced / untraced, paired per round, with its interval."""
        return paired(list(self.traced_step_s), list(self.plain_step_s))

    @property
    def cpu_ratio(self) -> Ratio:
        """The same on the training thread's CPU time: the tracer's own work per step, which
        other processes' load does not inflate (a far narrower interval on a shared machine)."""
        return paired(list(self.traced_cpu_s), list(self.plain_cpu_s))

    @property
    def in_situ_call_us(self) -> float:
        """The training thread's extra CPU per traced collective, in the training loop (cold
        caches and the bookkeeping of asynchronous work included, unlike `traced_call_us`)."""
        extra_s = (self.cpu_ratio.value - 1) * statistics.median(self.plain_cpu_s)
        return extra_s / max(1, self.collectives_per_step) * 1e6

    @property
    def overhead(self) -> float:
        return self.ratio.value - 1

    @property
    def noise(self) -> float:
        """How finely this run can tell: the interval's relative half-width."""
        return self.ratio.noise

    @property
    def decision(self) -> str:
        """The three-way decision against GOAL: met, missed or undecided (module docstring)."""
        return decide(self.ratio, 1 + GOAL)

    @property
    def overhead_of_medians(self) -> float:
        return statistics.median(self.traced_step_s) / statistics.median(self.plain_step_s) - 1

    @property
    def per_call_share(self) -> float:
        """The per-call price x calls per step, over the median untraced step."""
        price_s = (self.traced_call_us - self.plain_call_us) * 1e-6
        return price_s * self.collectives_per_step / statistics.median(self.plain_step_s)

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if self.ok:
            r = self.ratio
            c = self.cpu_ratio
            d.update(
                overhead=self.overhead,
                overhead_interval=[r.low - 1, r.high - 1],
                noise=self.noise,
                decision=self.decision,
                goal=GOAL,
                overhead_of_medians=self.overhead_of_medians,
                cpu_overhead=c.value - 1,
                cpu_overhead_interval=[c.low - 1, c.high - 1],
            )
        return d


def run_tracer_bench(options: TracerBenchOptions) -> TracerBenchResult:
    """One launch, tracing off in the launcher (this benchmark installs the tracer itself)."""
    return run_cost(options, tracer_bench_on_rank, TracerBenchResult, stall_timeout_s=None)


def tracer_bench_on_rank(ctx: RankContext, options: TracerBenchOptions) -> dict:
    """The interleaved rounds (module docstring), then the per-call price."""
    trainer = Trainer(ctx, options.train_spec())
    cpu: dict[bool, list[float]] = {False: [], True: []}

    def arm(traced: bool) -> float:
        # Both arms switch twice before their step, ending traced or not: swapping the
        # functions costs the next step a few hundred microseconds (caches and specialized
        # bytecode rebuilt), a cost the tracer does not have in use (installed once), so it
        # must fall on both arms alike or it is counted as the tracer's.
        first, last = (tracer.pause, tracer.resume) if traced else (tracer.resume, tracer.pause)
        first()
        last()
        wall, thread_cpu = timed_with_cpu(lambda: next_step(trainer), ctx.device)
        cpu[traced].append(thread_cpu)
        return wall

    tmp = tempfile.mkdtemp(prefix="ddp-verify-bench-")
    next_step(trainer)  # warm-up: gradients and optimizer state allocated
    tracer.install(os.path.join(tmp, "trace"), rank=ctx.rank)
    first = tracer.records_written()
    next_step(trainer)
    per_step = tracer.records_written() - first
    load_before = os.getloadavg()[0]
    arms = {"plain": lambda: arm(False), "traced": lambda: arm(True)}
    samples = take_turns(ctx, arms, options.rounds, "bench-tracer", every=40)
    tracer.uninstall()
    plain_us, traced_us = _per_call_us(ctx, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "parameters": parameters(trainer.model),
        "collectives_per_step": per_step,
        "plain_step_s": tuple(samples["plain"]),
        "traced_step_s": tuple(samples["traced"]),
        "plain_cpu_s": tuple(cpu[False]),
        "traced_cpu_s": tuple(cpu[True]),
        "load_avg": (load_before, os.getloadavg()[0]),
        "plain_call_us": plain_us,
        "traced_call_us": traced_us,
    }


def _per_call_us(ctx: RankContext, tmp: str) -> tuple[float, float]:
    """The per-call price, without the network: the tracer's wrapper around a stand-in
    all_reduce that does nothing, against the stand-in itself (CPU microseconds a call costs,
    not the machine's load: process time)."""

    def stand_in(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    tracer.install(os.path.join(tmp, "calls"), rank=ctx.rank)
    wrapped = tracer.wrapped("all_reduce", stand_in)
    call = torch.ones(1, device=ctx.device)
    calls: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(20):
        for traced in (False, True):
            fn = wrapped if traced else stand_in
            start = time.process_time()
            for _ in range(1000):
                fn(call)
            calls[traced].append((time.process_time() - start) / 1000 * 1e6)
    tracer.uninstall()
    return statistics.median(calls[False]), statistics.median(calls[True])
