"""The docs' examples, parsed; what of an example's output must agree with a real run; and the
maintainer's command that re-runs the examples checked for real, after an output changed.

    python -m tests.doc_excerpts                  # re-run every command in REAL, show each drift
    python -m tests.doc_excerpts matrix           # only the commands that contain "matrix"
    python -m tests.doc_excerpts --write [TEXT]   # and paste each real output into the docs

(from the repository's root, in its environment). A command runs once, for real (`python -m
verify ...`, its stdout), and is compared with every excerpt of it in README.md and docs/.
`--write` replaces an excerpt's output whole when the excerpt elides nothing (no `...` line);
one that elides lines is left to a hand edit, and the real output is printed to paste from.

What is compared (`essence`): the first line (what ran); every table's rows, cell by cell,
whatever the column widths (the matrix's rows and statuses, the audit's checkpoints and
mismatches), without a timing column (`audit ms`); the verdict lines (`PASS:`, `FAULT:`,
`CRASH:`...), `hint:` and `note:` lines, and the entries under `failures:`, `not claimed:`,
`n/a:` and `findings`. Masked there: the run's time after the verdict (`(7s, 7 launches)`) and
collective numbers (`#227`: a count of every collective the launch issued, which moves
whenever a row or the audit adds one), the sanitizer note's two counts (in a run that
crashed, they say how far the ranks got first), and where a crashed cell's rank was when the
launch ended (`(at finish_gradient_synchronization (...))`: the wait, or the next op, as the
crash's timing falls). Not compared: the thread note (the machine's cores),
the report folder and disk lines (a time stamp), and a diagnosis's detail lines (each rank's
state, the backend's own wording, stderr tails, detection times): they depend on the machine,
its load and the order ranks die in.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = "python -m verify "

#: The commands run for real (tests/test_docs.py runs them on every test run, so each is a
#: cheap one: one to seven launches, seconds on an idle machine): every excerpt of each, in
#: any doc, is compared with the real output. The `matrix` ones run as one matrix in the test
#: (`matrix_outputs`), each as its own command here.
REAL = (
    "consistency --impl zero1 --world-size 3 --workload unused --steps 2",
    "consistency --impl docs/examples/forgot_buffers_ddp.py:ForgotBuffersDDP --workload buffers",
    "consistency --impl docs/examples/student_ddp.py:StudentDDP --workload unused",
    "matrix --impl docs/examples/student_ddp.py:StudentDDP",
    "matrix --impl tests/fixtures/third_party/cs336_style.py:DDPBucketed",
    "matrix --impl tests/fixtures/third_party/cs336_style.py:DDPBucketedFloat32Buffer "
    "--rows world-2,mixed,bf16",
    "matrix --impl tests/fixtures/third_party/cs336_style.py:ShardedOptimizerDotOptimizer "
    "--rows world-2,param-groups,add-param-group,scheduler,round-trip,more-ranks-than-params",
    "matrix --impl tests/fixtures/third_party/cs336_style.py:ShardedOptimizerInopt "
    "--rows world-2,param-groups,scheduler,round-trip",
)


@dataclass(frozen=True)
class Example:
    doc: str
    line: int  # of the `$ ` line, from 1
    argv: tuple[str, ...]
    output: tuple[str, ...]  # () for a command in a ```bash block

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.argv)}"

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def examples() -> list[Example]:
    """Every `python -m verify` command in the docs: after `$ ` in a ```text block (with the
    output that follows it), or anywhere in a ```bash block (without)."""
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


def matches(doc: list[str], real: list[str]) -> bool:
    """`real` against `doc`, where a `...` line is any lines and `...` in a line any text."""
    if not doc:
        return not real
    if doc[0].strip() == "...":
        return any(matches(doc[1:], real[k:]) for k in range(len(real) + 1))
    pattern = ".*".join(map(re.escape, doc[0].split("...")))
    return bool(real) and re.fullmatch(pattern, real[0]) is not None and matches(doc[1:], real[1:])


# --- what matters ----------------------------------------------------------------------------

_VERDICT = re.compile(r"[A-Z][A-Z ]*[A-Z]: ")  # PASS:, FAULT:, NOTHING CERTIFIED:, CRASH: ...
_SECTIONS = ("failures:", "not claimed:", "n/a:", "findings")
_DROPPED = ("note: ranks ran with", "report:", "disk:")
_TIMING = ("audit ms",)  # a table's column that is a time
_RULE = re.compile(r"-+( +-+)*")
# how far ranks got before one crashed (or the timing of a race) sets these two counts
_SANITIZER_COUNTS = re.compile(r"(note: --sanitize: )\d+( async collectives tracked, )\d+( )")


def essence(lines: list[str]) -> list[str]:
    """What of a report an excerpt must show as a real run does (module docstring); a `...`
    line stays, to stand for any lines."""
    out: list[str] = []
    section, table, timed = None, False, False
    for i, line in enumerate(lines):
        s = line.strip()
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if s == "...":
            out.append("...")
        elif i == 0:
            out.append(_masked(line))  # what ran
        elif s and _RULE.fullmatch(following):  # a table's header
            table, timed = True, s.endswith(_TIMING)
            out.append(_row(s, timed))
        elif table and s:
            if not _RULE.fullmatch(s):
                out.append(_row(s, timed))
        else:
            table = False
            if line and not line[0].isspace():
                section = s if s.startswith(_SECTIONS) else None
            if s.startswith(_DROPPED):
                continue
            if (
                _VERDICT.match(s)
                or s.startswith(("hint:", "note:"))
                or section is not None
                and (s == section or line.startswith(" "))
            ):
                out.append(_masked(line.rstrip()))
    return out


def _row(line: str, timed: bool) -> str:
    cells = re.split(r"\s{2,}", line)
    return " | ".join(cells[:-1] if timed else cells)


def _masked(line: str) -> str:
    line = re.sub(r"\s+\(\d+(\.\d+)?s(, [^()]*)?\)$", "", line)  # the run's time, its launches
    line = re.sub(_SANITIZER_COUNTS, r"\1N\2N\3", line)
    # Where a rank died: which line, and whether one is named at all, depends on how far the
    # ranks got before the launch was ended (a CI run printed none where the docs show one).
    line = re.sub(r" \(at [^()]*(\([^()]*\)[^()]*)*\)$", "", line)
    return re.sub(r"#\d+", "#N", line)  # collective numbers


def drift(doc: list[str], real: list[str]) -> list[str]:
    """The lines of `essence`, doc against real, where they part ([] when they agree)."""
    want, got = essence(doc), essence(real)
    if matches(want, got):
        return []
    import difflib

    return list(difflib.unified_diff(want, got, "docs", "real run", lineterm="", n=1))


# --- the real runs ---------------------------------------------------------------------------


def matrix_outputs(commands: list[str]) -> dict[str, list[str]]:
    """What each `matrix` command of `commands` prints, from ONE matrix run of all their
    implementations on all their rows (in this process): a cell's verdict does not depend on
    the cells beside it in a launch (`verify/checks/matrix.py`), and one run costs a few
    launches where one a command would cost several each. Only the run's time, its launch
    count and collective numbers differ from running each command alone, and `essence`
    masks them. Every command must take the same options but for --impl and --rows."""
    from verify.checks.matrix import MatrixResult, run_matrix
    from verify.cli import parse

    parsed = {c: parse(shlex.split(c)) for c in commands}
    options = [o for _, o, _ in parsed.values()]
    rows = () if any(not o.rows for o in options) else tuple(r for o in options for r in o.rows)
    impls = tuple(i for o in options for i in o.impls)
    merged = replace(options[0], impls=tuple(dict.fromkeys(impls)), rows=tuple(dict.fromkeys(rows)))
    for o in options:
        assert replace(o, impls=merged.impls, rows=merged.rows) == merged, o
    result = run_matrix(merged)
    out = {}
    for c, (command, o, _) in parsed.items():
        keys = {b.key for b in o.behaviours}
        cells = {k: r for k, r in result.results.items() if k[0] in o.impls and k[1] in keys}
        alone = MatrixResult(o, cells, result.elapsed_s, result.launches)
        out[c] = command.printer()(alone).splitlines()
    return out


def run_for_real(command: str) -> list[str]:
    """`python -m verify COMMAND` in a fresh interpreter, from the repository's root: stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "verify", *shlex.split(command)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    return proc.stdout.splitlines()


