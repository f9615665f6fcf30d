"""Two torchrun agents on loopback, as two nodes of one job: what the multi-node tests run.

`two_nodes(folder, script, *args)` starts `torchrun --nnodes 2 --nproc-per-node 1 --node-rank
0|1 --master-addr 127.0.0.1 --master-port P -m verify.hang_run script ARGS`, one agent per
node, each in its own folder (its report folder lands there) and its own session, waits for
both (bounded), kills whatever is left of either session, and returns what each printed.

The port: node 0's agent hosts the job's store on it, so it must be free when the agent binds
it. The OS picks one (bind to port 0, read it, close); under `pytest -n auto` another test may
take it in between, so a launch whose agent could not bind is retried with a new port.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.processes import session_members

ROOT = Path(__file__).resolve().parents[1]
_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


@dataclass(frozen=True)
class Node:
    returncode: int
    stdout: str
    stderr: str
    folder: Path  # the node's working directory: its report folder is under profiles/
    leftover: tuple[int, ...]  # processes of its session still alive at the end (none, or a bug)

    def report(self) -> Path:
        return next((self.folder / "profiles").glob("hang_torchrun_*"))

    def ours(self) -> list[str]:
        """The lines the tool printed (not the script's, not torchrun's, not c10d's)."""
        return [ln for ln in self.stderr.splitlines() if ln.startswith("verify.hang_run")]


def two_nodes(folder: Path, script: str, *args: str, stall_s: float = 3.0) -> list[Node]:
    for _ in range(3):
        nodes = _launch(folder, script, args, stall_s, _free_port())
        if not any(_IN_USE.search(n.stderr) for n in nodes):
            return nodes
    return nodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(folder: Path, script: str, args, stall_s: float, port: int) -> list[Node]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), DDP_VERIFY_STALL_TIMEOUT=str(stall_s), OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cwd = folder / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "verify.hang_run", script, *args]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    outputs, left = [], []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=150))
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate())
        left = [_left_of(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its ranks too, should any be left
    return [
        Node(proc.returncode, out, err, folder / f"node{node}", tuple(gone))
        for node, (proc, (out, err), gone) in enumerate(zip(procs, outputs, left))
    ]


def _left_of(sid: int, wait_s: float = 5.0) -> list[int]:
    """Live processes of session `sid` (each agent leads its own), after a short wait for
    ranks being torn down."""
    end = time.monotonic() + wait_s
    while (members := session_members(sid)) and time.monotonic() < end:
        time.sleep(0.1)
    return members
