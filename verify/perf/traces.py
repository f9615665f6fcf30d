"""Step time, compute, communication and overlap, read back from the written profiler traces.

The profiler writes Chrome-trace JSON (the file TensorBoard, Perfetto and chrome://tracing
open). This module parses it and measures, for every profiled step (`ProfilerStep#N` on the
thread that trains):

- **step**: the `ProfilerStep#N` range.
- **communication** C: when collectives were actually on the wire.
  - CPU / gloo: gloo runs every collective, blocking or async, on its own worker threads and
    records a `gloo:<op>` range there (e.g. `gloo:all_reduce`) from the moment a worker picks
    the work up until it completes. C is the union of those ranges, so several collectives in
    flight on different gloo threads count once. Queueing before a worker picks the work up
    is not communication; waiting inside the range for a slower peer is (a real collective
    cannot finish before its slowest participant arrives).
  - GPU / NCCL: the union of NCCL kernels (`nccl*` kernel events) on the GPU streams; gloo
    carrying CUDA tensors: its worker threads' ranges, as on CPU. The host ranges' copies on
    the GPU's streams (`gpu_user_annotation`) are left out (`host_events`).
- **compute** B: when the device computed.
  - CPU: the union of operator ranges (`cpu_op` events) on the training thread, minus the
    `c10d::` operators that only hand a collective to the backend. Gaps between operators
    are time spent blocked (in `Work.wait()`, DDP's end-of-backward wait, `.tolist()` on a
    pending result) or in Python between operators: the trace cannot tell these apart, and
    the Python part is small (a few ms per step in our models, from gaps of < 50 us).
  - GPU: the union of all other kernels.
- **exposed communication** = |C \\ B|: time something was on the wire while nothing was
  computed; **overlap fraction** = 1 - exposed / communication (the share hidden).
  By construction exposed <= communication <= step and compute <= step.
- **collectives** and **bytes** per step: every `gloo:*` / `nccl:*` range starting in the step,
  with its input tensor's size (for an all-reduce, the bucket; for a broadcast, the buffer).
- **issued**: the collectives the code called, by kind and by the phase it called them in,
  from the dispatcher's `c10d::` operators (`issued.py`: gloo runs a reduce-scatter as an
  all-reduce, and its range says so).

Limits, on CPU: the gloo threads need the same cores as compute, so "overlapped" here means
"progressing concurrently", not "free": overlap can lengthen compute instead of hiding
communication (see docs/profiling.md). Profiling itself adds overhead to every operator.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verify.perf import issued as issued_ops

Interval = tuple[float, float]

#: the ranges the one trainer marks each step with (verify/training/trainer.py)
PHASES = ("forward", "backward", "grad_sync", "optimizer_step")
_COLLECTIVE = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):")
_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "int": 4,
    "long int": 8,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}
_WORKER = re.compile(r"^(?P<worker>.*?)(\.\d+)?\.pt\.trace\.json(\.gz)?$")


@dataclass(frozen=True)
class StepMetrics:
    """One profiled step on one rank; times in milliseconds."""

    rank: int
    step: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float
    collectives: int
    bytes: int
    phases_ms: dict  # PHASES -> total ms of that range in the step
    issued: dict = field(default_factory=dict)  # kind -> phase -> operators (issued.py)

    @property
    def overlap(self) -> float | None:
        """Share of communication hidden behind compute (None: no communication)."""
        return 1.0 - self.exposed_ms / self.comm_ms if self.comm_ms > 0 else None


# --- intervals ------------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def measure(disjoint: Sequence[Interval]) -> float:
    return sum(e - s for s, e in disjoint)


def clip(disjoint: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in disjoint if e > lo and s < hi]


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """a minus b, both sorted and disjoint."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# --- reading traces -------------------------------------------------------------------------


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def find_traces(run_dir: str | Path) -> dict[str, Path]:
    """{worker name: trace file} of one run folder (the newest file per worker)."""
    found: dict[str, Path] = {}
    for path in sorted(Path(run_dir).iterdir()):
        m = _WORKER.match(path.name)
        if m:
            found[m.group("worker")] = path
    return found


