"""Progress on stderr: one line rewritten in place on a terminal, plain lines elsewhere, with
n of m and an estimate of the time left once there is a pace to go by (verify/progress.py).
In-process, no ranks: milliseconds."""

from __future__ import annotations

import io
import time

from verify import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _say_three_steps(stream: io.StringIO) -> None:
    progress.enable(stream)
    try:
        for step in (1, 2, 3):
            progress.say(f"consistency naive on mlp: step {step}/3")
            time.sleep(0.01)
    finally:
        progress.disable()


def test_plain_lines_when_stderr_is_not_a_terminal():
    out = io.StringIO()
    _say_three_steps(out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue() and "\033" not in out.getvalue()
    assert lines[0].endswith("step 1/3")  # no pace yet: no estimate
    assert lines[1].endswith("s left)") and "step 2/3  (" in lines[1], lines[1]
    assert lines[2].endswith("step 3/3")  # done: nothing left to estimate


def test_one_line_rewritten_in_place_on_a_terminal_and_cleared_at_the_end():
    out = _Terminal()
    _say_three_steps(out)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r\033[K") == 4, repr(text)  # 3 lines, 1 clear
    assert text.endswith("\r\033[K")


def test_silent_unless_enabled():
    out = io.StringIO()
    progress.say("nobody hears this: 1/2")
    assert out.getvalue() == "" and not progress.enabled()
