"""Hints follow from what was measured, the same in the text and in `--json`
(verify/hints/table.py, script_hints.py), on classes the tool has never seen
(tests/fixtures/hint_students.py):

- a class that never sends its last, partly filled bucket gets the same hint (a bucket never
  launched) wherever it shows: the matrix's several-buckets row, under both checks, and
  `consistency` / `equivalence` on the `unused` workload. The equivalence check tells it from
  a bucket launched too early by measuring that the ranks hold different gradients;
- a class that clips the averaged gradients on rank 0 only gets a hint naming clipping on one
  rank, from both checks: the ranks' gradients are one factor apart in every tensor;
- the same clipping on every rank is no finding (the replicas stay identical);
- so for a training script under `verify audit` (tests/fixtures/clip_script.py): clipping on
  the main process only is named by the audit's hint, clipping everywhere passes.

The rules are tested here in-process, table-driven: each case is a finding with the kind and
numbers its check measured on those classes (`HINT_RULES`), in the run's situation, and the
reports and `--json` built from it. One real run (a frozen parameter's bucket) checks that a
hint reaches a check's output. The real runs of the classes and the script above are
`hint_problems`, which the load test runs under CPU hogs (tests/test_load.py, `pytest -m
load`). The catalogue's hints are asserted on real output in tests/test_faulty.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.matrix import MatrixOptions, run_matrix
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli.text_checks import consistency as consistency_text
from verify.cli.text_checks import equivalence as equivalence_text
from verify.cli.text_matrix import cell_hint
from verify.hints import kinds
from verify.hints.table import Situation, with_hints

FIXTURE = str(Path(__file__).resolve().parent / "fixtures" / "hint_students.py")
SCRIPT = str(Path(__file__).resolve().parent / "fixtures" / "clip_script.py")
BUCKETS, CLIPS, CLIPS_ALL = (f"{FIXTURE}:{c}" for c in
                             ("BucketsWhenFull", "ClipsOnMaster", "ClipsEverywhere"))  # fmt: skip
NEVER_SENT = "a bucket never launched (the last, partly filled bucket must be flushed too)"
LAUNCHED_EARLY = "launched before all of its gradients were ready"


def _first_hint(result) -> str:
    return next((f.hint for f in result.findings if f.hint), "") or ""


def _json_hints(result) -> list:
    """Every finding's hint as --json prints it (a "hint" key on each, none left out)."""
    doc = json.loads(json.dumps(result.to_dict()))
    findings = doc["findings"]
    assert findings and all("hint" in f and "kind" in f and "numbers" in f for f in findings)
    return [f["hint"] for f in findings]


def bucket_problems() -> list[str]:
    """What is wrong with the hints of the class that never sends its last bucket."""
    problems = []
    matrix = run_matrix(MatrixOptions(impls=(BUCKETS,), rows=("several-buckets",)))
    said = {}
    for check in ("consistency", "equivalence"):
        cell = matrix.result(BUCKETS, "several-buckets", check)
        if cell.status != "fail":
            problems.append(f"several-buckets / {check}: {cell.status} ({cell.detail})")
        said[f"several-buckets / {check}"] = cell_hint(cell) or ""
    for name, check, options in (
        ("consistency", check_consistency, ConsistencyOptions),
        ("equivalence", check_equivalence, EquivalenceOptions),
    ):
        result = check(options(impl=BUCKETS, workload="unused", bucket_mb=0.0045))
        if result.verdict != "fault":
            problems.append(f"unused / {name}: {result.headline}")
        said[f"unused / {name}"] = "hint: " + _first_hint(result)
        if _json_hints(result)[0] != _first_hint(result):
            problems.append(f"unused / {name}: the JSON's hint is not the text's")
    for where, line in said.items():
        if NEVER_SENT not in line or LAUNCHED_EARLY in line:
            problems.append(f"{where}: {line!r}")
    if len(set(said.values())) != 1:
        problems.append(f"not the same hint everywhere: {said}")
    return problems


def clip_problems() -> list[str]:
    """What is wrong with the verdicts and hints of the two clipping classes."""
    problems = []
    for name, result, text in (
        ("consistency", check_consistency(ConsistencyOptions(impl=CLIPS)), consistency_text),
        ("equivalence", check_equivalence(EquivalenceOptions(impl=CLIPS)), equivalence_text),
    ):
        hint = _first_hint(result)
        if result.verdict != "fault" or "clip" not in hint or "rank 0 " not in hint:
            problems.append(f"{name}: {result.verdict}: {hint!r}")
        if f"hint: {hint}" not in text(result):
            problems.append(f"{name}: the text does not show the hint: {text(result)}")
        if _json_hints(result)[0] != hint:
            problems.append(f"{name}: the JSON's hint is not the text's")
    right = check_consistency(ConsistencyOptions(impl=CLIPS_ALL))
    if right.verdict != "pass":
        problems.append(f"clipping on every rank flagged: {right.headline}")
    return problems


