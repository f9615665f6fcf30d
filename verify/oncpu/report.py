"""What a rehearsal mapped on every rank, read back by the tool (`checks/script.py`, and a
torchrun job's rank 0 under `verify.audit_run`), and how it reads as text.

Each rank counts its own calls (`rank<r>.on_cpu.json`); the report lists each call site once,
in the script's order, with how many times each rank made it, and the device questions the
script asked that the rehearsal left to torch (`unmapped`: answered as this CPU machine
answers them). A call some rank could not map is the run's outcome: `refused` (exit 2, no
verdict). A process of a launcher command that never joined a process group leaves its
calls in `on_cpu.<pid>.json` (`launching/launched.py`), for the one line that says why the
command left before any rank joined (`left_early`).
"""

from __future__ import annotations

import glob
import json
import os
import re

from verify.oncpu.unmappable import CannotMap

REPORT_SUFFIX = "on_cpu.json"  # rank<r>.on_cpu.json in the report folder
UNJOINED = "on_cpu.{pid}.json"  # a launcher command's process that never joined


def read(report_dir: str, ranks) -> tuple[tuple[dict, ...], CannotMap | None]:
    """(every call site mapped, with `per_rank` counts; the first call a rank could not
    map, or None) from the ranks' files in `report_dir`."""
    files = _files({r: os.path.join(report_dir, f"rank{r}.{REPORT_SUFFIX}") for r in ranks})
    refused = [CannotMap.from_dict(d["refused"]) for d in files.values() if d.get("refused")]
    first = min(refused, key=lambda c: _order(c.where), default=None)
    return _sites(files, "mapped", "to"), first


def read_unmapped(report_dir: str, ranks) -> tuple[dict, ...]:
    """The device questions the ranks asked that were not mapped, as `read`'s sites (with
    the CPU build's `answer` in place of `to`)."""
    files = _files({r: os.path.join(report_dir, f"rank{r}.{REPORT_SUFFIX}") for r in ranks})
    return _sites(files, "unmapped", "answer")


def read_unjoined(report_dir: str) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """(mapped, unmapped) of the processes that never joined, keyed by process id."""
    paths = glob.glob(os.path.join(glob.escape(report_dir), UNJOINED.format(pid="*")))
    files = _files({int(p.rsplit(".", 2)[-2]): p for p in paths if p.split(".")[-2].isdigit()})
    return _sites(files, "mapped", "to"), _sites(files, "unmapped", "answer")


def left_early(mapped, unmapped, most: int = 6) -> str:
    """The clause that says a command or script left before any rank joined under a
    rehearsal: what it mapped, and what the script asked that it did not map."""

    def listed(sites, key):
        shown = [f"{m['call']} -> {m[key]} at {m['where']}" for m in sites[:most]]
        return ", ".join(shown) + (f", and {len(sites) - most} more" if len(sites) > most else "")

    said = "--on-cpu was on"
    said += f": it mapped {listed(mapped, 'to')}" if mapped else ", and mapped no CUDA call"
    if unmapped:
        said += (
            f"; the script asked, unmapped (a CPU machine's answer): {listed(unmapped, 'answer')}"  # noqa: E501
        )
    return said


def lines(on_cpu: dict) -> list[str]:
    """The mapping as the console shows it (`on_cpu`: {"ranks": N, "mapped": what `read`
    returned, "unmapped": what `read_unmapped` returned}): one line per call site."""
    mapped, world = on_cpu["mapped"], on_cpu["ranks"]
    out = (
        _listed(on_cpu, mapped, "to") if mapped else ["on-cpu: the script made no CUDA call to map"]
    )
    unmapped = on_cpu.get("unmapped") or ()
    if unmapped:
        out.append("on-cpu: device questions left unmapped (a CPU machine's answers):")
        out += [f"  {m['where']}: {m['call']} -> {m['answer']} ({_times(m, world)})"
                for m in unmapped]  # fmt: skip
    return out


def _listed(on_cpu: dict, mapped, key: str) -> list[str]:
    world = on_cpu["ranks"]
    calls = sum(sum(m["per_rank"].values()) for m in mapped) // max(world, 1)
    whose = f" on rank {on_cpu['rank']}" if "rank" in on_cpu else ""
    out = [
        f"on-cpu: CUDA calls mapped to the CPU{whose}, {len(mapped)} sites, ~{calls} calls a rank:"
    ]
    out += [f"  {m['where']}: {m['call']} -> {m[key]} ({_times(m, world)})" for m in mapped]
    return out


def _times(m: dict, world: int) -> str:
    counts = list(m["per_rank"].values())
    if world == 1:  # one rank's own report (a torchrun rank under verify.audit_run)
        return f"{counts[0]}x"
    if len(counts) == world and min(counts) == max(counts):
        return f"{counts[0]}x on each rank"
    if len(counts) == 1:
        return f"{counts[0]}x on rank {next(iter(m['per_rank']))} only"
    return f"{min(counts)}-{max(counts)}x a rank, on {len(counts)} of {world} ranks"


def _files(paths: dict) -> dict:
    """The JSON of each file of `paths` (key -> path) that could be read."""
    found = {}
    for key, path in paths.items():
        try:
            with open(path) as f:
                found[key] = json.load(f)
        except (OSError, ValueError):
            continue
    return found


def _sites(files: dict, field: str, to: str) -> tuple[dict, ...]:
    """The entries under `field` of every file, one a site in the script's order, with how
    many times each file's process made it (`per_rank`)."""
    sites: dict[tuple[str, str, str], dict[int, int]] = {}
    for who, data in files.items():
        for m in data.get(field) or ():
            sites.setdefault((m["call"], m[to], m["where"]), {})[who] = m["count"]
    return tuple(
        {"call": c, to: t, "where": w, "per_rank": per_rank}
        for (c, t, w), per_rank in sorted(sites.items(), key=lambda kv: _order(kv[0][2]))
    )


def _order(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return (path, int(line)) if re.fullmatch(r"\d+", line) else (where, 0)
