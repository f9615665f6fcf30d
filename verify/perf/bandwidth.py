"""`bench`'s bandwidth bar: our bucket all-reduces on the wire against raw ones of the same sizes.

`BucketedDDP` is trained by the one trainer's construction (`Trainer`, so it is built and
broadcast as every check builds it); its gradients are then made ready under `no_sync()`,
and `finish_gradient_synchronization()` launches every bucket (copying each in, divided, just
before its launch: `zero_grad` as the trainer calls it, set_to_none by default, leaves fresh
gradients every round, as in training) and waits; the averages are then in `.grad`, views of
the buckets. Against it: raw all-reduces of buffers of the same sizes, launched the same way.
Interleaved, the order alternating each round.

"On the wire", on CPU, is measured the same way for both: from the first all-reduce's launch
on the last rank to launch it, to the last completion on the last rank to see it (stamped by a
callback on each Work's future; ranks on one host share `perf_counter`'s clock). So the copy
of bucket k+1 while bucket k is in flight counts against us, as it does in training; how much
later a rank launches its first bucket because it copied slower does not (that is the copy's
cost, not the collective's). The whole synchronization, copies and usage map included, is
reported beside it. On CUDA a future completes when its kernel is enqueued, not done, so there
the span is the whole call with the device synchronized, copies included for ours: a stricter
bar.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from verify.launching import RankContext
from verify.perf.timing import timed
from verify.training.trainer import Trainer, TrainSpec


def bucket_bandwidth(ctx: RankContext, spec: TrainSpec, repeats: int) -> dict:
    """{"ours_s", "raw_s", "ours_sync_s": seconds per round, "buckets": bytes per bucket} for
    `BucketedDDP` built from `spec` (its impl must be "bucketed"); {} at world size 1."""
    if ctx.world_size == 1:
        return {}
    trainer = Trainer(ctx, spec)
    ddp = trainer.wrapped
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

    batch = trainer.workload.batch(1, ctx.world_size).shard(ctx.rank, ctx.world_size)
    batch = batch.to(ctx.device)
    out: dict[str, list[float]] = {"ours_s": [], "raw_s": [], "ours_sync_s": []}
    for r in range(repeats + 1):  # round 0 is warm-up
        trainer.optimizer.zero_grad(set_to_none=spec.set_to_none)  # as a training step does
        with ddp.no_sync():  # gradients ready, nothing launched: the sync alone is timed
            trainer.workload.loss(ddp, batch).backward()
        pair = [(ours, "ours"), (raw_all_reduce, "raw")]
        for fn, key in pair if r % 2 else pair[::-1]:
            stamps.clear()
            total = timed(fn, ctx.device)
            wire = total if ctx.device.type == "cuda" else _span(stamps, ctx.device)
            if r:
                out[f"{key}_s"].append(wire)
                if key == "ours":
                    out["ours_sync_s"].append(total)
    out["buckets"] = [b.buffer.numel() * b.buffer.element_size() for b in ddp.buckets]
    return out


def _span(stamps: list[list[float]], device: torch.device) -> float:
    """From the last rank's first launch to the last completion on any rank (a collective)."""
    edges = torch.tensor(
        [min(s for s, _ in stamps), max(e for _, e in stamps)], dtype=torch.float64, device=device
    )
    dist.all_reduce(edges, op=dist.ReduceOp.MAX)
    return float(edges[1] - edges[0])
