"""Timing on every rank at once, and what a set of timings can decide.

- `timed(fn, device)`: the ranks start together (a barrier), each runs `fn` and waits for its
  device (CUDA work is asynchronous), and every rank gets the slowest rank's seconds: a step
  of data-parallel training is as slow as its slowest rank. `timed_with_cpu` adds the calling
  thread's CPU time, which other processes' load does not inflate.
- `interleave(arms, rounds)`: every arm once per round, the order rotating each round, so a
  drift of the machine's load (other jobs, page cache, clocks) falls on every arm alike
  instead of on whichever ran during the bad minute.
- `paired(a, b)`: arm a against arm b, round by round: the geometric mean of the per-round
  ratios a_i / b_i, with a Student-t confidence interval on the mean of their logs. Pairing
  cancels what the two arms of one round share (the load of that moment); logs make the
  ratio symmetric (1.1 and 1 / 1.1 are as far from 1) and its noise closer to normal. The
  interval treats rounds as independent samples; rounds seconds apart are nearly so.
- `decide(ratio, goal)`: "met" when the whole interval lies on the goal's side, "missed" when
  it lies wholly on the other side, "undecided" when it straddles the goal: the noise
  (`Ratio.noise`, the interval's half-width) is larger than the distance to the goal, and
  more rounds (or a quieter machine) are what would decide.

`timed` and `timed_with_cpu` are collectives: call them on every rank, in the same order, or
the ranks hang. Every tensor they hand to a collective lives on the rank's device: an NCCL group
has no CPU backend ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

CONFIDENCE = 0.95
MET, MISSED, UNDECIDED = "met", "missed", "undecided"


def barrier(device: torch.device) -> None:
    """Every rank arrives before any leaves (NCCL: on this rank's GPU, host included)."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def timed(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """The slowest rank's seconds per call of `fn`, over `inner` back-to-back calls (several
    for calls too short to time one by one). A collective."""
    return timed_with_cpu(fn, device, inner)[0]


def timed_with_cpu(
    fn: Callable[[], object], device: torch.device, inner: int = 1
) -> tuple[float, float]:
    """(wall, cpu) seconds per call of `fn`, each the slowest rank's: `cpu` is the calling
    thread's CPU time (`time.thread_time`), the work `fn` did itself, without the time spent
    waiting for peers or taken by other processes (on CUDA it includes the host's wait for
    the device). A collective."""
    barrier(device)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(inner):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    spent = [time.perf_counter() - wall, time.thread_time() - cpu]
    t = torch.tensor(spent, dtype=torch.float64, device=device) / inner
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def interleave(
    arms: Mapping[Hashable, Callable[[], float]],
    rounds: int,
    each_round: Callable[[int], None] | None = None,
) -> dict[Hashable, list[float]]:
    """`rounds` samples of every arm: each arm (a function returning one sample, in seconds)
    runs once per round, the order rotating by one every round. `each_round(r)` is called
    before round r (from 1), for progress."""
    names = list(arms)
    samples: dict[Hashable, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        if each_round is not None:
            each_round(r + 1)
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(arms[name]())
    return samples


@dataclass(frozen=True)
class Ratio:
    """Arm a over arm b, paired per round (module docstring).

    Attributes:
        value: the geometric mean over rounds of a_i / b_i.
        low, high: its confidence interval (0 and inf when fewer than 2 rounds).
        rounds: how many pairs it rests on.
        confidence: the interval's two-sided confidence.
    """

    value: float
    low: float
    high: float
    rounds: int
    confidence: float = CONFIDENCE

    @property
    def noise(self) -> float:
        """The interval's relative half-width: value x (1 +- noise) spans it (about)."""
        if self.low <= 0 or math.isinf(self.high):
            return math.inf
        return math.sqrt(self.high / self.low) - 1

    def to_dict(self) -> dict:
        return {
            "value": self.value,
            "low": self.low,
            "high": self.high,
            "rounds": self.rounds,
            "confidence": self.confidence,
        }


def paired(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> Ratio:
    """a / b round by round, with a t-interval on the mean log-ratio (module docstring)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need as many samples of both arms, at least one: {len(a)}, {len(b)}")
    logs = [math.log(x / y) for x, y in zip(a, b)]
    n, mean = len(logs), statistics.fmean(logs)
    if n < 2:
        return Ratio(math.exp(mean), 0.0, math.inf, n, confidence)
    half = t_quantile(n - 1, (1 + confidence) / 2) * statistics.stdev(logs) / math.sqrt(n)
    return Ratio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, confidence)


def decide(ratio: Ratio, goal: float, *, at_most: bool = True) -> str:
    """MET, MISSED or UNDECIDED for the goal `ratio <= goal` (`ratio >= goal` when not
    `at_most`), from where the interval lies (module docstring)."""
    if at_most:
        if ratio.high <= goal:
            return MET
        if ratio.low > goal:
            return MISSED
    else:
        if ratio.low >= goal:
            return MET
        if ratio.high < goal:
            return MISSED
    return UNDECIDED


def t_quantile(df: int, p: float) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, the Cornish-Fisher
    expansion in 1/df beyond (Abramowitz & Stegun 26.7.5: within 0.004 of the table at 3
    degrees of freedom for p = 0.975, within 1e-4 from 10 on)."""
    if df < 1 or not 0 < p < 1:
        raise ValueError(f"need df >= 1 and 0 < p < 1, got {df}, {p}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / df ** (k + 1) for k, term in enumerate(terms))
