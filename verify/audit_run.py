"""`python -m verify.audit_run [--audit-every K] [--sanitize] train.py ARGS`: run a training
script as one rank of a torchrun job under every script check: the hang watchdog (as
`verify.hang_run`), the replica audit at every optimizer step, and the race sanitizer when
asked. On one machine `python -m verify audit --nproc N -- train.py ARGS` starts the ranks
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

USAGE = "usage: python -m verify.audit_run [--audit-every K] [--sanitize] train.py ARGS"


def parse(argv: list[str]) -> tuple[int, bool, list[str]]:
    """(every, sanitize, the script and its arguments); ValueError on bad input."""
    every, sanitize, i = 1, False, 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--sanitize":
            sanitize = True
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
    return every, sanitize, script


def main(argv: list[str]) -> int:
    from verify.cli import text_audit
    from verify.launching.torchrun import script_main, script_report_dir
    from verify.script_audit import AuditReport

    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        every, sanitize, script = parse(argv)
    except ValueError as exc:
        print(f"verify.audit_run: error: {exc}", file=sys.stderr)
        return 2
    code = 0
    try:
        script_main(script, audit_every=every, sanitize=sanitize)
    except SystemExit as exc:  # the script called sys.exit(): its code, after the verdict
        code = exc.code if isinstance(exc.code, int) else 1
    rank = int(os.environ.get("RANK", "0"))
    report_dir = script_report_dir()
    report = AuditReport.read(os.path.join(report_dir, f"rank{rank}.audit.json"))
    faulty = report is not None and bool(report.faults)
    nothing = not faulty and code == 0 and (report is None or report.audits == 0)
    if rank == 0:
        verdict = "fault" if faulty else "nothing audited" if nothing else "pass"
        lines = text_audit.findings(report) + [text_audit.verdict_line(report, verdict)]
        print("\n".join(["verify.audit_run:", *lines, f"report: {report_dir}"]), flush=True)
    return 1 if faulty else 2 if nothing else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
