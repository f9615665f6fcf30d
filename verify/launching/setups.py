"""What a user's script's rank runs around the script when the job asks for it: its set-ups.

A set-up is small picklable data (it travels in the job, `RankJob.setups`) with one
method, `start(rank)`. It is called once the rank's tracer and helper thread are in and
before the script imports anything from `torch.distributed`, in the job's order (the
rehearsal last: its wrappers then sit over the sanitizer's and the audit's, which see the
gloo the script is given, not the NCCL it asked for). `start` returns what is running, whose
`finish(exc)` saves what it found and returns its reading of the failure `exc` (None when
the script ended cleanly): the rehearsal's call it could not map, a usage error; None for
the others. `finish` is called once, after a crash too; it never raises.

    Sanitize(path)       the race sanitizer around the script (`verify/sanitize/`): a script
                         has no steps the tool knows of, so works never waited on are found
                         when it ends; its findings go to `path` as JSON
    Audit(settings)      the replica audit at every optimizer step (`verify/script_audit/`),
                         installed before the script builds its first module
    Rehearse(path)       a script written for CUDA, rehearsed on this CPU rank
                         (`verify/oncpu/`); its mapping report goes to `path`
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from verify.script_audit.report import AuditSettings


@dataclass(frozen=True)
class Sanitize:
    path: str

    def start(self, rank: int) -> _Running:
        from verify.sanitize import Sanitizer

        sanitizer = Sanitizer(rank=rank)
        sanitizer.install()
        return _Running(lambda exc: self._save(sanitizer, ended=exc is None))

    def _save(self, sanitizer, ended: bool) -> None:
        if ended:  # works never waited on, at the end (after a crash: left by the crash)
            sanitizer.end_step()
        with open(self.path, "w") as f:
            json.dump([r.to_dict() for r in sanitizer.findings], f, indent=1, default=str)


@dataclass(frozen=True)
class Audit:
    settings: AuditSettings

    def start(self, rank: int) -> _Running:
        from verify.script_audit import StepHooks

        hooks = StepHooks(self.settings)
        hooks.install()
        return _Running(lambda exc: hooks.finish())


@dataclass(frozen=True)
class Rehearse:
    path: str

    def start(self, rank: int) -> _Running:
        from verify import oncpu

        return _Running(oncpu.install(self.path, rank).finish)


class _Running:
    """A started set-up: `finish(exc)` once, its failures swallowed (module docstring)."""

    def __init__(self, finish) -> None:
        self._finish = finish
        self._done = False

    def finish(self, exc: BaseException | None = None) -> object:
        if self._done:
            return None
        self._done = True
        with contextlib.suppress(Exception):
            return self._finish(exc)
        return None


def rehearsing(setups: Sequence) -> bool:
    """Whether a script written for CUDA is rehearsed on the CPU (a failure is then read by
    the rehearsal, never taken for a script that needs CUDA: `needs_cuda.py`)."""
    return any(isinstance(s, Rehearse) for s in setups)


def start(setups: Sequence, rank: int) -> list[_Running]:
    """Start `setups` in order (module docstring)."""
    return [s.start(rank) for s in setups]


def finish(running: Sequence[_Running], exc: BaseException | None = None) -> object:
    """Finish every started set-up, the last started first; what the first of them made of
    the failure `exc` (the rehearsal's usage error), or None."""
    readings = [r.finish(exc) for r in reversed(running)]
    return next((x for x in readings if x is not None), None)
