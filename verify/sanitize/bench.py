"""What the sanitizer costs a training step, measured side by side (a sketch for the real bench).

`python -m verify.sanitize.bench [size_m] [bucket_mb] [steps]`: BucketedDDP on the transformer
workload, 2 ranks over gloo, the launcher's tracer on (as in real runs). Steps rotate through
four arms: plain, sanitized, check-only (`adversarial=False`: no copies) and plain again (the
noise floor), one model and optimizer for all, so drifts in load hit every arm alike. Prints
each arm's median step time (slowest rank), the median over steps of arm / plain, and the
sanitizer's own accounting.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from impls.bucketed import BucketedDDP
from verify.launching import launch
from verify.sanitize import Sanitizer
from verify.training.workloads import get_workload

ARMS = ("plain", "sanitized", "check-only", "control")


def _run(ctx, size_m, bucket_mb, steps):
    workload = get_workload("transformer", size_m=size_m)
    torch.manual_seed(0)
    model = workload.build()
    wrapped = BucketedDDP(model, bucket_size_mb=bucket_mb)
    opt = torch.optim.AdamW(workload.param_groups(model))
    sanitizers = {
        "sanitized": Sanitizer(rank=ctx.rank),
        "check-only": Sanitizer(rank=ctx.rank, adversarial=False),
    }
    times = {arm: [] for arm in ARMS}
    k = len(ARMS)
    order = ["warm-up"] + [a for r in range(steps) for a in ARMS[r % k :] + ARMS[: r % k]]
    for step, arm in enumerate(order):  # the order rotates every round
        san = sanitizers.get(arm)
        if san is not None:
            san.install()
            san.name_tensors(model.named_parameters())
        start = time.perf_counter()
        opt.zero_grad()
        batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        if san is not None:
            san.end_step()
        elapsed = time.perf_counter() - start
        if san is not None:
            san.uninstall()
        if arm != "warm-up":  # allocators and caches warm up in the first step
            times[arm].append(elapsed)
    assert not any(s.findings for s in sanitizers.values())
    params = sum(p.numel() for p in model.parameters())
    return times, {arm: s.stats for arm, s in sanitizers.items()}, params


def main(size_m: float | None = None, bucket_mb: float = 25.0, steps: int = 15) -> None:
    result = launch(_run, world_size=2, args=(size_m, bucket_mb, steps), timeout_s=1800)
    if not result.ok:
        raise SystemExit(result.summary())
    (t0, stats, params), (t1, _, _) = result.values
    slowest = {arm: [max(a, b) for a, b in zip(t0[arm], t1[arm])] for arm in ARMS}
    median = {arm: statistics.median(v) for arm, v in slowest.items()}
    print(f"transformer {params / 1e6:.2f}M params, bucket {bucket_mb} MB, {steps} steps an arm")
    for arm in ARMS:
        ratio = statistics.median(a / p for a, p in zip(slowest[arm], slowest["plain"]))
        print(f"  {arm:10s} {median[arm] * 1e3:7.1f} ms  {ratio:.2f}x plain")
    for arm, st in stats.items():
        ms = {"check": st.check_s / steps * 1e3, "copies": st.copy_s / steps * 1e3}
        print(
            f"  {arm} (rank 0, a step): {st.ops_seen / steps:.0f} ops seen, "
            f"{st.ops_checked / steps:.0f} checked, {st.tracked / steps:.1f} collectives, "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
        )


if __name__ == "__main__":
    args = [float(a) for a in sys.argv[1:]]
    main(args[0] if args and args[0] > 0 else None, *args[1:2], *map(int, args[2:3]))
