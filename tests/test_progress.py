"""Progress on stderr: one line rewritten in place on a terminal; in a log (a file, a pipe,
CI), a task's start, restart and end and a line every few seconds, not one a message; n of m
and an estimate of the time left once there is a pace to go by (verify/progress.py).

In-process, no ranks (milliseconds), but for one real `matrix` launch (15 cells) whose
stderr is a real file, and then a real pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import sys
import threading
import time

import pytest

from verify import progress
from verify.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_gap(monkeypatch):
    """Every message of a log written, as before lines were thinned (for the estimates)."""
    monkeypatch.setattr(progress, "MIN_GAP_S", 0.0)
    monkeypatch.setattr(progress, "GAP_SHARE", 0.0)


def _say_three_steps(stream: io.StringIO) -> None:
    progress.enable(stream)
    try:
        for step in (1, 2, 3):
            progress.say("consistency naive on mlp: step ", step, 3)
            time.sleep(0.01)
    finally:
        progress.disable()


def test_plain_lines_with_estimates_when_stderr_is_not_a_terminal(no_gap):
    out = io.StringIO()
    _say_three_steps(out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue() and "\033" not in out.getvalue()
    assert lines[0].endswith("step 1/3")  # no pace yet: no estimate
    assert lines[1].endswith("s left)") and "step 2/3  (" in lines[1], lines[1]
    assert lines[2].endswith("step 3/3")  # done: nothing left to estimate


def test_a_log_gets_starts_restarts_ends_and_a_line_a_gap(monkeypatch):
    """Two tasks side by side (two world sizes of a matrix), 150 messages in ~1.5 s, with a
    gap of 0.3 s: each task's first and last count, the restart of one (a fresh launch), a
    routine line about every 0.3 s, and at the end the newest line held back."""
    monkeypatch.setattr(progress, "MIN_GAP_S", 0.3)
    out = io.StringIO()
    progress.enable(out)
    start = time.monotonic()
    try:
        for k in range(1, 101):
            progress.say("matrix, world size 2: cell ", k, 100, ": naive / frozen / consistency")
            if k <= 40:
                progress.say(
                    "matrix, world size 3: cell ", k, 40, ": naive / world-3 / consistency"
                )
            time.sleep(0.01)
        progress.say("matrix, world size 2: cell ", 1, 9, ": naive / tied / consistency")  # again
        progress.say("matrix, world size 2: cell ", 2, 9, ": naive / tied / equivalence")  # held
        elapsed = time.monotonic() - start
    finally:
        progress.disable()
    lines = [re.sub(r"^\[\s*\d+s\] matrix, ", "", line) for line in out.getvalue().splitlines()]
    counts = [re.search(r"cell (\d+/\d+)", line).group(1) for line in lines]
    for shown in ("1/100", "100/100", "1/40", "40/40", "1/9"):
        assert shown in counts, lines
    assert counts[-1] == "2/9", lines  # held back, then written when progress stopped
    routine = len(lines) - 6
    assert 1 <= routine <= elapsed / 0.3 + 1, lines
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()


def test_one_line_rewritten_in_place_on_a_terminal_and_cleared_at_the_end():
    out = _Terminal()
    _say_three_steps(out)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r\033[K") == 4, repr(text)  # 3 lines, 1 clear
    assert text.endswith("\r\033[K")


def test_silent_unless_enabled():
    out = io.StringIO()
    progress.say("nobody hears this: ", 1, 2)
    assert out.getvalue() == "" and not progress.enabled()


def test_a_count_is_given_never_read_out_of_the_text(no_gap):
    """A message whose text happens to hold "k/n" (a path, a ratio) is no count: no estimate,
    and no task of the same name is disturbed by it."""
    out = io.StringIO()
    progress.enable(out)
    try:
        for step in (1, 2, 3):
            progress.say("train: step ", step, 4)
            progress.say(f"reading runs/2025-{step}/4.json")  # digits/digits: not a count
            time.sleep(0.01)
    finally:
        progress.disable()
    lines = out.getvalue().splitlines()
    assert [s.split("] ", 1)[1] for s in lines[1::2]] == [
        "reading runs/2025-1/4.json", "reading runs/2025-2/4.json", "reading runs/2025-3/4.json"
    ], lines  # fmt: skip
    assert "train: step 3/4  (" in lines[4] and lines[4].endswith("s left)"), lines


# --- real runs: naive's consistency on 15 rows of world size 2, in one launch ----------------

# (the optimizer rows are n/a for a DDP wrapper: decided in the parent, never run, never said)
ROWS = "world-2,frozen,tied,unused-everywhere,buffers,mixed,no-sync,no-sync-unused,keep-grads,"
ROWS += "one-bucket,bucket-per-param,several-buckets,bf16,bf16-compute,model-round-trip"
MATRIX = ["matrix", "--impl", "naive", "--checks", "consistency", "--rows", ROWS]


def _matrix_with_stderr(stream, monkeypatch) -> tuple[int, float]:
    """`python -m verify matrix ...` in this process, its stderr `stream`: exit code, seconds."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "stderr", stream)
    start = time.monotonic()
    code = main(MATRIX)
    return code, time.monotonic() - start


def test_a_real_matrix_logged_to_a_file_writes_a_few_lines(tmp_path, monkeypatch, capsys):
    """Before: one line a cell (15 here, 564 for `matrix --impl all`)."""
    with open(tmp_path / "stderr.log", "w") as log:
        code, elapsed = _matrix_with_stderr(log, monkeypatch)
    assert code == 0, capsys.readouterr().out
    lines = (tmp_path / "stderr.log").read_text().splitlines()
    assert all(re.match(r"\[\s*\d+s\] matrix, world size 2: cell \d+/15: ", s) for s in lines)
    assert "cell 1/15:" in lines[0] and "cell 15/15:" in lines[-1], lines
    assert len(lines) <= 2 + elapsed / 5.0, lines  # (5 s: progress.MIN_GAP_S)
    assert "PASS: 12 pass, 3 not claimed" in capsys.readouterr().out


def test_a_real_matrix_on_a_terminal_rewrites_one_line(monkeypatch, capsys):
    """Every cell's line, each rewriting the last, and the line cleared before the report."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:  # a pseudo-terminal's buffer is small: drain it while the run writes
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the slave side is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    terminal = os.fdopen(slave, "w")
    try:
        assert terminal.isatty()
        code, _ = _matrix_with_stderr(terminal, monkeypatch)
    finally:
        monkeypatch.undo()  # sys.stderr back before the pseudo-terminal closes
        terminal.close()
        reader.join(timeout=10)
        os.close(master)
    assert code == 0, capsys.readouterr().out
    text = b"".join(chunks).decode()
    assert "\n" not in text, repr(text)  # (a pty would have turned any into \r\n)
    shown = [s for s in text.split("\r\033[K") if s]
    assert [re.search(r"cell (\d+)/15", s).group(1) for s in shown] == [
        str(k) for k in range(1, 16)
    ], shown
    assert text.endswith("\r\033[K")  # cleared: the report starts on a clean line
