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

import pytest

from verify.checks.behaviours import BEHAVIOUR
from verify.checks.detection import run_detection
from verify.checks.matrix import CERTIFIED
from verify.cli.text_matrix import detection as format_detection

# Modules of impls.faulty.
FAMILIES = ("ddp_faults", "bucket_faults", "zero_faults", "race_faults", "shard_faults")
# The controls: the certified implementations but the sharded rungs added with issue 20,
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


@pytest.mark.parametrize("name", FAMILIES)
def test_every_fault_is_caught_and_no_control_is_flagged(name):
    result = run_detection(
        family(name), controls=CONTROLS, control_rows=control_rows(name), named_check_only=True
    )
    missed = [
        f"{d.name}: {d.caught_by} said {d.checks[d.caught_by].status} on {d.shows_on}"
        for d in result.detections
        if not d.caught
    ]
    assert not missed, "\n".join(missed)
    flagged = [f"{c}: {r.headline}" for c, r in result.false_alarms]
    assert not flagged, "\n".join(flagged)
    assert all(list(d.checks) == [d.caught_by] for d in result.detections)
    table = format_detection(result)
    assert (
        f"PASS: {len(result.detections)}/{len(result.detections)} faulty implementations" in table
    )
