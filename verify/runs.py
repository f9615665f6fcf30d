"""Where measurements land and what they say about the machine that made them.

Every profile, benchmark and training run writes into a fresh folder
`<out>/<name>_<world>x<device>_<stamp>/` (never over an earlier run: a suffix `-2`, `-3`, ...
is added if two runs start in the same second) holding a `metadata.json` with the command,
torch version, hardware and date, so a table or chart found later says where it came from.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import sys
import threading
from pathlib import Path

import torch

DEFAULT_OUT = "profiles"


def machine_info() -> dict:
    """Hardware and software facts a benchmark table should carry."""
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        # Other work on the machine when the run started: benchmark numbers depend on it.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gloo": torch.distributed.is_gloo_available(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def describe_machine(info: dict) -> str:
    """One line: 'Intel Xeon ..., 2 cores, torch 2.13.0+cpu, host'."""
    parts = [info.get("cpu") or platform.machine(), f"{info.get('cores')} cores"]
    if info.get("gpus"):
        parts.append(f"{len(info['gpus'])}x {info['gpus'][0]}")
    parts.append(f"torch {info.get('torch')}")
    if info.get("load_avg_1m") is not None:
        parts.append(f"load average {info['load_avg_1m']:g} at the start")
    return ", ".join(parts)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def new_run_dir(out: str | os.PathLike, name: str, world_size: int, device: str) -> Path:
    """Create and return `out/<name>_<world>x<device>_<stamp>/`, never an existing folder."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "-", name).strip("-") or "run"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(out) / f"{safe}_{world_size}x{device}_{stamp}"
    Path(out).mkdir(parents=True, exist_ok=True)
    candidate, n = base, 1
    while True:
        try:
            candidate.mkdir()  # atomic: two runs in the same second get different folders
            return candidate
        except FileExistsError:
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")


def write_metadata(run_dir: Path, options: dict) -> dict:
    """Write `metadata.json` (command, options, machine, date) and return it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("verify", "__main__.py")):
        argv[:1] = ["-m", "verify"]  # how it was typed: python -m verify ...
    meta = {
        "command": " ".join(shlex.quote(a) for a in ["python", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "options": options,
        "machine": machine_info(),
    }
    write_json(run_dir / "metadata.json", meta)
    return meta


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def default_device(world_size: int) -> str:
    """'cuda' when every rank can have its own GPU, else 'cpu'."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cuda"
    return "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


# --- progress -------------------------------------------------------------------------------
# Ranks' stdout and stderr belong to the launcher (it keeps them for diagnosis and keeps
# --json output clean), so rank 0 reports progress by appending lines to a file in the run
# folder, and the parent relays new lines to its own stderr while it waits for the launch.


class Progress:
    """Picklable: `say(msg)` appends a line to the progress file (rank 0 only, if enabled)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = str(path) if path else None

    def __call__(self, msg: str, *, rank: int = 0) -> None:
        if self.path and rank == 0:
            with open(self.path, "a") as f:
                f.write(msg.rstrip("\n") + "\n")


@contextlib.contextmanager
def relay_progress(progress: Progress, *, interval_s: float = 0.5):
    """While the block runs, copy new lines of the progress file to stderr."""
    if not progress.path:
        yield
        return
    Path(progress.path).touch()
    stop = threading.Event()

    def pump(offset: int = 0) -> int:
        with open(progress.path, "rb") as f:
            f.seek(offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # whole lines only
        if complete:
            sys.stderr.write(complete.decode("utf-8", "replace"))
            sys.stderr.flush()
        return offset + len(complete)

    def loop() -> None:
        offset = 0
        while not stop.wait(interval_s):
            offset = pump(offset)
        pump(offset)

    thread = threading.Thread(target=loop, name="progress-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
