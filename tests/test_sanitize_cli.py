"""`--sanitize` through the CLI: a user's script under `hang --nproc`, the checks
on PyTorch DDP (whose C++ reducer the sanitizer cannot see, and says so), and the commands
that cannot use it refusing it in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sanitize_cost
from verify.cli import main

ROOT = Path(__file__).resolve().parents[1]
RACY = "tests/fixtures/race_script.py"


def test_a_racy_script_is_caught_under_hang_nproc_sanitize(run_cli, tmp_path):
    proc = run_cli(
        "hang", "--nproc", "2", "--sanitize", "--out", str(tmp_path), "--json", "--", RACY
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "fault" and doc["diagnosis"]["verdict"] == "ok"  # no hang: a race
    messages = [r["message"] for r in doc["races"]]
    assert any("div_" in m and "race_script.py:" in m and "in flight" in m for m in messages)
    assert {r["rank"] for r in doc["races"]} == {0, 1}
    hints = {r["hint"] for r in doc["races"]}
    assert any("divided while its all-reduce was still running" in h for h in hints), hints


def test_what_the_sanitizer_found_before_a_crash_is_reported_with_it(run_cli, tmp_path):
    """Rank 1 raises after its racy steps: the crash is the diagnosis, and the races both
    ranks found before it are reported too (the crashed rank's saved before it reported)."""
    proc = run_cli(
        "hang", "--nproc", "2", "--sanitize", "--out", str(tmp_path), "--json", "--", RACY,
        "--then-raise",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert "the loss went NaN" in json.dumps(doc["diagnosis"]), doc["diagnosis"]
    assert {r["rank"] for r in doc["races"]} == {0, 1}, doc["races"]


def test_pytorch_ddp_is_clean_and_its_blind_spot_said(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["equivalence", "--impl", "torch-ddp", "--steps", "2", "--sanitize"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "PyTorch DDP's reducer issues its collectives from C++" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hang", "--impl", "naive", "--sanitize"], "--sanitize applies to a script"),
        (["profile", "--impl", "naive", "--sanitize"], "unrecognized arguments: --sanitize"),
    ],
)
def test_commands_that_cannot_use_it_refuse_it(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_cost_benchmark_runs_every_arm(capsys):
    """`benchmarks/sanitize_cost.py`: every arm timed side by side, the slowdown with its
    interval, and where the time went (the figures themselves are for docs/races.md, not
    asserted)."""
    argv = ["--device", "cpu", "--model-size", "0.5", "--repeats", "3"]
    assert sanitize_cost.main([*argv, "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "pass" and set(doc["slowdown"]) == {"sanitized", "check-only"}
    assert all(len(v) == 3 for v in doc["steps_s"].values())
    assert doc["stats"]["sanitized"]["tracked"] > 0 and doc["stats"]["plain"]["tracked"] == 0


def test_the_matrix_cost_report_gives_the_ratio_and_each_arms_verdicts():
    """`benchmarks/sanitize_cost.py --matrix` times whole matrices (the runs are the matrix's own, tested
    in test_matrix.py); its report, from a result (no launch): the ratio with its interval,
    and the verdicts of every round, so a verdict that varies shows."""
    from benchmarks.bench_sanitize import SanitizeBenchOptions, SanitizeBenchResult
    from benchmarks.text_costs import sanitize as text

    options = SanitizeBenchOptions(matrix=True, repeats=2, device="cpu")
    result = SanitizeBenchResult(
        options, "pass", steps_s={"plain": (2.0, 4.0), "sanitized": (3.0, 6.0)},
        machine="here", matrix_verdicts={"plain": ("pass", "fault"), "sanitized": ("fault",) * 2},
    )  # fmt: skip
    out = text(result)
    assert "the certification matrix of bucketed (every row), 2 interleaved rounds" in out
    assert "1.500 [1.500, 1.500]" in out and "pass x1, fault x1" in out and "fault x2" in out
    assert result.to_dict()["slowdown"]["sanitized"]["value"] == pytest.approx(1.5)


def test_the_checks_catch_a_never_waited_collective_by_default():
    """A student's hook DDP that never waits on its all-reduces gives the right numbers on a
    CPU almost every run, so without the race check consistency passes it (the opt-out,
    --no-sanitize, says so in its help). The checks run the sanitizer by default: caught,
    with the line that issued the collective, and the twin that waits passes."""
    from verify.checks.consistency import ConsistencyOptions, check_consistency
    from verify.checks.equivalence import EquivalenceOptions, check_equivalence

    fixture = "tests/fixtures/hook_ddp.py"
    buggy, correct = f"{fixture}:HookDDPNoWait", f"{fixture}:HookDDP"
    for check, options in ((check_consistency, ConsistencyOptions),
                           (check_equivalence, EquivalenceOptions)):  # fmt: skip
        found = check(options(impl=buggy, steps=2))
        assert found.verdict == "fault", found.headline
        assert found.findings[0].phase == "race", found.headline
        assert "hook_ddp.py" in found.findings[0].message, found.findings[0].message
        assert check(options(impl=correct, steps=2)).verdict == "pass"
    # What --no-sanitize gives up: the race is never named. (Its values are right almost every
    # run on a CPU, so the check mostly passes; when a gradient is read mid-flight, the audit
    # may still see replicas differ, which is the bug showing, not a false alarm.)
    blind = check_consistency(ConsistencyOptions(impl=buggy, steps=2, sanitize=False))
    assert not [f for f in blind.findings if f.phase == "race"], blind.headline
