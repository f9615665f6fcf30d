"""The report of `bench`: a result in, text out, nothing run (the tool's own costs:
`benchmarks/text_costs.py`).

Every goal is printed with the number it rests on, its 95% interval and the decision: "met"
(the whole interval within the goal), "MISSED" (wholly outside), or "undecided (noise +-x%)"
(the interval straddles the goal; x is its half-width: what more rounds or a quieter machine
would have to shrink). A report says what the run shows, and no more.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from tabulate import tabulate

from verify.cli.text_perf import best_bucket_line, failed
from verify.perf.alphabeta import MiB, bus_factor
from verify.perf.bench_result import LOCAL, REFERENCE, SHARDED_REFERENCE, ZERO1_MEMORY
from verify.perf.timing import MET, MISSED, Ratio

if TYPE_CHECKING:
    from verify.perf.bench_result import BenchResult


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
        _share_legend(o.world_size),
        "",
    ]
    if result.sweep:
        lines += _sweep(result) + [""]
    if result.memory and any(ZERO1_MEMORY[0] in m for m in result.memory):
        lines += ["memory (tensor bytes):", _memory_table(result), ""]
    if result.shards:
        lines += _ladder(result) + [""]
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
    share = "exposed comm" if result.options.world_size > 1 else "overhead"
    headers = ["variant", "median ms", "min ms", "/ torch-ddp", "min / min", share]
    return tabulate(rows, headers=headers, disable_numparse=True)


def _share_legend(world_size: int) -> str:
    """What the last column of the steps table is: at one rank nothing is communicated, so
    (step - local step) / step is what the wrapper adds (hooks, copies, its bookkeeping)."""
    if world_size == 1:
        return (
            "(overhead = (step - local step) / step, median over rounds of the same round's "
            "steps: at world size 1 nothing is communicated, so this is what the wrapper adds "
            "to a step (hooks, copies, bookkeeping); <0: below this machine's noise)"
        )
    return (
        "(exposed comm = (step - local step) / step, median over rounds of the same round's "
        "steps: the step's share spent in communication not hidden by compute; <0: below "
        "this machine's noise)"
    )


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
            if impl not in ZERO1_MEMORY:  # the ladder's table below has every rung
                continue
            for phase, m in phases.items():
                rows.append(
                    [impl, rank, phase]
                    + [f"{m[k] / MiB:.2f}" for k in ("params", "grads", "optimizer")]
                    + ["-" if m["allocated"] is None else f"{m['allocated'] / MiB:.1f}"]
                )
    headers = ["impl", "rank", "when", "params MiB", "grads MiB", "opt state MiB", "alloc MiB"]
    return tabulate(rows, headers=headers, disable_numparse=True)


def _ladder(result: BenchResult) -> list[str]:
    """Each memory variant's bytes per rank over the unsharded total (the memory check's
    measure: 1/N is a perfect shard), whether it shards what it promises, and its step time
    against FSDP2's, paired per round."""
    first = next(iter(result.shards.values()))
    n = len(first.kinds[0].per_rank)
    totals = ", ".join(f"{k.kind} {k.unsharded / MiB:.1f} MiB" for k in first.kinds)
    rows = []
    for impl, r in result.shards.items():
        ratio = result.against_fsdp(impl)
        promised = ", ".join(r.promised) or "nothing"
        verdict = "" if not r.promised else (": sharded" if r.passed else ": NOT sharded")
        rows.append(
            [impl]
            + [", ".join(f"{x:.2f}" for x in k.ratios) for k in r.kinds]
            + [promised + verdict]
            + [_against(impl, ratio)]
        )
    headers = ["variant", *(f"{k.kind} / unsharded" for k in first.kinds), "promises to shard"]
    return [
        f"memory per rank against the unsharded total (the memory check's measure; unsharded: "
        f"{totals}; 1/N = {1 / n:.2f}) and step time against {SHARDED_REFERENCE} (paired per "
        "round, 95% interval):",
        tabulate(rows, headers=[*headers, f"step / {SHARDED_REFERENCE}"], disable_numparse=True),
    ]


def _against(impl: str, ratio: Ratio | None) -> str:
    if impl == SHARDED_REFERENCE:
        return "1 (the reference)"
    return "-" if ratio is None else f"{ratio.value:.3f} {interval(ratio.low, ratio.high)}"


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
        f"the copies into the buckets and the usage map: {sync * 1e3:.1f} ms"
    )
