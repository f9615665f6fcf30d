"""`python -m verify compare --drill DIR_A DIR_B`: below the first departing step, the first
op where the two runs part (docs/compare.md, "The drill-down").

The comparison of the two recordings names the first step that departs (`departure.py`).
The drill-down climbs from there, and says at which rung it stopped and why:

1. nothing departs: nothing to drill into (a pass);
2. the batches already differed at or before that step (`batch_departure.py`): the data,
   not the computation; no re-run;
3. what departs is not computed by the step (the starting parameters, a setting, the
   GradScaler's scale): no op to drill into; no re-run;
4. the runs split the batch over other numbers of ranks or micro-steps: a rank's ops differ
   by design, and are not matched one to one; no re-run;
5. each run again, as its manifest says (its script and arguments, world size, threads, and
   folder), up to its departing step, which is captured op by op (`capture.py`), and no
   further. A re-run that does not reproduce its own recording bitwise up to that step
   (the script is not deterministic here: it reads the clock, the network, a file that
   changed, or a generator it never seeded) is said, and nothing is guessed;
6. the two captures op by op (`streams.py`): the first op whose output differs while its
   inputs matched, with its module and the script's line, or where the inputs already
   differed and after which op, or that the runs ran other ops there.

The verdict stays the comparison's: a pass when the runs agree, a fault when they depart,
whatever rung the drill-down reached. Recordings of other scripts are a usage error (one
line, exit 2), as recordings of other models are.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace

from verify.checks.compare import CompareOptions, CompareResult
from verify.hints import kinds as k
from verify.hints.phases import GRADS, LAYOUT, PARAMS_FIRST, SCALER, SETTINGS
from verify.recording import store, tolerance
from verify.recording.capture import FOLDER
from verify.recording.departure import Comparison, NotComparable, compare_recordings
from verify.recording.streams import (
    DIFFERS,
    Op,
    Part,
    boundary,
    first_divergence,
    first_part,
    ops_of,
)
from verify.watching.stacks import relpath

NOTHING, BATCH, NOT_COMPUTED, SPLIT, REPLAY, COMPILED, OP, REORDERED, UNSEEN = (
    "nothing to drill into", "the batch", "not computed", "split", "replay", "compiled", "op",
    "summation order", "unseen",
)  # fmt: skip
_NOT_COMPUTED = {
    k.START_DEPARTS: "the runs start from other parameters (their initialization, or the "
                     "checkpoint they loaded): no step computed them",
    k.SETTING_DEPARTS: "a setting departs: the script sets it, no op of the step computes it",
    k.SCALER_DEPARTS: "the GradScaler's scale departs: set by its own schedule, not by an op "
                      "of the step",
}  # fmt: skip


@dataclass(frozen=True)
class Rerun:
    """One side run again up to its departing step."""

    side: str  # "A" or "B"
    recording: str
    step: int  # the step captured, in this side's numbering
    seconds: float
    report_dir: str
    unlike: str | None = None  # where the re-run departs from its own recording; None: alike
    capture: dict | None = None  # rank 0's capture, as written (`capture.Capture.write`)
    ranks: tuple[tuple[Op, ...], ...] = ()  # every rank's capture, in rank order
    eager: bool = False  # a compiled run, re-run with torch.compile turned off
    failed: bool = False  # the re-run, or its capture, ended before the step was captured

    @property
    def ops(self) -> tuple[Op, ...]:
        """Rank 0's capture."""
        return self.ranks[0] if self.ranks else ()


@dataclass(frozen=True)
class Drill:
    """Where the drill-down stopped (module docstring) and what it found there."""

    rung: str
    says: str  # why it stopped there, one line
    part: Part | None = None
    module: dict | None = None  # the part's module call (`capture.ModuleCall`), if any
    reruns: tuple[Rerun, ...] = field(default_factory=tuple)
    sides: tuple[str, str] = ("A", "B")  # what the part's two ops are of: runs, or ranks

    def to_dict(self) -> dict:
        out = asdict(self)
        for r in out["reruns"]:
            r.pop("capture"), r.pop("ranks")
        return out


def run_compare(options: CompareOptions) -> CompareResult:
    """`compare DIR_A DIR_B`, and under `--drill` the drill-down below its first departure.
    Raises `NotARecording` (one line, exit 2) for a folder that is not a whole recording
    (`store.read` checks each whole, A first)."""
    a, b = (store.read(folder) for folder in options.recordings)
    comparison = compare_recordings(a, b, options.align_step)
    found = drill(a, b, comparison, options.out) if options.drill else None
    return CompareResult(options, comparison, found)