def script_problems(out: str) -> list[str]:
    """What is wrong with the audit of a script that clips on rank 0 only, and on all."""
    problems = []
    wrong = check_audit(AuditOptions(script=(SCRIPT, "main-only"), out=out, console="none"))
    faults = wrong.audit.faults if wrong.audit is not None else ()
    hint = faults[0].hint if faults else ""
    if wrong.verdict != "fault" or "clip" not in hint or "rank 0 " not in hint:
        problems.append(f"clipping on rank 0: {wrong.verdict}: {hint!r}")
    right = check_audit(AuditOptions(script=(SCRIPT, "everywhere"), out=out, console="none"))
    if right.verdict != "pass":
        problems.append(f"clipping on every rank: {right.verdict}")
    return problems


def hint_problems(out: str) -> list[str]:
    """What is wrong with the real runs' hints (the load test runs it under CPU hogs; idle,
    the same rules are the in-process table below)."""
    return bucket_problems() + clip_problems() + script_problems(out)


# --- the rules, table-driven: a finding as its check measured it, and the run's situation ---
# The numbers are those the real runs of `hint_problems` measure (the classes and script named
# in each case), so the table is what those runs' hints follow from, in-process.
UNUSED, EQUIVALENCE = Situation(world_size=2), Situation(2, scheduler=True, round_trip_step=1)
SEVERAL = Situation(world_size=2, several_buckets=True)  # the matrix's several-buckets row
APART = {"scale": None, "ranks": [1], "reference_rank": 0, "frozen": 0}  # consistency's
OFF = {"step": 1, "first_gradient_step": 1, "ranks_off": [0, 1], "world_size": 2, "scale": None,
       "ranks_agree": False}  # equivalence's: off the average, the ranks apart  # fmt: skip
HINT_RULES = [  # (what ran, kind, numbers, situation, said in the hint, not said)
    ("BucketsWhenFull, consistency, unused", kinds.GRADIENTS_DIFFER, APART, UNUSED,
     NEVER_SENT, LAUNCHED_EARLY),
    ("BucketsWhenFull, consistency, several-buckets", kinds.GRADIENTS_DIFFER, APART, SEVERAL,
     NEVER_SENT, LAUNCHED_EARLY),
    ("BucketsWhenFull, equivalence, unused", kinds.GRADIENTS_DIVERGE, OFF, EQUIVALENCE,
     NEVER_SENT, LAUNCHED_EARLY),
    ("BucketsWhenFull, equivalence, several-buckets", kinds.GRADIENTS_DIVERGE, OFF, SEVERAL,
     NEVER_SENT, LAUNCHED_EARLY),
    # the ranks hold the same (wrong) gradients: every bucket was sent, one of them too early
    ("launched early, equivalence, several-buckets", kinds.GRADIENTS_DIVERGE,
     {**OFF, "ranks_agree": True}, SEVERAL, LAUNCHED_EARLY, NEVER_SENT),
    # rank 0 clipped its averaged gradients: rank 1's are 29.4 x rank 0's in every tensor
    ("ClipsOnMaster, consistency", kinds.GRADIENTS_DIFFER, {**APART, "scale": 29.4}, UNUSED,
     "the gradients on rank 0 are 0.034 x those on rank 1", NEVER_SENT),
    # ... and rank 0's are 0.034 x the one-process average, rank 1's are right
    ("ClipsOnMaster, equivalence", kinds.GRADIENTS_DIVERGE,
     {**OFF, "ranks_off": [0], "scale": 0.034}, EQUIVALENCE,
     "the gradients on rank 0 are 0.034 x those on rank 1", NEVER_SENT),
]  # fmt: skip


def _hinted(kind: str, numbers: dict, situation) -> str:
    (found,) = with_hints([_finding(kind, **numbers)], situation)
    return found.hint or ""


@pytest.mark.parametrize("ran, kind, numbers, situation, said, unsaid", HINT_RULES,
                         ids=[case[0] for case in HINT_RULES])  # fmt: skip
