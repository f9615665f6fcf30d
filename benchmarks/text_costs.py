"""The reports of the tool's own costs, `bench-audit`, `bench-tracer` and `bench-sanitize` (the
maintainer's scripts `benchmarks/audit_cost.py`, `tracer_cost.py`, `sanitize_cost.py`): a
result in, text out, nothing run. Goals are printed as in `text_bench.py` (value, 95% interval,
decision).
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from tabulate import tabulate

from benchmarks.bench_tracer import GOAL as TRACER_GOAL
from verify.cli.text_bench import decision, interval
from verify.cli.text_perf import failed
from verify.perf.alphabeta import MiB
from verify.training.language import GPTConfig

if TYPE_CHECKING:
    from benchmarks.bench_audit import AuditBenchResult
    from benchmarks.bench_tracer import TracerBenchResult


def audit(result: AuditBenchResult) -> str:
    o = result.options
    if not result.ok:
        return failed("bench-audit", result)
    if o.script_audit:
        return _script_audit(result)
    rows = [
        [name, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}"]
        for name, v in [
            ("training step", result.step_s),
            ("audit (fingerprints)", result.audit_s),
            ("all-gather of every tensor", result.allgather_s),
        ]
    ]
    goals = [
        f"{what + ':':20s}{r.value:.4f}  95% interval {interval(r.low, r.high, fmt='.4f')}  "
        f"(goal <= {goal:g}: {decision(decided, r)})"
        for what, r, goal, decided in result.bars()
    ]
    return "\n".join(
        [
            f"audit benchmark: {o.impl} on a {result.parameters / 1e6:.1f}M-parameter transformer, "
            f"world size {o.world_size}, {o.repeats} interleaved rounds",
            f"audited per step: {result.audited_tensors} tensors, {result.audited_bytes / MiB:.0f} "
            f"MiB per rank",
            f"machine: {result.machine}",
            "",
            tabulate(rows, headers=["what", "median ms", "min ms"]),
            "",
            "paired per round (geometric mean of each round's ratio):",
            *goals,
        ]
    )


def _script_audit(result: AuditBenchResult) -> str:
    """`bench-audit --script-audit`: audited / plain step, side by side."""
    o = result.options
    rows = [
        [name, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}"]
        for name, v in [("plain step", result.plain_s), ("audited step", result.audited_s)]
    ]
    what, r, goal, decided = result.bars()[0]
    block = GPTConfig.with_params(o.model_size_m).block_size
    return "\n".join([
        f"audit --nproc cost: {o.impl} on a {result.parameters / 1e6:.1f}M-parameter transformer, "
        f"world size {o.world_size}, {o.local_batch * block} tokens per rank and step "
        f"({o.local_batch} x {block}), {o.repeats} interleaved rounds",
        f"audited at every step: up to {result.audited_tensors} tensors and settings per audit "
        f"point; findings: {result.findings}; time inside the audit: "
        f"{result.audit_s_per_step * 1e3:.1f} ms a step (rank 0)",
        f"machine: {result.machine}",
        "",
        tabulate(rows, headers=["what", "median ms", "min ms"]),
        "",
        _goal_bar(what, r, goal, decided),
    ])  # fmt: skip


def tracer(result: TracerBenchResult) -> str:
    o = result.options
    if not result.ok:
        return failed("bench-tracer", result)
    r = result.ratio
    rows = [
        [name, f"{statistics.median(v) * 1e3:.2f}", f"{min(v) * 1e3:.2f}"]
        for name, v in [
            ("training step, untraced", result.plain_step_s),
            ("training step, traced", result.traced_step_s),
        ]
    ]
    c = result.cpu_ratio
    return "\n".join(
        [
            f"tracer benchmark: {o.impl} (bucket {o.bucket_mb:g} MB) on a "
            f"{result.parameters / 1e6:.2f}M-parameter transformer, world size {o.world_size}, "
            f"{result.collectives_per_step} traced collectives per step, {o.rounds} interleaved "
            "rounds (one untraced and one traced step each)",
            f"machine: {result.machine}; load average {result.load_avg[0]:.1f} -> "
            f"{result.load_avg[1]:.1f} on {os.cpu_count()} cpus during the rounds",
            "",
            tabulate(rows, headers=["what", "median ms", "min ms"]),
            "",
            f"tracer cost per collective call (CPU, no network): "
            f"{result.traced_call_us - result.plain_call_us:.1f} us; x calls per step / median "
            f"step: {100 * result.per_call_share:.2f}%",
            f"ratio of the medians: {100 * result.overhead_of_medians:+.2f}%",
            f"on the training thread's CPU time (paired per round): {100 * (c.value - 1):+.2f}%, "
            f"95% interval {interval(c.low - 1, c.high - 1, 100, '+.2f')}% (about "
            f"{result.in_situ_call_us:.0f} us a collective in the training loop)",
            f"tracer overhead on a step (paired per round): {100 * result.overhead:+.2f}%, 95% "
            f"interval {interval(r.low - 1, r.high - 1, 100, '+.2f')}%  (goal < "
            f"{100 * TRACER_GOAL:g}%: {decision(result.decision, r)})",
        ]
    )


def sanitize(result) -> str:
    """`bench-sanitize`: the slowdown of each sanitized arm, and where the time went."""
    o = result.options
    if not result.ok:
        return failed("bench-sanitize", result)
    if o.matrix:
        return _sanitize_matrix(result)
    rows = []
    for arm, steps in result.steps_s.items():
        row = [arm, f"{statistics.median(steps) * 1e3:.1f}", f"{min(steps) * 1e3:.1f}"]
        if arm == "plain":
            rows.append(row + ["-", "-", "-", "-"])
            continue
        r = result.ratio(arm)
        rows.append(
            row + [
                f"{r.value:.3f} {interval(r.low, r.high)}",
                f"{result.per_step(arm, 'tracked'):.0f}",
                f"{result.per_step(arm, 'ops_checked'):.0f}",
                f"{result.per_step(arm, 'check_s') * 1e3:.1f} + "
                f"{result.per_step(arm, 'copy_s') * 1e3:.1f}",
            ]
        )  # fmt: skip
    headers = ["arm", "median ms", "min ms", "/ plain (95% interval)", "async colls",
               "ops checked", "check + copy ms"]  # fmt: skip
    return "\n".join(
        [
            f"sanitizer benchmark: {o.impl} (bucket {o.bucket_mb:g} MB) on a "
            f"{result.parameters / 1e6:.2f}M-parameter transformer, world size {o.world_size}, "
            f"{o.repeats} interleaved rounds (one step of each arm per round), slowest rank",
            f"machine: {result.machine}",
            "",
            tabulate(rows, headers=headers, disable_numparse=True),
            "",
            "per step, from the sanitizer's own accounting (rank 0): async collectives tracked, "
            "operators compared against memory in flight, and seconds spent comparing and "
            "copying (adversarial completion); the rest of the slowdown is every operator's "
            "detour through the dispatch mode while the check is on",
        ]
    )


def _sanitize_matrix(result) -> str:
    """`bench-sanitize --matrix`: whole matrices without and with the sanitizer."""
    o = result.options
    rows = []
    for arm, times in result.steps_s.items():
        r = result.ratio(arm)
        ratio = "-" if arm == "plain" else f"{r.value:.3f} {interval(r.low, r.high)}"
        verdicts = result.matrix_verdicts[arm]
        said = ", ".join(f"{v} x{verdicts.count(v)}" for v in dict.fromkeys(verdicts))
        rows.append([arm, f"{statistics.median(times):.1f}", f"{min(times):.1f}", ratio, said])
    headers = ["arm", "median s", "min s", "/ plain (95% interval)", "matrix verdicts"]
    return "\n".join(
        [
            f"sanitizer benchmark: the certification matrix of {o.impl} (every row), "
            f"{o.repeats} interleaved rounds (one matrix of each arm per round), wall time",
            f"machine: {result.machine}",
            "",
            tabulate(rows, headers=headers, disable_numparse=True),
            "",
            "plain is `matrix --no-sanitize`, sanitized is `matrix` (the default); verdicts "
            "that differ between the arms, or between rounds, are a race",
        ]
    )


def record_cost(result) -> str:
    """`python benchmarks/record_cost.py`: recorded / audited step, and the recording's size."""
    if not result.ok:
        return failed("bench-record", result)
    o = result.options
    bars = [_goal_bar(what, r, goal, decided) for what, r, goal, decided in result.bars()]
    med = {k: statistics.median(v) * 1e3 for k, v in
           (("audited", result.audited_s), ("recorded", result.recorded_s),
            ("unbatched", result.unbatched_s))}  # fmt: skip
    mb = result.projected_bytes / 1e6
    own = result.recorder_s_per_step - result.fingerprint_s_per_step  # sketches, collectives
    return "\n".join([
        f"audit --record cost: {o.impl} on a {result.parameters / 1e6:.1f}M-parameter "
        f"transformer, world size {o.world_size}, {o.repeats} interleaved rounds",
        f"machine: {result.machine}",
        f"audited step: median {med['audited']:.1f} ms; recorded step: median "
        f"{med['recorded']:.1f} ms; recorded without the batch: median {med['unbatched']:.1f} ms",
        f"time inside the recorder: {result.recorder_s_per_step * 1e3:.1f} ms a recorded step "
        f"(rank 0), of which {result.fingerprint_s_per_step * 1e3:.1f} ms the fingerprints the "
        "audit then reuses",
        f"the recorder's own: {own * 1e3:.1f} ms ({own * 1e3 / med['audited']:.2%} of the "
        f"audited step's median: its sketching {result.sketch_s_per_step * 1e3:.1f} ms, rank 0 "
        f"sketching {result.sketched_share:.0%} of the elements; its all-gather an audit point, "
        "which brings the losses too; its rows)",
        f"the batch's own: {result.batch_s_per_step * 1e3:.2f} ms a recorded step (rank 0: "
        f"fingerprinting the inputs of the outermost module call, {result.batch_s_per_step * 1e3 / med['recorded']:.3%} "
        "of the recorded step's median)",
        f"time inside the audit's hooks (rank 0, median a step): audited "
        f"{result.audited_hooks_s * 1e3:.1f} ms, recorded {result.recorded_hooks_s * 1e3:.1f} "
        f"ms; recorded - audited step median: {med['recorded'] - med['audited']:+.1f} ms",
        *bars,
        f"recording: {result.rows} rows over {result.recorded_steps} steps, "
        f"{result.bytes_on_disk} bytes on disk ({result.bytes_per_row:.0f} bytes a row)",
        f"projected: a 100M-parameter model of this family ({result.projected_tensors} "
        f"parameter tensors) over 1000 steps: {mb:.1f} MB (goal <= 100 MB: "
        f"{'met' if mb <= 100 else 'missed'})",
    ])  # fmt: skip


