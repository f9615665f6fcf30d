"""The watchdog's eyes and the backend's logs: what the launcher needs around a hang.

- `Watchdog` polls the header of every rank's trace file (`tracer.py`): a rank progresses when
  it issues or completes a collective. A stall is *no rank* progressing for `stall_timeout_s`
  while at least one waits in a collective: a rank that computes for a while and then issues
  its next collective resets the clock for everyone, so a slow rank is never a hang, and ranks
  that all compute (nothing pending) are not hung either.
- `backend_env` turns on the backend's own debug output for a run whose report is kept:
  gloo's C++ logs and PyTorch's distributed debug logs (to each rank's stderr file) and the
  flight recorder; on NCCL also `NCCL_DEBUG=INFO` into a file per process and the flight
  recorder's dump on timeout. The NCCL variables are only set for the NCCL backend, so
  nothing here needs CUDA.
- `start_rank_helper` runs a daemon thread in each rank that writes the flight recorder's dump
  when the parent asks (`request_flight_recorder`): a thread, because a rank stuck in a
  collective has released the GIL in C++, while its main thread would never run a Python
  signal handler.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from verify.watching import tracer

FR_BUFFER = "2000"  # flight-recorder entries kept per process group
_FR_WAIT_S = 1.0


class Watchdog:
    """Declares a stall from the ranks' trace headers; see the module docstring."""

    def __init__(self, trace_paths: list[str | None], stall_timeout_s: float) -> None:
        self.paths = trace_paths
        self.stall_timeout_s = stall_timeout_s
        self.events: list[int | None] = [None] * len(trace_paths)
        self.last_change: float | None = None  # monotonic
        self.last_event_wall = 0.0  # wall clock of the last progress any rank made
        self.stalled_at: float | None = None  # wall clock of the verdict

    def poll(self) -> bool:
        """Read every header once; True once the run is stalled."""
        now = time.monotonic()
        if self.last_change is None:  # the clock starts when everyone is up
            self.last_change, self.last_event_wall = now, time.time()
        waiting = False
        for i, path in enumerate(self.paths):
            header = tracer.read_header(path) if path else None
            if header is None:
                continue
            events, pending, last = header
            if events != self.events[i]:
                self.events[i] = events
                self.last_change = now
                self.last_event_wall = max(self.last_event_wall, last)
            waiting = waiting or pending > 0
        if waiting and now - self.last_change >= self.stall_timeout_s:
            self.stalled_at = time.time()
            return True
        return False

    def detection_s(self) -> float | None:
        """Seconds from the last progress any rank made (as last seen) to now, the verdict."""
        if self.last_change is None:
            return None
        return time.time() - self.last_event_wall


def backend_env(backend: str, report_dir: str) -> dict[str, str]:
    """Environment that makes the backend log what a hang report needs (see the docstring)."""
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


def _request_path(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.fr.request")


def fr_path(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.flight_recorder.json")


def start_rank_helper(report_dir: str, rank: int, backend: str) -> None:
    """In a rank: dump the flight recorder into the report folder when the parent asks."""

    def serve() -> None:
        request = _request_path(report_dir, rank)
        while not os.path.exists(request):
            time.sleep(0.2)
        try:
            dump = _flight_recorder_json()
        except Exception as exc:  # not built in, or not enabled: say so in the file
            dump = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        with open(fr_path(report_dir, rank) + ".tmp", "w") as f:
            f.write(dump)
        os.replace(fr_path(report_dir, rank) + ".tmp", fr_path(report_dir, rank))

    threading.Thread(target=serve, name="ddp-verify-fr", daemon=True).start()


def _flight_recorder_json() -> str:
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace_json", None) or c10d._dump_fr_trace_json
    raw = dump(includeCollectives=True, onlyActive=False)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def request_flight_recorder(report_dir: str, ranks: list[int]) -> list[str]:
    """Ask live ranks for their flight-recorder dump; the paths that appeared in time."""
    for rank in ranks:
        with contextlib.suppress(OSError), open(_request_path(report_dir, rank), "w"):
            pass
    end = time.monotonic() + _FR_WAIT_S
    while time.monotonic() < end and not all(os.path.exists(fr_path(report_dir, r)) for r in ranks):
        time.sleep(0.05)
    for rank in ranks:
        with contextlib.suppress(OSError):
            os.remove(_request_path(report_dir, rank))
    return [fr_path(report_dir, r) for r in ranks if os.path.exists(fr_path(report_dir, r))]
