"""`python -m verify list`: every implementation the tool knows and the workloads, as text.

Its own module so that `list` imports the registry and the workloads and nothing else of the
tool (no checker, no launcher): tests/test_cli.py counts the modules it imports.
"""

from __future__ import annotations

from tabulate import tabulate

from impls.registry import REGISTRY
from verify.training.workloads import WORKLOADS


def listing(_options=None) -> str:
    """Every implementation the tool knows (and which commands run it), and the workloads."""
    kinds = {"builtin": "checks, hang, perf", "reference": "checks, hang, perf",
             "faulty": "checks (faults)", "hang": "hang"}  # fmt: skip
    rows = [
        [i.name, i.kind, "yes" if i.sharded else "", kinds.get(i.kind, ""), i.summary]
        for i in REGISTRY.values()
    ]
    headers = ["implementation", "kind", "sharded", "commands", "what it does"]
    lines = [tabulate(rows, headers=headers), ""]
    rows = [[name, cls.summary] for name, cls in WORKLOADS.items()]
    lines.append(tabulate(rows, headers=["workload", "what it exercises"]))
    return "\n".join(lines)