def drill(a: store.Recording, b: store.Recording, c: Comparison, out: str) -> Drill:
    """The drill-down below `c`, B's comparison with A (module docstring); re-runs write
    their run folders under `out`. Raises `NotComparable` for recordings of other scripts."""
    _same_script(a, b)
    if not c.departs:
        return Drill(NOTHING, _agree(a.meta, b.meta, c))
    first = c.first
    seen = c.batches.first if c.batches is not None else None
    if seen is not None and seen.step <= first.step:
        return Drill(BATCH, f"the runs were given other batches from step {seen.step}, "
                            f"micro-step {seen.micro} (batches: above), before the departure "
                            f"at step {first.step}: the data differs, not the computation")  # fmt: skip
    if first.kind in _NOT_COMPUTED:
        return Drill(NOT_COMPUTED, _NOT_COMPUTED[first.kind])
    split = _split(a.meta, b.meta)
    if split:
        return Drill(SPLIT, split)
    index = a.optimizers.index(first.optimizer) if first.optimizer in a.optimizers else 0
    reruns = (_rerun("A", a, index, first.step, out), _rerun("B", b, index, first.step_b, out))
    unlike = [r for r in reruns if r.unlike]
    if unlike:
        return _compiled(unlike[0], reruns, (a, b), c) or _not_replayed(unlike[0], reruns)
    part = first_part(list(reruns[0].ops), list(reruns[1].ops), a.meta.get("device", "cpu"))
    edge = boundary(reruns[0].capture, reruns[1].capture)
    if part is None:
        last = reruns[0].ops[-1] if reruns[0].ops else None
        after = f", after {last.op} at {last.line}" if last else ""
        return Drill(UNSEEN, "every op the dispatcher ran gave the same outputs: the difference "
                             f"was made below it (a custom kernel, a C++ extension){after}",
                     module=edge, reruns=reruns)  # fmt: skip
    module = edge or _module_of(part, reruns[0].capture)
    reordered = _reordered(part, a.meta, b.meta, c)
    if reordered:
        return Drill(REORDERED, reordered, part, module, reruns)
    return Drill(OP, "", part, module, reruns)


def drill_replicas(result):
    """`audit --drill`: below the first step where the replicas diverged, the run again up
    to it with every rank captured (`_rerun`), and rank 0 against the first rank the audit
    found apart (`streams.first_divergence`). `result`: the audit's `RecordedAudit`, whose
    recording the re-run must reproduce; returned with its `drill`."""
    own = result.audit_result
    faults = [f for f in own.faults if f.check == "audit"]
    if own.run.failure or not faults or result.recording is None:
        why = "the run failed (above)" if own.run.failure else "the replicas agree (above)"
        return replace(result, drill=Drill(NOTHING, why))
    f = faults[0]
    said = next((w for p, w in _REPLICAS_NOT_COMPUTED.items() if _is(f, p)), None)
    if said is not None:
        return replace(result, drill=Drill(NOT_COMPUTED, said))
    rec = store.read(result.recording)
    label = (f.where or "").rsplit("(", 1)[-1].rstrip(")")
    index = rec.optimizers.index(label) if label in rec.optimizers else 0
    rerun = _rerun("the run", rec, index, f.step, own.options.out)
    if rerun.unlike:
        return replace(result, drill=_not_replayed(rerun, (rerun,)))
    other = next((r for r in f.ranks if r != 0), 1)
    synced = not _is(f, GRADS)  # the gradients agreed: a collective ran
    part = first_divergence(list(rerun.ranks[0]), list(rerun.ranks[other]), synced,
                            rec.meta.get("device", "cpu"))  # fmt: skip
    sides = ("rank 0", f"rank {other}")
    if part is None:
        return replace(result, drill=Drill(UNSEEN, _UNSEEN_RANKS, reruns=(rerun,), sides=sides))
    module = _module_of(part, rerun.capture)
    return replace(result, drill=Drill(OP, "", part, module, (rerun,), sides))


# the replicas' first difference, by its phase, where no op of a step computed it
_REPLICAS_NOT_COMPUTED = {
    PARAMS_FIRST: "the replicas start from other parameters (each rank initialized its own, "
                  "and nothing broadcast them): no step computed them",
    SETTINGS: "the ranks' optimizer settings differ: the script sets them, no op of the step "
              "computes them",
    SCALER: "the ranks' GradScaler scales differ: set by its own schedule, not by an op",
    LAYOUT: "the ranks hold other tensors: a layout, not a value an op computed",
}  # fmt: skip
_UNSEEN_RANKS = ("no op both ranks ran from the same inputs gave other outputs: the replicas "
                 "part where the dispatcher sees no op (a custom kernel, a C++ extension), or "
                 "from inputs that differ by design (each rank's batch) with no collective to "
                 "make them the same")  # fmt: skip


