"""`python benchmarks/audit_cost.py --script-audit`: what `audit --nproc N` costs a training
step, measured side by side in one launch.

The audit of a user's script runs in PyTorch's global optimizer step hooks
(`verify/script_audit/`). Here it is installed exactly as in a script's rank (before the
model is built, so parameters get their names), on the one trainer's transformer (AdamW,
`bench-audit`'s wrapper), and two arms take turns every round, the order rotating:

- plain: one training step with the step hooks detached;
- audited: the same step with them attached: gradients, settings and buffers before the
  step, parameters and optimizer state after it, fingerprinted and agreed on over the
  audit's own gloo group.

Every time is the slowest rank's (the skeleton of `costs.py`). The ratio audited / plain is
paired per round with a 95% interval (`timing.paired`); the goal is at most 1.02.
"""

from __future__ import annotations

from benchmarks.costs import take_turns
from verify.launching import RankContext
from verify.perf.base import next_step, parameters
from verify.perf.timing import timed
from verify.script_audit import AuditSettings, StepHooks
from verify.training.trainer import Trainer

GOAL = 1.02


def script_audit_bench_on_rank(ctx: RankContext, options) -> dict:
    """Plain and audited steps, interleaved (module docstring); `options` is the
    `AuditBenchOptions` of `bench-audit`."""
    auditor = StepHooks(AuditSettings(every=1, path=None))
    auditor.install()  # before the model exists, as in a script's rank
    try:
        trainer = Trainer(ctx, options.train_spec())
        trainer.step(1)  # warm-up, audited: state allocated, the side group made
        auditor.detach()
        trainer.step(2)

        def step(audited: bool) -> float:
            (auditor.attach if audited else auditor.detach)()
            return timed(lambda: next_step(trainer), ctx.device)

        warm = auditor.seconds  # the side group's creation is not a step's cost
        arms = {"plain": lambda: step(False), "audited": lambda: step(True)}
        samples = take_turns(ctx, arms, options.repeats, "bench-audit --script-audit")
        report = auditor.report()
    finally:
        auditor.remove()
    return {
        "parameters": parameters(trainer.model),
        "audited_tensors": report.tensors,
        "plain_s": tuple(samples["plain"]),
        "audited_s": tuple(samples["audited"]),
        "findings": len(report.findings),
        "audit_s_per_step": (report.seconds - warm) / options.repeats,
    }
