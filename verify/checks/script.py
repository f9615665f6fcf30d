"""A user's script under the watchdog: the one path `hang` and `audit` take with a script
(`--nproc N -- train.py`: `launching/script.py` starts the ranks) or a launcher command
(`-- torchrun ... train.py`: `launching/launcher.py` starts it, `launching/command.py`
watches it), and the report folder both write.

`run_watched_script` makes the run's folder (`script_start.py`), starts the script in N ranks
(output streamed with a `[rank N]` prefix) or the command as given, with the watchdog,
`--sanitize` when asked and the replica audit when asked, and reads back what the ranks
left: the diagnosis, the captured files, the race findings and the audit reports. The
commands turn a `ScriptRun` into their result. A script that needs CUDA where there is none
is a usage error (ValueError, exit 2: `launching/needs_cuda.py`), not a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from verify import runs
from verify.checks.failures import hinted_diagnosis
from verify.checks.sanitizing import race_hint
from verify.checks.script_start import (
    console_of,
    run_env,
    run_folder,
    setups_of,
    start_command,
    unwritable,
)
from verify.launching import run_script, unjoined
from verify.launching.command import NothingJoined, run_command
from verify.launching.launcher import Started, is_command
from verify.launching.needs_cuda import NeedsCuda
from verify.oncpu import report as on_cpu_report
from verify.oncpu.unmappable import CannotMap
from verify.script_audit import AuditReport
from verify.watching import capture, trace_file
from verify.watching.findings import Diagnosis


@dataclass(frozen=True, kw_only=True)
class WatchedRun:
    """What a run under the watchdog left: its diagnosis, report folder and captured files;
    the base of `hang`'s result and of a script's run."""

    diagnosis: Diagnosis
    report_dir: str
    elapsed_s: float
    failure: str | None = None  # the launcher's summary when a rank failed
    files: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)  # rank -> process id (all ended on return)
    notes: tuple[str, ...] = ()
    threads: str = ""
    races: tuple[dict, ...] = ()  # --sanitize: every rank's race findings
    on_cpu: dict | None = None  # --on-cpu: the ranks, each call site mapped (oncpu/report.py)

    @property
    def watched_verdict(self) -> str:
        """The run's verdict on its own: a hang, desync, crash or race is a fault; a run the
        tool could not judge ("timeout", "unwatched": ranks the script started itself) is
        that, not a pass."""
        if self.diagnosis.faulty or self.races:
            return "fault"
        return (
            self.diagnosis.verdict if self.diagnosis.verdict in ("timeout", "unwatched") else "pass"
        )

    def watched(self) -> dict:
        """The fields of `WatchedRun`, to build another result from this one."""
        return {f.name: getattr(self, f.name) for f in fields(WatchedRun)}

    def watched_dict(self) -> dict:
        """The JSON of the fields of `WatchedRun`."""
        return {
            **self.watched(),
            "diagnosis": hinted_diagnosis(self.diagnosis),  # each finding with its hint
            "notes": list(self.notes),
            "races": [{**r, "hint": race_hint(r, len(self.pids))} for r in self.races],
            "on_cpu": self.on_cpu,
        }


@dataclass(frozen=True, kw_only=True)
class ScriptRun(WatchedRun):
    """A script's run, and the audit's report when it ran."""

    audit: AuditReport | None = None


def run_watched_script(
    options,
    *,
    command: str,
    audit_every: int | None = None,
    record: bool = False,
    started: Started | None = None,
) -> ScriptRun:
    """Run `options.script` in `options.nproc` ranks, or the launcher command it is, under the
    watchdog (module docstring).

    `options`: a command's options with the script knobs (`script`, `nproc`, `backend`,
    `stall_timeout_s`, `timeout_s`, `threads_per_rank`, `console`, `sanitize`, `on_cpu`,
    `out`).
    `command` names the report folder (`hang_train.py_2xcpu_<stamp>`). `record`: the audit
    also writes a recording into `<report folder>/recording` (`verify/recording/`).
    `started`: the launcher command, already started by the CLI before it imported torch
    (`script_start.start_command`, `verify/cli/head_start.py`); else it is started here.
    """
    start = time.monotonic()
    if is_command(options.script):  # the command as given, its ranks its launcher's
        started = started or start_command(options, command, audit_every=audit_every, record=record)
        report_dir, start = started.report_dir, started.start
        run = _watch_command(options, started)
    else:
        report_dir = run_folder(options, command, record)
        _first_write(report_dir, options)
        run = run_script(
            options.script, nproc=options.nproc, threads_per_rank=options.threads_per_rank,
            report_dir=report_dir,
            stall_timeout_s=options.stall_timeout_s, timeout_s=options.timeout_s,
            env=run_env(options, report_dir, record), console=console_of(options),
            setups=setups_of(options, audit_every),
        )  # fmt: skip
    elapsed = time.monotonic() - start
    if not os.path.isdir(report_dir):
        raise _removed(report_dir)
    world = run.world_size
    files, pids = finish_report(report_dir, world)
    mapped = _rehearsed(run, report_dir, world) if options.on_cpu else None
    needs = [o.value for o in run.outcomes if isinstance(o.value, NeedsCuda)]
    if needs and not run.ok:  # written for GPUs, run without: a usage error (needs_cuda.py)
        first = min(needs, key=lambda n: n.where)
        raise ValueError(
            f"the script cannot run on this machine: {first.message(options.backend)} "
            f"(each rank's traceback: {report_dir}/rank<r>.stderr)"
        )
    return ScriptRun(
        report_dir=report_dir, elapsed_s=elapsed, diagnosis=replace(run.diagnosis, files=files),
        failure=None if run.ok else run.summary(), files=files, pids=pids, notes=run.notes,
        threads=run.threads,
        races=races_of(report_dir, world) if options.sanitize else (),
        audit=None if audit_every is None else audit_of(report_dir, world),
        on_cpu=mapped,
    )  # fmt: skip


def _watch_command(options, started: Started):
    """The launcher command `started`, watched to its end (`run_command`); ended at once if
    the watch cannot begin or nothing of it joined a process group."""
    try:
        _metadata_beside(started.report_dir, options)
        return run_command(
            started, timeout_s=options.timeout_s, stall_timeout_s=options.stall_timeout_s
        )
    except NothingJoined as exc:  # said with what its processes left (`unjoined.py`)
        started.abandon()
        if not os.path.isdir(started.report_dir):  # the joins went with it, seen or not
            raise _removed(started.report_dir) from None
        raise NothingJoined(_why_unjoined(options, started.report_dir, str(exc))) from None
    except BaseException:  # before the watch began (Ctrl-C, a full disk): nothing left
        started.abandon()
        raise


def _removed(report_dir: str) -> ValueError:
    """A run folder gone by the run's end (a clean-up job, a user's `rm -r`): nothing of the
    run can be checked, whether or not its ranks' joins were seen before it went."""
    return ValueError(
        f"the run folder {report_dir} was removed while the run ran: the ranks' reports went "
        "with it (the audit's, the traces), so the run could not be checked (the ranks' output "
        "says where the audit stopped)"
    )


