"""One row of the CLI table: a subcommand, its options dataclass, what runs it, what prints it.

The CLI (`verify/cli/__init__.py`) only parses (flags derived from `options`, see
`flags.py`), calls `run(options)`, prints `text(result)` or `result.to_dict()` as JSON,
writes `text(result)` into the result's folder as `<report>.txt` when the command keeps one,
and exits with the code of `result.verdict` ("pass" 0, "fault" 1, "timeout" 2). Every result
type has a `verdict` field and a `to_dict()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A subcommand.

    Attributes:
        name: `python -m verify <name>`.
        help: one line for `python -m verify --help`.
        options: the options dataclass its flags come from (None: no options, `list`).
        run: `run(options) -> result`; raises ValueError for input it cannot run (exit 2).
        text: `text(result) -> str`, the human-readable report.
        conflicts: pairs of options fields whose flags cannot be given together.
        script: takes a script and its arguments after `--` (`hang --nproc N -- train.py`).
        fixed: options the CLI sets from other flags: `fixed(args) -> dict` (e.g. where a
            script's output goes under --json).
        report: the name of the text report the CLI writes into the result's folder
            (`report_dir`, else `run_dir`) as `<report>.txt`: what the command printed, kept
            beside the `<report>.json` the run wrote. None: no folder, no file.
    """

    name: str
    help: str
    options: type | None
    run: Callable[[Any], Any]
    text: Callable[[Any], str]
    conflicts: tuple[tuple[str, str], ...] = ()
    script: bool = False
    fixed: Callable[[Any], dict] | None = None
    report: str | None = None
