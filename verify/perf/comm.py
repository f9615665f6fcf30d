"""`python -m verify comm`: what the collectives cost here, and the bucket size that follows.

Measures all-reduce, all-gather, reduce-scatter and broadcast over message sizes from KB to
(by default) 64 MiB, at each requested world size, and reports bandwidth as nccl-tests defines
it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), for S bytes, n
ranks and time t:

    algbw = S / t
    busbw = algbw * 2(n-1)/n   all-reduce      (S: the buffer)
          = algbw * (n-1)/n    all-gather      (S: the gathered output)
          = algbw * (n-1)/n    reduce-scatter  (S: the input)
          = algbw              broadcast

busbw is comparable across world sizes and against the hardware's link speed; here the
"link" is local memory, so the table also gives the memory-copy bandwidth of one core
(`tensor.copy_`, bytes copied per second) as the physical reference.

From the all-reduce times it fits the alpha-beta model t(S) = alpha + S / beta (per-call
overhead and algorithm bandwidth; weighted least squares on relative error, so small messages
count as much as large ones) and predicts, for a model's gradient bytes G and backward time
T, the bucket size that minimizes DDP's exposed communication (`predict_exposed`).

Every time is the slowest rank's; sizes, ops and repeats are interleaved so noise from other
processes spreads over all of them; each sample averages several back-to-back calls for small
messages (as nccl-tests does), and the report gives medians.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verify import runs
from verify.launching import RankContext, launch
from verify.perf import charts
from verify.training.workloads import get_workload

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
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


# --- the alpha-beta model -------------------------------------------------------------------


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


# --- measuring ------------------------------------------------------------------------------


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective: call on all ranks)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, inner: int = 1) -> float:
    """Slowest rank's seconds per call of `fn`, over `inner` back-to-back calls."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return slowest((time.perf_counter() - start) / inner)


def _inner(nbytes: int) -> int:
    return 20 if nbytes <= MiB else 5 if nbytes <= 16 * MiB else 1