def test_a_hint_follows_from_the_finding_and_its_situation(ran, kind, numbers, situation, said,
                                                           unsaid):  # fmt: skip
    """What each check measured on the class is what names the cause: the equivalence check
    tells a bucket never sent (the ranks hold different gradients) from one launched too early
    (they agree); one factor in every tensor on one rank is a clipping there."""
    hint = _hinted(kind, numbers, situation)
    assert said in hint and unsaid not in hint, hint
    assert ("clip" in hint) == ("Clips" in ran), hint


def test_a_never_sent_bucket_gets_one_hint_in_every_report_and_its_json():
    """The same hint under both checks, in the matrix's cell, in the text and in `--json`."""
    from verify.checks.cells import CellResult
    from verify.checks.consistency import ConsistencyResult
    from verify.checks.equivalence import EquivalenceReport, EquivalenceResult

    said = {}
    for name, kind, numbers, situation, *_ in HINT_RULES[:4]:
        (found,) = with_hints([_finding(kind, **numbers)], situation)
        said[f"{name}, matrix"] = cell_hint(CellResult("fail", "differs", findings=(found,)))
        if kind == kinds.GRADIENTS_DIFFER:
            result = ConsistencyResult(ConsistencyOptions(impl=BUCKETS), "fault", findings=(found,))
            text = consistency_text(result)
        else:
            report = EquivalenceReport(findings=(found,))
            result = EquivalenceResult(EquivalenceOptions(impl=BUCKETS), "fault", report)
            text = equivalence_text(result)
        said[f"{name}, text"] = f"hint: {found.hint}" if f"hint: {found.hint}" in text else text
        said[f"{name}, json"] = "hint: " + _json_hints(result)[0]
    assert len(set(said.values())) == 1, said
    assert NEVER_SENT in next(iter(said.values()))


@pytest.mark.parametrize("scales, clipped", [((0.5, 0.5), True), ((0.5, 0.25), False)])
def test_a_scripts_gradients_one_factor_apart_on_one_rank_get_the_clipping_hint(scales, clipped):
    """`verify audit` of tests/fixtures/clip_script.py main-only: rank 1's gradients are one
    multiple of rank 0's in every tensor (rank 0 clipped them); a factor that is not common to
    every tensor gets the phase's hint."""
    from verify.hints import phases
    from verify.hints.script_audit import PHASE_HINTS, script_hint
    from verify.replica_audit.finding import Finding, TensorDiff, diff_numbers

    diffs = tuple(TensorDiff(f"fc{i}.weight", (1,), 0, scale=1 / c) for i, c in enumerate(scales))
    found = Finding("audit", phases.GRADS, 0, "gradients differ", kind=kinds.DIVERGENCE,
                    numbers={"tensors": diff_numbers(diffs)})  # fmt: skip
    hint = script_hint(found)
    if clipped:
        assert "clip" in hint and hint.startswith("the gradients on rank 0 are 0.5 x"), hint
    else:
        assert hint == PHASE_HINTS[phases.GRADS]


# What a finding's hint says follows what the run measured beside it (verify/hints/table.py,
# hint_rules.py), built here as the checks build them: in-process, no launch.
def _finding(kind: str, **numbers):
    from verify.replica_audit.finding import Finding

    return Finding("consistency", "gradients", 1, "step 1 gradients: fc1.weight differs",
                   "fc1.weight", (1,), kind=kind, numbers=numbers)  # fmt: skip


@pytest.mark.parametrize(
    "others, numbers, said",
    [  # (findings before it in the run, the gradients finding's numbers, its hint starts with)
        ((), {"scale": None, "frozen": 0}, "gradients still differ across ranks"),
        (("read while a collective was in flight",), {"scale": None, "frozen": 0},
         "the gradients differ because of the races above"),
        (("collective never waited on",), {"scale": 0.0, "frozen": 3},
         "the gradients differ because of the races above"),
        ((), {"scale": None, "frozen": 2},
         "a bucket never launched: a frozen or unused parameter's hook never fires"),
        ((), {"scale": 0.5, "ranks": [1], "reference_rank": 0, "frozen": 2},
         "the gradients on rank 1 are 0.5 x"),
    ],
)  # fmt: skip
def test_gradients_that_differ_get_the_hint_of_what_else_was_measured(others, numbers, said):
    """The after-effect of a race (handles waited only at the next batch) is said to be one,
    not a bucket that never launched; parameters no hook fires for name the frozen bucket."""
    from verify.hints import kinds
    from verify.hints.table import Situation, with_hints

    found = [*(_finding(kind, op="add_", access="read", gradient=True) for kind in others),
             _finding(kinds.GRADIENTS_DIFFER, **numbers)]  # fmt: skip
    hinted = with_hints(found, Situation(world_size=2))
    assert hinted[-1].hint.startswith(said), hinted[-1].hint
    assert all(f.hint and "never launched" not in f.hint for f in hinted[:-1])


