"""The reports of `compare DIR_A DIR_B` and of `audit --record/--against`, as text: formatting
only, every verdict is decided by `verify/recording/departure.py` and `verify/checks/compare.py`."""

from __future__ import annotations

from verify.checks.compare import CompareResult, RecordedAudit, verdict_of
from verify.checks.drill import (
    BATCH,
    COMPILED,
    NOT_COMPUTED,
    NOTHING,
    OP,
    REORDERED,
    REPLAY,
    SPLIT,
    UNSEEN,
    Drill,
)
from verify.checks.verdict import FAULT, NOTHING_AUDITED, PASS
from verify.cli import text_audit
from verify.recording.batch_departure import INPUTS, ORDER, SAMPLES
from verify.recording.capture import FORWARD, OPTIMIZER
from verify.recording.departure import Comparison
from verify.recording.streams import (
    DIFFERS,
    NO_SYNC,
    NONDETERMINISTIC,
    ONLY_ONE,
    OTHER_INPUTS,
    OTHER_OPS,
    RANDOM,
    WRITTEN_BELOW,
    Part,
)


def compare(result: CompareResult) -> str:
    a, b = result.options.recordings
    lines = [f"compare: {b} (this run) against {a} (the recording)"]
    lines += comparison_lines(result.comparison, result.verdict)
    if result.drill is not None:
        lines += drill_lines(result.drill)
    return "\n".join(lines)


_STOPPED = {BATCH: "at the batch", NOT_COMPUTED: "at the step", SPLIT: "at the split",
            REPLAY: "at the replay", COMPILED: "at torch.compile", UNSEEN: "below the dispatcher"}  # fmt: skip


def drill_lines(d: Drill) -> list[str]:
    """The drill-down's rungs, and where it stopped (`checks/drill.py`)."""
    if d.rung == NOTHING:
        return [f"DRILL: nothing to drill into: {d.says}"]
    lines = []
    if len(d.reruns) == 2:
        lines.append("drill-down: each run again up to its departing step, op by op")
    elif d.reruns:
        lines.append("drill-down: the run again up to the step, every rank op by op")
    for r in d.reruns:
        alike = "reproduced bitwise" if r.unlike is None else "NOT reproduced"
        lines.append(f"  re-ran {r.side} ({r.recording}) to step {r.step} in {r.seconds:.1f} s: "
                     f"its recording {alike} (report: {r.report_dir})")  # fmt: skip
    if d.rung == REORDERED:  # the op, then why the search ends at it
        return (
            lines
            + _part_lines(d.part, d.module, d.sides)[:-1]
            + [f"DRILL: stopped at the summation order: {d.says}"]
        )
    if d.rung != OP:
        if d.module is not None:
            lines.append(_module_line(d.module))
        return lines + [f"DRILL: stopped {_STOPPED[d.rung]}: {d.says}"]
    if d.part.why == NO_SYNC:
        return lines + _unsynced(d.part, d.module, d.sides)
    return lines + _part_lines(d.part, d.module, d.sides)


def _unsynced(p: Part, module: dict | None, sides) -> list[str]:
    """Two ranks whose gradients differ in a step that ran no collective: that first, then
    where else their ops part, if anywhere."""
    lines = [f"  step: no collective ran before the optimizer's step, on {' or '.join(sides)}"]
    if p.also is not None:
        also = _part_lines(p.also, None, sides)[:-1]
        lines += [f"  besides, {x.strip()}" for x in also]
    return lines + ["DRILLED TO THE STEP: nothing synchronized the ranks' gradients in this step "
                    "(an all-reduce left out or skipped, no_sync() around the step's last "
                    "micro-step, a model not wrapped in DDP)"]  # fmt: skip


