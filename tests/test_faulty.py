"""The detection matrix, asserted: every faulty implementation (`impls/faulty/`) is caught by
the check its docstring names, on the behaviours where its bug shows, and no correct
implementation (the built-ins, torch-ddp, torch-zero) is flagged on those same behaviours.

One test per family of faults, so xdist can spread them over workers. Each is one detection
run: the family's faults (only the check each must be caught by; `python -m verify faults`
shows every check) and the controls (every check) share launches, one per world size, plus
one for each cell that crashes its launch (`arrival-order` aborts gloo on purpose; it runs
last, so nothing is left to rerun). Each behaviour's controls run in the first family that
uses it, so no control cell runs twice.
"""

from __future__ import annotations

import inspect
import io

import pytest
import torch

from verify import progress
from verify.checks.behaviours import BEHAVIOUR
from verify.checks.detection import run_detection
from verify.checks.matrix import CERTIFIED
from verify.cli.text_matrix import cell_hint
from verify.cli.text_matrix import detection as format_detection

# The cause each fault's hint line must name (verify/hints/table.py), read off the real
# output of the catalogue: a newcomer reads the fix, not only the place.
HINTS = {
    "faulty:no-divide": "never divided by the world size",
    "faulty:divide-by-two": "divided by a hard-coded 2",
    "faulty:zero-grad-for-unused": "no rank used got a gradient",
    "faulty:average-at-construction": "broadcast every parameter",
    "faulty:no-buffer-broadcast": "broadcast the buffers",
    "faulty:frozen-not-broadcast": "frozen ones too",
    "faulty:reduces-parameter": "reduced the parameter rather than its .grad",
    "faulty:handles-never-cleared": "handles (or of reduced gradients) never cleared",
    "faulty:arrival-order": "launched in the order gradients arrive",
    "faulty:ready-when-not-none": "not when its .grad is not None",
    "faulty:launch-on-last-member": "count the members that are ready",
    "faulty:final-bucket-unsent": "a bucket never launched",
    "faulty:skip-bucket-missing-grad": "every rank must send every bucket",
    "faulty:zero-no-param-sync": "broadcast each updated parameter",
    "faulty:zero-group-options-lost": "each parameter group must keep its own options",
    "faulty:zero-grad-owned-only": "zero_grad() that clears only some gradients",
    "faulty:zero-no-shard": "only this rank's partition",
    "faulty:zero-local-state-dict": "the state_dict() round trip after step 1 lost state",
    "faulty:zero-add-group-unsharded": "add_param_group()",
    "faulty:zero-ignores-scheduler": "the scheduler's lr never reached the inner optimizer",
    # the optimizer's reads of gradients in flight come first (before "never waited on"): the
    # sharper cause
    "faulty:step-before-wait": "the optimizer read a gradient whose all-reduce was still running",
    "faulty:divide-before-wait": "divide after handle.wait()",
    "faulty:shared-staging-buffer": "give each bucket its own buffer",
    "faulty:zero-unwaited-broadcast": "never waited on",
    "faulty:zero3-no-divide": "never divided by the world size",
    "faulty:zero3-not-regathered": "gathered again before its backward",
    "faulty:zero3-accumulation-lost": "a later forward replaced",
    "faulty:zero3-stale-on-one-rank": "gathered at an earlier step",
    "faulty:zero3-padded-tail-dropped": "the shard that also holds the padding",
    "faulty:zero3-unsharded": "every rank holds every parameter whole",
    "faulty:zero3-load-wrong-rows": "each rank keeps its own rows",
    "faulty:zero2-shared-scatter-input": "while an async collective on it was running",
}

# Modules of impls.faulty.
FAMILIES = ("ddp_faults", "bucket_faults", "zero_faults", "race_faults", "shard_faults")
# The controls: the certified implementations but the sharded rungs (zero2, zero3, torch-fsdp),
# which the matrix certifies on every row (tests/test_zero2.py, test_zero3.py, the docs'
# matrix); as controls here they would add a third to this test's time.
CONTROLS = tuple(n for n in CERTIFIED if n not in ("zero2", "zero3", "torch-fsdp"))


def family(name: str) -> tuple[str, ...]:
    from impls.faulty import FAULTS

    return tuple(n for n, f in FAULTS.items() if f.cls.__module__ == f"impls.faulty.{name}")


