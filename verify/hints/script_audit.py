"""What a script audit's finding usually means (`verify audit`, `script_audit/report.py`):
the audit's part of the one hint table (`table.py`), keyed by the finding's phase (what was
compared: parameters, settings, gradients, ...) and its measured numbers, never by a
message.

Gradients that differ across ranks by one factor in every tensor (`TensorDiff.scale`, fitted
where the tensors are gathered: `replica_audit/compare.py`) were scaled on some ranks only,
as a gradient clipping under `if rank == 0:` does; any other difference gets the phase's
hint.
"""

from __future__ import annotations

from verify.hints import phases as report
from verify.hints.rules import scaled_on_some
from verify.replica_audit.measure import common_scale

PHASE_HINTS = {
    report.PARAMS_FIRST: "the replicas start from different weights: the initial broadcast from rank "
    "0 is missing (a hand-written DDP must broadcast parameters and buffers when it wraps the "
    "model), or each rank initializes the model from its own seed, or code changed them on "
    "some ranks after the wrap (a checkpoint loaded, or an edit under `if rank == 0:` or in a "
    "hook that only rank 0 runs)",
    report.SETTINGS: "an optimizer setting differs across ranks: a learning-rate scheduler (or code "
    "that sets param_groups values) ran on some ranks only, e.g. under `if master_process:`; "
    "every rank must step it",
    report.SCALER: "the GradScaler's scale differs: scaler.update() ran on some ranks only, or the "
    "ranks saw different inf/NaN gradients (gradients not synchronized before unscale)",
    report.BUFFERS_SYNCED: "buffers differ right after DDP broadcast them from rank 0: the ranks "
    "modified them between the broadcast and the forward, or wrap different models",
    report.BUFFERS_LOCAL: "the script's wrapper does not synchronize these buffers (no DDP wrapper, "
    "DDP with broadcast_buffers=False, or DDP skipped its broadcast at the forward: after a "
    "no_sync() one, or under Lightning's manual optimization), so running statistics are kept "
    "per rank: a "
    "documented design, not a fault; broadcast them from rank 0 before evaluating or saving "
    "if you need one model",
    report.GRADS: "gradients were not synchronized, or synchronized only on some micro-steps (with "
    "gradient accumulation, `require_backward_grad_sync` / `no_sync()` must be decided before "
    "the forward of each micro-step), or averaged differently on some ranks (a sum not divided "
    "by the world size, or divided on some ranks only)",
    report.PARAMS_AFTER: "parameters differ after a step whose gradients and settings agreed: the "
    "update itself ran differently on some ranks (a rank-local clip, learning rate or "
    "optimizer setting, optimizer state loaded or reset on some ranks only, or lagging on a rank "
    "that joined early under join() with uneven data: join() syncs the model, not the "
    "optimizer; or an edit of the parameters outside the optimizer)",
    report.STATE: "optimizer state differs although the gradients agreed: state changed on some ranks "
    "only (a rank-local load_state_dict or reset)",
    report.LAYOUT: "the ranks audit different sets of tensors here: optimizer state or gradients "
    "present on some ranks only (a parameter used or frozen on some ranks only), or the "
    "ranks are at different optimizer steps (a step skipped on some ranks)",
}


def script_hint(finding) -> str:
    """The hint of a script audit's finding (the one `Finding`, of check "audit")."""
    if finding.phase == report.GRADS:
        diffs = [d for d in finding.tensors if d.ranks]
        c = common_scale(d.scale for d in diffs)
        if c is not None and c not in (0, 1):
            differ, ref = sorted({r for d in diffs for r in d.ranks}), [diffs[0].reference_rank]
            # Clipping only shrinks: name the ranks whose gradients are the smaller.
            return scaled_on_some(differ, ref, c) if c < 1 else scaled_on_some(ref, differ, 1 / c)
    return PHASE_HINTS[finding.phase]
