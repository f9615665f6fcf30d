"""The reports of `profile`, `comm`, `scaling` and `train`: a result in, text out, nothing run.

Each function takes the result its command returned and gives what `python -m verify
<command>` prints (and what the run folder keeps as `<name>.txt`): a header with what ran and
on which machine (the thread budget included), the tables, where the files are, the notes. A
run that did not finish gives the launcher's account of why. The benchmarks' reports are in
`text_bench.py`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tabulate import tabulate

from verify.perf import issued, traces
from verify.perf.alphabeta import KiB, MiB, best_bucket, bus_factor

if TYPE_CHECKING:
    from verify.perf.comm import CommResult
    from verify.perf.profiling import ProfileResult
    from verify.perf.scaling import ScalingResult
    from verify.perf.train import TrainResult


def failed(command: str, result) -> str:
    """What a run that did not finish prints: how it ended, and the launcher's account."""
    how = "timed out" if result.verdict == "timeout" else "failed"
    where = f"\n(partial results in {result.run_dir})" if getattr(result, "run_dir", None) else ""
    return f"{command} {how}:\n{result.failure}{where}"


def _table(rows: list, headers: list) -> str:
    return tabulate(rows, headers=headers, disable_numparse=True)


def _notes(notes) -> list[str]:
    return [f"note: {n}" for n in notes]


def profile(result: ProfileResult) -> str:
    o = result.options
    if not result.ok:
        return failed("profile", result)
    size = _model(o.model_size_m) if o.model_size_m else "tiny"
    lines = [
        f"profile: {', '.join(o.variants)} on a {size} transformer, world size "
        f"{o.world_size}, bucket {o.bucket_mb:g} MB, {o.active} active steps "
        f"(after {o.wait} wait + {o.warmup} warm-up)",
        f"machine: {result.machine}",
        "",
    ]
    rows = [
        [
            s.impl,
            f"{s.step_ms:.1f}",
            f"{s.compute_ms:.1f}",
            f"{s.comm_ms:.1f}",
            f"{s.exposed_ms:.1f}",
            "-" if s.overlap is None else f"{100 * s.overlap:.0f}%",
            f"{s.collectives:g}",
            f"{s.bytes / MiB:.1f}",
        ]
        for s in result.summaries
    ]
    headers = ["impl", "step ms", "compute ms", "comm ms", "exposed ms", "overlap", "colls", "MiB"]
    lines += [_table(rows, headers), ""]
    rows = [[s.impl] + [f"{s.phases_ms[p]:.1f}" for p in traces.PHASES] for s in result.summaries]
    lines += [_table(rows, ["impl", *(f"{p} ms" for p in traces.PHASES)]), ""]
    lines += _issued(result.summaries)
    lines += [
        "means per step and rank, from the written traces; comm = union of gloo/NCCL "
        "collective ranges, exposed = comm while the training thread ran no operator",
        f"traces: {result.run_dir}",
        f"open:   tensorboard --logdir {result.run_dir}   (or load a .pt.trace.json file "
        "in https://ui.perfetto.dev)",
    ]
    return "\n".join(lines + _notes(result.notes))


def _issued(summaries) -> list[str]:
    """Collectives issued per step, by kind and by the phase they were issued in: where the
    all-gathers and reduce-scatters of parameter sharding sit beside compute."""
    columns = (*traces.PHASES, issued.OTHER)
    rows = [
        [s.impl, k] + [f"{per_phase[p]:g}" if per_phase.get(p) else "-" for p in columns]
        for s in summaries
        for k, per_phase in sorted(s.issued.items())
    ]
    if not rows:
        return []
    return [
        "collectives issued per step, by the phase they were issued in (the dispatcher's c10d "
        "operators; gloo runs a reduce-scatter as an all-reduce, so on its thread the range "
        "reads gloo:all_reduce):",
        _table(rows, ["impl", "collective", *columns]),
        "",
    ]


