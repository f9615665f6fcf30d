"""What a rehearsal mapped on every rank, read back by the tool (`checks/script.py`, and a
torchrun job's rank 0 under `verify.audit_run`), and how it reads as text.

Each rank counts its own calls (`rank<r>.on_cpu.json`); the report lists each call site once,
in the script's order, with how many times each rank made it. A call some rank could not map
is the run's outcome: `refused` (exit 2, no verdict).
"""

from __future__ import annotations

import json
import os
import re

from verify.oncpu.unmappable import CannotMap

REPORT_SUFFIX = "on_cpu.json"  # rank<r>.on_cpu.json in the report folder


def read(report_dir: str, ranks) -> tuple[tuple[dict, ...], CannotMap | None]:
    """(every call site mapped, with `per_rank` counts; the first call a rank could not
    map, or None) from the ranks' files in `report_dir`."""
    sites: dict[tuple[str, str, str], dict[int, int]] = {}
    refused: list[CannotMap] = []
    for r in ranks:
        path = os.path.join(report_dir, f"rank{r}.{REPORT_SUFFIX}")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for m in data.get("mapped", ()):
            sites.setdefault((m["call"], m["to"], m["where"]), {})[r] = m["count"]
        if data.get("refused"):
            refused.append(CannotMap.from_dict(data["refused"]))
    mapped = [
        {"call": c, "to": t, "where": w, "per_rank": per_rank}
        for (c, t, w), per_rank in sorted(sites.items(), key=lambda kv: _order(kv[0][2]))
    ]
    first = min(refused, key=lambda c: _order(c.where), default=None)
    return tuple(mapped), first


def lines(on_cpu: dict) -> list[str]:
    """The mapping as the console shows it (`on_cpu`: {"ranks": N, "mapped": what `read`
    returned}): one line per call site."""
    mapped, world = on_cpu["mapped"], on_cpu["ranks"]
    if not mapped:
        return ["on-cpu: the script made no CUDA call to map"]
    calls = sum(sum(m["per_rank"].values()) for m in mapped) // max(world, 1)
    whose = f" on rank {on_cpu['rank']}" if "rank" in on_cpu else ""
    out = [
        f"on-cpu: CUDA calls mapped to the CPU{whose}, {len(mapped)} sites, ~{calls} calls a rank:"
    ]
    for m in mapped:
        counts = list(m["per_rank"].values())
        if world == 1:  # one rank's own report (a torchrun rank under verify.audit_run)
            times = f"{counts[0]}x"
        elif len(counts) == world and min(counts) == max(counts):
            times = f"{counts[0]}x on each rank"
        elif len(counts) == 1:
            times = f"{counts[0]}x on rank {next(iter(m['per_rank']))} only"
        else:
            times = f"{min(counts)}-{max(counts)}x a rank, on {len(counts)} of {world} ranks"
        out.append(f"  {m['where']}: {m['call']} -> {m['to']} ({times})")
    return out


def _order(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return (path, int(line)) if re.fullmatch(r"\d+", line) else (where, 0)
