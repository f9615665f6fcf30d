"""The reports of `bench`, `bench-audit` and `bench-tracer`: a result in, text out, nothing run.

Every goal is printed with the number it rests on, its 95% interval and the decision: "met"
(the whole interval within the goal), "MISSED" (wholly outside), or "undecided (noise +-x%)"
(the interval straddles the goal; x is its half-width: what more rounds or a quieter machine
would have to shrink). A report says what the run shows, and no more.
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from tabulate import tabulate

from verify.perf.alphabeta import MiB, bus_factor
from verify.perf.bench_result import LOCAL, MEMORY_VARIANTS, REFERENCE
from verify.perf.bench_tracer import GOAL as TRACER_GOAL
from verify.perf.text import best_bucket_line, failed
from verify.perf.timing import MET, MISSED, Ratio
from verify.training.language import GPTConfig

if TYPE_CHECKING:
    from verify.perf.bench_audit import AuditBenchResult
    from verify.perf.bench_result import BenchResult
    from verify.perf.bench_tracer import TracerBenchResult


def decision(decided: str, ratio: Ratio | None = None) -> str:
    """'met', 'MISSED' or 'undecided (noise +-3.1%)'."""
    if decided == MET:
        return "met"
    if decided == MISSED:
        return "MISSED"
    noise = "" if ratio is None else f" (noise +-{100 * ratio.noise:.1f}%)"
    return f"undecided{noise}"


def interval(low: float, high: float, scale: float = 1.0, fmt: str = ".3f") -> str:
    return f"[{low * scale:{fmt}}, {high * scale:{fmt}}]"


def bench(result: BenchResult) -> str:
    o = result.options
    if not result.ok:
        return failed("bench", result)
    lines = [
        f"bench: {result.parameters / 1e6:.1f}M-parameter transformer, world size "
        f"{o.world_size}, local batch {o.local_batch}, bucket {o.bucket_mb:g} MB; "
        f"{o.repeats} interleaved rounds after {o.warmup} warm-up, slowest rank",
        f"machine: {result.machine}",
        "",
        _steps_table(result),
        "(exposed comm = (step - local step) / step, median over rounds of the same round's "
        "steps: the step's share spent in communication not hidden by compute; <0: below "
        "this machine's noise)",
        "",
    ]
    if result.sweep:
        lines += _sweep(result) + [""]
    if result.memory and any(MEMORY_VARIANTS[0] in m for m in result.memory):
        lines += ["memory (tensor bytes):", _memory_table(result), ""]
    if result.bandwidth:
        lines += [_bandwidth_line(result), ""]
    rows = [
        [
            b.what,
            f"{b.value:.4f}",
            "exact" if b.ratio is None else interval(b.ratio.low, b.ratio.high),
            b.goal,
            decision(b.decision, b.ratio),
            b.detail,
        ]
        for b in result.bars()
    ]
    lines += [
        "bars (step-time and bandwidth ratios paired per round: geometric mean over rounds of "
        "each round's ratio, 95% interval):",
        tabulate(
            rows, headers=["what", "value", "interval", "goal", "", ""], disable_numparse=True
        ),
        "",
        f"written to {result.run_dir}",
    ]
    return "\n".join(lines + [f"note: {n}" for n in result.notes])


def _steps_table(result: BenchResult) -> str:
    ref = REFERENCE if REFERENCE in result.steps else None
    rows = []
    for name, samples in result.steps.items():
        med = statistics.median(samples)
        rows.append(
            [
                name,
                f"{med * 1e3:.1f}",
                f"{min(samples) * 1e3:.1f}",
                "-" if ref is None else f"{med / result.median(ref):.3f}",
                "-" if ref is None else f"{min(samples) / min(result.steps[ref]):.3f}",
                "-" if name == LOCAL else _share(result.exposed_share(name)),
            ]
        )
    headers = ["variant", "median ms", "min ms", "/ torch-ddp", "min / min", "exposed comm"]
    return tabulate(rows, headers=headers, disable_numparse=True)


_BELOW_NOISE = (
    "(<0: the step came out faster than the local step it contains: this machine's noise is "
    "larger than the exposed time, which it cannot measure here)"
)


def _ms(seconds: float) -> str:
    """Exposed time, or "<0" where noise made the difference negative (never printed as is)."""
    return "<0" if seconds < 0 else f"{seconds * 1e3:.1f}"


def _share(share: float) -> str:
    return "<0" if share < 0 else f"{100 * share:.0f}%"


def _sweep(result: BenchResult) -> list[str]:
    o = result.options
    rows = []
    for mb in o.sweep_sizes:
        row = [f"{mb:g}"]
        for impl in o.sweep_impls:
            key = f"{impl}@{mb:g}"
            row += [
                f"{result.median(key, 'sweep') * 1e3:.1f}",
                _ms(result.sweep_exposed(key)),
            ]
        pred = result.predicted_exposed(mb)
        rows.append(row + ["-" if pred is None else f"{pred * 1e3:.1f}"])
    headers = ["bucket MB"]
    for impl in o.sweep_impls:
        headers += [f"{impl} ms", "exposed ms"]
    out = [
        f"bucket sweep ({o.sweep_repeats} rounds; local step "
        f"{result.median(LOCAL, 'sweep') * 1e3:.1f} ms; exposed = step - local step, median "
        "over rounds of the same round's pair):",
        tabulate(rows, headers=headers + ["predicted exposed ms"], disable_numparse=True),
    ]
    if any("<0" in cell for row in rows for cell in row):
        out.append(_BELOW_NOISE)
    main, swept = result.median(LOCAL), result.median(LOCAL, "sweep")
    if max(main, swept) > 1.2 * min(main, swept):  # the machine's load moved between them
        out.append(
            f"note: the local step took {swept * 1e3:.1f} ms in the sweep's rounds and "
            f"{main * 1e3:.1f} ms in the main rounds: the machine's load changed between "
            "them; compare numbers within one table, not across"
        )
    if result.fit is not None:
        out.append(best_bucket_line(result.fit, result.grad_bytes, result.backward_s))
    return out


def _memory_table(result: BenchResult) -> str:
    rows = []
    for rank, per_impl in enumerate(result.memory):
        for impl, phases in per_impl.items():
            for phase, m in phases.items():
                rows.append(
                    [impl, rank, phase]
                    + [f"{m[k] / MiB:.2f}" for k in ("params", "grads", "optimizer")]
                    + ["-" if m["allocated"] is None else f"{m['allocated'] / MiB:.1f}"]
                )
    headers = ["impl", "rank", "when", "params MiB", "grads MiB", "opt state MiB", "alloc MiB"]
    return tabulate(rows, headers=headers, disable_numparse=True)


def _bandwidth_line(result: BenchResult) -> str:
    b = result.bandwidth
    total = sum(b["buckets"])
    factor = bus_factor("all_reduce", result.options.world_size)
    ours, raw = statistics.median(b["ours_s"]), statistics.median(b["raw_s"])
    sync = statistics.median(b["ours_sync_s"])
    return (
        f"bucket all-reduces on the wire ({len(b['buckets'])} bucket{'s' if len(b['buckets']) != 1 else ''}, {total / MiB:.1f} MiB, "
        f"from the last rank's first launch to the last completion): ours {ours * 1e3:.1f} ms "
        f"({total * factor / ours / 1e9:.2f} GB/s busbw), raw all_reduce {raw * 1e3:.1f} ms "
        f"({total * factor / raw / 1e9:.2f} GB/s busbw); the whole synchronization with "
        f"copy-in/out and the usage map: {sync * 1e3:.1f} ms"
    )


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
        f"{what}: {r.value:.4f}  95% interval {interval(r.low, r.high, fmt='.4f')}  "
        f"(goal <= {goal:g}: {decision(decided, r)})",
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
