"""The record every faulty implementation carries: which check must catch it, and where.

A faulty implementation is a class decorated with `@fault(name, caught_by=..., shows_on=...)`.
The decorator only records a `Fault` in `FAULTS`, which the detection matrix
(`python -m verify faults`) and its test read; `impls.registry` builds `faulty:<name>` from
each record (through `impls.recipes.from_class`, so it is built exactly as a user's class
would be). This module imports nothing of the registry's: the import runs one way.

The class docstring is the documentation: its first paragraph says what is wrong, a paragraph that
starts with "Symptom:" says what goes wrong in training, and the text says why the named check
is the one that sees it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

#: the checks a fault can name: the two columns of the certification matrix, and the shard
#: check (each rank's optimizer state against 1/N of the unsharded state)
CHECKS = ("consistency", "equivalence", "shard")


@dataclass(frozen=True)
class Fault:
    """One deliberately broken implementation.

    Attributes:
        name: the registered name, `faulty:<name>`.
        cls: the class (a DDP wrapper or a sharded optimizer).
        caught_by: the check that must report it (one of CHECKS).
        shows_on: keys of the matrix behaviours (rows, `verify.checks.behaviours`) on which
            it shows; the detection matrix runs those.
        sanitize: a race on an async collective, caught on every run only under the race
            sanitizer (`--sanitize`); the detection matrix runs it sanitized.
    """

    name: str
    cls: type
    caught_by: str
    shows_on: tuple[str, ...]
    sanitize: bool = False

    @property
    def bug(self) -> str:
        """The docstring's first paragraph: what is wrong."""
        return " ".join(_doc(self.cls).split("\n\n", 1)[0].split())

    @property
    def symptom(self) -> str:
        for paragraph in _doc(self.cls).split("\n\n"):
            if paragraph.startswith("Symptom:"):
                return " ".join(paragraph.removeprefix("Symptom:").split())
        return ""


FAULTS: dict[str, Fault] = {}


def fault(name: str, *, caught_by: str, shows_on: tuple[str, ...], sanitize: bool = False):
    """Record the decorated class in `FAULTS` as `faulty:<name>` (see the module docstring).
    Returns the class unchanged."""
    if caught_by not in CHECKS:
        raise ValueError(f"caught_by must be one of {CHECKS}, got {caught_by!r}")
    full_name = f"faulty:{name}"

    def record(cls: type) -> type:
        if not _doc(cls).count("Symptom:"):
            raise ValueError(f"{cls.__name__}: the docstring must have a 'Symptom:' paragraph")
        if full_name in FAULTS:
            raise ValueError(f"{full_name} is already in the catalogue")
        FAULTS[full_name] = Fault(full_name, cls, caught_by, tuple(shows_on), sanitize)
        return cls

    return record


def _doc(cls: type) -> str:
    return inspect.getdoc(cls) or ""
