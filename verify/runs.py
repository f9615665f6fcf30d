"""Where measurements land and what they say about the machine that made them.

Every profile, benchmark, training run and hang report writes into a fresh folder
`<out>/<name>_<world>x<device>_<stamp>/` (never over an earlier run: a suffix `-2`, `-3`, ...
is added if two runs start in the same second) holding a `metadata.json` with the command,
options, torch version, hardware, load average and date, and, once the ranks have run, the
thread budget they were given and the one-line description of all that (`machine_line`), so a
table or chart found later says where it came from.

Nothing cleans `<out>` by itself (a profile of every variant writes over 100 MB): the CLI says
what a run took on disk and what the folder holds (`disk_line`), and `python -m verify clean
--keep N` removes all but the newest N run folders (`prune`); only folders named as this module
names them are ever touched.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from verify import private
from verify.options import Options, knob

DEFAULT_OUT = "profiles"


def machine_info() -> dict:
    """Hardware and software facts a benchmark table should carry."""
    # torch here, not at the top: the launcher form makes its run folder (`new_run_dir`) and
    # starts the user's launcher before the tool imports torch (verify/launching/launcher.py).
    import torch

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


def describe_machine(info: dict, threads: str = "") -> str:
    """One line: 'Intel Xeon ..., 2 cores, torch 2.13.0+cpu, load average 0.5 at the start;
    1 thread per rank (2 cores / 2 ranks)' (`threads`: the ranks' thread budget, when known)."""
    parts = [info.get("cpu") or platform.machine(), f"{info.get('cores')} cores"]
    if info.get("gpus"):
        parts.append(f"{len(info['gpus'])}x {info['gpus'][0]}")
    parts.append(f"torch {info.get('torch')}")
    if info.get("load_avg_1m") is not None:
        parts.append(f"load average {info['load_avg_1m']:g} at the start")
    return ", ".join(parts) + (f"; {threads}" if threads else "")


def _cpu_model() -> str | None:
    """The CPU's model name, from the kernel on Linux: no library call gives it (psutil has
    none; platform.processor() is empty or the architecture there), elsewhere platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def new_run_dir(out: str | os.PathLike, name: str, world_size: int | str, device: str) -> Path:
    """Create and return `out/<name>_<world>x<device>_<stamp>/`, never an existing folder;
    `world_size` "N" for a launcher command's run (its launcher decides the ranks). The folder
    is this user's alone, 0700 whatever the umask: its ranks' messages are read from it
    (`verify/private.py`)."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "-", name).strip("-") or "run"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(out) / f"{safe}_{world_size}x{device}_{stamp}"
    Path(out).mkdir(parents=True, exist_ok=True)
    candidate, n = base, 1
    while True:
        try:
            private.make_dir(candidate)  # atomic: two runs in one second get two folders
            return candidate
        except FileExistsError:
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")


def write_metadata(run_dir: Path, options: dict, threads: str = "") -> dict:
    """Write `metadata.json` (command, options, machine, date) and return it.

    Called again with `threads` (the ranks' thread budget, known once they have run), it keeps
    what the first call recorded (the command, the date, the machine as it was at the start)
    and adds `threads` and `machine_line`.
    """
    path = run_dir / "metadata.json"
    if path.exists():
        meta = json.loads(path.read_text())
    else:
        argv = list(sys.argv)
        if argv and argv[0].endswith(os.path.join("verify", "__main__.py")):
            argv[:1] = ["-m", "verify"]  # how it was typed: python -m verify ...
        meta = {
            "command": " ".join(shlex.quote(a) for a in ["python", *argv]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "options": options,
            "machine": machine_info(),
        }
    if threads:
        meta["threads"] = threads
    meta["machine_line"] = describe_machine(meta["machine"], meta.get("threads", ""))
    write_json(path, meta)
    return meta


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def save_report(report_dir: str, data: dict) -> None:
    """`report.json` in the run folder, where it can be written: on a full disk the verdict
    is still printed (and says the audit stopped), never lost to the save."""
    with contextlib.suppress(OSError):
        write_json(Path(report_dir) / "report.json", data)


def default_device(world_size: int) -> str:
    """'cuda' when every rank can have its own GPU, else 'cpu'."""
    import torch  # as in machine_info

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "cuda"
    return "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


# `<name>_<world>x<device>_<stamp>[-n]`, as new_run_dir names them: nothing else is a run.
_RUN_NAME = re.compile(r".+_(?:\d+|N)x[a-z]+_(\d{8}-\d{6})(-\d+)?$")


def run_folders(out: str | os.PathLike) -> list[Path]:
    """The run folders under `out`, oldest first (by the stamp in the name, then the suffix)."""
    found = []
    for path in Path(out).iterdir() if Path(out).is_dir() else ():
        m = _RUN_NAME.match(path.name)
        if m and path.is_dir() and not path.is_symlink():
            found.append((m.group(1), int((m.group(2) or "-1")[1:]), path.name, path))
    return [p for *_, p in sorted(found)]


def folder_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files below `path` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def disk_line(run_dir: str | os.PathLike) -> str:
    """What a run left on disk, and what its `out` folder holds in all, with the way to trim it."""
    run_dir = Path(run_dir)
    runs = run_folders(run_dir.parent)
    total = sum(folder_bytes(r) for r in runs)
    return (
        f"disk: this run {human_bytes(folder_bytes(run_dir))}; {run_dir.parent}/ holds "
        f"{len(runs)} run{'s' if len(runs) != 1 else ''}, {human_bytes(total)} "
        f"(python -m verify clean --keep N --out {run_dir.parent} keeps the newest N)"
    )


@dataclass(frozen=True, kw_only=True)
class CleanOptions(Options):
    """`python -m verify clean`: which folder, how many runs to keep."""

    keep: int = knob(help="run folders to keep, the newest ones (0 removes them all)", minimum=0)
    out: str = knob(DEFAULT_OUT, "the folder whose run folders are trimmed")
    dry_run: bool = knob(False, "say what would be removed, remove nothing")


@dataclass(frozen=True)
class CleanResult:
    options: CleanOptions
    removed: tuple[str, ...]
    freed_bytes: int
    kept: tuple[str, ...]
    verdict: str = "pass"

    def to_dict(self) -> dict:
        return {"check": "clean", "verdict": self.verdict, "removed": list(self.removed),
                "freed_bytes": self.freed_bytes, "kept": list(self.kept),
                "dry_run": self.options.dry_run}  # fmt: skip


def prune(options: CleanOptions) -> CleanResult:
    """Remove all but the newest `options.keep` run folders under `options.out`."""
    runs = run_folders(options.out)
    cut = max(0, len(runs) - options.keep)
    old, kept = runs[:cut], runs[cut:]
    freed = sum(folder_bytes(p) for p in old)
    if not options.dry_run:
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
    return CleanResult(options, tuple(map(str, old)), freed, tuple(map(str, kept)))