def collective_call(op: str, nbytes: int, ctx: RankContext):
    """A zero-argument function running `op` on an `nbytes` message (see `bus_factor` for
    what the message is per op), with its buffers allocated once."""
    n = ctx.world_size
    numel = max(n, nbytes // 4 // n * n)  # float32, divisible by the world size
    dev = ctx.device
    if op == "all_reduce":
        buf = torch.ones(numel, device=dev)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out = torch.empty(numel, device=dev)
        part = torch.ones(numel // n, device=dev)
        return lambda: dist.all_gather_into_tensor(out, part)
    if op == "reduce_scatter":
        inp = torch.ones(numel, device=dev)
        part = torch.empty(numel // n, device=dev)
        return lambda: dist.reduce_scatter_tensor(part, inp)
    if op == "broadcast":
        buf = torch.ones(numel, device=dev)
        return lambda: dist.broadcast(buf, src=0)
    raise ValueError(f"unknown collective {op!r}")


def memcpy_bandwidth(nbytes: int, repeats: int = 5, device: torch.device | None = None) -> float:
    """Bytes per second `dst.copy_(src)` moves on this rank (median; all ranks at once)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    samples = [timed(lambda: dst.copy_(src)) for _ in range(repeats)]
    return (nbytes // 4 * 4) / statistics.median(samples)


@dataclass(frozen=True, kw_only=True)
class CommOptions:
    world_sizes: tuple[int, ...] = (2, 3, 4)
    min_bytes: int = 4 * KiB
    max_bytes: int = 64 * MiB
    ops: tuple[str, ...] = OPS
    repeats: int = 5
    model_size_m: float = 10.0  # the model whose best bucket size is predicted
    device: str | None = None
    out: str = runs.DEFAULT_OUT
    timeout_s: float = 1800.0
    progress: bool = False

    def __post_init__(self) -> None:
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"world sizes must be >= 1, got {self.world_sizes}")
        if not 4 <= self.min_bytes <= self.max_bytes:
            raise ValueError("need 4 <= min_bytes <= max_bytes")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown collectives {sorted(unknown)}; choose from {OPS}")

    @property
    def sizes(self) -> list[int]:
        """Powers of 4 from min_bytes up to max_bytes (max_bytes always included)."""
        out, s = [], self.min_bytes
        while s < self.max_bytes:
            out.append(s)
            s *= 4
        return out + [self.max_bytes]


@dataclass(frozen=True)
class CommPoint:
    op: str
    world_size: int
    nbytes: int
    seconds: float  # median over repeats of the slowest rank's time per call
    min_seconds: float

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.world_size)


@dataclass(frozen=True)
class CommResult:
    options: CommOptions
    ok: bool
    points: tuple[CommPoint, ...] = ()
    memcpy_Bps: float = 0.0
    fits: dict = field(default_factory=dict)  # world size -> AlphaBeta of all_reduce
    grad_bytes: int = 0
    backward_s: float = 0.0
    predictions: dict = field(default_factory=dict)  # world size -> (bucket bytes, exposed s)
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "options": dataclasses.asdict(self.options),
            "points": [
                {**dataclasses.asdict(p), "algbw_GBps": p.algbw / 1e9, "busbw_GBps": p.busbw / 1e9}
                for p in self.points
            ],
            "memcpy_GBps": self.memcpy_Bps / 1e9,
            "alpha_beta": {str(k): dataclasses.asdict(v) for k, v in self.fits.items()},
            "grad_bytes": self.grad_bytes,
            "backward_s": self.backward_s,
            "predicted_bucket": {
                str(k): {"bucket_bytes": b, "exposed_s": e}
                for k, (b, e) in self.predictions.items()
            },
            "run_dir": self.run_dir,
            "machine": self.machine,
            "failure": self.failure,
            "notes": list(self.notes),
        }


def run_comm(options: CommOptions) -> CommResult:
    """One launch per world size; then fits and predictions in the parent."""
    device = options.device or runs.default_device(max(options.world_sizes))
    run_dir = runs.new_run_dir(options.out, "comm", max(options.world_sizes), device)
    meta = runs.write_metadata(run_dir, dataclasses.asdict(options))
    points: list[CommPoint] = []
    memcpy, grad_bytes, backward_s = 0.0, 0, 0.0
    progress = runs.Progress(run_dir / "progress.log" if options.progress else None)
    for ws in options.world_sizes:
        progress(f"comm: world size {ws}")
        with runs.relay_progress(progress):
            run = launch(
                _rank_main,
                world_size=ws,
                args=(options, progress),
                timeout_s=options.timeout_s,
                backend=runs.backend_for(device),
            )
        if not run.ok:
            return CommResult(options, False, tuple(points), failure=run.summary())
        got = run.values[0]
        points += got["points"]
        memcpy = max(memcpy, got["memcpy_Bps"])
        if got["backward_s"]:
            grad_bytes, backward_s = got["grad_bytes"], got["backward_s"]
    fits, predictions, notes = {}, {}, []
    for ws in options.world_sizes:
        ar = [p for p in points if p.op == "all_reduce" and p.world_size == ws]
        if ws > 1 and len({p.nbytes for p in ar}) >= 2:
            try:
                fits[ws] = fit_alpha_beta([p.nbytes for p in ar], [p.seconds for p in ar])
            except ValueError as e:  # all latency, or noise: widen the size range
                notes.append(f"world size {ws}: no alpha-beta fit ({e})")
                continue
            predictions[ws] = best_bucket(fits[ws], grad_bytes, backward_s)
    result = CommResult(
        options,
        True,
        tuple(points),
        memcpy,
        fits,
        grad_bytes,
        backward_s,
        predictions,
        str(run_dir),
        runs.describe_machine(meta["machine"]),
    )
    series = {
        f"{op} n={ws}": [p.busbw / 1e9 for p in points if p.op == op and p.world_size == ws]
        for op in options.ops
        for ws in options.world_sizes
        if ws > 1
    }
    chart = charts.bandwidth(
        run_dir / "busbw.png",
        options.sizes,
        series,
        reference=("memcpy (1 core)", memcpy / 1e9),
        title="bus bandwidth (nccl-tests definition)",
    )
    result = dataclasses.replace(result, notes=tuple(n for n in [*notes, chart.note] if n))
    runs.write_json(run_dir / "comm.json", result.to_dict())
    (run_dir / "comm.txt").write_text(format_comm(result) + "\n")
    return result


def _rank_main(ctx: RankContext, options: CommOptions, progress: runs.Progress) -> dict:
    samples: dict[tuple[str, int], list[float]] = {}
    calls = {(op, s): collective_call(op, s, ctx) for op in options.ops for s in options.sizes}
    for fn in calls.values():  # warm-up: connections, first-touch of buffers
        fn()
    for r in range(options.repeats):
        progress(
            f"comm: world size {ctx.world_size}, round {r + 1}/{options.repeats}", rank=ctx.rank
        )
        keys = list(calls)
        keys = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate: no fixed position
        for key in keys:
            samples.setdefault(key, []).append(timed(calls[key], _inner(key[1])))
    points = [
        CommPoint(
            op, ctx.world_size, _message_bytes(s, ctx.world_size), statistics.median(v), min(v)
        )
        for (op, s), v in samples.items()
    ]
    del calls
    memcpy = memcpy_bandwidth(options.max_bytes, device=ctx.device)
    grad_bytes, backward_s = 0, 0.0
    if ctx.world_size == min(options.world_sizes):
        grad_bytes, backward_s = measure_backward(ctx, options.model_size_m)
    return {
        "points": points,
        "memcpy_Bps": memcpy,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
    }


def _message_bytes(nbytes: int, n: int) -> int:
    return max(n, nbytes // 4 // n * n) * 4


def measure_backward(ctx: RankContext, model_size_m: float, repeats: int = 3) -> tuple[int, float]:
    """(gradient bytes, median backward seconds) of the transformer workload on this rank,
    with every rank computing at once (as in training: they share the cores)."""
    workload = get_workload("transformer", size_m=model_size_m)
    torch.manual_seed(0)
    model = workload.build().to(ctx.device)
    batch = workload.batch(0, ctx.world_size).shard(ctx.rank, ctx.world_size).to(ctx.device)
    times = []
    for _ in range(repeats + 1):
        loss = workload.loss(model, batch)
        times.append(timed(loss.backward))
        model.zero_grad(set_to_none=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return grad_bytes, statistics.median(times[1:])


# --- formatting -----------------------------------------------------------------------------


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= 0.99 * scale:  # sizes rounded down to a multiple of the world size
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"


def format_comm(result: CommResult) -> str:
    from tabulate import tabulate

    if not result.ok:
        return f"comm failed:\n{result.failure}"
    o = result.options
    lines = [
        f"collectives: {', '.join(o.ops)}; world sizes {', '.join(map(str, o.world_sizes))}; "
        f"median of {o.repeats} interleaved repeats, slowest rank",
        f"machine: {result.machine}",
        f"memcpy bandwidth (one core, all ranks copying at once): "
        f"{result.memcpy_Bps / 1e9:.2f} GB/s",
        "",
    ]
    for ws in o.world_sizes:
        rows = []
        for size in sorted({p.nbytes for p in result.points if p.world_size == ws}):
            row = [_size(size)]
            for op in o.ops:
                p = next(
                    (q for q in result.points if (q.op, q.world_size, q.nbytes) == (op, ws, size)),
                    None,
                )
                row += (
                    ["-", "-"] if p is None else [f"{p.seconds * 1e6:.0f}", f"{p.busbw / 1e9:.2f}"]
                )
            rows.append(row)
        headers = ["size"] + [h for op in o.ops for h in (f"{op} us", "busbw GB/s")]
        lines += [f"world size {ws}:", tabulate(rows, headers=headers, disable_numparse=True), ""]
    if result.fits:
        rows = []
        for ws, fit in result.fits.items():
            bucket, exposed = result.predictions[ws]
            rows.append(
                [
                    ws,
                    f"{fit.alpha_s * 1e6:.0f}",
                    f"{fit.beta_Bps / 1e9:.2f}",
                    f"{fit.beta_Bps * bus_factor('all_reduce', ws) / 1e9:.2f}",
                    f"{100 * fit.max_rel_error:.0f}%",
                    _size(bucket),
                    f"{exposed * 1e3:.1f}",
                ]
            )
        headers = [
            "world",
            "alpha us",
            "beta (algbw) GB/s",
            "busbw GB/s",
            "worst fit error",
            "best bucket",
            "exposed ms",
        ]
        lines += [
            f"all-reduce fit t(S) = alpha + S/beta, and the bucket size it predicts for a "
            f"{o.model_size_m:g}M-parameter transformer ({_size(result.grad_bytes)} of "
            f"gradients, backward {result.backward_s * 1e3:.0f} ms):",
            tabulate(rows, headers=headers, disable_numparse=True),
            "(the measured sweep: python -m verify bench; the model assumes communication does "
            "not slow compute, which a CPU cannot give)",
            "",
        ]
    lines.append(f"written to {result.run_dir}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
