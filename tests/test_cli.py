"""The CLI end to end: verdicts, exit codes (0 pass, 1 fault, 2 cannot run), one-line errors.

The cases run `main()` in this process, as `python -m verify` runs it (the ranks are real,
forked from this worker's zygotes: no interpreter to start and import torch into per case).
One case runs a real shell command, to see what a user's terminal gets (no traceback), and
one runs under a real torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = "tests/fixtures/user_classes.py"


def test_bad_input_from_the_shell_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "verify", "consistency", "--impl", "no_such_module:Cls"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == "verify: error: --impl 'no_such_module:Cls': module 'no_such_module' not found"
    )


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "from os import does_not_exist\n",
            "importing userpkg_bad failed: ImportError: cannot import name",
        ),
        ("def broken(:\n", "importing userpkg_bad failed: SyntaxError"),
        (
            "raise RuntimeError('boom at import')\n",
            "importing userpkg_bad failed: RuntimeError: boom at import",
        ),
        (
            "import no_such_dependency\n",
            "importing userpkg_bad failed: No module named 'no_such_dependency'",
        ),
    ],
)
def test_a_module_that_fails_to_import_is_one_line_and_exit_2(
    tmp_path, source, message, run_cli, monkeypatch
):
    (tmp_path / "userpkg_bad.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "userpkg_bad", raising=False)
    proc = run_cli("consistency", "--impl", "userpkg_bad:MyDDP")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr


def test_consistency_passes_for_bucketed_and_prints_table_and_verdict(run_cli):
    proc = run_cli("consistency", "--impl", "bucketed", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checkpoint" in proc.stdout and "step 2 gradients" in proc.stdout
    assert "PASS: replicas bitwise identical on both ranks at all 5 checkpoints" in proc.stdout
    # stderr is not a terminal here: plain progress lines, each step once, none rewritten
    steps = [line for line in proc.stderr.splitlines() if ": step " in line]
    assert [s.split("] ", 1)[1][:38] for s in steps] == [
        "consistency bucketed on mlp: step 1/2",
        "consistency bucketed on mlp: step 2/2",
    ], proc.stderr
    assert "\r" not in proc.stderr and "\033" not in proc.stderr, proc.stderr


def test_json_output_is_one_document(run_cli):
    proc = run_cli("consistency", "--impl", "zero1", "--world-size", "3", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["check"] == "consistency" and doc["passed"] is True
    assert doc["options"]["world_size"] == 3
    assert [c["label"] for c in doc["checkpoints"]] == [
        "construction",
        "step 1 gradients",
        "step 1",
    ]


def test_json_stays_clean_when_the_user_class_prints(run_cli):
    proc = run_cli("consistency", "--impl", f"{FIXTURES}:Chatty", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["passed"] is True


def test_user_class_from_a_file_passes(run_cli):
    proc = run_cli(
        "consistency", "--impl", "docs/examples/student_ddp.py:StudentDDP", "--steps", "2"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


def test_user_class_that_forgets_buffers_is_caught_at_construction(run_cli):
    proc = run_cli(
        "consistency",
        "--impl",
        "docs/examples/forgot_buffers_ddp.py:ForgotBuffersDDP",
        "--workload",
        "buffers",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAULT: construction: buffer:offset differs on rank 1 (vs rank 0)" in proc.stdout


def test_a_rank_that_raises_exits_1_with_its_traceback_summarized(run_cli):
    proc = run_cli("consistency", "--impl", f"{FIXTURES}:RaisesOnRankOne")
    assert proc.returncode == 1
    assert "rank 1" in proc.stdout and "rank one exploded in forward" in proc.stdout
    assert "user_classes.py" in proc.stdout  # the user's frame is named


def test_a_user_class_taking_bucket_size_mb_gets_the_cli_value(run_cli):
    ok = run_cli(
        "consistency",
        "--impl",
        f"{FIXTURES}:TakesBucketSize",
        "--bucket-mb",
        "0.75",
        "--steps",
        "1",
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    wrong = run_cli(
        "consistency", "--impl", f"{FIXTURES}:TakesBucketSize", "--bucket-mb", "2", "--steps", "1"
    )
    # A constructor that raises is a class the tool cannot construct: one line, exit 2.
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "got bucket_size_mb=2.0, expected 0.75" in wrong.stderr
    assert wrong.stderr.count("\n") == 1 and "user_classes.py:" in wrong.stderr


def test_a_user_sharded_optimizer_by_import_path(run_cli):
    proc = run_cli(
        "consistency", "--impl", "impls.zero:ShardedOptimizer", "--world-size", "3", "--steps", "2"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_under_torchrun_the_cli_joins_instead_of_spawning():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "verify", "consistency", "--impl", "bucketed", "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS: replicas bitwise identical on both ranks") == 1
