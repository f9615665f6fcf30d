"""`python benchmarks/sanitize_cost.py` (a maintainer's script): what `--sanitize` costs a
training step, and where (with `--matrix`, a whole certification matrix: `bench_sanitize_matrix.py`).

In one launch the one trainer (`training/trainer.py`) trains the transformer workload with
the bucketed implementation; its steps rotate through three arms, one step each per round,
the order rotating every round (`timing.interleave`): plain; sanitized (access checking and
adversarial completion, what `--sanitize` runs); and check-only (access checking without the
copies of adversarial completion); the skeleton is `costs.py`'s. Each arm installs its
sanitizer just before its step and removes it just after (the plain arm installs and removes one
too, before its step, so the cost of swapping functions falls on every arm alike). Each sample
is the slowest rank's step.

The costs are sanitized / plain and check-only / plain, paired per round with 95% intervals
(`timing.paired`). Beside them, where the time went, from the sanitizer's own accounting
(`SanitizerStats`): collectives tracked, operators checked while one was in flight, seconds
classifying and comparing, seconds copying.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from typing import ClassVar

from benchmarks.bench_sanitize_matrix import run_sanitize_matrix_bench
from benchmarks.costs import CostOptions, run_cost, take_turns
from verify.launching import RankContext
from verify.options import knob
from verify.perf.base import Measured, model_size, next_step, parameters
from verify.perf.timing import Ratio, paired, timed
from verify.training.trainer import Trainer, TrainSpec, spec_from

ARMS = ("plain", "sanitized", "check-only")


@dataclass(frozen=True, kw_only=True)
class SanitizeBenchOptions(CostOptions):
    """What the sanitizer is measured on, and for how long."""

    model_size_m: float | None = model_size(5.0)
    bucket_mb: float = knob(4.0, "bucket size (several buckets a step)", unit="MB", positive=True)
    repeats: int = knob(15, "interleaved rounds (one step of each arm per round)", minimum=2)
    matrix: bool = knob(
        False, "time whole certification matrices of --impl instead of steps: `matrix "
        "--no-sanitize` against `matrix` (sanitized, the default), one of each per round "
        "(--model-size, --bucket-mb and --world-size do not apply)",
    )  # fmt: skip

    command: ClassVar[str] = "bench-sanitize"

    def train_spec(self) -> TrainSpec:
        return spec_from(self, steps=1 + len(ARMS) * self.repeats)


@dataclass(frozen=True)
class SanitizeBenchResult(Measured):
    """Every step's time in every arm, and the sanitizer's accounting per step."""

    options: SanitizeBenchOptions
    verdict: str
    parameters: int = 0
    steps_s: dict | None = None  # arm -> seconds per step (slowest rank)
    stats: dict | None = None  # arm -> SanitizerStats fields summed over its steps (rank 0)
    load_avg: tuple[float, float] = (0.0, 0.0)
    machine: str = ""
    failure: str | None = None
    matrix_verdicts: dict | None = None  # --matrix: arm -> each round's matrix verdict

    def ratio(self, arm: str) -> Ratio:
        return paired(list(self.steps_s[arm]), list(self.steps_s["plain"]))

    def per_step(self, arm: str, key: str) -> float:
        return self.stats[arm][key] / len(self.steps_s[arm])

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if self.ok:
            d["slowdown"] = {
                arm: self.ratio(arm).to_dict() for arm in self.steps_s if arm != "plain"
            }
            d["median_step_s"] = {arm: statistics.median(v) for arm, v in self.steps_s.items()}
        return d


def run_sanitize_bench(options: SanitizeBenchOptions) -> SanitizeBenchResult:
    if options.matrix:
        return run_sanitize_matrix_bench(options, SanitizeBenchResult)
    return run_cost(options, sanitize_bench_on_rank, SanitizeBenchResult)


def sanitize_bench_on_rank(ctx: RankContext, options: SanitizeBenchOptions) -> dict:
    """The interleaved rounds (module docstring); rank 0's accounting comes back."""
    from verify.sanitize import Sanitizer

    trainer = Trainer(ctx, options.train_spec())
    trainer.step(1)  # warm-up: gradients and optimizer state allocated
    sanitizers = {
        "plain": Sanitizer(rank=ctx.rank),
        "sanitized": Sanitizer(rank=ctx.rank),
        "check-only": Sanitizer(rank=ctx.rank, adversarial=False),
    }

    def arm(name: str) -> float:
        sanitizer = sanitizers[name]

        def step() -> None:
            if name == "plain":  # the swap's cost, without the sanitizer in the step
                sanitizer.install()
                sanitizer.uninstall()
                next_step(trainer)
                return
            sanitizer.install()
            sanitizer.name_tensors(trainer.model.named_parameters())
            try:
                next_step(trainer)
                sanitizer.end_step()
            finally:
                sanitizer.uninstall()

        return timed(step, ctx.device)

    load_before = os.getloadavg()[0]
    arms = {name: (lambda n=name: arm(n)) for name in ARMS}
    samples = take_turns(ctx, arms, options.repeats, "bench-sanitize", every=5)
    return {
        "parameters": parameters(trainer.model),
        "steps_s": {name: tuple(v) for name, v in samples.items()},
        "stats": {name: asdict(s.stats) for name, s in sanitizers.items()},
        "load_avg": (load_before, os.getloadavg()[0]),
    }
