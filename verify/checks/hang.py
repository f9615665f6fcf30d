"""`python -m verify hang`: run a job under the hang watchdog and report a diagnosis.

Two ways in:

- `--impl NAME`: train the implementation through the workloads where data-parallel code
  hangs (a parameter used on one rank only and parameters never used, several buckets, tied
  weights) with `launch(..., stall_timeout_s=...)`;
- `--nproc N -- train.py ARGS`: run the user's own script in N processes (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT set, a free port picked), each under
  `python -m verify.hang_run`, which traces its collectives, while this process watches.

Either way one report folder is written per run, never over an earlier one:
`profiles/hang_<name>_<world>x<device>_<stamp>/` (or under `--out DIR`) with report.txt (what
was printed), report.json, metadata.json and, per rank, `rank<r>.collectives.jsonl` (every
traced collective), `rank<r>.stack` (faulthandler dump at the hang), `rank<r>.stderr` (the
backend's debug log: TORCH_CPP_LOG_LEVEL=INFO, TORCH_DISTRIBUTED_DEBUG=INFO; NCCL_DEBUG=INFO
files on NCCL) and `rank<r>.flight_recorder.json`. Exit code 0: no hang and no desync; 1: a
hang, desync or crash was diagnosed; 2: the check could not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

from impls.faulty import hang_scenarios as scenarios
from impls.registry import resolve
from verify.launching import DEFAULT_STALL_TIMEOUT_S, RankContext, launch, run_script
from verify.training.workloads import get_workload
from verify.watching import capture, trace_file
from verify.watching.findings import Diagnosis

#: (workload, bucket size in MB): a parameter used on one rank only and parameters unused in
#: some or all steps; many small buckets; a weight shared by two layers.
HANG_WORKLOADS = (("unused", 0.002), ("mlp", 0.0005), ("tied", 0.002))
_GRACE_S = 1.5


@dataclass(frozen=True, kw_only=True)
class HangOptions:
    impl: str | None = None  # --impl mode
    script: tuple[str, ...] = ()  # --nproc mode: the script and its arguments
    world_size: int = 2
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    steps: int = 3
    out: str = "profiles"
    timeout_s: float = 600.0
    backend: str = "gloo"
    console: str = "stdout"  # where a script's ranks' output is echoed: stdout, stderr, none

    def __post_init__(self) -> None:
        if (self.impl is None) == (not self.script):
            raise ValueError("give either --impl NAME or --nproc N -- script.py ARGS")
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall timeout must be > 0 seconds, got {self.stall_timeout_s}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (faults show at step 2), got {self.steps}")
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) and (
            "DDP_VERIFY_SPAWNED" not in os.environ
        ):
            raise ValueError(
                "under torchrun, run your script as `torchrun ... -m verify.hang_run train.py "
                "ARGS` (see docs/debugging.md); `hang` spawns and watches its own ranks"
            )
        if self.impl is not None:
            resolve(self.impl)
        elif not os.path.isfile(self.script[0]):
            raise ValueError(f"script {self.script[0]} does not exist")


@dataclass(frozen=True)
class HangResult:
    options: HangOptions
    diagnosis: Diagnosis
    report_dir: str
    elapsed_s: float
    failure: str | None = None  # the launcher's summary when a rank failed
    files: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)  # rank -> process id (all ended on return)

    @property
    def passed(self) -> bool:
        return not self.diagnosis.faulty

    def to_dict(self) -> dict:
        return {
            "check": "hang",
            "passed": self.passed,
            "verdict": self.diagnosis.verdict,
            "report_dir": self.report_dir,
            "elapsed_s": self.elapsed_s,
            "options": {k: v for k, v in vars(self.options).items()},
            "diagnosis": self.diagnosis.to_dict(),
            "failure": self.failure,
            "files": self.files,
            "pids": self.pids,
        }


# ------------------------------------------------------------ --impl


def check_hang(options: HangOptions) -> HangResult:
    """Run `options.impl` (or the script) under the watchdog; write and return the report."""
    name = options.impl or os.path.basename(options.script[0])
    report_dir = new_report_dir(options.out, name, options.world_size, options.backend)
    _write_json(os.path.join(report_dir, "metadata.json"), _metadata(options))
    start = time.monotonic()
    if options.script:
        run = run_script(
            options.script,
            nproc=options.world_size,
            report_dir=report_dir,
            stall_timeout_s=options.stall_timeout_s,
            timeout_s=options.timeout_s,
            env=capture.backend_env(options.backend, report_dir),
            console={"stdout": sys.stdout, "stderr": sys.stderr}.get(options.console),
        )
    else:
        run = launch(
            run_hang_on_rank,
            world_size=options.world_size,
            args=(options,),
            timeout_s=options.timeout_s,
            backend=options.backend,
            env=capture.backend_env(options.backend, report_dir),
            stall_timeout_s=options.stall_timeout_s,
            report_dir=report_dir,
        )
    assert run.diagnosis is not None
    diagnosis, failure = run.diagnosis, None if run.ok else run.summary()
    elapsed = time.monotonic() - start
    files, pids = finish_report(report_dir, options.world_size)
    diagnosis = _with_files(diagnosis, files)
    result = HangResult(options, diagnosis, report_dir, elapsed, failure, files, pids)
    with open(os.path.join(report_dir, "report.txt"), "w") as f:
        f.write(format_hang(result) + "\n")
    _write_json(os.path.join(report_dir, "report.json"), result.to_dict())
    return result


def run_hang_on_rank(ctx: RankContext, options: HangOptions) -> int:
    """Train the implementation for a few steps on each hang-prone workload; the watchdog in
    the parent does the checking. Returns the number of steps run."""
    impl = resolve(options.impl)
    steps = 0
    for workload_name, bucket_mb in HANG_WORKLOADS:
        workload = get_workload(workload_name)
        torch.manual_seed(ctx.rank)
        model = workload.build().to(ctx.device)
        wrapped = impl.wrap(
            model, bucket_size_mb=bucket_mb, find_unused_parameters=workload.has_unused_parameters
        )
        optimizer = impl.make_optimizer(workload.param_groups(model), torch.optim.SGD)
        finish = getattr(wrapped, "finish_gradient_synchronization", None)
        start_batch = getattr(wrapped, "on_train_batch_start", None)
        for step in range(1, options.steps + 1):
            if start_batch is not None:
                start_batch()
            optimizer.zero_grad()
            batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
            workload.loss(wrapped, batch.to(ctx.device)).backward()
            if finish is not None:
                finish()
            optimizer.step()
            steps += 1
    return steps


# ------------------------------------------------------------ the report folder


def new_report_dir(out: str, name: str, world: int, backend: str) -> str:
    """`out/hang_<name>_<world>x<device>_<stamp>/`, created; never an existing folder."""
    device = "gpu" if backend == "nccl" else "cpu"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out, f"hang_{slug}_{world}x{device}_{stamp}")
    path, i = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            i += 1
            path = f"{base}-{i}"


def finish_report(report_dir: str, world: int) -> tuple[dict[str, str], dict[int, int]]:
    """Turn the binary traces into rank<r>.collectives.jsonl; the captured files, and the
    ranks' process ids (from their traces)."""
    files: dict[str, str] = {}
    pids: dict[int, int] = {}
    for r in range(world):
        jsonl = os.path.join(report_dir, f"rank{r}.collectives.jsonl")
        trace = trace_file.export_jsonl(os.path.join(report_dir, f"rank{r}.trace"), jsonl)
        if trace is not None:
            pids[r] = trace.pid
        for kind in ("collectives.jsonl", "stack", "stderr", "stdout", "flight_recorder.json"):
            path = os.path.join(report_dir, f"rank{r}.{kind}")
            if os.path.exists(path) and os.path.getsize(path) > 0:
                files[f"rank{r}.{kind}"] = path
    for name in sorted(os.listdir(report_dir)):
        if name.startswith(("nccl.", "nccl_trace_rank_")):
            files[name] = os.path.join(report_dir, name)
    return files, pids