def _part_lines(p: Part, module: dict | None, sides=("A", "B")) -> list[str]:
    op = p.a or p.b
    lines = [] if module is None else [_module_line(module)]
    if module is not None and module["module"] != op.module:
        module = None  # the boundary is another module's: the op's own is said by its name
    at = f"{op.op} at {op.line} ({_where(op, module)})"
    if p.why in (OTHER_OPS, ONLY_ONE):
        a, b = sides
        if p.a is None or p.b is None:
            ran, other = (a, b) if p.a else (b, a)
            lines.append(f"  op: {ran} ran {at}, which {other} did not")
        else:
            lines.append(f"  op: {a} ran {p.a.op} at {p.a.line}, {b} ran {p.b.op} at "
                         f"{p.b.line} ({_where(op, module)})")  # fmt: skip
        return lines + ["DRILLED TO THE OP: other ops ran here: the code differs (an edit, a "
                        "branch taken, a kernel fused)"]  # fmt: skip
    if p.why == OTHER_INPUTS:
        i = p.argument
        given = f"argument {i}: {p.a.arg(i)} in {sides[0]}, {p.b.arg(i)} in {sides[1]}"
        after = (f"after {p.before.op} at {p.before.line}, the last op alike" if p.before
                 else "before the step's first op")  # fmt: skip
        lines.append(f"  op: {at}: given other inputs ({given})")
        if p.passed_value:
            return lines + [
                "DRILLED TO THE OP: the script passed another value to it, where "
                "every op before was alike: the code or its arguments differ"
            ]
        return lines + [f"DRILL: stopped at the inputs: they already differed, and no op "
                        f"before made the difference: it entered {after}, where the "
                        "dispatcher sees no op (the batch, a parameter set outside the step, a "
                        "kernel of a C++ extension)"]  # fmt: skip
    gap = p.gap
    by = f" (by at least {gap:.2g} relative)" if gap else ""
    same = "the same inputs" if sides == ("A", "B") else f"the same inputs on {' and '.join(sides)}"
    lines.append(f"  op: {at}: {same}, other outputs{by}")
    return lines + [_WHY[p.why]]


_WHY = {
    DIFFERS: "DRILLED TO THE OP: the first op whose output differs while its inputs matched: "
             "the root cause",
    RANDOM: "DRILLED TO THE OP: the first op whose output differs while its inputs matched "
            "draws from a random generator: the generators' states differ (seeded otherwise, "
            "or drawn from more or less before)",
    NONDETERMINISTIC: "DRILLED TO THE OP: the first op whose output differs while its inputs "
                      "matched is one PyTorch documents as non-deterministic on this device "
                      "(torch.use_deterministic_algorithms)",
    WRITTEN_BELOW: "DRILL: stopped at the inputs: the op read memory that `empty` returned and "
                   "no op the dispatcher saw wrote (a kernel of a C++ extension, a custom CUDA "
                   "kernel): the difference entered there",
}  # fmt: skip


_BOUNDARY = {
    "forward": "its output differs while its input matched",
    "gradient": "the first module whose output's gradient differs, as the backward reached it",
    "around": "the module the op ran in",
}


def _module_line(m: dict) -> str:
    called = f", called at {m['line']}" if m.get("line") else ""
    kind = f"{m['kind']}{called}" if m.get("kind") else called.lstrip(", ")
    return f"  module: {m['module'] or '(the model)'} ({kind}): {_BOUNDARY[m['how']]}"


def _where(op, module: dict | None) -> str:
    if op.phase == OPTIMIZER:
        return "in the optimizer's step"
    if not op.module:
        return "in the script's own code" if op.phase == FORWARD else "in the backward"
    kind = f" ({module['kind']})" if module else ""
    return f"in the {op.phase} of {op.module}{kind}"


