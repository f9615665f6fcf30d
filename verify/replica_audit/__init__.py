"""The replica audit's one engine: what every audit of replicated state shares, whether it
audits a class (`verify/checks/audit.py`: consistency, the matrix's cells), a class's shard
layout (`verify/checks/layout.py`), the matrix's agreement on each cell
(`verify/checks/agreement.py`) or a user's script (`verify/script_audit/`).

    compare.py     the one comparison of an audit point's entries across the ranks, and the
                   one Auditor that asks it for a class's checkpoints (`checks/audit.py`) and
                   a script's audit points (`script_audit/hooks.py`): what each rank holds,
                   the fingerprints, who differs, and the first few differences measured
    fingerprint.py one exact fingerprint per tensor, computed where it lives
    group.py       the small group interface and the one agreement reduction over it
                   (min and max in one all-reduce, O(1) in the world size); who differs,
                   gathered only after the ranks disagree
    measure.py     the one measure of a tensor that differs (bitwise, by how much, where,
                   the factor it is of the reference's)
    finding.py     the one typed Finding of every check, the script audit's included, and
                   the one TensorDiff of every audit

Imports only torch: the script audit runs it inside a user's ranks.
"""
