"""The node watchdogs' keys in a torchrun job's store (`jobwide.py`), sealed.

That store listens on every interface (torchrun's choice), and any process that reaches it
can list, write and delete keys, so nothing read from it is unpickled or believed on its
word: every value is inert data (JSON, `inert.py`) sealed with the job's secret
(`sealed.py`), under key names derived from that secret. The nodes' watchdogs agree the
secret over a gloo group of their own, met through the store as the job's own groups are
(one node: the watchdog's own secret, never sent). A value that does not check out (forged,
or moved from another key) is ignored and said once on stderr; a forged claim is no claim,
and the first sealed one replaces it.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from verify.launching import inert, sealed

REASONS = ("hang", "crash", "end")  # what a verdict is claimed for


class Board:
    """Sealed values under the job's keys: `key` arguments are relative to its prefix."""

    def __init__(self, store, seal: sealed.Seal, who: str) -> None:
        self.store, self._seal, self._who = _Store(store), seal, who
        self.prefix = f"ddp-verify/job/{seal.prefix}/"
        self._ignored: set[str] = set()

    @classmethod
    def connect(cls, meeting: str, node: int, nodes: int, wait_s: float, answer_s: float, who):
        """The board of node `node` of `nodes`: the job's store (MASTER_ADDR:MASTER_PORT, its
        calls' timeout `answer_s`), its secret agreed under the prefix `meeting` within
        `wait_s` (as long as a rank may take to start). `who` names the lines said."""
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=wait_s),
        )  # fmt: skip
        seal, _ = sealed.agree(dist.PrefixStore(meeting, store), node, nodes, store.timeout)
        store.set_timeout(datetime.timedelta(seconds=answer_s))
        return cls(store, seal, who)

    def set(self, key: str, value) -> None:
        full = self.prefix + key
        self.store.set(full, self._seal.pack(full, inert.dumps(value)))

    def has(self, *keys: str) -> bool:
        return self.store.check([self.prefix + k for k in keys])

    def get(self, key: str, kind):
        """The value of type `kind` at `key` (which must be there); None where it does not
        check out."""
        return self.open(key, self.store.get(self.prefix + key), kind)

    def raw(self, keys: list[str]) -> list[bytes]:
        """What `keys` hold (all must be there), unopened: `open` each."""
        return self.store.multi_get([self.prefix + k for k in keys])

    def wait(self, keys: list[str], seconds: float) -> None:
        full = [self.prefix + k for k in keys]
        self.store.wait(full, datetime.timedelta(seconds=seconds))

    def open(self, key: str, blob: bytes, kind):
        data = self._seal.unpack(self.prefix + key, blob)
        if data is None:
            self.ignore(key, "not sealed with this job's secret")
            return None
        try:
            return inert.loads(kind, data)
        except inert.Malformed as exc:  # sealed by a node, yet not what it should be: a bug
            self.ignore(key, f"malformed ({exc})")
            return None

    def claim(self, reason: str, node: int) -> None:
        """Claim the verdict for `reason`, once: the first sealed claim stands, and a value
        there that is no sealed claim is replaced."""
        key = self.prefix + "claim"
        mine = self._seal.pack(key, f"{reason}:{node}".encode())
        there = self.store.compare_set(key, "", mine)
        if there != mine and self._claim_in(there) is None:
            self.store.compare_set(key, there, mine)

    def claimed(self) -> tuple[str, int] | None:
        """The verdict's claim (its reason and node) once one is made; None before."""
        key = self.prefix + "claim"
        return self._claim_in(self.store.get(key)) if self.store.check([key]) else None

    def _claim_in(self, blob: bytes) -> tuple[str, int] | None:
        data = self._seal.unpack(self.prefix + "claim", blob)
        reason, _, node = (data or b"").decode(errors="replace").partition(":")
        if data is None or reason not in REASONS or not node.isdigit():
            self.ignore("claim", "not a claim this job's nodes sealed")
            return None
        return reason, int(node)

    def ignore(self, key: str, why: str) -> None:
        """Say once a key whose value was ignored: another process wrote the job's store."""
        if key not in self._ignored:
            self._ignored.add(key)
            print(f"{self._who}: ignored {key} in the job's store: {why}", file=sys.stderr,
                  flush=True)  # fmt: skip


class _Store:
    """The job's store until it is lost (it goes with the first node's agent): from then on
    every call fails at once, rather than each leaving the client's warning on stderr."""

    def __init__(self, store) -> None:
        self._store, self.gone = store, False

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args):
            if self.gone:
                raise ConnectionError("the job's store is gone")
            try:
                return method(*args)
            except dist.DistNetworkError:
                self.gone = True
                raise

        return call
