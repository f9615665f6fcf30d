"""The cost model of DDP's communication: bus bandwidth, the alpha-beta fit, the best bucket.

- `bus_factor`: busbw / algbw as nccl-tests defines it
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), for S bytes, n ranks
  and time t: algbw = S / t; busbw = algbw x 2(n-1)/n for all-reduce (S: the buffer), x (n-1)/n
  for all-gather (S: the gathered output) and reduce-scatter (S: the input), x 1 for
  broadcast. busbw is comparable across world sizes and against a link's speed.
- `fit_alpha_beta`: t(S) = alpha + S / beta (per-call overhead and algorithm bandwidth) from
  measured times, weighted least squares on relative error so small messages count as much as
  large ones.
- `predict_exposed` / `best_bucket`: for a model's gradient bytes G and backward time T, the
  communication a bucketed DDP leaves exposed after backward, and the bucket size that
  minimizes it (the assumptions are in `predict_exposed`'s docstring).

Pure functions, no process group: `comm.py` and `bench.py` measure, this module models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

KiB, MiB = 1024, 1024 * 1024


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on `n` ranks (nccl-tests' definitions)."""
    if n == 1:
        return 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class AlphaBeta:
    """t(S) = alpha_s + S / beta_Bps: per-call overhead and algorithm bandwidth."""

    alpha_s: float
    beta_Bps: float
    max_rel_error: float = 0.0  # worst |fit - measured| / measured over the fitted points

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least squares on relative error: minimize sum(((alpha + S/beta) - t) / t)^2.

    Linear in (alpha, 1/beta): divide each equation by t and solve the 2x2 normal equations.
    Needs at least two distinct sizes; alpha is clamped at 0 (a negative overhead is noise).
    """
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError("need times for at least two distinct sizes")
    rows = [(1.0 / t, s / t) for s, t in zip(sizes, times)]  # [alpha, 1/beta] . row = 1
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] for r in rows)
    b2 = sum(r[1] for r in rows)
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    inv_beta = (a11 * b2 - a12 * b1) / det
    if alpha < 0:  # refit the bandwidth alone
        alpha, inv_beta = 0.0, b2 / a22
    if inv_beta <= 0:
        raise ValueError("times do not grow with size: cannot fit a bandwidth")
    fit = AlphaBeta(alpha, 1.0 / inv_beta)
    err = max(abs(fit.time(s) - t) / t for s, t in zip(sizes, times))
    return dataclasses.replace(fit, max_rel_error=err)


def predict_exposed(
    model: AlphaBeta, grad_bytes: float, backward_s: float, bucket_bytes: float
) -> float:
    """Seconds of DDP communication left after backward ends, for buckets of `bucket_bytes`.

    Assumptions (stated, not hidden): gradients become ready at a constant byte rate over the
    backward pass; a bucket's all-reduce starts when its last gradient is ready and the
    previous one finished (one collective on the wire at a time), and costs alpha + b / beta;
    communication does not slow computation down. The last assumption holds on GPUs (NCCL
    has its own SMs and links); on a CPU the backend's threads take cores from compute, so the
    measured sweep sits above this prediction by however much they slow backward.
    """
    if bucket_bytes <= 0 or grad_bytes <= 0:
        raise ValueError("bucket and gradient bytes must be positive")
    count = math.ceil(grad_bytes / bucket_bytes)
    done = 0.0  # when the previous all-reduce finished
    ready_bytes = 0.0
    for k in range(count):
        size = min(bucket_bytes, grad_bytes - k * bucket_bytes)
        ready_bytes += size
        ready = backward_s * ready_bytes / grad_bytes
        done = max(done, ready) + model.time(size)
    return max(0.0, done - backward_s)


def best_bucket(
    model: AlphaBeta,
    grad_bytes: float,
    backward_s: float,
    candidates: Sequence[float] = (),
    *,
    slack: float = 0.01,
) -> tuple[float, float]:
    """(bucket bytes, exposed seconds): the largest bucket whose predicted exposed time is
    within `slack` x backward of the minimum, over `candidates` or, by default, a
    quarter-octave grid from 16 KiB to the whole gradient.

    Why not the plain minimum: when communication keeps up with backward, every small enough
    bucket leaves only the last one exposed, so the minimum is flat and sits at the smallest
    size, where the per-call overhead the model ignores on a CPU (each call costs the cores
    compute needs) is largest. Within 1% of backward, fewer calls is the better bet.
    """
    if not candidates:
        lo, hi = math.log2(16 * KiB), math.log2(max(grad_bytes, 16 * KiB))
        candidates = [2 ** (lo + i / 4) for i in range(int((hi - lo) * 4) + 1)] + [grad_bytes]
    scored = [(b, predict_exposed(model, grad_bytes, backward_s, b)) for b in candidates]
    floor = min(e for _, e in scored) + slack * backward_s
    return max((item for item in scored if item[1] <= floor), key=lambda item: item[0])
