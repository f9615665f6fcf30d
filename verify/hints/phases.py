"""The phases of a script audit's finding (the `phase` of its `Finding`): what was compared, in
the order they are audited around one step, each a label with the step in it. Apart from
`report.py` so the hint table (`hints/script_audit.py`) can key on them without importing
the report that shows its hints."""

# Phases, in the order they are audited around one step; each a label with the step in it.
PARAMS_FIRST = "parameters before step {step} (the first audited)"
SETTINGS = "optimizer settings before step {step}"
SCALER = "GradScaler before step {step}"
BUFFERS_SYNCED = "buffers after DDP's broadcast, before step {step}"
BUFFERS_LOCAL = "buffers before step {step}"
GRADS = "gradients before step {step}"
PARAMS_AFTER = "parameters after step {step}"
STATE = "optimizer state after step {step}"
LAYOUT = "the tensors audited at step {step}"
PHASES = (PARAMS_FIRST, SETTINGS, SCALER, BUFFERS_SYNCED, BUFFERS_LOCAL, GRADS, PARAMS_AFTER,
          STATE, LAYOUT)  # fmt: skip
