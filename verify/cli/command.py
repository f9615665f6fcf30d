"""One row of the CLI table: a subcommand, its options dataclass, what runs it, what prints it.

The CLI (`verify/cli/__init__.py`) only parses (flags derived from `options`, see
`flags.py`), calls `run(options)`, prints `text(result)` or `result.to_dict()` as JSON,
writes `text(result)` into the result's folder as `<report>.txt` when the command keeps one,
and exits with the code of `result.verdict` ("pass" 0, "fault" 1, "timeout" 2). Every result
type has a `verdict` field and a `to_dict()`.

A row names its options, its runner and its printer as strings, `"package.module:name"`, and
the CLI imports them on dispatch: `python -m verify list` and `--help` import only what they
show, not every checker and measurement (tests/test_imports.py reads these strings as imports,
so a circle through them is still found).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def load(reference: str) -> Any:
    """The object a `"package.module:name"` reference names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Command:
    """A subcommand.

    Attributes:
        name: `python -m verify <name>`.
        help: one line for `python -m verify --help`.
        options: `"module:Class"`, the options dataclass its flags come from (None: no
            options, `list`).
        run: `"module:function"`, `run(options) -> result`; raises ValueError for input it
            cannot run (exit 2). None for a command without options (it only prints).
        text: `"module:function"`, `text(result) -> str`, the human-readable report.
        conflicts: pairs of options fields whose flags cannot be given together.
        script: takes a script and its arguments after `--` (`hang --nproc N -- train.py`).
        fixed: options the CLI sets from other flags: `fixed(args) -> dict` (e.g. where a
            script's output goes under --json).
        positional: the options field that takes the positional arguments
            (`compare DIR_A DIR_B`: `recordings`), None: none.
        report: the name of the text report the CLI writes into the result's folder
            (`report_dir`, else `run_dir`) as `<report>.txt`: what the command printed, kept
            beside the `<report>.json` the run wrote. None: no folder, no file.
    """

    name: str
    help: str
    options: str | None
    run: str | None
    text: str
    conflicts: tuple[tuple[str, str], ...] = ()
    script: bool = False
    fixed: Callable[[Any], dict] | None = None
    report: str | None = None
    positional: str | None = None

    def options_class(self) -> type | None:
        """The options dataclass (imported now), or None for a command without options."""
        return None if self.options is None else load(self.options)

    def runner(self) -> Callable[[Any], Any]:
        """`run(options) -> result` (imported now)."""
        assert self.run is not None, f"{self.name} has no options to run with"
        return load(self.run)

    def printer(self) -> Callable[[Any], str]:
        """`text(result) -> str` (imported now)."""
        return load(self.text)