def _compiled(r: Rerun, reruns: tuple[Rerun, ...], recs, c: Comparison) -> Drill | None:
    """A compiled run whose eager re-run does not reproduce it, while the other run's re-run
    does: the eager re-run against the other run's recording. Alike, the departure is
    torch.compile's; else the eager runs depart too, and are the runs to drill."""
    other = reruns[1] if r is reruns[0] else reruns[0]
    if not r.eager or r.failed or other.unlike or other.eager:
        return None
    mine = store.read(os.path.join(r.report_dir, "recording"))
    a, b = (recs[0], mine) if r is reruns[1] else (mine, recs[1])
    eager = compare_recordings(a, b, align_step=c.offset)
    if eager.departs:
        return Drill(COMPILED, f"{r.side} was compiled; with torch.compile turned off for its "
                               f"re-run it still departs from {other.side}, at "
                               f"{eager.first.name}, {eager.first.phase}: record {r.side} "
                               "without torch.compile and drill the eager runs", reruns=reruns)  # fmt: skip
    return Drill(COMPILED, f"{r.side} was compiled; with torch.compile turned off for its re-run "
                           f"it computes every step up to the departure as {other.side} does "
                           f"({'bitwise' if eager.bitwise else 'within the tolerance'}): the "
                           "departure is torch.compile's (its kernels fuse ops and reorder "
                           "their sums), inside a graph the dispatcher does not see op by op",
                 reruns=reruns)  # fmt: skip


def _is(finding, phase: str) -> bool:
    """The finding is at `phase` (a label of `hints/phases.py`, kept unformatted)."""
    return finding.phase in (phase, phase.format(step=finding.step))


def _not_replayed(r: Rerun, reruns: tuple[Rerun, ...]) -> Drill:
    if r.failed:
        return Drill(REPLAY, f"the re-run of {r.side} did not capture its step: {r.unlike}: "
                             "nothing is drilled", reruns=reruns)  # fmt: skip
    return Drill(REPLAY, f"the re-run of {r.side} does not reproduce its recording: "
                         f"{r.unlike}; the script is not deterministic on this machine (it may "
                         "read the clock, the network, a file that changed, or a generator it "
                         "never seeded): nothing is drilled", reruns=reruns)  # fmt: skip


def _reordered(part: Part, ma: dict, mb: dict, c: Comparison) -> str | None:
    """Runs compared within the tolerance whose first op apart gave outputs no further apart
    than a changed summation order makes them: the op-by-op search ends there (every op
    after it is given inputs apart in their last bits), and says where the order changed."""
    if c.bitwise or part.why != DIFFERS or part.gap is None:
        return None
    limit = tolerance.eps(part.a.shape.split(" ")[0], 0)
    if part.gap > limit:
        return None
    where = _order_changed(ma, mb) or c.mode_reason
    return (f"its outputs are apart by at least {part.gap:.2g}, within the tolerance "
            f"{limit:.2g} of a changed summation order ({where}): every op after it is given "
            "inputs apart in their last bits, so no op further on can be said to differ from "
            "the same inputs; drill into runs that sum in one order")  # fmt: skip


def _agree(ma: dict, mb: dict, c: Comparison) -> str:
    """Why two runs that agree need no drill-down; within the tolerance, where the order of
    the sums changed between them."""
    if c.bitwise:
        return "B agrees with A bitwise at every compared step"
    said = _order_changed(ma, mb) or c.mode_reason
    return (f"B agrees with A within the tolerance of a changed summation order at every "
            f"compared step: {said}")  # fmt: skip


def _order_changed(ma: dict, mb: dict) -> str:
    """Where the order of the sums changed between two runs, from their manifests."""
    where = []
    (world_a, micro_a), (world_b, micro_b) = _split_of(ma), _split_of(mb)
    if world_a != world_b:
        where.append(f"the gradients' all-reduce sums over {world_a} and {world_b} ranks")
    if micro_a != micro_b:
        where.append(f"each step's batch is split into {micro_a} and {micro_b} micro-steps")
    if ma.get("threads") != mb.get("threads"):
        where.append(f"the kernels split their sums over {ma.get('threads')} and "
                     f"{mb.get('threads')} threads")  # fmt: skip
    if ma.get("compiled") != mb.get("compiled"):
        where.append("torch.compile's kernels fuse ops in one run only")
    return "; ".join(where)


def _same_script(a: store.Recording, b: store.Recording) -> None:
    sa, sb = (_script(r) for r in (a, b))
    if sa and sb and sa != sb:
        raise NotComparable(f"{b.path} is a recording of {sb}, {a.path} of {sa}: a "
                            "drill-down re-runs one script twice (record both runs of it)")  # fmt: skip


