"""The environment variables the tool sets and reads, and the default stall timeout: one leaf
module, imported by every part of the launcher that needs them (and by nothing it imports).
It imports nothing but `os` (the launcher form's start, `launcher.py`, imports no torch).

impls/faulty/hang_scenarios.py spells `STALL_ENV` out again: `impls` imports nothing of
`verify`.
"""

import os

SPAWNED_ENV = "DDP_VERIFY_SPAWNED"  # marks our ranks: they must not mistake us for torchrun
STALL_ENV = "DDP_VERIFY_STALL_TIMEOUT"  # ranks can read their stall timeout (scenarios do)
HANG_DIR_ENV = "DDP_VERIFY_HANG_DIR"  # under torchrun: this node's report folder
NO_ZYGOTE_ENV = "DDP_VERIFY_NO_ZYGOTE"  # "1": always start fresh interpreters
JOBS_ENV = "DDP_VERIFY_JOBS"  # test runs or tools sharing the machine (the thread budget)
# A launcher command's processes (`launcher.py`): the run's report folder (bootstrap/ spells it
# out again: it imports nothing), the set-ups a rank starts (`setups.to_env`: JSON), and
# under --on-cpu the GPUs the rehearsed node has (--nproc; "" when off: bootstrap/ spells it
# out again too).
LAUNCHED_ENV = "DDP_VERIFY_LAUNCHED"
LAUNCHED_SETUPS_ENV = "DDP_VERIFY_LAUNCHED_SETUPS"
LAUNCHED_ON_CPU_ENV = "DDP_VERIFY_LAUNCHED_ON_CPU"
# The run's secret (hex), which only the processes the tool started hold: it seals what its
# ranks say in the launcher's store (`roll_call.py`).
LAUNCHED_SECRET_ENV = "DDP_VERIFY_LAUNCHED_SECRET"
RECORD_ENV = "DDP_VERIFY_RECORD"  # "1": `audit --record/--against` (verify/recording/recorder.py)
# "<optimizer index>:<step>": a drill-down's re-run captures that step op by op, then ends
# (verify/recording/capture.py)
DRILL_ENV = "DDP_VERIFY_DRILL"
# A file of the report folder: the run's verdict is out (failing ranks wait for it; ranks a
# launcher starts after it, torchrun's restarts, are not the run's).
DIAGNOSED = "job.diagnosed"
FR_BUFFER = "2000"  # flight-recorder entries kept per process group
# No collective issued or completed by any rank for this long while one waits and none works
# (see the watchdog): a hang. The one default of every command and helper.
DEFAULT_STALL_TIMEOUT_S = 10.0


def joining() -> bool:
    """True in a process torchrun started (and not in a rank this tool spawned)."""
    torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    return torchrun and SPAWNED_ENV not in os.environ


def backend_env(backend: str, report_dir: str) -> dict[str, str]:
    """The environment that makes the backend log what a hang report needs, for a run whose
    report is kept: gloo's C++ logs and PyTorch's distributed debug logs (to each rank's stderr
    file) and the flight recorder; on NCCL also `NCCL_DEBUG=INFO` into a file per process and
    the flight recorder's dump on timeout. The NCCL variables are only set for the NCCL
    backend, so nothing here needs CUDA."""
    env = {
        "TORCH_CPP_LOG_LEVEL": "INFO",
        # INFO, not DETAIL: DETAIL wraps every group in a checker that runs extra collectives,
        # which changes how a mismatch fails (it raises instead of hanging).
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
        "TORCH_FR_BUFFER_SIZE": FR_BUFFER,
    }
    if backend == "nccl":
        env.update(
            NCCL_DEBUG="INFO",
            NCCL_DEBUG_SUBSYS="INIT,COLL,P2P",
            NCCL_DEBUG_FILE=os.path.join(report_dir, "nccl.%h.%p.log"),  # one per process
            TORCH_NCCL_TRACE_BUFFER_SIZE=FR_BUFFER,
            TORCH_NCCL_DUMP_ON_TIMEOUT="1",
            TORCH_NCCL_DEBUG_INFO_TEMP_FILE=os.path.join(report_dir, "nccl_trace_rank_"),
        )
    return env
