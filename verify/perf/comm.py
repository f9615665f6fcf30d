"""`python -m verify comm`: what the collectives cost here, and the bucket size that follows.

At each requested world size (one launch each), all-reduce, all-gather, reduce-scatter and
broadcast over message sizes from KB to (by default) 64 MiB, with algorithm and bus bandwidth
as nccl-tests defines them (`alphabeta.bus_factor`), beside the memory-copy bandwidth of one
core (`tensor.copy_`, all ranks copying at once: on loopback the "link" is local memory).

From the all-reduce times at each world size it fits t(S) = alpha + S / beta and predicts,
for the transformer of `--model-size` (its gradient bytes and its backward time, measured at
the smallest world size), the bucket size that minimizes DDP's exposed communication
(`alphabeta.best_bucket`).

Every time is the slowest rank's (`timing.timed`); sizes and ops are interleaved, the order
rotating each round (`timing.interleave`), so noise from other processes spreads over all of
them; each sample averages several back-to-back calls for small messages (as nccl-tests
does); the report gives medians. The run folder holds comm.json, comm.txt and busbw.png.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from verify import progress
from verify.launching import LaunchResult, RankContext, launch
from verify.options import OutputOptions, knob, launch_knobs
from verify.perf import charts
from verify.perf.alphabeta import MiB, best_bucket, bus_factor, fit_alpha_beta
from verify.perf.base import Measured, MeasureOptions, RunFolder, model_size, say
from verify.perf.collectives import (
    OPS,
    collective_call,
    inner_calls,
    measure_backward,
    memcpy_bandwidth,
    memcpy_name,
    message_bytes,
)
from verify.perf.timing import interleave, timed


@dataclass(frozen=True, kw_only=True)
class CommOptions(MeasureOptions, OutputOptions):
    """The collectives, sizes and world sizes to measure."""

    world_sizes: tuple[int, ...] = knob(
        (2, 3, 4), "world sizes to measure, one launch each", minimum=1
    )
    min_kb: float = knob(4.0, "smallest message", unit="KiB", positive=True)
    max_mb: float = knob(
        64.0, "largest message (sizes grow by 4x up to it)", unit="MiB", positive=True
    )
    repeats: int = knob(5, "interleaved rounds over every op and size", minimum=1)
    model_size_m: float = model_size(10.0, "the transformer whose best bucket size is predicted")
    ops: tuple[str, ...] = knob(OPS, "collectives to measure", choices=OPS, cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 4 <= self.min_bytes <= self.max_bytes:
            raise ValueError(
                f"--min-kb {self.min_kb:g} and --max-mb {self.max_mb:g}: need 4 B <= smallest "
                "<= largest message"
            )

    @property
    def ranks(self) -> int:
        return max(self.world_sizes)

    @property
    def min_bytes(self) -> int:
        return int(self.min_kb * 1024)

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * MiB)

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
    seconds: float  # median over rounds of the slowest rank's time per call
    min_seconds: float

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.world_size)


@dataclass(frozen=True)
class CommResult(Measured):
    """Every (op, world size, size) point, the fits and the predicted bucket sizes."""

    options: CommOptions
    verdict: str
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
        o = self.options
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "options": {**o.to_dict(), "min_bytes": o.min_bytes, "max_bytes": o.max_bytes},
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
    """One launch per world size; then the fits and predictions, in this process."""
    folder = RunFolder.start(options, "comm", options.ranks)
    launches, sweep = _launch_each(options)
    machine, last, points = folder.machine(*launches), launches[-1], tuple(sweep.points)
    if not last.ok:
        result = CommResult.from_launch(
            options, last, points=points, run_dir=str(folder.path), machine=machine
        )
        folder.save("comm", result)
        return result
    fits, predictions, notes = _fit_each(options, sweep)
    series = {
        f"{op} n={ws}": [p.busbw / 1e9 for p in points if p.op == op and p.world_size == ws]
        for op in options.ops
        for ws in options.world_sizes
        if ws > 1
    }
    chart = charts.bandwidth(
        folder.path / "busbw.png",
        options.sizes,
        series,
        reference=(memcpy_name(options.device_type), sweep.memcpy_Bps / 1e9),
        title="bus bandwidth (nccl-tests definition)",
    )
    result = CommResult.from_launch(
        options,
        last,
        points=points,
        memcpy_Bps=sweep.memcpy_Bps,
        fits=fits,
        grad_bytes=sweep.grad_bytes,
        backward_s=sweep.backward_s,
        predictions=predictions,
        run_dir=str(folder.path),
        machine=machine,
        notes=tuple(n for n in [*notes, chart.note] if n),
    )
    folder.save("comm", result)
    return result


@dataclass
class _Sweep:
    """What the launches that finished measured: their points, the fastest memcpy, and the
    transformer's gradient bytes and backward time (from the smallest world size's launch)."""

    points: list[CommPoint] = field(default_factory=list)
    memcpy_Bps: float = 0.0
    grad_bytes: int = 0
    backward_s: float = 0.0


def _launch_each(options: CommOptions) -> tuple[list[LaunchResult], _Sweep]:
    """`comm_on_rank` launched at each world size in turn, stopping after the first launch
    that fails (the last of the launches returned; its ranks' values are not in the sweep)."""
    sweep, launches = _Sweep(), []
    for i, ws in enumerate(options.world_sizes, 1):
        progress.say(f"comm: world size {ws} (", i, len(options.world_sizes), ")")
        run = launch(comm_on_rank, world_size=ws, args=(options,), **launch_knobs(options))
        launches.append(run)
        if not run.ok:
            break
        got = run.values[0]
        sweep.points += got["points"]
        sweep.memcpy_Bps = max(sweep.memcpy_Bps, got["memcpy_Bps"])
        if got["backward_s"]:
            sweep.grad_bytes, sweep.backward_s = got["grad_bytes"], got["backward_s"]
    return launches, sweep


def _fit_each(options: CommOptions, sweep: _Sweep) -> tuple[dict, dict, list[str]]:
    """At each world size over 1 with all-reduce times at two sizes or more: the alpha-beta
    fit and the bucket size it predicts (both keyed by world size), or a note saying why
    there is no fit."""
    fits, predictions, notes = {}, {}, []
    for ws in options.world_sizes:
        ar = [p for p in sweep.points if p.op == "all_reduce" and p.world_size == ws]
        if ws > 1 and len({p.nbytes for p in ar}) >= 2:
            try:
                fits[ws] = fit_alpha_beta([p.nbytes for p in ar], [p.seconds for p in ar])
            except ValueError as e:  # all latency, or noise: widen the size range
                notes.append(f"world size {ws}: no alpha-beta fit ({e})")
                continue
            predictions[ws] = best_bucket(fits[ws], sweep.grad_bytes, sweep.backward_s)
    return fits, predictions, notes


def comm_on_rank(ctx: RankContext, options: CommOptions) -> dict:
    """Every (op, size) interleaved over `repeats` rounds; then memcpy, and at the smallest
    world size the transformer's gradient bytes and backward time."""
    calls = {(op, s): collective_call(op, s, ctx) for op in options.ops for s in options.sizes}
    for fn in calls.values():  # warm-up: connections, first touch of the buffers
        fn()

    def arm(fn, nbytes: int):
        inner = inner_calls(nbytes)
        return lambda: timed(fn, ctx.device, inner)

    arms = {key: arm(fn, key[1]) for key, fn in calls.items()}
    samples = interleave(
        arms,
        options.repeats,
        lambda r: say(ctx, f"comm: world size {ctx.world_size}, round ", r, options.repeats),
    )
    points = [
        CommPoint(
            op, ctx.world_size, message_bytes(s, ctx.world_size), statistics.median(v), min(v)
        )
        for (op, s), v in samples.items()
    ]
    del calls, arms  # free the buffers before the memcpy measurement allocates its own
    memcpy = memcpy_bandwidth(options.max_bytes, ctx.device)
    grad_bytes, backward_s = 0, 0.0
    if ctx.world_size == min(options.world_sizes):
        grad_bytes, backward_s = measure_backward(ctx, options.model_size_m)
    return {
        "points": points,
        "memcpy_Bps": memcpy,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
    }
