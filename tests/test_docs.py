"""Every example in README.md and docs/ checked against the tool, so a drifted example fails.

Covered, in-process (no ranks; the whole file parses in well under a second):

- every `python -m verify ...` command shown (in a ```text block after `$ `, or in a ```bash
  block) parses and builds its options: its flags, its registered names, the files it names;
- `list`: its output, line by line;
- every bad-input example (one line on stderr, exit 2, before any rank starts): run, and its
  message compared;
- the first line of every `consistency`, `equivalence` and `hang` example (what ran: the
  implementation, workload, world size, steps, bucket size) against what its options print;
- every `matrix` example's rows (in order) and its n/a cells, which the options decide;
- every `python benchmarks/X.py ...` (the tool's measurements of itself, a maintainer's
  scripts) parses with that script's flags, and no doc runs them as `python -m verify`.

Run for real: the commands of `doc_excerpts.REAL` (a few launches, seconds each; the matrix
ones as one matrix run), each compared with every excerpt of it, in any doc, on what matters:
rows, verdict, finding, hint and note lines, without times and what depends on the machine
(`doc_excerpts.essence`). When an output changes on purpose, `python -m tests.doc_excerpts
--write` re-runs them and pastes the real output into the docs.

Not covered: the other real runs' tables and findings (their first line and their command
are), the measurement commands' outputs, the torchrun example, a refusal that needs ranks to
start, and the examples naming a file the guide shows but the repository does not hold
(`group_ddp.py`). In a doc's output, a line `...` stands for any lines, and `...` inside a
line for any text.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from tests.doc_excerpts import DOCS, REAL, ROOT, drift, examples, matches, matrix_outputs
from verify.cli import UsageError, main, parse
from verify.cli.text_checks import header

NOT_IN_REPO = ("group_ddp.py",)  # shown in the guide as code, not shipped
# how the guides' ```bash blocks name the reader's own files: not files to run
PLACEHOLDERS = ("path/to/", "mypkg.", "-- train.py")

EXAMPLES = [
    e
    for e in examples()
    if not any(f in " ".join(e.argv) for f in NOT_IN_REPO)
    and (e.output or not any(f in " ".join(e.argv) for f in PLACEHOLDERS))
]


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
    if "cuda" in argv and not torch.cuda.is_available():
        # A GPU run's example: here its flags are refused for want of a GPU, and only that.
        with pytest.raises(ValueError, match="needs a GPU|needs one GPU per rank"):
            parse(argv)
        pytest.skip("a GPU run: parsed where there is a GPU")
    _, options, _ = parse(argv)  # raises on a flag, name or file that no longer exists
    first = next((line for line in out if line.startswith(("consistency:", "equivalence:",
                                                            "hang check:"))), None)  # fmt: skip
    if first is not None and options is not None:
        shown = re.sub(r" \(\d+(\.\d+)?s\)$", "", first)  # hang prints its time after it
        assert shown == header(options), f"{example}\n  docs: {shown}\n  tool: {header(options)}"
    # (a command in a ```bash block, or one whose output has no such line: it parses)


def _excerpts(command: str) -> list:
    found = [e for e in EXAMPLES if e.output and e.command == command]
    assert found, f"no excerpt of {command} in the docs: take it out of doc_excerpts.REAL"
    return found


def _agree(command: str, real: list[str]) -> None:
    """Every excerpt of `command` against its real output, on what matters (doc_excerpts)."""
    drifted = {str(e): drift(list(e.output), real) for e in _excerpts(command)}
    drifted = {where: d for where, d in drifted.items() if d}
    assert not drifted, "\n".join(
        [f"{w}: drifted (python -m tests.doc_excerpts --write rewrites it)\n" + "\n".join(d)
         for w, d in drifted.items()] + ["real output:", *real]
    )  # fmt: skip


SINGLE_RUNS = [c for c in REAL if not c.startswith("matrix ")]
MATRIX_RUNS = [c for c in REAL if c.startswith("matrix ")]


@pytest.mark.parametrize("command", SINGLE_RUNS)
def test_an_excerpt_says_what_a_real_run_says(command, at_root, capsys):
    """A verdict's excerpt, run for real (one launch): its table, findings, hints, notes and
    verdict, as `doc_excerpts.essence` reads them."""
    main(shlex.split(command))
    _agree(command, capsys.readouterr().out.splitlines())


def test_the_matrix_excerpts_say_what_a_real_matrix_says(at_root):
    """The guides' matrices of one class each, from one real matrix run of all of them
    (`doc_excerpts.matrix_outputs`): rows, statuses, failures and their hints, claims, the
    verdict and its counts."""
    for command, real in matrix_outputs(MATRIX_RUNS).items():
        _agree(command, real)


def _table(output: tuple[str, ...]) -> list[list[str]]:
    """A matrix excerpt's rows, split into cells (a `...` row kept as one cell); [] when it
    shows no table."""
    lines = list(output)
    rule = next((i for i, line in enumerate(lines) if line.startswith("---")), len(lines))
    rows = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


MATRIX_EXCERPTS = [e for e in EXAMPLES if e.argv[0] == "matrix" and e.output
                   and "--json" not in e.argv]  # fmt: skip


@pytest.mark.parametrize("example", MATRIX_EXCERPTS, ids=str)
def test_a_matrix_excerpt_shows_the_rows_the_tool_prints(example, at_root):
    """Every matrix excerpt, without ranks: its rows are the command's rows, in order (a `...`
    row for any), and its n/a cells are the ones decided before any launch. (Drift seen: an
    excerpt of 22 rows where the tool prints 25.)"""
    from impls.registry import resolve
    from verify.checks.cells import not_applicable
    from verify.cli.text_matrix import COMPACT, SYMBOL

    argv = list(example.argv)
    if "cuda" in argv and not torch.cuda.is_available():  # the rows are the same on CPU ranks
        for flag in ("--device", "--backend"):
            if flag in argv:
                del argv[argv.index(flag) : argv.index(flag) + 2]
    _, options, _ = parse(argv)
    rows = _table(example.output)
    if not rows:
        return  # (an excerpt that shows the report's end only)
    titles = [b.title for b in options.behaviours]
    shown = [r[0] for r in rows]
    assert matches(shown, titles), f"{example}\n  docs: {shown}\n  tool: {titles}"
    by_title = {b.title: b for b in options.behaviours}
    impls = options.impl_names
    for row in (r for r in rows if r[0] in by_title):
        b = by_title[row[0]]
        for impl, cell in zip(impls, row[1:]) if len(impls) > 1 else [(impls[0], row[1:])]:
            checks = [c for c in options.checks if c != "shard" or resolve(impl).sharded]
            said = list(cell) if len(impls) > 1 else cell
            na = SYMBOL["n/a"] if len(impls) == 1 else COMPACT["n/a"]
            expected = [bool(not_applicable(resolve(impl), b, c)) for c in checks]
            assert [s == na for s in said] == expected, f"{example}: {impl} / {b.key}: {said}"


BENCHMARK = re.compile(r"python (benchmarks/(\w+)\.py)((?: [^`#\n]*)?)")
STALE = re.compile(r"verify bench-(audit|tracer|sanitize)")


def test_the_docs_run_the_benchmarks_as_the_scripts_they_are(at_root):
    """The tool's measurements of itself are a maintainer's scripts (`benchmarks/`): every
    `python benchmarks/X.py ARGS` the docs show parses with that script's flags, and no doc
    still runs them as `python -m verify bench-*`."""
    import importlib

    shown = 0
    for path in DOCS:
        text = path.read_text()
        assert not STALE.search(text), f"{path.name}: {STALE.search(text).group(0)}"
        for match in BENCHMARK.finditer(text):
            assert (ROOT / match.group(1)).is_file(), match.group(0)
            script = importlib.import_module(f"benchmarks.{match.group(2)}")
            argv = shlex.split(match.group(3))
            if "cuda" in argv and not torch.cuda.is_available():
                continue  # a GPU run's flags are refused here for want of a GPU (as above)
            parse(argv, script.COMMAND)  # raises on a flag or value that no longer exists
            shown += 1
    assert shown >= 8, shown


def test_the_comparison_skips_the_machine_and_sees_every_finding():
    """`doc_excerpts.drift` on a report and its variants: times, the thread note, collective
    numbers and column widths are not drift; a row, a note, a hint or a verdict's clause is."""
    real = [
        "consistency: x on buffers, world size 2, 3 steps",
        "",
        "checkpoint      tensors    mismatched    audit ms",
        "------------  ---------  ------------  ----------",
        "construction          9             1        17.6",
        "step 1                27             0         4.6",
        "",
        "hint: broadcast the buffers",
        "rank 0 [error]: Read error [127.0.0.1]:28805: Connection reset by peer",
        "note: --sanitize: 24 async collectives tracked, 0 operators checked while one was in flight",
        "note: ranks ran with 1 thread per rank (2 cores / 2 ranks)",
        "FAULT: all_reduce #23 differs: buffers were not broadcast  (2.8s)",
    ]
    noisy = [line.replace("17.6", "80.5").replace("#23", "#20") for line in real]
    noisy[4] = "construction     9    1    3"  # narrower columns, another time
    noisy[8] = "rank 0 [error]: Read error [127.0.0.1]:939: Connection closed by peer"
    noisy[10] = "note: ranks ran with 2 threads per rank (4 cores / 2 ranks)"
    noisy[11] = noisy[11].replace("(2.8s)", "(11.1s)")
    assert drift(noisy, real) == []
    for k in (5, 7, 9):  # a row, the hint, the sanitizer note: gone from the docs
        assert drift(real[:k] + real[k + 1 :], real), k
    clipped = real[:11] + ["FAULT: all_reduce #23 differs  (2.8s)"]
    assert drift(clipped, real)
    assert drift(["...", *real[7:]], real) == []  # a `...` line stands for any lines
