"""The replica audit inside a user's script's ranks (`python -m verify audit --nproc N --
train.py`): at every optimizer step, is every tensor meant to be replicated bitwise identical
on every rank?

    hooks.py       the global optimizer step hooks; what is audited when
    closures.py    when a step's gradients are final (`step(closure)`: when the closure returns)
    naming.py      the modules the script built; a tensor's name in its model
    buffers.py     the buffers as DDP broadcast them at a forward, until the audit takes them
    collect.py     the replicated entries of a phase (sharded tensors skipped)
    side_group.py  the audit's own gloo group, beside the script's
    book.py        distinct findings, recurrences and echoes
    report.py      the typed records a rank writes for the parent

Fingerprints and agreement are the replica audit's one engine (`verify/replica_audit/`).

Imports only torch and the engine: the launcher installs it in a rank before the script runs.
"""

from verify.replica_audit.finding import Finding, TensorDiff
from verify.script_audit.hooks import StepHooks
from verify.script_audit.report import AuditReport, AuditSettings

__all__ = ["AuditReport", "AuditSettings", "Finding", "StepHooks", "TensorDiff"]