def payload_bytes(event: dict) -> int:
    """Bytes of a collective's first input (a tensor, or a list of tensors)."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    if not dims:
        return 0
    first = dims[0]
    shapes = first if first and isinstance(first[0], list) else [first]
    numel = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        numel += n
    dtype = types[0] if types else "float"
    return numel * _DTYPE_BYTES.get(dtype, 4)


def host_events(trace: dict) -> list[dict]:
    """The trace's complete events, less the host ranges' copies on the GPU's streams
    (`gpu_user_annotation`, at GPU time), which would count each step and collective twice."""
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and "dur" in e and e.get("cat") != "gpu_user_annotation"
    ]


def profiler_steps(events: list[dict]) -> list[dict]:
    """The `ProfilerStep#N` ranges of the thread that trains, in time order."""
    return sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=_span)


def analyze(trace: dict, *, rank: int = 0) -> list[StepMetrics]:
    """Metrics of every `ProfilerStep#N` in one rank's trace (see the module docstring)."""
    events = host_events(trace)
    if not (steps := profiler_steps(events)):
        return []
    main_tid = steps[0]["tid"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    collectives = [e for e in events if _COLLECTIVE.match(e["name"])]
    if kernels:  # GPU: NCCL's kernels, or gloo's threads where it carries CUDA tensors
        comm = [_span(e) for e in kernels if "nccl" in e["name"].lower()]
        comm = union(comm + [_span(e) for e in collectives if e["tid"] != main_tid])
        busy = union(_span(e) for e in kernels if "nccl" not in e["name"].lower())
    else:  # CPU: gloo worker threads vs. the training thread's operators
        comm = union(_span(e) for e in collectives if e["tid"] != main_tid)
        busy = union(
            _span(e)
            for e in events
            if e.get("cat") == "cpu_op"
            and e["tid"] == main_tid
            and not e["name"].startswith(("c10d::", "record_param_comms"))
        )
    annotations = [e for e in events if e["tid"] == main_tid and e.get("cat") == "user_annotation"]
    phase_spans = [(e["name"], *_span(e)) for e in annotations if e["name"] in PHASES]
    out = []
    for st in steps:
        lo, hi = _span(st)
        c = clip(comm, lo, hi)
        in_step = [e for e in collectives if lo <= e["ts"] < hi]
        phases = {p: 0.0 for p in PHASES}
        for e in annotations:
            if e["name"] in phases and lo <= e["ts"] < hi:
                phases[e["name"]] += e["dur"] / 1e3
        out.append(
            StepMetrics(
                rank=rank,
                step=int(st["name"].split("#", 1)[1]),
                step_ms=(hi - lo) / 1e3,
                compute_ms=measure(clip(busy, lo, hi)) / 1e3,
                comm_ms=measure(c) / 1e3,
                exposed_ms=measure(subtract(c, busy)) / 1e3,
                collectives=len(in_step),
                bytes=sum(payload_bytes(e) for e in in_step),
                phases_ms=phases,
                issued=issued_ops.count(events, phase_spans, lo, hi),
            )
        )
    return out


def _span(event: dict) -> Interval:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


# --- summaries ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariantSummary:
    """Means over every profiled step of every rank (means keep exposed <= comm <= step)."""

    impl: str
    ranks: int
    steps: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float
    collectives: float
    bytes: float
    phases_ms: dict
    step_ms_median: float
    issued: dict = field(default_factory=dict)  # kind -> phase -> operators per step

    @property
    def overlap(self) -> float | None:
        return 1.0 - self.exposed_ms / self.comm_ms if self.comm_ms > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "overlap": self.overlap}


def summarize(impl: str, metrics: Sequence[StepMetrics]) -> VariantSummary:
    if not metrics:
        raise ValueError(f"{impl}: the traces hold no profiled step")

    def mean(attr: str) -> float:
        return statistics.fmean(getattr(m, attr) for m in metrics)

    return VariantSummary(
        impl=impl,
        ranks=len({m.rank for m in metrics}),
        steps=len({m.step for m in metrics}),
        step_ms=mean("step_ms"),
        compute_ms=mean("compute_ms"),
        comm_ms=mean("comm_ms"),
        exposed_ms=mean("exposed_ms"),
        collectives=mean("collectives"),
        bytes=mean("bytes"),
        phases_ms={p: statistics.fmean(m.phases_ms[p] for m in metrics) for p in PHASES},
        step_ms_median=statistics.median(m.step_ms for m in metrics),
        issued=issued_ops.mean([m.issued for m in metrics]),
    )


def analyze_run(run_dir: str | Path, impl: str) -> tuple[VariantSummary, list[StepMetrics]]:
    """Summary of one run folder holding one trace per rank (workers named `rank<N>`)."""
    metrics: list[StepMetrics] = []
    traces = find_traces(run_dir)
    if not traces:
        raise ValueError(f"no *.pt.trace.json in {run_dir}")
    for worker, path in sorted(traces.items()):
        rank = int(worker[4:]) if re.fullmatch(r"rank\d+", worker) else len(metrics)
        metrics += analyze(load_trace(path), rank=rank)
    return summarize(impl, metrics), metrics


def timeline(trace: dict, step_index: int = 0) -> list[tuple[str, list[tuple[float, float, str]]]]:
    """Rows of (start ms, duration ms, name) within one profiled step, for a timeline chart:
    the training thread's phases, the bucket launches and waits (from any thread: on a GPU
    autograd runs the gradient hooks that launch them on a thread of its own), the
    collectives issued, named by kind (`issued.py`: a reduce-scatter that gloo runs as an
    all-reduce is a reduce-scatter here), and each communication thread's collectives (times
    from the step's start)."""
    events = host_events(trace)
    steps = profiler_steps(events)
    if len(steps) <= step_index:
        return []
    step = steps[step_index]
    lo, hi = _span(step)
    main_tid = step["tid"]
    inside = [e for e in events if lo <= e["ts"] < hi]

    def row(selected):
        return [((e["ts"] - lo) / 1e3, e["dur"] / 1e3, e["name"]) for e in selected]

    rows = [
        ("phases", row(e for e in inside if e["tid"] == main_tid and e["name"] in PHASES)),
        (
            "sync ranges",
            row(
                e
                for e in inside
                if e.get("cat") == "user_annotation"
                and re.search(r"\.(launch|wait)\[|^zero1\.", e["name"])
            ),
        ),
        # Issuing takes microseconds: drawn at least 0.3% of the step wide, to be seen.
        (
            "issued",
            [
                (s, max(d, 0.003 * (hi - lo) / 1e3), issued_ops.kind(n))
                for s, d, n in row(e for e in inside if issued_ops.kind(e["name"]))
            ],
        ),
    ]
    comm_threads = sorted({e["tid"] for e in inside if _COLLECTIVE.match(e["name"])} - {main_tid})
    for n, tid in enumerate(comm_threads):
        rows.append(
            (
                f"comm thread {n}",
                row(e for e in inside if e["tid"] == tid and _COLLECTIVE.match(e["name"])),
            )
        )
    return [(label, items) for label, items in rows if items]