def audit(result) -> str:
    """`audit`'s report (`text_audit.audit`); under --record/--against (a `RecordedAudit`),
    then the recording's or the comparison's lines. The comparison is printed whatever the
    audit found (a run whose replicas diverge, checked against a good recording, is the
    feature's main use); the verdict stays the audit's fault first (`RecordedAudit`)."""
    if not isinstance(result, RecordedAudit):
        return text_audit.audit(result)
    own = result.audit_result
    # one rank: nothing compared across ranks, and its steps recorded (counts, not text)
    alone = (text_audit.ranks_of(own) == 1 and own.audit is not None
             and own.audit.audits == 0 and result.recording is not None)  # fmt: skip
    plain = text_audit.audit(own, recorded_alone=alone).split("\n")
    report = plain.pop()  # "report: <folder>"
    if result.comparison is not None:
        c = result.comparison
        plain += [f"against {result.options.against}:"]
        plain += comparison_lines(c, verdict_of(c))
        if own.verdict not in (PASS, NOTHING_AUDITED):  # the run's own fault is the verdict
            why = "the replicas diverged (above)" if own.faults else "the run's own (above)"
            plain.append(f"verdict: {result.verdict}: {why}, whatever the comparison found")
    elif own.verdict not in (PASS, NOTHING_AUDITED) or result.options.drill:
        pass  # the run's own fault is the verdict, or --drill alone: recorded to replay
    elif result.recording is not None:
        plain.append(f"RECORDED: {_plural(result.steps_recorded, 'optimizer step')} into "
                     f"{result.recording} (compare a run with it: audit --against "
                     f"{result.recording} -- ...)")  # fmt: skip
    else:
        plain.append("NOTHING RECORDED: the script took no optimizer step (exit 2)")
    if result.drill is not None:
        plain += drill_lines(result.drill)
    return "\n".join(plain + [report])


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def comparison_lines(c: Comparison, verdict: str) -> list[str]:
    mode = "bitwise" if c.bitwise else "within the tolerance of docs/compare.md"
    lines = [
        f"aligned: {c.alignment}",
        f"compared: {mode} ({c.mode_reason})",
    ]
    lines += [f"note: {n}" for n in c.notes]
    steps = f"steps {_range(c.steps_a)} of the recording, {_range(c.steps_b)} of this run"
    if c.compared_steps == 0:
        return lines + ["NOTHING COMPARED: the runs share no optimizer step (exit 2)"]
    lines += _batches(c)
    d = c.first
    if d is None or verdict == PASS:
        how = "bitwise" if c.bitwise else "within tolerance"
        if c.closest is not None:
            ratio, gap, limit, what = c.closest
            lines.append(f"closest to its tolerance: {what}: relative difference at least "
                         f"{gap:.2g}, {ratio:.1%} of the tolerance {limit:.2g}")  # fmt: skip
        return lines + [f"AGREE {how} at every compared step ({steps})"]
    at = f"step {d.step}" + (f" (this run's step {d.step_b})" if d.step_b != d.step else "")
    lines.append(f"FIRST DEPARTURE: {at}, {d.phase}, {d.optimizer}: {d.name}: {d.what}")
    if d.hint:
        lines.append(f"  what it usually means: {d.hint}")
    lines += _following(c, d.step)
    lines.append(f"DEPART: this run departs from the recording at {c.departing_steps} of "
                 f"{c.compared_steps} compared steps ({steps}), first at {at}: "
                 f"{d.phase}, {d.name}")  # fmt: skip
    assert verdict == FAULT
    return lines


# what a batch that differs means, by how it differs, and the verb its input takes
_BATCH_SAYS = {ORDER: ("the data order is not the same", "holds"),
               SAMPLES: ("the data order is not the same", "holds"),
               INPUTS: ("the model is given other inputs", "is")}  # fmt: skip


def _batches(c: Comparison) -> list[str]:
    """Whether the runs were given the same batches, before the first departure: a batch
    that differs there is a finding of its own (the data order), not the gradients'."""
    b = c.batches
    if b is None or b.steps == 0:  # a recording without batches: nothing said, as before
        return []
    departs = c.first is not None
    if departs:
        upto = (c.steps_a[0], c.first.step)
        steps = "step" + ("s" if upto[1] > upto[0] else "")
        same = f"the same batches up to the departure ({steps} {_range(upto)} of the recording)"
    else:
        same = "the same batches at every compared step"
        if b.steps < c.compared_steps:
            same += f" (the {b.steps} that both runs recorded batches at)"
    x = b.first
    if x is None:
        return [f"batches: {same}"]
    at = f"step {x.step}" + (f" (this run's step {x.step_b})" if x.step_b != x.step else "")
    if x.micro is not None:
        at += f", micro-step {x.micro}"
    else:
        n = x.numbers
        at += (f" (its whole global batch: {n['micro_steps_recording']} micro-steps in the "
               f"recording, {n['micro_steps']} in this run)")  # fmt: skip
    why, verb = _BATCH_SAYS[x.how]
    found = f"the batches differ from {at}: {why}: {x.name} {verb} {x.what}"
    if departs and x.step > c.first.step:  # after the departure: not its cause
        return [f"batches: {same}; {found}"]
    return [f"batches: {found}"]


def _following(c: Comparison, first: int) -> list[str]:
    """What follows the first departure: the rest of its step, entry by entry; then each
    later departing step in one line (the first few)."""
    lines = []
    same = [f for f in c.following if f[0] == first]
    for _, phase, n, names in same:
        more = ", ..." if n > len(names) else ""
        lines.append(f"  then {phase}: {n} {'entry' if n == 1 else 'entries'} "
                     f"({', '.join(names)}{more})")  # fmt: skip
    later: dict[int, list[str]] = {}
    for step, phase, n, _ in c.following:
        if step != first:
            later.setdefault(step, []).append(f"{phase.replace(f' {step}', '')} ({n})")
    for step, phases in list(later.items())[:3]:
        lines.append(f"  then at step {step}: {', '.join(phases)}")
    left = c.departing_steps - 1 - min(len(later), 3)
    if left > 0:
        lines.append(f"  and {left} more departing step{'s' if left > 1 else ''}")
    return lines


def _range(r: tuple[int, int]) -> str:
    return f"{r[0]}..{r[1]}" if r[1] > r[0] else str(r[0])
