"""The measuring pieces `comm` and `bench` share, run inside a rank (collectives: call them on
every rank, in the same order).

- `collective_call(op, nbytes, ctx)`: a zero-argument call of one collective on buffers of the
  rank's device, allocated once, so a loop times the collective and nothing else;
- `inner_calls(nbytes)`: how many back-to-back calls one sample averages (as nccl-tests does:
  a small message is too short to time alone);
- `memcpy_bandwidth`: one core's `copy_` bandwidth, the physical reference on loopback;
- `measure_backward`: a transformer's gradient bytes and backward time (backward alone, no
  wrapper, no optimizer: not a training step);
- `fit_in_launch`: the all-reduce alpha-beta fit from sizes measured now (`alphabeta.py`).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from verify.launching import RankContext
from verify.perf.alphabeta import AlphaBeta, MiB, fit_alpha_beta
from verify.perf.timing import timed
from verify.training.workloads import get_workload

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def inner_calls(nbytes: int) -> int:
    """Back-to-back calls per sample: enough to time a small message above the clock's noise."""
    return 20 if nbytes <= MiB else 5 if nbytes <= 16 * MiB else 1


def message_bytes(nbytes: int, n: int) -> int:
    """The bytes `collective_call(op, nbytes)` really moves: float32, a multiple of n."""
    return max(n, nbytes // 4 // n * n) * 4


def collective_call(op: str, nbytes: int, ctx: RankContext):
    """A zero-argument function running `op` on an `nbytes` message on the rank's device
    (see `bus_factor` for what the message is per op), its buffers allocated once."""
    n, dev = ctx.world_size, ctx.device
    numel = message_bytes(nbytes, n) // 4
    if op == "all_reduce":
        buf = torch.ones(numel, device=dev)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out, part = torch.empty(numel, device=dev), torch.ones(numel // n, device=dev)
        return lambda: dist.all_gather_into_tensor(out, part)
    if op == "reduce_scatter":
        inp, part = torch.ones(numel, device=dev), torch.empty(numel // n, device=dev)
        return lambda: dist.reduce_scatter_tensor(part, inp)
    if op == "broadcast":
        buf = torch.ones(numel, device=dev)
        return lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {op!r}")


def memcpy_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes per second `dst.copy_(src)` moves on this rank (median; all ranks at once), on
    buffers of `nbytes`, or of `memcpy_bytes()` when that is larger: a buffer that fits in the
    cache measures the cache, not the memory a loopback collective copies through."""
    nbytes = max(nbytes, memcpy_bytes())
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    samples = [timed(lambda: dst.copy_(src), device) for _ in range(repeats)]
    return (nbytes // 4 * 4) / statistics.median(samples)


def memcpy_name(device_type: str) -> str:
    """What `memcpy_bandwidth` measures: one core's copy on a CPU, a copy within the GPU's
    memory on CUDA (no core involved)."""
    return "memcpy (GPU memory)" if device_type == "cuda" else "memcpy (1 core)"


def memcpy_bytes() -> int:
    """Four times the last-level CPU cache (sysfs; 32 MiB assumed where it cannot be read),
    at most 256 MiB: a copy that size streams from memory."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
            sizes.append(int(text[:-1]) * 1024 if text.endswith("K") else int(text))
        except (OSError, ValueError):
            continue
    return min(4 * (max(sizes) if sizes else 32 * MiB), 256 * MiB)


def measure_backward(ctx: RankContext, model_size_m: float, repeats: int = 3) -> tuple[int, float]:
    """(gradient bytes, median backward seconds) of the transformer workload on this rank,
    every rank computing at once (as in training: they share the machine). Backward alone:
    the model is not wrapped and never stepped, so this is not a training step."""
    workload = get_workload("transformer", size_m=model_size_m)
    torch.manual_seed(0)
    model = workload.build().to(ctx.device)
    batch = workload.batch(1, ctx.world_size).shard(ctx.rank, ctx.world_size).to(ctx.device)
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        loss = workload.loss(model, batch)
        times.append(timed(loss.backward, ctx.device))
        model.zero_grad(set_to_none=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return grad_bytes, statistics.median(times[1:])


def fit_in_launch(ctx: RankContext, grad_bytes: int, repeats: int = 3) -> AlphaBeta | None:
    """The all-reduce alpha-beta fit from sizes 64 KiB up to the gradient's (at least 4 MiB),
    measured now on these ranks; None at world size 1 or when noise swamps the size."""
    if ctx.world_size == 1:
        return None
    sizes = [
        s
        for s in (64 * 1024, MiB // 4, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
        if s <= max(grad_bytes, 4 * MiB)
    ]
    calls = {s: collective_call("all_reduce", s, ctx) for s in sizes}
    for fn in calls.values():
        fn()
    samples = {
        s: [timed(calls[s], ctx.device, inner_calls(s)) for _ in range(repeats)] for s in sizes
    }
    try:
        return fit_alpha_beta(sizes, [statistics.median(v) for v in samples.values()])
    except ValueError:  # noise swamped the size dependence: no prediction this run
        return None
