"""`audit` of scripts with uneven data: under PyTorch's join() a rank that runs out of data
stops stepping while the others go on. The steps every rank took are audited, the others are
counted in a note, never a hang and never a fault (`verify/script_audit/joins.py`); a rank
really parked inside such a loop is still a HANG naming it; without join() the rank that left
early is named as before.

Before: the correct join() scripts were a HANG ("rank 0 never issued all_reduce #11"): the
audit's own collectives at a step the joined rank never takes waited for it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.processes import alive
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli.text_audit import audit as audit_text
from verify.script_audit import report

ROOT = Path(__file__).resolve().parents[1]
FRESH = str(ROOT / "tests" / "fixtures" / "join_uneven.py")
UNEVEN = str(ROOT / "tests" / "fixtures" / "uneven_shards.py")
STALL_S = 3.0

# name -> (ranks, script and arguments)
CASES = {
    "fresh": (3, (FRESH, "ok")),
    "zero": (3, (FRESH, "zero")),
    "epochs": (2, (FRESH, "epochs")),
    "fixture": (2, (UNEVEN, "--join", "--barrier")),
    "parked": (3, (FRESH, "parked")),
    "no-join": (2, (UNEVEN, "--barrier")),
}


LOADED = ("fresh", "parked", "no-join")  # the cases of the hog window (tests/test_load.py)


def join_problems(out: str, names: tuple[str, ...] = tuple(CASES)) -> list[str]:
    """The cases `names` at once (shared with the load test): empty when every verdict is right.

    tests/fixtures/join_uneven.py ok: ranks of 5, 8 and 11 steps under `Join([model])`, the
    lowest rank out of data first: a pass, the 5 steps all three took audited, the 6 that rank
    2 took after rank 0 joined counted (down to 1 of 3 ranks); the same with ZeRO (whose join
    hook steps the optimizer on the joined ranks: never audited, never counted). Two epochs
    (join_uneven.py epochs): join() syncs the model, not the momentum, which lags on the rank
    that joined early: the replicas really differ from the first step of the second epoch,
    step 5 as the audit counts them (the steps every rank took). uneven_shards.py --join: a
    pass, 4 audited, 2 counted. join_uneven.py parked: rank 1 polls for a file no one writes
    inside the join: a HANG naming rank 1, no divergence. uneven_shards.py --barrier, no
    join(): the HANG naming rank 1 that left the loop early, as `hang` says it."""
    options = {
        name: AuditOptions(
            script=script,
            nproc=nproc,
            stall_timeout_s=STALL_S,
            out=out,
            console="none",
            timeout_s=300,
        )  # fmt: skip
        for name, (nproc, script) in CASES.items()
        if name in names
    }
    with ThreadPoolExecutor(max_workers=len(options)) as pool:
        runs = {name: pool.submit(check_audit, o) for name, o in options.items()}
        results = {name: run.result() for name, run in runs.items()}
    problems = []
    passes = {"fresh": (5, {"SGD": 6}, (1, 3)), "zero": (5, {"ZeroRedundancyOptimizer": 6}, (1, 3)),
              "fixture": (4, {"Adam": 2}, (1, 2))}  # fmt: skip
    for name, expected in passes.items():
        r = results.get(name)
        if r is None:
            continue
        if r.verdict != "pass" or r.faults or r.audit is None:
            problems.append(f"{name}: {r.verdict}: {audit_text(r)}")
        elif (r.audit.audited_steps, r.audit.joined, r.audit.joined_ranks) != expected:
            problems.append(f"{name}: audited, joined, fewest: {audit_text(r)}")
        elif "note: uneven data under join()" not in audit_text(r):
            problems.append(f"{name}: no note of the steps not audited: {audit_text(r)}")
        # the audit adds nothing to what the script prints (torch warns on Work.result())
        warned = [p.name for p in Path(r.report_dir).glob("rank*.stderr")
                  if "deprecated" in p.read_text(errors="replace")]  # fmt: skip
        if warned:
            problems.append(f"{name}: a deprecation warning in {warned}")
    r = results.get("epochs")
    if r is not None:
        causes = [(f.phase, f.step, f.ranks) for f in r.faults if f.echo_of is None]
        if r.verdict != "fault" or causes != [(report.PARAMS_AFTER, 5, (1,))]:
            problems.append(f"epochs: {r.verdict}: {audit_text(r)}")
    r = results.get("parked")
    if r is not None:
        d = r.run.diagnosis
        if not (r.verdict == "fault" and d.verdict == "hang" and d.culprit == 1 and not r.faults):
            problems.append(f"parked: {r.verdict}: {audit_text(r)}")
    r = results.get("no-join")
    if r is not None:
        d = r.run.diagnosis
        if not (d.verdict == "hang" and d.culprit == 1 and d.headline.startswith("rank 1 left")):
            problems.append(f"no-join: {audit_text(r)}")
    pids = [p for r in results.values() for p in r.run.pids.values()]
    if not pids or [p for p in pids if alive(p)]:
        problems.append(f"left running: {pids}")
    return problems


def test_join_steps_every_rank_took_are_audited_the_rest_counted(tmp_path):
    """The cases the hog window does not run (`LOADED`: `test_the_cases_under_load`)."""
    problems = join_problems(str(tmp_path), tuple(n for n in CASES if n not in LOADED))
    assert not problems, "\n".join(problems)


@pytest.mark.under_load
def test_the_cases_under_load(tmp_path):
    problems = join_problems(str(tmp_path), LOADED)
    assert not problems, "\n".join(problems)
