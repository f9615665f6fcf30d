"""`--on-cpu` on a user's script: a script written for CUDA rehearsed on every CPU rank of it,
as a set-up of the runtime (`verify/launching/setups.py`; named by `verify/plugins.py`). Each
rank's mapping report goes to `rank<r>.on_cpu.json` in the run folder; a failure the script
died of is read here first (`reads_failures`): a call the rehearsal could not map is a usage
error, never a script that needs CUDA.

In a launcher command's process (`launched.py`) the rehearsal is installed at the import of
torch (`early`), long before the process is a rank: it counts in memory until the adoption
starts this set-up, which names its file after the rank `init_process_group` gave (torchrun's
RANK or mp.spawn's `rank=` alike) and saves it; it is saved again at the rank's end, with the
call it could not map when that is what the rank died of. A process that never joins leaves
what it counted at the user's lines in `on_cpu.<pid>.json` when it exits (a script that
leaves before joining, as pytorch/examples' do when they count too few GPUs); the launcher
itself, which counts nothing of the user's, leaves nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass
from typing import ClassVar

from verify.oncpu.report import REPORT_SUFFIX, UNJOINED

# A launcher command's process: its rehearsal from its import of torch (None: it could not
# be installed, and the script runs unmapped); empty in the tool's own ranks.
_early: list = []


@dataclass(frozen=True)
class Rehearse:
    reads_failures: ClassVar[bool] = True

    def early(self) -> None:
        """In a launcher command's process, from the bootstrap once torch is imported: map
        CUDA to the CPU here (its report file is named at the adoption, `start`). A failure
        to install is said where the tool looks; the script then runs unmapped and fails on
        its first CUDA call as it would."""
        from verify.launching import launched

        _early.append(None)
        try:
            from verify import oncpu

            _early[0] = oncpu.install(None, -1)
            atexit.register(_save_unjoined)
        except Exception as exc:
            launched.say(f"on_cpu.{os.getpid()}.error", exc)

    def start(self, rank: int, folder: str):
        from verify import oncpu

        path = os.path.join(folder, f"rank{rank}.{REPORT_SUFFIX}")
        if not _early:  # a rank of the tool's own: installed now, over the other set-ups
            return oncpu.install(path, rank).finish
        if _early[0] is None:  # it could not be installed (said then): nothing to finish
            return lambda exc: None
        ledger = _early[0].ledger  # its report, under the rank now known
        ledger.path, ledger.rank = path, rank
        ledger.save()
        return _early[0].finish


def _save_unjoined() -> None:
    """At the exit of a process that never joined: what its rehearsal counted at the user's
    lines, for the line that says why the command left before any rank joined
    (`oncpu/report.py`, `left_early`)."""
    from verify.launching import launched
    from verify.launching.env import LAUNCHED_ENV

    ledger = _early[0].ledger
    if launched.joined() or not ledger.has_user_sites():
        return
    with contextlib.suppress(OSError, KeyError):
        ledger.path = os.path.join(os.environ[LAUNCHED_ENV], UNJOINED.format(pid=os.getpid()))
        ledger.save()
