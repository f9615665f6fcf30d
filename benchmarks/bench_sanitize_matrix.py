"""`python benchmarks/sanitize_cost.py --matrix`: what the race sanitizer costs the certification
matrix, where it is on by default.

The whole matrix of `--impl` (every row and check; its world sizes' launches side by side, as a
user runs it) runs once per arm per round, the arms taking turns and the order rotating every
round (`timing.interleave`): plain (`matrix --no-sanitize`) and sanitized (`matrix`, the
default). A sample is the matrix's wall time (`MatrixResult.elapsed_s`: starting the ranks,
training, agreeing on every cell, everything a user waits for). The cost is sanitized / plain,
paired per round, with its 95% interval (`timing.paired`). Each arm's verdicts are kept
beside the times: a class whose verdicts differ between the arms, or from round to round
without the sanitizer, races.
"""

from __future__ import annotations

import os

from verify import progress, runs
from verify.checks.verdict import PASS
from verify.perf.timing import interleave

MATRIX_ARMS = ("plain", "sanitized")


def run_sanitize_matrix_bench(options, result_type):
    """The interleaved rounds (module docstring), as a `result_type` (`SanitizeBenchResult`,
    handed in by its module, which imports this one) whose samples are whole matrices;
    `options` is `bench-sanitize`'s (`--impl`, `--repeats`, the thread budget)."""
    from verify.checks.matrix import MatrixOptions, run_matrix

    info = runs.machine_info()
    verdicts: dict[str, list[str]] = {arm: [] for arm in MATRIX_ARMS}

    def arm(name: str):
        matrix = MatrixOptions(
            impls=(options.impl,),
            sanitize=name == "sanitized",
            threads_per_rank=options.threads_per_rank,
            command="bench-sanitize",
        )

        def sample() -> float:
            result = run_matrix(matrix)
            verdicts[name].append(result.verdict)
            return result.elapsed_s

        return sample

    def each_round(r: int) -> None:
        progress.say("bench-sanitize --matrix: round ", r, options.repeats)

    load_before = os.getloadavg()[0]
    samples = interleave({name: arm(name) for name in MATRIX_ARMS}, options.repeats, each_round)
    return result_type(
        options,
        PASS,  # a measurement: the matrices' own verdicts are data (`matrix_verdicts`)
        steps_s={name: tuple(v) for name, v in samples.items()},
        load_avg=(load_before, os.getloadavg()[0]),
        machine=runs.describe_machine(info),
        matrix_verdicts={name: tuple(v) for name, v in verdicts.items()},
    )