def _script(r: store.Recording) -> str | None:
    argv = r.meta.get("argv") or []
    if not argv:
        return None
    return os.path.normpath(os.path.join(r.meta.get("cwd") or os.getcwd(), argv[0]))


def _split_of(m: dict) -> tuple[int, int]:
    """How a run splits each step's batch: (world size, its most micro-steps in a step)."""
    return m.get("world_size"), max(m.get("micro_steps") or [1])


def _split(ma: dict, mb: dict) -> str | None:
    for x, y, what in zip(_split_of(ma), _split_of(mb), ("ranks", "micro-steps")):
        if x != y:
            return (f"the runs split the batch over {x} and {y} {what}: a rank's ops differ by "
                    "design and are not matched one to one (drill into runs of one split)")  # fmt: skip
    return None


def _rerun(side: str, rec: store.Recording, index: int, step: int, out: str) -> Rerun:
    """`rec`'s script run again as its manifest says, up to `step` of optimizer `index`,
    captured there (`capture.py`); checked against `rec` bitwise. A compiled run is run
    with torch.compile turned off (`TORCHDYNAMO_DISABLE`): the capture reads eager ops, and a
    compiled graph's kernels are not ops the dispatcher sees one by one."""
    from verify.checks.script_audit import check_audit
    from verify.checks.script_options import AuditOptions

    m, here = rec.meta, os.getcwd()
    start, eager = time.monotonic(), ":eager" if m.get("compiled") else ""
    _runnable(rec)
    os.chdir(m.get("cwd") or here)
    try:
        options = AuditOptions(
            script=tuple(m["argv"]), nproc=m["world_size"], threads_per_rank=m.get("threads"),
            out=os.path.join(here, out), console="stderr", drill_at=f"{index}:{step}{eager}",
            record=os.path.join(here, out, f"drill-{side}-{time.strftime('%Y%m%d-%H%M%S')}"),
        )  # fmt: skip
        result = check_audit(options)
    finally:
        os.chdir(here)
    seconds = time.monotonic() - start
    report_dir = relpath(result.report_dir)
    made = _captures(result.report_dir, m["world_size"])
    broken = next((c["broken"] for c in made if c.get("broken")), None)
    if not made or result.recording is None or broken:
        why = (f"its capture stopped: {broken}" if broken else
               f"it failed: {result.audit_result.run.failure or 'it did not reach that step'}")  # fmt: skip
        return Rerun(side, rec.path, step, seconds, report_dir, why, failed=True)
    kept = os.path.join(result.report_dir, "recording")  # the evidence, in its run folder
    shutil.move(result.recording, kept)
    c = compare_recordings(rec, store.read(kept), align_step=0)
    unlike = None if not c.departs else f"{c.first.name}, {c.first.phase}: {c.first.what}"
    if unlike is None and not c.bitwise:  # alike within a tolerance is not a replay
        unlike = f"it sums in another order ({c.mode_reason}), so it cannot be alike bitwise"
    ranks = tuple(tuple(ops_of(r["ops"])) for r in made)
    return Rerun(side, rec.path, step, seconds, report_dir, unlike, made[0], ranks, bool(eager))


def _runnable(rec: store.Recording) -> None:
    """A recording a drill-down can run again as it was run (one line, exit 2, otherwise)."""
    m = rec.meta
    if m.get("launched"):
        raise ValueError(f"{rec.path} was recorded under a launcher (audit -- torchrun ...): a "
                         "drill-down runs the script again under --nproc; record it with "
                         "audit --nproc N --record DIR -- train.py ARGS")  # fmt: skip
    if m.get("cwd") and not os.path.isdir(m["cwd"]):
        raise ValueError(f"{rec.path} was recorded in {m['cwd']}, which is not a folder here: "
                         "a drill-down runs the script again where it ran")  # fmt: skip


def _captures(report_dir: str, world: int) -> list[dict]:
    """Every rank's capture (`capture.Capture.write`), in rank order; [] if one is missing."""
    found = []
    for r in range(world):
        path = os.path.join(report_dir, FOLDER, f"rank{r}.json")
        if not os.path.isfile(path):
            return []
        with open(path) as f:
            found.append(json.load(f))
    return found


def _module_of(part: Part, capture: dict) -> dict | None:
    """The call of the module the part's op ran in (`how`: "around"), if any."""
    op = part.a or part.b
    if op is None or not op.module:
        return None
    call = next((c for c in capture["calls"] if c["module"] == op.module), None)
    return None if call is None else {**call, "how": "around"}
