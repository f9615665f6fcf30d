"""Every example in README.md and docs/ checked against the tool, so a drifted example fails.

Covered, in-process (no ranks; the whole file parses in well under a second):

- every `python -m verify ...` command shown (in a ```text block after `$ `, or in a ```bash
  block) parses and builds its options: its flags, its registered names, the files it names;
- `list`: its output, line by line;
- every bad-input example (one line on stderr, exit 2, before any rank starts): run, and its
  message compared;
- the first line of every `consistency`, `equivalence` and `hang` example (what ran: the
  implementation, workload, world size, steps, bucket size) against what its options print.

Run for real (one launch, a few seconds): README's class that forgets its buffers, compared
on everything that does not depend on the machine (the checkpoint table without its timing
column, the mismatch table, the hint, the verdict without its time).

Not covered: the numbers and timings of the other real runs (they depend on the machine and
its load; their first line and their command are covered), the measurement commands' outputs,
the torchrun example, a refusal that needs ranks to start, and the examples naming a file the
guide shows but the repository does not hold (`group_ddp.py`). In a doc's output, a line
`...` stands for any lines, and `...` inside a line for any text.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from verify.cli import UsageError, main, parse
from verify.cli.text_checks import header

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_IN_REPO = ("group_ddp.py",)  # shown in the guide as code, not shipped
# how the guides' ```bash blocks name the reader's own files: not files to run
PLACEHOLDERS = ("path/to/", "mypkg.", "-- train.py")
PREFIX = "python -m verify "


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    argv: tuple[str, ...]
    output: tuple[str, ...]  # () for a command in a ```bash block

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.argv)}"


def examples() -> list[Example]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        fence, i = None, 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                fence = None if fence else (line[3:].strip() or "plain")
            elif fence == "text" and line.startswith("$ "):
                out = []
                j = i + 1
                while j < len(lines) and not lines[j].startswith(("$ ", "```")):
                    out.append(lines[j])
                    j += 1
                if line[2:].startswith(PREFIX):
                    found.append(_example(path, i, line[2 + len(PREFIX) :], tuple(out)))
                i = j
                continue
            elif fence == "bash" and PREFIX in line:
                command = line[line.index(PREFIX) + len(PREFIX) :]
                command = re.split(r"\s+#|\s+&&|;", command)[0]
                found.append(_example(path, i, command, ()))
            i += 1
    return found


def _example(path: Path, index: int, command: str, output: tuple[str, ...]) -> Example:
    return Example(str(path.relative_to(ROOT)), index + 1, tuple(shlex.split(command)), output)


EXAMPLES = [
    e
    for e in examples()
    if not any(f in " ".join(e.argv) for f in NOT_IN_REPO)
    and (e.output or not any(f in " ".join(e.argv) for f in PLACEHOLDERS))
]


def matches(doc: list[str], real: list[str]) -> bool:
    """`real` against `doc`, where a `...` line is any lines and `...` in a line any text."""
    if not doc:
        return not real
    if doc[0].strip() == "...":
        return any(matches(doc[1:], real[k:]) for k in range(len(real) + 1))
    pattern = ".*".join(map(re.escape, doc[0].split("...")))
    return bool(real) and re.fullmatch(pattern, real[0]) is not None and matches(doc[1:], real[1:])


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # torchrun's would change defaults
    monkeypatch.delenv("RANK", raising=False)


def test_the_docs_hold_examples():
    """The parser finds them (a change of the docs' format must not silence this file)."""
    assert len(EXAMPLES) > 60
    assert any(e.argv == ("list",) for e in EXAMPLES)
    assert sum(bool(e.output) and e.output[0].startswith("verify: error:") for e in EXAMPLES) >= 5


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_every_example_parses_and_says_what_the_docs_show(example, at_root, capsys):
    argv, out = list(example.argv), list(example.output)
    if argv == ["list"]:
        assert main(argv) == 0
        real = capsys.readouterr().out.splitlines()
        assert matches(out, real), "\n".join(real)
        return
    if out and out[0].startswith("verify: error:"):
        try:
            parse(argv)
        except (UsageError, ValueError) as exc:
            assert matches(out[:1], [f"verify: error: {exc}"]), f"verify: error: {exc}"
            return
        pytest.skip("refused only once ranks run: not checked here")  # (none in the docs now)
    _, options, _ = parse(argv)  # raises on a flag, name or file that no longer exists
    first = next((line for line in out if line.startswith(("consistency:", "equivalence:",
                                                            "hang check:"))), None)  # fmt: skip
    if first is not None and options is not None:
        shown = re.sub(r" \(\d+(\.\d+)?s\)$", "", first)  # hang prints its time after it
        assert shown == header(options), f"{example}\n  docs: {shown}\n  tool: {header(options)}"
    # (a command in a ```bash block, or one whose output has no such line: it parses)


def _stable(lines: list[str]) -> list[str]:
    """Without what depends on the machine: the thread note, times, the audit ms column."""
    out, in_table = [], False
    for line in lines:
        if line.startswith("note: ranks ran with"):
            continue
        line = re.sub(r"  \(\d+(\.\d+)?s\)$", "", line)
        if line.startswith("checkpoint ") and line.rstrip().endswith("audit ms"):
            in_table = True
        if in_table and not line.strip():
            in_table = False
        if in_table:
            line = "|".join(re.split(r"\s{2,}", line.strip())[:-1])
        out.append(line)
    return out


def test_a_verdict_example_runs_as_the_readme_shows(at_root, capsys):
    (example,) = [e for e in EXAMPLES if e.doc == "README.md" and "ForgotBuffersDDP" in str(e)]
    assert main(list(example.argv)) == 1
    real = capsys.readouterr().out.splitlines()
    assert _stable(list(example.output)) == _stable(real), "\n".join(real)