def _with_files(diag: Diagnosis, files: dict) -> Diagnosis:
    from dataclasses import replace

    return replace(diag, files=dict(files))


def _metadata(options: HangOptions) -> dict:
    return {
        "command": " ".join([os.path.basename(sys.executable), "-m", "verify", *sys.argv[1:]]),
        "options": vars(options),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.node()}, {os.cpu_count()} cpus",
        "cuda": torch.cuda.is_available(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def format_hang(result: HangResult) -> str:
    o = result.options
    what = o.impl or " ".join(o.script)
    head = (
        f"hang check: {what}, world size {o.world_size}, stall timeout {o.stall_timeout_s:g}s "
        f"({result.elapsed_s:.1f}s)"
    )
    d = result.diagnosis
    if not d.faulty:
        body = "no hang: every rank finished and every collective matched on every rank"
        return f"{head}\n{body}\nreport: {result.report_dir}"
    return f"{head}\n{d.text()}\nreport: {result.report_dir}"


# ------------------------------------------------------------ every scenario


def run_scenarios(
    *, world_size: int = 2, stall_timeout_s: float = 3.0, out: str = "profiles", jobs: int = 2
) -> list[HangResult]:
    """`check_hang` on every registered hang:* scenario (`jobs` at a time, in threads)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> HangResult:
        return check_hang(
            HangOptions(impl=name, world_size=world_size, stall_timeout_s=stall_timeout_s, out=out)
        )

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, scenarios.SCENARIOS))


def _as_expected(result: HangResult) -> bool:
    """The scenario got the verdict it is built to get, and its culprit (the last rank)."""
    expected = scenarios.SCENARIOS[result.options.impl][2]
    d = result.diagnosis
    if expected == "ok":
        return d.verdict == "ok"
    # gloo turns some mismatches into an abort rather than a hang: either is a detection.
    close = {"hang": {"hang", "crash"}, "desync": {"desync", "hang"}, "crash": {"crash"}}
    return d.verdict in close[expected] and d.culprit == result.options.world_size - 1


def format_scenarios(results: list[HangResult], stall_timeout_s: float) -> str:
    rows = []
    for r in results:
        d = r.diagnosis
        kind = next((f.kind for f in d.findings if f.message == d.headline), "")
        detect = "-" if d.detection_s is None or d.verdict == "desync" else f"{d.detection_s:.1f}"
        rows.append([
            r.options.impl, scenarios.SCENARIOS[r.options.impl][2], d.verdict,
            "-" if d.culprit is None else d.culprit, kind, (d.collective or "-")[:40], detect,
            f"{r.elapsed_s:.1f}", "yes" if _as_expected(r) else "NO",
        ])  # fmt: skip
    headers = ["scenario", "built to", "verdict", "culprit", "finding", "collective",
               "detected s", "run s", "as expected"]  # fmt: skip
    hangs = [r.diagnosis.detection_s for r in results if r.diagnosis.verdict == "hang"]
    worst = max((h for h in hangs if h is not None), default=None)
    bar = stall_timeout_s + 2
    tail = (
        f"slowest hang detection {worst:.1f}s after the last progress (bar: stall timeout + 2 = "
        f"{bar:g}s: {'met' if worst <= bar else 'MISSED'})"
        if worst is not None
        else "no hang verdicts"
    )
    return f"{tabulate(rows, headers=headers)}\n\n{tail}"


# ------------------------------------------------------------ CLI


def register(subparsers) -> None:
    from verify.cli import _positive_float, _positive_int, impl_help

    p = subparsers.add_parser(
        "hang",
        help="run under the hang watchdog: diagnose hangs and desyncs",
        description="python -m verify hang --impl NAME | --nproc N -- train.py ARGS",
    )
    p.add_argument("--impl", default=None, help=impl_help())
    p.add_argument(
        "--scenarios",
        action="store_true",
        help="run every hang:* scenario and print what each was diagnosed as, and how fast",
    )
    p.add_argument("--jobs", type=_positive_int("--jobs"), default=2, help="with --scenarios")
    p.add_argument("--nproc", type=_positive_int("--nproc"), default=None)
    p.add_argument("--world-size", type=_positive_int("--world-size"), default=2)
    p.add_argument(
        "--stall-timeout",
        type=_positive_float("--stall-timeout"),
        default=DEFAULT_STALL_TIMEOUT_S,
        help="seconds without progress on any rank that make a hang",
    )
    p.add_argument("--steps", type=_positive_int("--steps"), default=3)
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=600.0)
    p.add_argument("--out", default="profiles", help="parent folder of the report folder")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- train.py ARGS (with --nproc)")
    p.set_defaults(run=cmd_hang)
    p = subparsers.add_parser(
        "bench-tracer", help="benchmark the collective tracer against a training step"
    )
    p.add_argument("--impl", default="bucketed", help=impl_help())
    p.add_argument("--world-size", type=_positive_int("--world-size"), default=2)
    p.add_argument("--model-size", type=_positive_float("--model-size"), default=None)
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=None)
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_bench_tracer)


def cmd_hang(args: argparse.Namespace) -> int:
    from verify.cli import EXIT_FAULT, EXIT_PASS, UsageError

    if args.scenarios:
        sweep = run_scenarios(
            world_size=args.world_size, stall_timeout_s=args.stall_timeout, out=args.out,
            jobs=args.jobs,
        )  # fmt: skip
        if args.json:
            print(json.dumps([r.to_dict() for r in sweep], indent=2, default=str))
        else:
            print(format_scenarios(sweep, args.stall_timeout))
        return EXIT_PASS if all(_as_expected(r) for r in sweep) else EXIT_FAULT
    script = tuple(a for a in args.script if a != "--") if args.script else ()
    if args.nproc is not None and not script:
        raise UsageError("--nproc needs a script: --nproc N -- train.py ARGS")
    if script and args.nproc is None:
        raise UsageError(f"unexpected arguments {' '.join(script)} (did you mean --nproc N --?)")
    options = HangOptions(
        impl=args.impl,
        script=script,
        console="stderr" if args.json else "stdout",
        world_size=args.nproc or args.world_size,
        stall_timeout_s=args.stall_timeout,
        steps=max(2, args.steps),
        out=args.out,
        timeout_s=args.timeout,
    )
    result = check_hang(options)
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else format_hang(result))
    return EXIT_PASS if result.passed else EXIT_FAULT


def cmd_bench_tracer(args: argparse.Namespace) -> int:
    from verify.cli import EXIT_FAULT, EXIT_PASS
    from verify.perf.bench_tracer import TracerBenchOptions, format_tracer_bench, run_tracer_bench

    options = TracerBenchOptions(
        impl=args.impl,
        world_size=args.world_size,
        model_size_m=args.model_size,
        repeats=args.repeats,
        **({} if args.bucket_mb is None else {"bucket_mb": args.bucket_mb}),
    )
    result = run_tracer_bench(options)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_tracer_bench(result))
    return EXIT_PASS if result.ok else EXIT_FAULT


# ------------------------------------------------------------ small helpers


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read() or None
    except OSError:
        return None


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


__all__ = ["HangOptions", "HangResult", "check_hang", "run_hang_on_rank"]
