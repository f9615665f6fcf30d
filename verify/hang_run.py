"""`python -m verify.hang_run train.py ARGS`: run a training script as one traced rank.

Used by `python -m verify hang --nproc N -- train.py ARGS` (which sets DDP_VERIFY_HANG_DIR and
watches from the parent), and directly under torchrun for jobs that span machines:

    torchrun --nnodes 2 --nproc-per-node 8 ... -m verify.hang_run train.py ARGS

Before the script runs, this process: traces its collectives into
`<dir>/rank<RANK>.trace` (`tracer.py`; the patch is in place before the script imports
anything, so `dist.all_reduce` resolves to the traced one); registers faulthandler on SIGUSR1
(and fatal signals) into `<dir>/rank<RANK>.stack`; and starts the flight-recorder helper
thread. Under torchrun there is no watching parent, so the process with LOCAL_RANK 0 also runs
a node watchdog thread: it reads the traces of the ranks on its node, and when none of them
progressed for DDP_VERIFY_STALL_TIMEOUT seconds (default 60) while one waits in a collective, it
dumps their stacks, writes the report (report.txt, report.json, rank*.collectives.jsonl) into
`profiles/hang_torchrun_<run id>_<host>/` (or DDP_VERIFY_HANG_DIR), prints the diagnosis to
stderr and ends the node's ranks, so torchrun tears the job down within seconds, not at the
collective timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

from verify.watching import capture

from verify.watching import tracer


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    rank = int(os.environ.get("RANK", "0"))
    report_dir = os.environ.get("DDP_VERIFY_HANG_DIR")
    under_torchrun = report_dir is None
    if under_torchrun:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        name = f"hang_torchrun_{run_id}_{socket.gethostname()}"
        report_dir = os.path.join("profiles", name)
    os.makedirs(report_dir, exist_ok=True)
    parent = os.environ.get("DDP_VERIFY_HANG_PARENT")
    if parent and sys.platform.startswith("linux"):  # die with the watching parent
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != int(parent):
            os._exit(1)
    stack_file = open(os.path.join(report_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)
    tracer.install(os.path.join(report_dir, f"rank{rank}.trace"), rank=rank)
    capture.start_rank_helper(report_dir, rank, "nccl" if _has_cuda() else "gloo")
    if under_torchrun and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        stall = float(os.environ.get("DDP_VERIFY_STALL_TIMEOUT", "60"))
        threading.Thread(
            target=_node_watchdog, args=(report_dir, stall), name="ddp-verify-watchdog",
            daemon=True,
        ).start()  # fmt: skip
    try:
        run_script(argv[0], argv[1:])
    except SystemExit:
        raise
    except BaseException:
        with open(os.path.join(report_dir, f"rank{rank}.traceback"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_script(path: str, args: list[str]) -> None:
    """Run the user's script as __main__, with its own directory first on sys.path."""
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _node_watchdog(report_dir: str, stall_timeout_s: float) -> None:
    """Under torchrun: watch this node's ranks; on a stall write the report and end them."""
    from verify.watching.diagnose import RankState, diagnose

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    ranks = list(range(first, first + local))
    paths = [os.path.join(report_dir, f"rank{r}.trace") for r in ranks]
    watchdog = capture.Watchdog(paths, stall_timeout_s)
    while not watchdog.poll():
        time.sleep(0.1)
    traces = [tracer.read_trace(p) for p in paths]
    for t in traces:
        if t is not None and t.pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(t.pid, signal.SIGUSR1)
    faulthandler.dump_traceback(file=open(os.path.join(report_dir, f"rank{first}.stack"), "a"))
    capture.request_flight_recorder(report_dir, ranks)
    time.sleep(0.5)
    states = []
    for r in ranks:
        try:
            with open(os.path.join(report_dir, f"rank{r}.stack")) as f:
                stack = f.read()
        except OSError:
            stack = None
        states.append(RankState(r, "timeout", "no rank on this node progressed", None, stack))
    # Ranks are numbered from 0 in the diagnosis; on node k of a multi-node job the other
    # nodes' ranks are unknown here and shown as missing traces.
    all_traces = [None] * first + traces
    all_states = [RankState(r, "timeout") for r in range(first)] + states
    diag = diagnose(all_traces, all_states, stalled=True, stall_timeout_s=stall_timeout_s,
                    detection_s=watchdog.detection_s())  # fmt: skip
    for r, t in zip(ranks, traces):
        if t is not None:
            with open(os.path.join(report_dir, f"rank{r}.collectives.jsonl"), "w") as f:
                for rec in t.records:
                    f.write(json.dumps(rec.to_dict()) + "\n")
            for leftover in (paths[ranks.index(r)], paths[ranks.index(r)] + ".strings"):
                with contextlib.suppress(OSError):
                    os.remove(leftover)
    with open(os.path.join(report_dir, "report.json"), "w") as f:
        json.dump(diag.to_dict(), f, indent=2, default=str)
    text = f"verify.hang_run (node watchdog): {diag.text()}\nreport: {report_dir}"
    with open(os.path.join(report_dir, "report.txt"), "w") as f:
        f.write(text + "\n")
    print(text, file=sys.stderr, flush=True)
    for t in traces:
        if t is not None and t.pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(t.pid, signal.SIGKILL)
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