def on_cpu(result) -> str:
    """`benchmarks/on_cpu_cost.py`: the CUDA script's step under the rehearsal against the CPU
    copy's, side by side."""
    o = result.options
    if not result.ok:
        return failed("bench-on-cpu", result)
    rows = [
        [name, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}"]
        for name, v in [("plain step (the CPU copy)", result.plain_s),
                        ("--on-cpu step (the CUDA script)", result.on_cpu_s)]
    ]  # fmt: skip
    what, r, goal, decided = result.bar()
    c = result.cpu_ratio
    return "\n".join([
        f"on-cpu cost: a GPT-style DDP step (width {o.width}), world size {o.world_size}, "
        f"{o.repeats} interleaved rounds; {result.sites_mapped} call sites mapped a step",
        f"machine: {result.machine}",
        "",
        tabulate(rows, headers=["what", "median ms", "min ms"]),
        "",
        _goal_bar(what, r, goal, decided),
        f"the same in CPU time: {c.value:.4f}  95% interval {interval(c.low, c.high, fmt='.4f')}"
        " (less swayed by other work on the machine)",
    ])  # fmt: skip


def _goal_bar(what: str, r, goal: float, decided) -> str:
    """`what: 1.0181  95% interval [a, b]  (goal <= 1.02: ...)`: a paired ratio against its goal."""
    return (
        f"{what}: {r.value:.4f}  95% interval {interval(r.low, r.high, fmt='.4f')}  "
        f"(goal <= {goal:g}: {decision(decided, r)})"
    )
