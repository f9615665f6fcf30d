"""Values signed with a job's secret, for a key-value store another process can reach.

torchrun's store listens on every interface (the user's launcher decides that), and any
process that reaches it can read, write and delete keys. What the tool keeps there (a node
watchdog's status, report and verdict claim, `jobwide.py`; a launch's rank reports,
`torchrun.py`) is therefore sealed: `pack` puts an HMAC-SHA256 of the key and the data under
the job's secret before the data, and `unpack` gives the data back only where that MAC checks
out, so a value that was forged, or moved from another key, is None: ignored, and reported by
the caller. Key names are derived from the secret too (`Seal.prefix`), so they cannot be
guessed either (torchrun's default rendezvous names every job's run "none").

The secret (`agree`): with one process it is that process's own random secret, which never
leaves it. With several it is rank 0's, broadcast over a gloo group of the job's ranks met
through the same store: a peer there is one the job's own rendezvous chose, exactly as the
job's own process groups (which carry its gradients) are, so that trust is no weaker than
torch's. What the store alone says is never believed.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os

import torch

from verify.launching import loopback

_MAC = 32  # bytes of HMAC-SHA256


class Seal:
    """Pack and unpack values under one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self.prefix = hmac.new(secret, b"key names", hashlib.sha256).hexdigest()[:24]

    def pack(self, key: str, data: bytes) -> bytes:
        return self._mac(key, data) + data

    def unpack(self, key: str, blob: bytes) -> bytes | None:
        """The data sealed under `key`; None where the seal does not check out."""
        mac, data = blob[:_MAC], blob[_MAC:]
        return data if hmac.compare_digest(mac, self._mac(key, data)) else None

    def _mac(self, key: str, data: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + data, hashlib.sha256).digest()


def agree(store, rank: int, size: int, timeout: datetime.timedelta) -> tuple[Seal, str | None]:
    """The job's seal, the same on each of `size` ranks (module docstring): every one of them
    calls this with the same `store` (prefixed for this agreement). Returns the seal and the
    interface the gloo group was made on (None: torch's default; also with one rank: no
    group). Raises what the group raises where a rank never comes within `timeout`."""
    if size == 1:
        return Seal(os.urandom(32)), None
    group, name = loopback.gloo_group(store, rank, size, timeout)
    secret = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([secret], opts).wait()
    return Seal(secret.numpy().tobytes()), name
