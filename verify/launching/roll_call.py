"""In a launcher command's ranks: whether every rank of the job is audited, agreed by the
audited ones before any waits for another in the audit's group.

A rank of the command is the tool's only if it inherited the tool's environment
(`launcher.py`: the bootstrap on PYTHONPATH, the run folder). A launcher that cleans its
workers' environment, as some schedulers do, starts ranks that train but run nothing of the
tool: the audit's group (`script_audit/side_group.py`) would wait for them for its whole
timeout, while the script's own collectives went on without it. So each rank of the tool
answers a roll call in the job's store as soon as its `init_process_group` returns
(`answer`), and the audit's group is made only once every rank has answered (`absent`).

The bound on waiting for an answer: when `init_process_group` returns on a rank over gloo,
its full mesh is connected, so every peer is inside its own `init_process_group` and
returns within moments; a rank of the tool answers on its return, before the script gets the
call back. A peer that has not answered `ROLL_CALL_S` after this rank's own answer is no rank
of the tool. The first rank to know (every rank answered, or one did not in time) decides
for all, atomically (`compare_set`), and every audited rank follows the decision: none waits
in the group for a rank that will never come, and none audits alone.

The store is the user's launcher's (torchrun's listens on every interface), so the answers
and the decision are sealed with the run's secret, which the tool hands down in the
environment (`LAUNCHED_SECRET_ENV`, `sealed.py`): only the tool's ranks hold it, and a forged
answer or decision does not check out (it is ignored, and a forged decision is replaced).
Outside the launcher form (no secret) every rank is the tool's own, and there is no roll call.
"""

from __future__ import annotations

import json
import os
import time

from verify.launching.env import LAUNCHED_SECRET_ENV

# Measured from this rank's own answer, so only the skew between two ranks' adoptions counts
# (the same imports and set-up on each, after the same return): a fraction of a second idle,
# seconds on a machine whose cores are all busy. Generous, since a healthy rank is never
# waited for this long (its answer ends the wait) and a cleaned one costs this once a run.
ROLL_CALL_S = 30.0
_PREFIX = "ddp-verify/audit/roll/"
_returned: list[float] = []  # when this process's init_process_group returned


def answer(rank: int) -> None:
    """This rank is the tool's: said in the job's store (right after `init_process_group`)."""
    _returned[:] = [time.monotonic()]
    seal, store = _seal(), _store()
    if seal is not None:
        key = _key(seal, f"here/{rank}")
        store.set(key, seal.pack(key, b"here"))


def absent(size: int) -> list[int]:
    """The ranks of the `size` that are not the tool's, as every audited rank agrees: [] where
    all are (or outside the launcher form). Waits at most ROLL_CALL_S from this rank's own
    `init_process_group` return for a decision."""
    seal = _seal()
    if seal is None:
        return []
    store, decided = _store(), _key(seal, "decided")
    end = (_returned[0] if _returned else time.monotonic()) + ROLL_CALL_S
    while True:
        if store.check([decided]):
            found = _decision(seal, decided, store.get(decided))
            if found is not None:
                return found
        missing = [r for r in range(size) if not _answered(store, seal, r)]
        if missing and time.monotonic() < end:
            time.sleep(0.05)
            continue
        mine = seal.pack(decided, json.dumps(missing).encode())
        there = store.compare_set(decided, "", mine)
        if there != mine and _decision(seal, decided, there) is None:
            store.compare_set(decided, there, mine)  # a forged decision is no decision


def said(missing: list[int]) -> str:
    """The one line naming the ranks that were not audited."""
    ranks = ", ".join(map(str, missing))
    who = f"rank {ranks}" if len(missing) == 1 else f"ranks {ranks}"
    return (
        f"{who} did not inherit the tool's environment: {'it' if len(missing) == 1 else 'they'} "
        "joined the job without answering the audit's roll call (a launcher that cleans its "
        "workers' environment starts them without the tool's PYTHONPATH and DDP_VERIFY_* "
        f"variables), so {'it was' if len(missing) == 1 else 'they were'} not audited"
    )


def _answered(store, seal, rank: int) -> bool:
    key = _key(seal, f"here/{rank}")
    return store.check([key]) and seal.unpack(key, store.get(key)) == b"here"


def _decision(seal, key: str, blob: bytes) -> list[int] | None:
    data = seal.unpack(key, blob)
    try:
        found = json.loads(data) if data is not None else None
    except ValueError:
        return None
    ok = isinstance(found, list) and all(type(r) is int for r in found)
    return found if ok else None


def _seal():
    secret = os.environ.get(LAUNCHED_SECRET_ENV, "")
    if not secret:
        return None
    from verify.launching.sealed import Seal

    return Seal(bytes.fromhex(secret))


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _key(seal, name: str) -> str:
    return f"{_PREFIX}{seal.prefix}/{name}"