def control_rows(name: str) -> tuple[str, ...]:
    """The rows of this family's faults that no earlier family has."""
    from impls.faulty import FAULTS

    seen: set[str] = set()
    for other in FAMILIES:
        rows = [k for n in family(other) for k in FAULTS[n].shows_on if k not in seen]
        if other == name:
            return tuple(dict.fromkeys(rows))
        seen.update(rows)
    raise KeyError(name)


def test_the_catalogue():
    """At least 15, every one in a family, each documented and pointing at real rows."""
    from impls.faulty import CHECKS, FAULTS

    assert len(FAULTS) >= 15
    assert sorted(FAULTS) == sorted(n for f in FAMILIES for n in family(f))
    for name, f in FAULTS.items():
        assert f.caught_by in CHECKS, name
        assert f.shows_on and all(k in BEHAVIOUR for k in f.shows_on), name
        assert f.bug and f.symptom, name
        assert f.caught_by in inspect.getdoc(f.cls).split("Symptom:")[1], name
        assert "# BUG:" in inspect.getsource(f.cls), name
        assert name in HINTS, f"{name}: no hint asserted (tests/test_faulty.py HINTS)"


@pytest.mark.parametrize("name", FAMILIES)
def test_every_fault_is_caught_and_no_control_is_flagged(name):
    said = io.StringIO()
    progress.enable(said)
    try:
        result = run_detection(
            family(name), controls=CONTROLS, control_rows=control_rows(name), named_check_only=True
        )
    finally:
        progress.disable()
    # progress is labelled by the command that runs (not "matrix"), with n of m
    assert "faults, world size 2: cell 1/" in said.getvalue(), said.getvalue()[:300]
    missed = [
        f"{d.name}: {d.caught_by} said {d.checks[d.caught_by].status} on {d.shows_on}"
        for d in result.detections
        if not d.caught
    ]
    assert not missed, "\n".join(missed)
    flagged = [f"{c}: {r.headline}" for c, r in result.false_alarms]
    assert not flagged, "\n".join(flagged)
    assert all(list(d.checks) == [d.caught_by] for d in result.detections)
    for d in result.detections:  # each finding says its cause, in the situation it showed in
        cell = d.checks[d.caught_by]
        line = cell_hint(cell) or ""  # chosen by the findings' kinds and numbers
        assert HINTS[d.name] in line, f"{d.name}: {line!r} for {cell.detail!r}"
        assert "verify/" not in cell.detail, f"the tool's frame as a place: {cell.detail}"
        if "(crashed)" in cell.detail:  # gloo aborted a victim: the first line names the cause
            first = cell.detail.splitlines()[0]
            assert "mismatch" in first or "extra" in first, first
            assert "failed (crashed)" not in first and "rank " in first, first
    table = format_detection(result)
    assert (
        f"PASS: {len(result.detections)}/{len(result.detections)} faulty implementations" in table
    )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_hints_tell_the_wrong_divisions_apart_by_the_world_size(world):
    """A gradient scaled by c is c x the average in every element: summed and never divided
    (c = N), divided twice (c = 1/N), divided by a hard-coded 2 (c = N/2) and zeroed (c = 0)
    each get their own hint at each world size (verify/hints/rules.py), chosen from the
    factor the equivalence check fits (`reference.compare`), not from its message; at two
    ranks "not divided" (c = 2) and "zeroed" (c = 0) are told apart too."""
    from verify.checks.verdict import Finding
    from verify.hints.kinds import GRADIENTS_DIVERGE
    from verify.hints.table import Situation, hint_for
    from verify.replica_audit.measure import fitted_scale

    ref = torch.linspace(-1, 1, 64, dtype=torch.float64)

    def said(c: float) -> str:
        scale = fitted_scale((ref * c).float(), ref)  # measured as the check measures it
        numbers = {
            "step": 1,
            "first_gradient_step": 1,
            "scale": scale,
            "ranks_off": list(range(world)),
            "world_size": world,
            "ranks_agree": True,
        }
        found = Finding("equivalence", "gradients", 1, "x", kind=GRADIENTS_DIVERGE,
                        numbers=numbers)  # fmt: skip
        return hint_for(found, Situation(world_size=world)) or ""

    assert "never divided by the world size" in said(world)
    assert "divided by the world size twice" in said(1 / world)
    if world != 2:  # at two ranks a hard-coded 2 is right
        assert "divided by a hard-coded 2" in said(world / 2)
    assert "gradients are zero" in said(0) and "never divided" not in said(0)
    assert said(1.0001) == ""  # an error that is no such factor gets no guess
