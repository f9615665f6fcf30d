"""The kinds of finding: what a check measured, as a key of the hint table (`table.py`).

A finding (`verdict.Finding`) carries one of these as its `kind` and what was measured as its
`numbers`; its hint is chosen from the two, never from the wording of its message, so a
message can be reworded without moving a hint. The names read as a report's words because
they are shown in `--json`.
"""

from __future__ import annotations

# The two kinds the one Finding itself reads (`fault`, `detail`), defined beside it.
from verify.replica_audit.finding import LAYOUT as AUDIT_LAYOUT  # noqa: F401
from verify.replica_audit.finding import NOTE  # noqa: F401

# --- consistency: replicas compared bitwise across ranks (`audit.py`) ----------------------
NOT_BROADCAST = "not broadcast"  # construction: replicas start from different values
GRADIENTS_DIFFER = "gradients differ across ranks"  # after finish_gradient_synchronization()
PARAMETERS_DIFFER = "parameters differ across ranks"  # after optimizer.step()
BUFFERS_DIFFER = "buffers differ across ranks"
STATE_DIFFERS = "optimizer state differs across ranks"
STATE_ON_SOME = "optimizer state on some ranks only"
# the fingerprints differed, the values gathered right after did not: still being written
VALUES_MOVED = "values moved while audited"
LAYOUT = "shard layout"  # shards that do not partition the parameter (`layout.py`)

# --- equivalence: every rank against one process (`reference.py`) --------------------------
GRADIENTS_DIVERGE = "gradients diverge from one process"
PARAMETERS_DIVERGE = "parameters diverge from one process"
BUFFERS_DIVERGE = "buffers diverge from one process"
GRAD_NOT_IN_REFERENCE = "a gradient the reference does not have"
NO_GRAD_HERE = "no gradient where the reference has one"
SHAPE_DIFFERS = "dtype or shape differs from the reference"

# --- either check ---------------------------------------------------------------------------
ROUND_TRIP_RAISED = "state_dict round trip raised"
RAISED_ON_SOME = "raised on some ranks only"  # `verdict.run_check`, `agreement.py`
RAISED = "raised"  # a rank's exception ended the run (`failures.py`)
COLLECTIVE_MISMATCH = "collective mismatch"  # the collective trace's diagnosis (`failures.py`)
HANG = "hang"  # a rank parked in or outside a collective while others wait

# --- races (`--sanitize`, `sanitizing.py`) --------------------------------------------------
NEVER_WAITED = "collective never waited on"
READ_IN_FLIGHT = "read while a collective was in flight"
WRITE_IN_FLIGHT = "written while a collective was in flight"

# --- the shard check (`cells.py`, `memory.py`) -----------------------------------------------
STATE_NOT_SHARDED = "optimizer state not sharded"
STATE_UNBALANCED = "optimizer state unbalanced"
STATE_COPIED = "optimizer state held twice on a rank"
NOT_SHARDED = "not sharded"  # parameters or gradients, per rung (numbers: "what")

# --- compare: this run against a recording (`recording/departure.py`), by what departed; its
# numbers: the compared step's index, the alignment's offset, the loss's values and micro-steps
START_DEPARTS = "starting parameters depart from the recording"
SETTING_DEPARTS = "a setting departs from the recording"
SCALER_DEPARTS = "the GradScaler departs from the recording"
BUFFERS_DEPART = "buffers depart from the recording"
LOSS_DEPARTS = "the loss departs from the recording"
GRADIENTS_DEPART = "gradients depart from the recording"
PARAMETERS_DEPART = "parameters depart from the recording after a step"
STATE_DEPARTS = "optimizer state departs from the recording"

# --- a script's replica audit (`script_audit/book.py`): the kind says whether it is a fault;
# its hint is keyed by what it compared, its phase (`script_audit.py`) ------------------------
DIVERGENCE = "divergence"  # tensors that newly differ across ranks at an audit point
# AUDIT_LAYOUT ("layout"): the ranks audit different sets of tensors, or are at other steps
# NOTE ("note"): buffers kept per rank by design; not a fault
