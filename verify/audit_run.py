"""`python -m verify.audit_run [--audit-every K] [--sanitize] [--on-cpu] train.py ARGS`: run a
training script as one rank of a torchrun job under every script check: the hang watchdog (as
`verify.hang_run`), the replica audit at every optimizer step, the race sanitizer when
asked, and with `--on-cpu` a script written for CUDA rehearsed on CPU ranks (docs/audit.md,
"Rehearsing a CUDA script on CPU"; rank 0 prints what was mapped, and a call that could not
be mapped is one line and exit 2). On one machine `python -m verify audit --nproc N -- train.py ARGS` starts the ranks
itself; across machines:

    torchrun --nnodes 2 --nproc-per-node 8 ... -m verify.audit_run train.py ARGS

Every rank reaches the same findings (they are decided by reductions over all ranks); rank 0
prints them when the script ends, and every rank exits 1 when the replicas diverged, or 2 when
the script ended well without an optimizer step in a group of 2 or more ranks (nothing was
audited: not a pass), so torchrun reports the job as failed. Reports go to `profiles/hang_torchrun_<run id>_<host>/`
(or DDP_VERIFY_HANG_DIR): `rank<r>.audit.json` beside the hang report's files. Exit 2 on bad
arguments.
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: python -m verify.audit_run [--audit-every K] [--sanitize] [--on-cpu] train.py ARGS"


def parse(argv: list[str]) -> tuple[int, bool, list[str], bool]:
    """(every, sanitize, the script and its arguments, on_cpu); ValueError on bad input."""
    every, sanitize, on_cpu, i = 1, False, False, 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--sanitize":
            sanitize = True
        elif argv[i] == "--on-cpu":
            on_cpu = True
        elif argv[i] == "--audit-every" and i + 1 < len(argv) and argv[i + 1].isdigit():
            every, i = int(argv[i + 1]), i + 1
        elif argv[i] == "--":
            i += 1
            break
        else:
            raise ValueError(f"unexpected argument {argv[i]} ({USAGE})")
        i += 1
    if every < 1:
        raise ValueError(f"--audit-every must be >= 1, got {every}")
    script = argv[i:]
    if not script:
        raise ValueError(USAGE)
    if not os.path.isfile(script[0]):
        raise ValueError(f"script {script[0]} does not exist")
    return every, sanitize, script, on_cpu


def main(argv: list[str]) -> int:
    from verify import plugins
    from verify.cli import text_audit
    from verify.launching.torchrun import script_main, script_report_dir
    from verify.script_audit import AuditReport

    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        every, sanitize, script, on_cpu = parse(argv)
    except ValueError as exc:
        print(f"verify.audit_run: error: {exc}", file=sys.stderr)
        return 2
    code = 0
    try:
        wanted = plugins.script_setups(sanitize=sanitize, audit_every=every, on_cpu=on_cpu)
        script_main(script, setups=wanted, tool="verify.audit_run")
    except SystemExit as exc:  # the script called sys.exit(): its code, after the verdict
        code = exc.code if isinstance(exc.code, int) else 1
    rank = int(os.environ.get("RANK", "0"))
    report_dir = script_report_dir()
    mapped = on_cpu_lines(report_dir, rank) if on_cpu else []
    if mapped and mapped[0].startswith("verify.audit_run: error:"):
        print(mapped[0], file=sys.stderr, flush=True)  # no verdict: a call it could not map
        return 2
    report = AuditReport.read(os.path.join(report_dir, f"rank{rank}.audit.json"))
    faulty = report is not None and bool(report.faults)
    nothing = not faulty and code == 0 and (report is None or report.audits == 0)
    stopped = not (faulty or nothing) and code == 0 and not (report.finished and not report.stopped)
    if rank == 0:
        verdict = ("fault" if faulty else "nothing audited" if nothing
                   else "audit stopped" if stopped else "pass")  # fmt: skip
        lines = text_audit.findings(report) + mapped + [text_audit.verdict_line(report, verdict)]
        print("\n".join(["verify.audit_run:", *lines, f"report: {report_dir}"]), flush=True)
    return 1 if faulty else 2 if nothing or stopped else code


def on_cpu_lines(report_dir: str, rank: int) -> list[str]:
    """What this rank's rehearsal mapped, as text (`--on-cpu`); or one error line when it met
    a call it could not map. Every rank counts its own calls: this rank's are shown."""
    from verify.oncpu import report

    mapped, refused = report.read(report_dir, [rank])
    if refused is not None:
        return [f"verify.audit_run: error: {refused.message()}"]
    unmapped = list(report.read_unmapped(report_dir, [rank]))
    return report.lines({"ranks": 1, "rank": rank, "mapped": list(mapped), "unmapped": unmapped})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
