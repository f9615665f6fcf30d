"""Ranks agree on every cell before the next begins, and every launch is watched.

The classes are student-style bugs that show on some ranks only, written for these tests
(tests/fixtures/one_rank_bugs.py), each beside a correct twin in the same plan whose cells
must keep passing. Before cell agreement, a constructor that raised on one rank was read as
that rank's refusal: it started the next cell while its peers still trained this one, and the
matrix sat silent until the 600 s launch timeout, with no verdict. Now each is decided within
the stall timeout (10 s by default, 3 s here) and a few seconds, by the class's fault, on its
rank and line.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fixtures import one_rank_bugs
from verify.checks.behaviours import BEHAVIOUR
from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.matrix import MatrixOptions, run_matrix, run_plan

FIXTURE = str(Path(one_rank_bugs.__file__).relative_to(Path.cwd()))
# The stall timeout of these matrices (`--stall-timeout`): a rank that waits for peers who never
# come is called hung on the evidence (no CPU progress), so a short one is as sound under load.
STALL_S = 3.0
ALL = ("consistency", "equivalence", "shard")


def _impl(name: str) -> str:
    return f"{FIXTURE}:{name}"


def plan_and_expectations():
    """(plan, {cell: (status, text the detail must hold)}): every pattern of one-rank bugs
    beside correct classes, in one plan (each world size is one launch, side by side)."""
    rows = [
        ("RoundRobinZeRO", "more-ranks-than-params", ALL, "fail", "only rank 3 raised"),
        ("RoundRobinZeROFixed", "more-ranks-than-params", ALL, "pass", ""),
        ("ExplodesAtStepTwo", "world-2", ("consistency",), "fail", "IndexError"),
        ("SkipsOnLastRank", "world-2", ("consistency",), "fail", "rank 1 skipped all_reduce"),
        ("PerGradientDDP", "world-2", ("consistency", "equivalence"), "pass", ""),
        ("ZerosNotAssigned", "used-on-one-rank", ("consistency",), "fail", "held on rank 0 only"),
        ("PerGradientDDP", "used-on-one-rank", ("consistency",), "pass", ""),
    ]
    plan, expected = [], {}
    for name, key, checks, status, text in rows:
        plan.append((_impl(name), BEHAVIOUR[key], checks))
        for check in checks:
            expected[(_impl(name), key, check)] = (status, text)
    return plan, expected


def load_plan():
    """The patterns with a stall or a tool collective in them, one check each, for the run
    under CPU hogs (tests/test_load.py)."""
    plan, expected = plan_and_expectations()
    keep = {("RoundRobinZeRO", "consistency"), ("RoundRobinZeROFixed", "consistency"),
            ("ZerosNotAssigned", "consistency"), ("SkipsOnLastRank", "consistency")}  # fmt: skip
    cells = {c: e for c, e in expected.items() if (c[0].split(":")[-1], c[2]) in keep}
    plan = [(i, b, ("consistency",)) for i, b, _ in plan if any(c[0] == i for c in cells)]
    plan = list({(i, b.key): (i, b, c) for i, b, c in plan}.values())
    cells = {c: e for c, e in cells.items() if any(c[:2] == (i, b.key) for i, b, _ in plan)}
    return plan, cells


def verdict_problems(plan, expected):
    """Run the plan: what differs from the expectations (empty: every verdict right), and
    the result."""
    impls = tuple(dict.fromkeys(impl for impl, _, _ in plan))
    result = run_plan(MatrixOptions(impls=impls, stall_timeout_s=STALL_S), plan)
    problems = []
    for cell, (status, text) in expected.items():
        got = result.results[cell]
        if got.status != status or text not in got.detail:
            problems.append(f"{cell}: {got.status}: {got.detail[:300]} (expected {status})")
    return problems, result


def test_one_rank_bugs_are_decided_in_seconds_and_the_correct_twins_pass():
    start = time.monotonic()
    plan, expected = plan_and_expectations()
    problems, result = verdict_problems(plan, expected)
    assert not problems, "\n".join(problems)
    # Each failure costs at most a stall timeout and the world sizes run side by side: far
    # from the 600 s launch timeout the empty-parameter-list cell used to take.
    assert time.monotonic() - start < 60

    # The raise names its rank and line; the row's other checks follow without a stall each.
    impl = _impl("RoundRobinZeRO")
    first = result.result(impl, "more-ranks-than-params", "consistency")
    line = next(
        i
        for i, text in enumerate(Path(FIXTURE).read_text().splitlines(), 1)
        if "BUG: [] on a rank owning nothing" in text
    )
    assert first.headline.startswith("only rank 3 raised: constructing the optimizer raised "
                                      "ValueError: optimizer got an empty parameter list")  # fmt: skip
    assert f"one_rank_bugs.py:{line} (make_local)" in first.headline
    assert "ranks 0, 1, 2 did not" in first.headline
    for check in ("equivalence", "shard"):  # the same construction: not another stall
        other = result.result(impl, "more-ranks-than-params", check)
        assert other.failed and "as in the consistency cell" in other.detail, other.detail


def test_a_single_check_calls_a_raise_on_some_ranks_a_fault_not_a_usage_error():
    """`consistency --world-size 4` on the round-robin ZeRO-1: it used to say "could not
    run" (exit 2) with no word of which rank raised."""
    options = ConsistencyOptions(
        impl=_impl("RoundRobinZeRO"), world_size=4, workload="tied", steps=1
    )
    result = check_consistency(options)
    assert result.verdict == "fault", result.headline
    assert result.headline.startswith("FAULT: only rank 3 raised: constructing the optimizer")
    assert result.findings[0].phase == "construction" and result.findings[0].ranks == (3,)


def test_every_rank_refusing_alike_is_still_a_usage_error():
    # Refuses any bucket size but 0.75 in its constructor, on every rank alike.
    bad = MatrixOptions(impls=("tests/fixtures/user_classes.py:TakesBucketSize",),
                        rows=("world-2",))  # fmt: skip
    with pytest.raises(ValueError, match="expected 0.75"):
        run_matrix(bad)


def test_a_matrix_that_certified_nothing_is_not_a_pass():
    result = run_matrix(MatrixOptions(impls=("bucketed",), rows=("scheduler",)))
    assert result.verdict == "nothing certified" and not result.passed
    assert all(r.status == "n/a" for r in result.results.values())
