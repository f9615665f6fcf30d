"""A launch's rank reports under torchrun (`torchrun.join`): through the job's key-value store
rather than a collective, sealed.

The store is one any process may write (torchrun's listens on every interface): a report is
inert data (`inert.py`) sealed with a secret the launch's ranks agreed before fn ran
(`sealed.py`: rank 0's, sent over a gloo group of the job's ranks, whose peers the job's own
rendezvous chose, as for the job's own groups), under a key named after that secret. Its
return value is pickled inside, and unpickled (`RankReport.outcome`) only once the seal
checks out: no weaker than torch's own trust in its peers. A value that does not check out is
not the rank's report: it is said, and waited past.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time

import torch.distributed as dist

from verify.launching import inert, sealed
from verify.launching.outcome import RankReport
from verify.launching.supervisor import GRACE_S


def agree(prefix: str, rank: int, world_size: int, timeout_s: float) -> sealed.Seal:
    """The seal of this launch's reports: a secret rank 0 sends the others over a gloo group
    of the job's ranks (`sealed.agree`), before fn runs, so no collective of fn's meets it."""
    store = dist.PrefixStore(f"{prefix}seal/", dist.distributed_c10d._get_default_store())
    seal, _ = sealed.agree(store, rank, world_size, datetime.timedelta(seconds=timeout_s))
    return seal


def reports(prefix, rank, world_size, report, timeout_s, created, seal) -> list:
    """Every rank's report, through the job's key-value store rather than a collective: a
    rank still inside fn's collectives cannot be mis-paired with the exchange, and a rank that
    failed does not wait for the process-group timeout. It waits a grace for its peers, then
    (if it created the group) destroys it, which makes peers blocked on it fail at once and
    report, and waits for their reports for at most `timeout_s`. Each sealed (docstring)."""
    store = dist.distributed_c10d._get_default_store()
    keys = {r: f"{prefix}{seal.prefix}/{r}" for r in range(world_size)}
    store.set(keys[rank], seal.pack(keys[rank], inert.dumps(report)))
    got = {rank: report}
    waits = [timeout_s] if report.ok else [GRACE_S, timeout_s]
    for i, wait_s in enumerate(waits):
        if collect(store, keys, got, seal, wait_s):
            break
        if i == 0 and len(waits) > 1 and created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    lost = RankReport.failure(f"did not report within {timeout_s:g}s", status="crashed")
    return [got.get(r, lost) for r in range(world_size)]


def collect(store, keys: dict[int, str], got: dict, seal: sealed.Seal, wait_s: float) -> bool:
    """Read into `got` each rank's report that checks out, for up to `wait_s`; True once
    every rank's is there."""
    end = time.monotonic() + wait_s
    while len(got) < len(keys):
        missing = [r for r in keys if r not in got]
        left = end - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(Exception):  # some are not there by the deadline
            store.wait([keys[r] for r in missing], datetime.timedelta(seconds=left))
        forged = False
        for r in missing:
            with contextlib.suppress(Exception):
                # check() first: get() on a missing key would block for the store's timeout.
                if store.check([keys[r]]):
                    rep = _report(seal, keys[r], store.get(keys[r]))
                    if rep is None:
                        forged = True
                    else:
                        got[r] = rep
        if forged:
            time.sleep(0.05)  # the rank's own report will replace it
    return True


def _report(seal: sealed.Seal, key: str, blob: bytes) -> RankReport | None:
    data = seal.unpack(key, blob)
    try:
        if data is not None:
            return inert.loads(RankReport, data)
    except inert.Malformed:
        pass
    print(f"verify: ignored {key} in the job's store: not a report this job sealed",
          file=sys.stderr, flush=True)  # fmt: skip
    return None
