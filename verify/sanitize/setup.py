"""`--sanitize` on a user's script: the race sanitizer around every rank of it, as a set-up
of the runtime (`verify/launching/setups.py`; named by `verify/plugins.py`).

A script has no steps the tool knows of, so works never waited on are found when it ends;
each rank's findings go to `rank<r>.races.json` in the run folder, after a crash too (those
the crash left are not "never waited": the script did not get to wait).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

RACES = "races.json"  # rank<r>.races.json in the run folder


@dataclass(frozen=True)
class Sanitize:
    def start(self, rank: int, folder: str):
        from verify.sanitize import Sanitizer

        sanitizer = Sanitizer(rank=rank)
        sanitizer.install()
        path = os.path.join(folder, f"rank{rank}.{RACES}")
        return lambda exc: _save(sanitizer, path, ended=exc is None)


def _save(sanitizer, path: str, ended: bool) -> None:
    if ended:  # works never waited on, at the end (after a crash: left by the crash)
        sanitizer.end_step()
    with open(path, "w") as f:
        json.dump([r.to_dict() for r in sanitizer.findings], f, indent=1, default=str)