def _first_write(report_dir: str, options) -> None:
    """The run folder's metadata, its first file. A folder that cannot be written (a full
    disk) is a run that cannot be checked: ValueError (one line, exit 2), the folder
    removed (the caller ends a launcher command it started: nothing of the run is left)."""
    try:
        runs.write_metadata(Path(report_dir), options.to_dict())
    except OSError as exc:
        raise unwritable(report_dir, exc) from None


def _metadata_beside(report_dir: str, options) -> None:
    """The run folder's metadata, written while a launcher command already runs (the CLI
    started it before it imported torch): a disk the command filled meanwhile costs the
    metadata, not the run, whose watch and verdict go on (the audit says where it stopped).
    A disk full before the command started was refused then (`script_start.run_folder`)."""
    with contextlib.suppress(OSError):
        runs.write_metadata(Path(report_dir), options.to_dict())


def _why_unjoined(options, report_dir: str, said: str) -> str:
    """The one line of a launcher command nothing of which joined a process group, in the
    `--nproc` form's words where its processes said why (`launching/unjoined.py`): the script
    does not exist, or needs CUDA; else `said` (nothing joined), with what they raised and
    where, and under --on-cpu what the rehearsal mapped."""
    notes = unjoined.read(report_dir)
    missing = next((n["missing"] for n in notes if n.get("missing")), None)
    if missing is not None:
        return (
            f"script {missing} does not exist: `{' '.join(options.script)}` ran it, and Python "
            "could not open it"
        )
    needs = [NeedsCuda(**n["needs_cuda"]) for n in notes if n.get("needs_cuda")]
    if needs:
        first = min(needs, key=lambda n: n.where)
        return (
            f"the script cannot run on this machine: {first.message(options.backend)} "
            f"(each process's traceback: {report_dir}/unjoined.<pid>.stderr)"
        )
    raised = [n for n in notes if n.get("error")]
    if raised:
        where = f" at {raised[0]['where']}" if raised[0].get("where") else ""
        said += f"; its processes raised {raised[0]['error']}{where} before joining (see above)"
    if options.on_cpu:
        said += f"; {on_cpu_report.left_early(*on_cpu_report.read_unjoined(report_dir))}"
    return said