def size(nbytes: float) -> str:
    """'64 KiB', '1 MiB': sizes rounded down to a multiple of the world size still read well."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= 0.99 * scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"


def comm(result: CommResult) -> str:
    if not result.ok:
        return failed("comm", result)
    o = result.options
    lines = [
        f"collectives: {', '.join(o.ops)}; world sizes {', '.join(map(str, o.world_sizes))}; "
        f"median of {o.repeats} interleaved rounds, slowest rank",
        f"machine: {result.machine}",
        f"memcpy bandwidth ({'on the GPU' if o.device_type == 'cuda' else 'one core'}, all "
        f"ranks copying at once, {_memcpy_mib(o.max_bytes)} MiB buffers, past the last-level "
        f"cache): {result.memcpy_Bps / 1e9:.2f} GB/s",
        "",
    ]
    for ws in o.world_sizes:
        lines += [f"world size {ws}:", _sweep_table(result, ws), ""]
    if result.fits:
        lines += [
            f"all-reduce fit t(S) = alpha + S/beta, and the bucket size it predicts for a "
            f"{_model(o.model_size_m)} transformer ({size(result.grad_bytes)} of "
            f"gradients, backward {result.backward_s * 1e3:.0f} ms):",
            _fits_table(result),
            "(the measured sweep: python -m verify bench; the model assumes communication does "
            "not slow compute, which a CPU cannot give)",
            "",
        ]
    lines.append(f"written to {result.run_dir}")
    return "\n".join(lines + _notes(result.notes))


def _sweep_table(result: CommResult, ws: int) -> str:
    """World size `ws`'s points: a row per message size, each op's time and bus bandwidth
    ("-" where it was not measured)."""
    ops = result.options.ops
    by_key = {(p.op, p.world_size, p.nbytes): p for p in result.points}
    rows = []
    for nbytes in sorted({p.nbytes for p in result.points if p.world_size == ws}):
        row = [size(nbytes)]
        for op in ops:
            p = by_key.get((op, ws, nbytes))
            row += ["-", "-"] if p is None else [f"{p.seconds * 1e6:.0f}", f"{p.busbw / 1e9:.2f}"]
        rows.append(row)
    return _table(rows, ["size"] + [h for op in ops for h in (f"{op} us", "busbw GB/s")])


def _fits_table(result: CommResult) -> str:
    """A row per world size fitted: alpha, beta, its bus bandwidth, the fit's worst error,
    and the best bucket size it predicts with the communication it leaves exposed."""
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
                size(bucket),
                f"{exposed * 1e3:.1f}",
            ]
        )
    headers = ["world", "alpha us", "beta (algbw) GB/s", "busbw GB/s", "worst fit error",
               "best bucket", "exposed ms"]  # fmt: skip
    return _table(rows, headers)


def best_bucket_line(fit, grad_bytes: int, backward_s: float) -> str:
    """The alpha-beta fit and the bucket size it predicts, in one line (`bench`)."""
    best, exposed = best_bucket(fit, grad_bytes, backward_s)
    return (
        f"alpha-beta fit: alpha {fit.alpha_s * 1e6:.0f} us, beta {fit.beta_Bps / 1e9:.2f} GB/s "
        f"(algbw); gradients {grad_bytes / MiB:.1f} MiB, backward {backward_s * 1e3:.0f} ms "
        f"-> predicted best bucket {best / MiB:.2g} MiB (exposed {exposed * 1e3:.1f} ms)"
    )


def scaling(result: ScalingResult) -> str:
    o = result.options
    if not result.ok:
        return failed("scaling", result)
    rows = [
        [
            p.world_size,
            f"{p.step_s * 1e3:.1f}",
            f"{p.throughput:.0f}",
            f"{result.speedup(p):.2f}",
            f"{100 * result.speedup(p) / p.world_size:.0f}%",
        ]
        for p in result.points
    ]
    lines = [
        f"scaling: {o.impl}, {_model(o.model_size_m)} transformer, local batch "
        f"{o.local_batch}, median of {o.repeats} steps at each world size",
        f"machine: {result.machine}",
        "",
        _table(rows, ["world", "step ms", "tokens/s", "speed-up", "efficiency"]),
        "",
        f"written to {result.run_dir}",
    ]
    return "\n".join(lines + _notes(result.notes))


def train(result: TrainResult) -> str:
    from verify.training.workloads import Markov

    o = result.options
    if not result.ok:
        return failed("train", result)
    tokens = o.world_size * o.local_batch * o.config.block_size
    rows = []
    for name, curve in result.losses.items():
        ref = name == result.reference
        rows.append(
            [
                name,
                1 if ref else o.world_size,
                f"{curve[0]:.4f}",
                f"{curve[-1]:.4f}",
                "-" if ref else f"{result.max_gap(name):.2e}",
                f"{o.steps / result.seconds[name]:.1f}",
                f"{o.steps * tokens / result.seconds[name]:.0f}",
            ]
        )
    headers = ["run", "ranks", "first loss", "final loss", "max |gap|", "steps/s", "tokens/s"]
    floor = Markov.branching
    lines = [
        f"train: {', '.join(o.impls)} for {o.steps} steps, world size {o.world_size}, global "
        f"batch {o.world_size * o.local_batch} x {o.config.block_size} tokens, AdamW lr "
        f"{o.lr:g}; data: Markov chain, loss floor ln({floor}) = {math.log(floor):.3f}",
        f"machine: {result.machine}",
        "",
        _table(rows, headers),
        "",
        "max |gap| = largest difference from the single-process loss on the same global "
        "batches (float rounding; grows slowly as training amplifies it)",
        f"written to {result.run_dir} (loss.png: every curve beside the single-process one)",
    ]
    return "\n".join(lines + _notes(result.notes))


def _memcpy_mib(max_bytes: int) -> str:
    from verify.perf.collectives import memcpy_bytes

    return f"{max(max_bytes, memcpy_bytes()) / MiB:g}"


def _model(size_m: float | None) -> str:
    """ "2.7M-parameter": the real count `--model-size 2` builds, as bench prints it."""
    from verify.training.language import parameters_m

    return f"{parameters_m(size_m):.1f}M-parameter"
