"""Two runs of a script compared step by step (`audit --record DIR`, `audit --against DIR`,
`compare DIR_A DIR_B`; docs/compare.md).

    sketch.py     a tensor's fixed-size numeric sketch (beside the engine's fingerprint)
    shares.py     which blocks each rank sketches (balanced), one rank's part of it
    loss.py       the loss, where the script's backward shows it
    precision.py  the dtypes autocast ran the forward in (the tolerance follows them)
    recorder.py   inside a rank: rows at the script audit's points, written by rank 0
    store.py      the folder's format (manifest + numpy arrays), its version, its check
    table.py      a recording's rows by (optimizer, step, phase, name); the phase order
    align.py      which step of one run is which of the other (a resume)
    tolerance.py  bitwise, or within a tolerance derived from the precision and the order
    departure.py  the first departure and what follows
    command.py    the `compare` command's options and result, and what `audit --record/--against` add
    capture.py    inside a drill-down's re-run: one step, op by op (a dispatch mode)
    streams.py    two captures of a step: the first op where they part, and why
    drill.py      `compare --drill`: the rungs below the first departure, the re-runs, the replay check

The recorder is called by the script audit's `StepHooks` (`verify/script_audit/hooks.py`) at
the points it audits, with the entries it collected and named (`collect.py`, `naming.py`).
"""