def _rehearsed(run, report_dir: str, world: int) -> dict:
    """What `--on-cpu` mapped on every rank; a ValueError (exit 2, no verdict) naming the
    first call it could not map, whether the rank died of it or the script caught it."""
    mapped, refused = on_cpu_report.read(report_dir, range(world))
    raised = [o.value for o in run.outcomes if isinstance(o.value, CannotMap)]
    first = refused or min(raised, key=lambda c: c.where, default=None)
    if first is not None:
        raise ValueError(
            f"{first.message()}; what was mapped before it: {report_dir}/rank<r>.on_cpu.json"
        )
    unmapped = on_cpu_report.read_unmapped(report_dir, range(world))
    return {"ranks": world, "mapped": list(mapped), "unmapped": list(unmapped)}


def finish_report(report_dir: str, world: int) -> tuple[dict[str, str], dict[int, int]]:
    """Turn the binary traces into rank<r>.collectives.jsonl; the captured files, and the
    ranks' process ids (from their traces)."""
    files: dict[str, str] = {}
    pids: dict[int, int] = {}
    for r in range(world):
        jsonl = os.path.join(report_dir, f"rank{r}.collectives.jsonl")
        trace_path = os.path.join(report_dir, f"rank{r}.trace")
        try:
            trace = trace_file.export_jsonl(trace_path, jsonl)
        except OSError:  # a full disk: the binary trace stays as it is
            trace = trace_file.read_trace(trace_path)
        if trace is not None:
            pids[r] = trace.pid
        kinds = ("collectives.jsonl", "stack", "stderr", "stdout", "flight_recorder.json",
                 "audit.json", on_cpu_report.REPORT_SUFFIX)  # fmt: skip
        for kind in kinds:
            path = os.path.join(report_dir, f"rank{r}.{kind}")
            if os.path.exists(path) and os.path.getsize(path) > 0:
                files[f"rank{r}.{kind}"] = path
        with contextlib.suppress(OSError):  # the helper's address: not a report
            os.remove(os.path.join(report_dir, f"rank{r}.{capture.ADDRESS}"))
    for name in sorted(os.listdir(report_dir)):
        if name.startswith(("nccl.", "nccl_trace_rank_")):
            files[name] = os.path.join(report_dir, name)
    return files, pids


def races_of(report_dir: str, world: int) -> tuple[dict, ...]:
    """The race sanitizer's findings of every rank (`rank<r>.races.json`)."""
    found = []
    for r in range(world):
        with contextlib.suppress(OSError, ValueError):
            found += json.loads((Path(report_dir) / f"rank{r}.races.json").read_text())
    return tuple(found)


def audit_of(report_dir: str, world: int) -> AuditReport | None:
    """The audit's report: every rank reaches the same findings (they are decided by
    reductions), so the one that audited most is taken (a rank that crashed wrote less); of
    those, under join(), the one that trained longest (its steps after others joined)."""
    reports = [
        AuditReport.read(os.path.join(report_dir, f"rank{r}.audit.json")) for r in range(world)
    ]
    reports = [r for r in reports if r is not None]
    # a report written at the end (or saying why the audit stopped) before one left behind
    key = lambda r: (r.audits, len(r.findings), sum(r.joined.values()), r.finished,  # noqa: E731
                     r.stopped is not None)  # fmt: skip
    return max(reports, key=key, default=None)
