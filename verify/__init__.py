"""Checkers that tell whether a data-parallel implementation is right, and why not.

- `launch`: the one spawn harness every multi-process run goes through.
- `workloads`: small deterministic models and data exercising the hard cases.
- `audit`: bitwise replica audit by fingerprints.
- `consistency`: replicas bitwise identical at every step.
- `cli`: `python -m verify ...`.
"""
