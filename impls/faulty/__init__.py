"""A catalogue of deliberately broken data-parallel implementations, `faulty:<name>`.

Proof that the checkers catch the bugs people really make: each class is a small variation of
a correct built-in (one method overridden, the wrong line marked `# BUG:`), and its docstring
says what is wrong, the symptom, and which check must catch it. `FAULTS` records, for each,
the check (`consistency`, `equivalence` or `shard`) and the certification-matrix behaviours
on which it shows; `python -m verify faults` runs them and prints the detection matrix, and
`tests/test_faulty.py` asserts it.

Importing this package only fills `FAULTS`; `impls.registry` imports it and builds the
`faulty:<name>` implementations from it (this package never imports the registry).

    ddp_faults      the average, the construction broadcast, what the hooks launch
    bucket_faults   when a bucket counts as ready, and which buckets are sent
    zero_faults     what a ZeRO-1 optimizer steps, syncs, zeroes, saves and adds
    race_faults     races on async collectives (caught on every run under --sanitize)
    shard_faults    what a ZeRO-3 reduce-scatter divides, and when a unit is gathered
    hang_scenarios  DDPs that hang or desync on purpose, for the hang check (`hang:<name>`;
                    not imported here: `impls.registry` reads its `SCENARIOS`)
"""

# Imported in the catalogue's order (it is the order of the detection matrix).
from . import ddp_faults  # noqa: I001
from . import bucket_faults, zero_faults
from . import race_faults
from . import shard_faults
from .catalogue import CHECKS, FAULTS, Fault

__all__ = [
    "CHECKS",
    "FAULTS",
    "Fault",
    "bucket_faults",
    "ddp_faults",
    "race_faults",
    "shard_faults",
    "zero_faults",
]
