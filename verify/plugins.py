"""The plug-ins a run of a user's script starts in its ranks, named for the runtime: the one
place that knows them. The front ends (`checks/script.py`, `checks/script_start.py`,
`verify.audit_run`, `verify.hang_run`) import this; the runtime (`verify/launching/`) never
does: it makes and starts the set-ups it is handed (`launching/setups.py`).

This module imports nothing of the plug-ins nor torch (a launcher command starts before the
tool imports torch, `verify/cli/head_start.py`): a set-up is named as "package.module:Class"
and imported in the rank.
"""

from __future__ import annotations

from verify.launching.env import LAUNCHED_ON_CPU_ENV
from verify.launching.setups import SetUp


def script_setups(
    *, sanitize: bool = False, audit_every: int | None = None, on_cpu: bool = False
) -> tuple[SetUp, ...]:
    """What runs around a user's script in each rank, in this order: the race sanitizer
    (`--sanitize`, `sanitize/setup.py`), the replica audit every `audit_every` optimizer steps
    (`audit`, None: off; `script_audit/setup.py`), and a script written for CUDA rehearsed on
    the CPU rank (`--on-cpu`, `oncpu/setup.py`), last: its wrappers sit over the others', which
    see the gloo the script is given, not the NCCL it asked for. In a launcher command's
    process the rehearsal starts at the import of torch (`early`)."""
    wanted = (
        SetUp("verify.sanitize.setup:Sanitize") if sanitize else None,
        None
        if audit_every is None
        else SetUp("verify.script_audit.setup:Audit", {"every": audit_every}),
        SetUp("verify.oncpu.setup:Rehearse", early=True) if on_cpu else None,
    )
    return tuple(s for s in wanted if s is not None)


def launcher_env(on_cpu_gpus: int) -> dict[str, str]:
    """What a launcher command's processes get for `--on-cpu` (`on_cpu_gpus`, 0: off): the
    GPUs of the node rehearsed (what `torch.cuda.device_count()` answers in a process that is
    no rank yet, `oncpu/cuda_api.py`; set, the bootstrap starts the rehearsal at the import of
    torch), and the machine's GPUs hidden from the launcher too, as in each rank."""
    if not on_cpu_gpus:
        return {LAUNCHED_ON_CPU_ENV: ""}
    return {LAUNCHED_ON_CPU_ENV: str(on_cpu_gpus), "CUDA_VISIBLE_DEVICES": ""}
