"""Checkers that tell whether a data-parallel implementation is right, and why not.

The wings (docs/design.md says how they fit; imports run down this list):

- `cli/`: `python -m verify ...`, the only printer: it parses, runs a command, prints its text
  or JSON and exits with the verdict's code.
- `checks/`: consistency, equivalence, the certification and detection matrices, hang, the
  script audit's command; their results and verdicts.
- `perf/`: the measurement commands (profile, bench, comm, scaling, train).
- `training/`: the one training loop, the workloads, checkpoints and the optimizer-state probe.
- `launching/`: every multi-process run (a zygote's forks or fresh interpreters, torchrun).
- `watching/`: the collective tracer, the evidence watchdog and the diagnosis of hangs.
- `sanitize/` (the race sanitizer) and `script_audit/` (the audit inside a user's script).
"""
