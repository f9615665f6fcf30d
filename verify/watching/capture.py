"""What a report captures besides the traces: the backend's logs, and answers from the ranks.

- the backend's own debug output is turned on by `launching/env.backend_env`;
- `start_rank_helper` runs a daemon thread in each rank that answers the parent through
  files: where the main thread is now (`request_where`, then `read_where`: the watchdog names
  the line a computing rank is at; `read_in_torch`: whether it is blocked inside a torch call
  the trace cannot see, such as PyTorch DDP's reducer), and the flight recorder's dump (`request_flight_recorder`).
  A thread, because a rank stuck in a collective has released the GIL in C++, while its main
  thread would never run a Python signal handler; and a file, because the rank may be gone
  by the time the parent reads the answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from verify import private
from verify.watching import stacks

_FR_WAIT_S = 1.0
_HELPER_POLL_S = 0.2


def _path(folder: str, rank: int, what: str) -> str:
    return os.path.join(folder, f"rank{rank}.{what}")


def fr_path(report_dir: str, rank: int) -> str:
    return _path(report_dir, rank, "flight_recorder.json")


def start_rank_helper(folder: str, rank: int) -> None:
    """In a rank: answer the parent's requests (see the module docstring) until exit."""

    def serve() -> None:
        fr_done = False
        while True:
            time.sleep(_HELPER_POLL_S)
            if os.path.exists(_path(folder, rank, "where.request")):
                with contextlib.suppress(OSError):
                    os.remove(_path(folder, rank, "where.request"))
                # The user's line, then whether the main thread is blocked inside torch.
                site, blocked = stacks.main_thread_site() or "", stacks.main_thread_in_torch()
                _write(folder, f"rank{rank}.where", f"{site}\n{int(blocked)}")
            if not fr_done and os.path.exists(_path(folder, rank, "fr.request")):
                fr_done = True
                try:
                    dump = _flight_recorder_json()
                except Exception as exc:  # not built in, or not enabled: say so in the file
                    dump = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
                _write(folder, os.path.basename(fr_path(folder, rank)), dump)

    threading.Thread(target=serve, name="ddp-verify-helper", daemon=True).start()


def _write(folder: str, name: str, text: str) -> None:
    """An answer the parent asked for, in the run folder only this user can write."""
    with contextlib.suppress(OSError, private.Untrusted):
        private.write(folder, name, text.encode(), asked=True)


def request_where(folder: str, rank: int) -> None:
    """Ask rank `rank` where its main thread is; `read_where` returns the answer once there."""
    with contextlib.suppress(OSError):
        os.remove(_path(folder, rank, "where"))
    with contextlib.suppress(OSError), open(_path(folder, rank, "where.request"), "w"):
        pass


def asker(folder: str, read):
    """`ask(rank, ask_first)`: `read(folder, rank)` of the rank helper's answer to "where is
    your main thread" (`read_where`, `read_in_torch`), asking the rank first when
    `ask_first`."""

    def ask(rank: int, ask_first: bool):
        if ask_first:
            request_where(folder, rank)
        return read(folder, rank)

    return ask


def read_where(folder: str, rank: int) -> str | None:
    """The user's line the rank's main thread was at (None: no answer yet, or no user frame)."""
    answer = _read_answer(folder, rank)
    return answer[0] or None if answer else None


def read_in_torch(folder: str, rank: int) -> bool | None:
    """Whether the rank's main thread was inside a call into torch that blocks without Python
    frames (`stacks.main_thread_in_torch`); None: no answer yet."""
    answer = _read_answer(folder, rank)
    return answer[1] == "1" if answer and len(answer) > 1 else None


def _read_answer(folder: str, rank: int) -> list[str] | None:
    """The answer's lines; raises `private.Untrusted` for one that is not this user's alone."""
    with contextlib.suppress(OSError):
        answer = private.read(folder, f"rank{rank}.where")
        return None if answer is None else answer.decode(errors="replace").split("\n")
    return None


def _flight_recorder_json() -> str:
    import torch
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    dump = flight_recorder_dump(torch._C._distributed_c10d, backend)
    raw = dump(includeCollectives=True, onlyActive=False)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def flight_recorder_dump(c10d, backend: str):
    """The dump function of `backend`'s flight recorder: NCCL keeps its own, which a CUDA
    build has even when the ranks run gloo (a gloo hang's dump from it would be empty); gloo's
    is the generic one."""
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    return nccl if nccl is not None and "nccl" in backend else c10d._dump_fr_trace_json


def request_flight_recorder(report_dir: str, ranks: list[int]) -> list[str]:
    """Ask live ranks for their flight-recorder dump; the paths that appeared in time."""
    for rank in ranks:
        with contextlib.suppress(OSError), open(_path(report_dir, rank, "fr.request"), "w"):
            pass
    end = time.monotonic() + _FR_WAIT_S
    while time.monotonic() < end and not all(os.path.exists(fr_path(report_dir, r)) for r in ranks):
        time.sleep(0.05)
    for rank in ranks:
        with contextlib.suppress(OSError):
            os.remove(_path(report_dir, rank, "fr.request"))
    return [fr_path(report_dir, r) for r in ranks if os.path.exists(fr_path(report_dir, r))]
