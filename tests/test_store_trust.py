"""What the tool reads from torchrun's store, which any process that reaches it can write
(it listens on every interface): nothing there is unpickled or believed on its word.

A real TCPStore client on loopback, beside a healthy `torchrun -m verify.hang_run` job, finds
the tool's keys (`list_keys`) and writes a pickle that runs code to the node's status key and
a claim of a hang to its claim key: the verdict stays OK, no code runs, and the tool says it
ignored them (`verify/launching/jobwide.py`, `sealed.py`, `inert.py`). Then, in-process and in
milliseconds: a launch's report exchange under torchrun waits past a forged report for the
rank's own (`exchange.collect`), and what a sealed value may hold is checked on read.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.processes import free_port
from tests.torchrun_jobs import one_node
from verify.launching import exchange, inert, sealed
from verify.launching.node_ranks import NodeStatus
from verify.launching.outcome import RankReport

TRAIN = """
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
w = torch.zeros(4)
for step in range(40):
    g = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(g)
    w -= 0.1 * g
    time.sleep(0.2)
print(f"rank {dist.get_rank()}: w={w.tolist()}")
dist.destroy_process_group()
"""


class _Plant:
    """Unpickled, it creates the file `path`: the proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _attack(port: int, planted: Path, found: list[str], until: float) -> None:
    """A hostile client of the store at `port`: once the tool's status key shows, a pickle
    that runs code there (again and again, for 3 s) and a claim of a hang, once."""
    while time.monotonic() < until:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            break
        time.sleep(0.1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
    )
    evil = pickle.dumps(_Plant(str(planted)))
    while time.monotonic() < until and not found:
        found += [k for k in store.list_keys() if re.fullmatch(r".*/status/0", k)]
        time.sleep(0.05)
    with contextlib.suppress(dist.DistError):  # the job, and its store, ended first
        for key in found[:1]:
            store.set(key[: -len("status/0")] + "claim", "hang:0")
            stop = time.monotonic() + 3
            while time.monotonic() < stop:
                store.set(key, evil)
                time.sleep(0.1)


def test_a_hostile_store_client_changes_no_verdict_and_runs_no_code(tmp_path):
    """The attack (module docstring) on a healthy job under torchrun's default rendezvous,
    whose run id is "none": before the fix the pickle ran inside rank 0 and the watchdog died
    with no verdict, and the claim alone made the job a HANG and killed its ranks."""
    (tmp_path / "train.py").write_text(TRAIN)
    planted, found, port = tmp_path / "planted", [], free_port()
    attacker = threading.Thread(
        target=_attack, args=(port, planted, found, time.monotonic() + 240), daemon=True
    )
    attacker.start()
    node = one_node(tmp_path, str(tmp_path / "train.py"), master_port=port)
    attacker.join(timeout=30)
    said = "\n".join(node.ours()) or node.stderr[-3000:]
    assert found, f"the attacker never found the tool's keys: {said}"
    assert not planted.exists(), "a pickle from the store ran in the tool"
    assert node.returncode == 0 and not node.killed, said
    assert "OK: no hang" in said and "HANG" not in said, said
    assert "ignored claim in the job's store: not a claim this job's nodes sealed" in said, said
    assert not node.leftover, node.leftover


def _secret_pair() -> tuple[sealed.Seal, sealed.Seal]:
    """The seals two ranks agree, met in threads over a store of this process."""
    store, seals = dist.HashStore(), {}

    def agree(rank: int) -> None:
        seals[rank], _ = sealed.agree(store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=agree, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return seals[0], seals[1]


def test_a_launch_waits_past_a_forged_report_for_the_ranks_own(tmp_path, capsys):
    """Under torchrun a launch's ranks exchange reports in the job's store: a pickle that
    runs code, put at rank 1's key before rank 1 reports, is not rank 1's report (it was
    unpickled as one); rank 1's own, sealed, is taken when it comes."""
    mine, theirs = _secret_pair()
    assert mine.prefix == theirs.prefix
    store, planted = dist.HashStore(), tmp_path / "planted"
    keys = {r: f"ddp-verify/launch1/{mine.prefix}/{r}" for r in range(2)}
    own = RankReport("ok", value=pickle.dumps(7))
    store.set(keys[1], pickle.dumps(_Plant(str(planted))))
    later = threading.Timer(0.3, lambda: store.set(keys[1], theirs.pack(keys[1], inert.dumps(own))))
    later.start()
    got = {0: RankReport("ok", value=pickle.dumps(3))}
    assert exchange.collect(store, keys, got, mine, wait_s=30)
    later.join()
    assert got[1] == own and got[1].outcome(1).value == 7
    assert not planted.exists()
    assert f"ignored {keys[1]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "raw",
    [b'{"events": 1}', b'{"events": "1", "waiting": true, "busy": false, "ended": false, '
     b'"last_event": 0}', b"[]", b"\x80\x04K\x01.", b'{"events": true, "waiting": true, '
     b'"busy": false, "ended": false, "last_event": 0, "mode": 1}'],
)  # fmt: skip
def test_a_sealed_value_holds_data_of_its_type_or_is_refused(raw):
    """What `inert.loads` refuses: a missing field, a wrong type, another shape, a pickle, an
    unknown field; the value a node writes comes back equal."""
    with pytest.raises(inert.Malformed):
        inert.loads(NodeStatus, raw)
    status = NodeStatus(12, True, False, False, 1.5, float("inf"), True)
    assert inert.loads(NodeStatus, inert.dumps(status)) == status


def test_a_seal_checks_its_key_and_its_secret():
    """A value moved to another key, or sealed under another secret, does not check out."""
    one, other = sealed.Seal(b"a" * 32), sealed.Seal(b"b" * 32)
    blob = one.pack("k/status/0", b"{}")
    assert one.unpack("k/status/0", blob) == b"{}"
    assert one.unpack("k/status/1", blob) is None
    assert other.unpack("k/status/0", blob) is None
    assert one.unpack("k/claim", b"hang:0") is None
