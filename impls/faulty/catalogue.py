"""The record every faulty implementation carries: which check must catch it, and where.

A faulty implementation is a class decorated with `@fault(name, caught_by=..., shows_on=...)`.
The decorator registers it as `faulty:<name>` (through `impls.registry.from_class`, so it is
built exactly as a user's class would be) and records a `Fault` in `FAULTS`, which the
detection matrix (`python -m verify faults`) and its test read.

The class docstring is the documentation: its first paragraph says what is wrong, a paragraph that
starts with "Symptom:" says what goes wrong in training, and the text says why the named check
is the one that sees it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from impls.registry import from_class, register

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
        shows_on: keys of the matrix behaviours (rows, `verify.matrix.BEHAVIOURS`) on which
            it shows; the detection matrix runs those.
    """

    name: str
    cls: type
    caught_by: str
    shows_on: tuple[str, ...]

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


def fault(name: str, *, caught_by: str, shows_on: tuple[str, ...]):
    """Register the decorated class as `faulty:<name>` (see the module docstring)."""
    if caught_by not in CHECKS:
        raise ValueError(f"caught_by must be one of {CHECKS}, got {caught_by!r}")

    def register_class(cls: type) -> type:
        if not _doc(cls).count("Symptom:"):
            raise ValueError(f"{cls.__name__}: the docstring must have a 'Symptom:' paragraph")
        impl = register(from_class(cls, name=f"faulty:{name}", source="faulty"))
        FAULTS[impl.name] = Fault(impl.name, cls, caught_by, tuple(shows_on))
        return cls

    return register_class


def _doc(cls: type) -> str:
    return inspect.getdoc(cls) or ""
