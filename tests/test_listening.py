"""Nothing the tool starts listens beyond loopback (docs/design.md, "What listens, and where").

While each kind of launch runs, a thread reads the system's socket table every 50 ms, and
every listening socket of this process or of a process below it (the zygote, the ranks) must
be bound to 127.0.0.1 or ::1. Each launch must also show the listeners it is known to open,
so the check cannot pass by sampling nothing. TensorBoard, the one server the suite starts
itself, is checked the same way while it serves (tests/test_profile.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from tests.processes import Listener, descendants, free_port, listeners
from verify.launching import RankContext, launch, loopback

SCRIPT = "tests/fixtures/hang_script.py"
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _listening():
    """The listeners of this process's tree seen while the block runs (not those before)."""
    me = os.getpid()
    before = listeners({me} | descendants(me))
    seen: set[Listener] = set()
    stop = threading.Event()

    def sample() -> None:
        while True:
            seen.update(listeners({me} | descendants(me)) - before)
            if stop.wait(0.05):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def _hold(ctx: RankContext, seconds: float) -> None:
    dist.barrier()  # every rank's gloo is up, and listening
    time.sleep(seconds)  # long enough for the sampler to see it


def test_nothing_a_launch_opens_listens_beyond_loopback(run_cli, tmp_path):
    """Function ranks (zygote-forked, file store, gloo), then a user's script under the
    sanitizer (the script path: the store this process hosts, the ranks' gloo; the sanitizer
    only adds checks inside the ranks). Before the fix the script's store showed as `::` or
    `0.0.0.0`, whatever host name it was given."""
    with _listening() as seen:
        result = launch(_hold, world_size=2, args=(0.5,))
    assert result.ok, result.outcomes
    ranks = {o.pid for o in result.outcomes}
    assert {x.pid for x in seen} >= ranks, seen  # gloo listens in every rank
    assert all(x.loopback for x in seen), sorted(seen, key=str)

    with _listening() as seen:
        ran = run_cli(
            "hang", "--nproc", "2", "--sanitize", "--json", "--out", str(tmp_path),
            "--", SCRIPT, "sleep", "0.5",
        )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    ranks = set(json.loads(ran.stdout)["pids"].values())
    assert os.getpid() in {x.pid for x in seen}, seen  # the ranks' rendezvous store
    assert {x.pid for x in seen} >= ranks, seen
    assert all(x.loopback for x in seen), sorted(seen, key=str)


def test_a_stale_torchrun_environment_is_one_line_and_listens_nowhere(tmp_path):
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left over from a job, and no job there:
    the check says so in one line, exit 2, and never listens (it became the server of a store
    on every interface at that port, waited 121 s for a peer, and ended in a DistStoreError
    traceback, exit 1). A rank never hosts the job's store: torchrun's agent does."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "verify", "consistency", "--impl", "bucketed"], cwd=tmp_path,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: set[Listener] = set()
    try:
        while proc.poll() is None and proc.returncode is None:
            seen |= listeners({proc.pid} | descendants(proc.pid))
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert err.splitlines() == [err.strip()], err[-3000:]
    assert f"MASTER_PORT={port}" in err and "no job's store answers" in err, err
    assert seen == set(), seen


def _side_group_on_one_node(ctx: RankContext) -> tuple[str | None, list[str]]:
    """In a rank: the audit's group made as in the launcher form on one node (no
    GLOO_SOCKET_IFNAME: only the tool's own ranks get it, `runner.py`; torchrun's
    LOCAL_WORLD_SIZE equal to the world), and the addresses this process listens on."""
    from verify.script_audit.side_group import SideGroup

    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    os.environ["LOCAL_WORLD_SIZE"] = str(ctx.world_size)
    group = SideGroup()
    assert group.ready()
    assert group.max([ctx.rank]) == [ctx.world_size - 1]  # the group is made, and works
    return group.interface, sorted({x.address for x in listeners({os.getpid()})})


def test_the_audits_own_group_is_on_loopback_on_one_node():
    """The audit's gloo group (script_audit/side_group.py) is made on the loopback device
    when every rank is on this machine, whatever the host name resolves to (it was made on
    gloo's default device: the host name's address, on most machines the network's)."""
    result = launch(_side_group_on_one_node, world_size=2)
    assert result.ok, result.summary()
    for interface, addresses in result.values:
        assert interface == loopback.ifname(), interface
        assert addresses and all(a in ("127.0.0.1", "::1") for a in addresses), addresses


def test_a_group_of_the_tools_faces_the_network_only_across_nodes(monkeypatch):
    """Where the ranks span nodes (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE) the group
    must reach them: torch's default device, as the job's own groups; a GLOO_SOCKET_IFNAME
    the user set wins; on one node, loopback."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert loopback.interface() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert loopback.interface() == loopback.ifname()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert loopback.interface() is None
