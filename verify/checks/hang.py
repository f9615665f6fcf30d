"""`python -m verify hang`: run a job under the hang watchdog and diagnose it.

Three ways in:

- `--impl NAME`: train the implementation through the workloads where data-parallel code
  hangs (a parameter used on one rank only and parameters never used, several buckets, tied
  weights), every rank traced and watched (`launching/`, `watching/`);
- `--nproc N -- train.py ARGS`: the user's own script in N ranks (`launching/script.py`),
  its output shown on the console with a rank prefix as it trains;
- `--scenarios`: every `hang:*` scenario (`impls/faulty/hang_scenarios.py`), each with the
  verdict it is built to get.

Every run writes a report folder, never over an earlier one (`runs.new_run_dir`):
`profiles/hang_<name>_<world>x<device>_<stamp>/` (or under `--out DIR`) with report.json,
report.txt (what the CLI printed), metadata.json and, per rank, `rank<r>.collectives.jsonl`
(every traced collective), `rank<r>.stack` (faulthandler dump at the hang), `rank<r>.stderr` / `.stdout`
(the rank's output with the backend's debug log) and `rank<r>.flight_recorder.json`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from impls.faulty import hang_scenarios as scenarios
from verify import progress, runs
from verify.checks.script import WatchedRun, finish_report, run_watched_script
from verify.checks.script_options import HangOptions
from verify.checks.verdict import Verdicted
from verify.launching import RankContext, launch, thread_budget
from verify.launching.env import backend_env
from verify.launching.launcher import Started
from verify.options import launch_knobs
from verify.training.hooks import Progress
from verify.training.interface import InterfaceError
from verify.training.trainer import Trainer, TrainSpec
from verify.training.workloads import get_workload

#: (workload, bucket size in MB): a parameter used on one rank only and parameters unused in
#: some or all steps; many small buckets; a weight shared by two layers.
HANG_WORKLOADS = (("unused", 0.002), ("mlp", 0.0005), ("tied", 0.002))


@dataclass(frozen=True)
class HangResult(WatchedRun, Verdicted):
    """The diagnosis of one run, its report folder, and the verdict the CLI exits with."""

    options: HangOptions

    @property
    def verdict(self) -> str:
        return self.watched_verdict

    def to_dict(self) -> dict:
        return {
            "check": "hang",
            "verdict": self.verdict,
            "passed": self.passed,
            "options": asdict(self.options),
            **self.watched_dict(),
        }


@dataclass(frozen=True)
class ScenariosResult:
    """`--scenarios`: every scenario's result; "pass" when each got the verdict it is built to
    get, naming the culprit."""

    options: HangOptions
    results: tuple[HangResult, ...]

    @property
    def verdict(self) -> str:
        return "pass" if all(as_expected(r) for r in self.results) else "fault"

    def to_dict(self) -> dict:
        return {"check": "hang-scenarios", "verdict": self.verdict,
                "results": [r.to_dict() for r in self.results]}  # fmt: skip


def check_hang(
    options: HangOptions, started: Started | None = None
) -> HangResult | ScenariosResult:
    """Run the implementation, the script or every scenario under the watchdog; write and
    return the report(s). `started`: the launcher command the CLI started already
    (`verify/cli/head_start.py`)."""
    if options.scenarios:
        return run_scenarios(options)
    if options.script:  # the path `audit --nproc` takes too, with the audit off
        run = run_watched_script(options, command="hang", started=started)
        result = HangResult(options, **run.watched())
        runs.write_json(Path(run.report_dir) / "report.json", result.to_dict())
        return result
    device = "gpu" if options.device_type == "cuda" else "cpu"
    report_dir = str(runs.new_run_dir(options.out, f"hang_{options.impl}", options.ranks, device))
    runs.write_metadata(Path(report_dir), asdict(options))
    start = time.monotonic()
    env = backend_env(options.backend, report_dir)
    run = launch(
        run_hang_on_rank, world_size=options.ranks, args=(options,), env=env,
        report_dir=report_dir, **launch_knobs(options),
    )  # fmt: skip
    elapsed = time.monotonic() - start
    files, pids = finish_report(report_dir, options.ranks)
    diagnosis = replace(run.diagnosis, files=dict(files))
    failure = None if run.ok else run.summary()
    skipped = run.outcomes[0].value[1] if run.ok else ()  # the same on every rank
    result = HangResult(
        options, diagnosis=diagnosis, report_dir=report_dir, elapsed_s=elapsed, failure=failure,
        files=files, pids=pids, notes=(*skipped, *run.notes), threads=run.threads,
    )  # fmt: skip
    runs.write_json(Path(report_dir) / "report.json", result.to_dict())
    return result


def run_hang_on_rank(ctx: RankContext, options: HangOptions) -> tuple[int, tuple[str, ...]]:
    """Train the implementation for a few steps on each hang-prone workload (SGD); the
    watchdog in the parent does the checking. Returns the number of steps run, and a note for
    each workload not run.

    A workload with parameters unused on some ranks that the class refuses at construction
    (ZeRO-3 and FSDP2 do, with one line: the matrix's "not claimed") is skipped, as it is by
    the matrix; the refusal comes before any collective, alike on every rank (a rank that
    refused alone leaves the others in collectives it never joins: the watchdog names it).
    Any other refusal is raised (exit 2), and so is a refusal of every workload."""
    steps, skipped = 0, []
    for i, (workload, bucket_mb) in enumerate(HANG_WORKLOADS, 1):
        spec = TrainSpec(
            impl=options.impl, workload=workload, bucket_mb=bucket_mb, steps=options.steps,
            optimizer="sgd",
        )  # fmt: skip
        label = f"hang {options.impl}: workload {i}/{len(HANG_WORKLOADS)} ({workload})"
        try:
            trainer = Trainer(ctx, spec, (Progress(label),))
        except InterfaceError as exc:
            if not get_workload(workload).has_unused_parameters or i == len(HANG_WORKLOADS):
                raise
            skipped.append(f"workload {workload} not run: the class refused it: {exc.reason}")
            continue
        trainer.run()
        steps += spec.steps
    return steps, tuple(skipped)


# ------------------------------------------------------------ every scenario


def run_scenarios(options: HangOptions) -> ScenariosResult:
    """`check_hang` on every registered hang:* scenario (`options.jobs` at a time)."""

    # The scenarios run side by side: their ranks share the machine's threads.
    threads = options.threads_per_rank or thread_budget(options.jobs * options.ranks).per_rank

    total, done = len(scenarios.SCENARIOS), []

    def one(name: str) -> HangResult:
        result = check_hang(replace(options, impl=name, scenarios=False, threads_per_rank=threads))
        done.append(name)
        progress.say(
            "hang scenarios: ", len(done), total, f" done ({name}: {result.diagnosis.verdict})"
        )
        return result

    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        return ScenariosResult(options, tuple(pool.map(one, scenarios.SCENARIOS)))


def as_expected(result: HangResult) -> bool:
    """The scenario got the verdict it is built to get, and its culprit (the last rank)."""
    expected = scenarios.SCENARIOS[result.options.impl][2]
    d = result.diagnosis
    if expected == "ok":
        return d.verdict == "ok"
    # gloo turns some mismatches into an abort rather than a hang: either is a detection.
    close = {"hang": {"hang", "crash"}, "desync": {"desync", "hang"}, "crash": {"crash"}}
    return d.verdict in close[expected] and d.culprit == result.options.ranks - 1


__all__ = ["HangOptions", "HangResult", "ScenariosResult", "check_hang"]