# --- one real run: a hint reaches a check's output (the rest: `hint_problems`, under load) ---


def test_a_bucket_planned_over_a_frozen_parameter_gets_the_frozen_hint():
    """A fresh class (tests/fixtures/frozen_buckets.py) on the frozen workload: the hint names
    the frozen parameter's bucket; on a model with none it is right (PASS)."""
    cls = f"{Path(__file__).resolve().parent / 'fixtures' / 'frozen_buckets.py'}:PlannedBucketsDDP"
    frozen = check_consistency(ConsistencyOptions(impl=cls, workload="frozen", steps=1))
    assert frozen.verdict == "fault", frozen.headline
    assert _first_hint(frozen).startswith("a bucket never launched: a frozen or unused"), (
        _first_hint(frozen)
    )
    assert _json_hints(frozen)[0] == _first_hint(frozen)
    assert f"hint: {_first_hint(frozen)}" in consistency_text(frozen)
    plain = check_consistency(ConsistencyOptions(impl=cls, workload="mlp", steps=1))
    assert plain.verdict == "pass", plain.headline


# A student's overlap DDP, written fresh: each gradient's all-reduce is launched from its hook,
# and the handles are waited at the next forward, after the optimizer stepped on them.
NEXT_BATCH = """
import torch.distributed as dist
from torch import nn


class NextBatchDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.handles = []
        for p in module.parameters():
            dist.broadcast(p.data, 0)
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        p.grad.div_(dist.get_world_size())
        self.handles.append(dist.all_reduce(p.grad, async_op=True))

    def forward(self, *args, **kwargs):
        for h in self.handles:  # BUG: the last batch's all-reduces, waited after its step()
            h.wait()
        self.handles.clear()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass
"""


def test_gradients_that_differ_after_races_are_said_to_follow_from_them(tmp_path):
    """A real run of a class that waits its handles only at the next batch: every race has
    its hint, and the gradients that differ after them are said to be the races' doing, not a
    bucket that never launched (every gradient was launched; none was waited)."""
    (tmp_path / "next_batch.py").write_text(NEXT_BATCH)
    result = check_consistency(ConsistencyOptions(impl=f"{tmp_path / 'next_batch.py'}:NextBatchDDP",
                                                  steps=2))  # fmt: skip
    assert result.verdict == "fault", result.headline
    *races, last = result.findings
    in_flight = {kinds.NEVER_WAITED, kinds.READ_IN_FLIGHT, kinds.WRITE_IN_FLIGHT}
    assert races and all(f.kind in in_flight for f in races), [f.kind for f in races]
    assert last.kind == kinds.GRADIENTS_DIFFER, last.kind
    assert last.hint.startswith("the gradients differ because of the races above"), last.hint
    assert not any("never launched" in (f.hint or "") for f in result.findings)
    assert f"hint: {last.hint}" in consistency_text(result)


def test_every_check_puts_its_findings_at_the_top_of_its_json():
    """`findings` at the top level of `equivalence --json` as of `consistency --json`
    (docs/equivalence.md), and only there: the equivalence report's other fields under
    `report`, its findings not again."""
    from verify.checks.consistency import ConsistencyResult
    from verify.checks.equivalence import EquivalenceReport, EquivalenceResult
    from verify.hints import kinds

    found = (_finding(kinds.GRADIENTS_DIVERGE, step=1, scale=2.0, ranks_agree=True),)
    report = EquivalenceReport(findings=found)
    docs = {
        "equivalence": EquivalenceResult(EquivalenceOptions(impl="naive"), "fault", report),
        "consistency": ConsistencyResult(ConsistencyOptions(impl="naive"), "fault", findings=found),
        "equivalence, no report": EquivalenceResult(EquivalenceOptions(impl="naive"), "fault"),
    }
    for name, result in docs.items():
        doc = json.loads(json.dumps(result.to_dict()))
        want = [] if name.endswith("no report") else [found[0].kind]
        assert [f["kind"] for f in doc["findings"]] == want, (name, doc.keys())
    doc = json.loads(json.dumps(docs["equivalence"].to_dict()))
    assert "findings" not in doc["report"] and "first_divergence" in doc["report"], doc["report"]