def excerpts_of(command: str) -> list[Example]:
    return [e for e in examples() if e.output and e.command == shlex.join(shlex.split(command))]


def write(example: Example, real: list[str]) -> None:
    """The real output in place of `example`'s, in its doc."""
    path = ROOT / example.doc
    lines = path.read_text().splitlines()
    assert lines[example.line - 1].startswith(f"$ {PREFIX}"), example
    lines[example.line : example.line + len(example.output)] = real
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    """The command line of the module docstring: 1 when some excerpt drifted (and was not
    written), else 0."""
    writing = "--write" in argv
    wanted = [a for a in argv if a != "--write"]
    drifted = 0
    for command in REAL:
        if wanted and not any(w in command for w in wanted):
            continue
        print(f"$ python -m verify {command}", flush=True)
        real = run_for_real(command)
        left = 0  # excerpts of this command that drifted and were not written
        # from the bottom of each doc up, so that writing one keeps the others' line numbers
        for example in sorted(excerpts_of(command), key=lambda e: (e.doc, -e.line)):
            diff = drift(list(example.output), real)
            if not diff:
                print(f"  {example.doc}:{example.line}: agrees")
            elif writing and not any(s.strip() == "..." for s in example.output):
                write(example, real)
                print(f"  {example.doc}:{example.line}: written")
            else:
                left += 1
                print(f"  {example.doc}:{example.line}: drifted")
                print("\n".join(f"    {d}" for d in diff))
        drifted += left
        if left:
            print("  real output:\n" + "\n".join(f"    {s}" for s in real))
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
