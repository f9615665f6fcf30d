"""What a user's script's rank runs around the script when the job asks for it: its set-ups.

The runtime knows none of them: a plug-in (the race sanitizer, the replica audit, the
rehearsal on the CPU) writes its set-up in a module of its own, and the front end names it
in the job (`verify/plugins.py`). A set-up travels as a `SetUp`, its class named as
"package.module:Class" with the keyword settings it is made with: small picklable data (the
job, `RankJob.setups`), and plain JSON in the environment of a launcher command's processes
(`to_env`, `from_env`), so that neither the launcher form's start (which imports no torch)
nor this module imports a plug-in. The class is imported in the rank, when it starts.

A set-up made from its settings has one method, `start(rank, folder)`, called once the
rank's tracer and helper thread are in and before the script imports anything from
`torch.distributed`, in the job's order (the rehearsal last: its wrappers then sit over the
sanitizer's and the audit's, which see the gloo the script is given, not the NCCL it asked
for); its files go to `folder` under the rank. `start` returns what is running: a
`finish(exc)` that saves what it found and returns its reading of the failure `exc` (None
when the script ended cleanly), for the rehearsal the call it could not map, a usage error;
None for the others. `finish` is called once, after a crash too; it never raises. A set-up
whose class says `reads_failures = True` reads a failure itself (the rehearsal): the rank
then never takes it for a script that needs CUDA (`needs_cuda.py`). A set-up named `early`
also has `early()`, called in a launcher command's process at its import of torch, long
before it is a rank (`launched.start_early`: the rehearsal maps CUDA from there); the others
are not even imported then.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SetUp:
    """A plug-in's set-up, by name: `where` is "package.module:Class", made as
    `Class(**settings)` in the rank (module docstring); `settings` are JSON values; `early`:
    it starts at the import of torch in a launcher command's process (its `early()`)."""

    where: str
    settings: dict = field(default_factory=dict)
    early: bool = False

    def made(self):
        """The set-up itself; ValueError for a class outside the tool (`verify.`): the name
        comes from the environment, and only the tool's own plug-ins are made from it."""
        module, name = self.where.split(":")
        if not module.startswith("verify."):
            raise ValueError(f"a set-up is one of the tool's plug-ins, not {self.where!r}")
        return getattr(importlib.import_module(module), name)(**self.settings)


def to_env(setups: Sequence[SetUp]) -> str:
    """`setups` as the text a launcher command's processes find in their environment."""
    return json.dumps([[s.where, s.settings, s.early] for s in setups])


def from_env(text: str | None) -> tuple[SetUp, ...]:
    """The set-ups `to_env` wrote (none for an empty or missing variable)."""
    found = json.loads(text or "[]")
    return tuple(SetUp(where, dict(settings), bool(early)) for where, settings, early in found)


class _Running:
    """A started set-up: `finish(exc)` once, its failures swallowed (module docstring)."""

    def __init__(self, finish, reads_failures: bool) -> None:
        self._finish = finish
        self._done = False
        self.reads_failures = reads_failures

    def finish(self, exc: BaseException | None = None) -> object:
        if self._done:
            return None
        self._done = True
        with contextlib.suppress(Exception):
            return self._finish(exc)
        return None


def start(setups: Sequence[SetUp], rank: int, folder: str) -> list[_Running]:
    """Start `setups` in order (module docstring)."""
    running = []
    for setup in setups:
        made = setup.made()
        running.append(_Running(made.start(rank, folder), getattr(made, "reads_failures", False)))
    return running


def reads_failures(running: Sequence[_Running]) -> bool:
    """Whether a started set-up reads the rank's failure itself (the rehearsal on the CPU:
    a failure is then never taken for a script that needs CUDA, `needs_cuda.py`)."""
    return any(r.reads_failures for r in running)


def finish(running: Sequence[_Running], exc: BaseException | None = None) -> object:
    """Finish every started set-up, the last started first; what the first of them made of
    the failure `exc` (the rehearsal's usage error), or None."""
    readings = [r.finish(exc) for r in reversed(running)]
    return next((x for x in readings if x is not None), None)
