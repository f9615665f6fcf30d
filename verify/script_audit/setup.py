"""`audit` on a user's script: the replica audit at every `every`-th optimizer step of every
rank, as a set-up of the runtime (`verify/launching/setups.py`; named by `verify/plugins.py`),
installed before the script builds its first module. Each rank's report goes to
`rank<r>.audit.json` in the run folder (`report.AuditReport`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AUDIT = "audit.json"  # rank<r>.audit.json in the run folder


@dataclass(frozen=True)
class Audit:
    every: int = 1

    def start(self, rank: int, folder: str):
        from verify.script_audit import StepHooks
        from verify.script_audit.report import AuditSettings

        hooks = StepHooks(AuditSettings(self.every, os.path.join(folder, f"rank{rank}.{AUDIT}")))
        hooks.install()
        return lambda exc: hooks.finish()
