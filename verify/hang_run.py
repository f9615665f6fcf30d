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

import sys

from verify.launching.torchrun import script_main

if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if sys.argv[1:] else 2)
    on_cpu = sys.argv[1] == "--on-cpu"  # a CUDA script rehearsed on CPU ranks (docs/audit.md)
    script_main(sys.argv[2 if on_cpu else 1 :], on_cpu=on_cpu)
