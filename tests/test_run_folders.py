"""Run folders on disk: a run says what it took and what `--out` holds, and `clean --keep N`
removes all but the newest N, touching nothing it did not name (verify/runs.py). In-process,
no ranks."""

from __future__ import annotations

from verify import runs
from verify.cli import main


def test_clean_keeps_the_newest_runs_and_nothing_else_is_touched(tmp_path, capsys):
    made = [runs.new_run_dir(tmp_path, "profile_all", 2, "cpu") for _ in range(4)]
    for i, path in enumerate(made):
        (path / "trace.json").write_bytes(b"x" * 1000 * (i + 1))
    (tmp_path / "my-notes").mkdir()  # not a run folder: never removed
    (tmp_path / "my-notes" / "a.txt").write_text("keep me")
    assert runs.run_folders(tmp_path) == made  # oldest first (same second: by suffix)
    line = runs.disk_line(made[-1])
    assert line.startswith("disk: this run 4.0 KB;") and "holds 4 runs, 10.0 KB" in line, line
    assert f"clean --keep N --out {tmp_path}" in line

    assert main(["clean", "--keep", "2", "--out", str(tmp_path), "--dry-run"]) == 0
    assert "would remove 2 run folders" in capsys.readouterr().out
    assert runs.run_folders(tmp_path) == made

    assert main(["clean", "--keep", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"removed 2 run folders under {tmp_path}/ (3.0 KB), kept the newest 2")
    assert runs.run_folders(tmp_path) == made[2:]
    assert (tmp_path / "my-notes" / "a.txt").read_text() == "keep me"


def test_a_launcher_commands_run_is_a_run(tmp_path):
    """`audit -- torchrun ...` names its folder with N ranks (its launcher decides them):
    `audit_torchrun_train.py_Nxcpu_<stamp>`, counted and cleaned like the others."""
    script = runs.new_run_dir(tmp_path, "audit_train.py", 2, "cpu")
    launched = runs.new_run_dir(tmp_path, "audit_torchrun_train.py", "N", "cpu")
    assert launched.name.startswith("audit_torchrun_train.py_Nxcpu_")
    assert sorted(runs.run_folders(tmp_path)) == sorted([script, launched])
    assert "holds 2 runs" in runs.disk_line(launched)
