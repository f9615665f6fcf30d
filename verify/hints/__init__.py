"""The hints: the kinds of finding every check and plug-in reports (`kinds.py`), the phases of
a script audit (`phases.py`), and the one table that says what each usually means and what to
do (`table.py`, its numeric rules in `rules.py`, the script audit's part in
`script_audit.py`). A leaf below the checks and the plug-ins: both name their findings' kinds
here, and nothing here imports either."""
