"""`python -m verify.hang_run [--on-cpu] train.py ARGS`: run a training script as one traced rank
of a torchrun job (for jobs that span machines; on one machine `python -m verify hang --nproc N --
train.py ARGS` starts and watches the ranks itself):

    torchrun --nnodes 2 --nproc-per-node 8 ... -m verify.hang_run train.py ARGS

Each rank traces its collectives into `profiles/hang_torchrun_<run id>_<host>/` (or
DDP_VERIFY_HANG_DIR), and the process with LOCAL_RANK 0 watches its node: at a hang it writes
the report, prints the diagnosis to stderr and ends the node's ranks, so torchrun tears the
job down within seconds rather than at the collective timeout. Across nodes one node prints
the diagnosis of the whole job, the others point to it. DDP_VERIFY_STALL_TIMEOUT sets
the stall timeout (default 10 s). See `verify/launching/torchrun.py`.
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: python -m verify.hang_run [--on-cpu] train.py ARGS"


def parse(argv: list[str]) -> tuple[list[str], bool]:
    """(the script and its arguments, on_cpu); ValueError naming what is wrong on bad input
    (an option the module does not take, as `--stall-timeout` would be under `verify hang`,
    ran as the script's path in every rank: a traceback each and a CRASH)."""
    on_cpu = argv[:1] == ["--on-cpu"]  # a CUDA script rehearsed on CPU ranks (docs/audit.md)
    script = argv[1:] if on_cpu else argv
    if script[:1] == ["--"]:
        script = script[1:]
    if not script:
        raise ValueError(f"no script given ({USAGE})")
    if script[0].startswith("-"):
        raise ValueError(
            f"unexpected argument {script[0]}: the one option is --on-cpu; the stall timeout "
            f"is DDP_VERIFY_STALL_TIMEOUT ({USAGE})"
        )
    if not os.path.exists(script[0]):  # (a folder or a zip with __main__.py runs too)
        raise ValueError(f"script {script[0]} does not exist")
    return script, on_cpu


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        raise SystemExit(0)
    try:
        script, on_cpu = parse(sys.argv[1:])
    except ValueError as exc:
        print(f"verify.hang_run: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from verify import plugins
    from verify.launching.torchrun import script_main  # (torch: once the input is good)

    script_main(script, setups=plugins.script_setups(on_cpu=on_cpu))
