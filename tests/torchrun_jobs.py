"""torchrun jobs for the tests: two agents on loopback as two nodes of one job, or one agent.

`two_nodes(folder, script, *args)` starts `torchrun --nnodes 2 --nproc-per-node 1 --node-rank
0|1 --master-addr 127.0.0.1 --master-port P -m verify.hang_run script ARGS`, one agent per
node, each in its own folder (its report folder lands there) and its own session, waits for
both (bounded), kills whatever is left of either session, and returns what each printed.
`one_node(folder, script, *args)` does the same for `torchrun --standalone --nproc-per-node
2` (or a fixed run id: `rdzv_id`). `module=` runs `verify.audit_run` instead. Every line either printed is kept with the
time it arrived (`Node.when`), so a test can time a verdict from what the script said.

The port: node 0's agent hosts the job's store on it, so it must be free when the agent binds
it. `free_port` picks one nothing listens on, below the range the kernel hands out; under
`pytest -n auto` another test's process may still take it in between, so node 1 starts only
once node 0's own agent listens there (else it could join another job's store), and a launch
whose agent could not bind is retried with a new port. (`--standalone` picks its own.)

The time limit: a job may take `STARTUP_S` to print its first line and `RUN_S` from then on;
a node still running then is killed, and says so (`Node.killed`), so that a test names the
deadline rather than a missing verdict.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.processes import descendants, free_port, listeners, session_members

ROOT = Path(__file__).resolve().parents[1]
_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
# Under tests/test_load.py's window the kernel shares the CPU among sessions, and each agent
# leads its own among dozens: starting one (torch imported twice) has taken over 100 s.
STARTUP_S = 240.0
RUN_S = 150.0  # from a node's first line: the stall timeouts here are seconds


@dataclass(frozen=True)
class Node:
    returncode: int
    stdout: str
    stderr: str
    folder: Path  # the node's working directory: its report folder is under profiles/
    leftover: tuple[int, ...]  # processes of its session still alive at the end (none, or a bug)
    lines: tuple[tuple[float, str], ...] = ()  # (time.monotonic() it arrived, line), both pipes
    killed: bool = False  # still running at the test's deadline (module docstring)

    def report(self) -> Path:
        return next((self.folder / "profiles").glob("hang_torchrun_*"))

    def ours(self) -> list[str]:
        """The lines the tool printed (not the script's, not torchrun's, not c10d's)."""
        prefixes = ("verify.hang_run", "verify.audit_run")
        return [ln for ln in self.stderr.splitlines() if ln.startswith(prefixes)]

    def when(self, text: str) -> float | None:
        """When the first line holding `text` arrived (time.monotonic()), None if none did."""
        return next((t for t, line in self.lines if text in line), None)


MODULE = "verify.hang_run"


def two_nodes(
    folder: Path, script: str, *args: str, stall_s: float = 3.0, module: str = MODULE
) -> list[Node]:
    for _ in range(3):
        port = free_port()
        cmds = [
            ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
             "--master-addr", "127.0.0.1", "--master-port", str(port)]
            for node in (0, 1)
        ]  # fmt: skip
        nodes = _launch(folder, cmds, [module, script, *args], stall_s, port=port)
        if not any(_IN_USE.search(n.stderr) for n in nodes):
            break
    # node 1 starts only once node 0 listens (module docstring): a lone node 0 never did
    assert len(nodes) == 2, f"node 0 never listened on port {port}: {nodes[0].stderr[-3000:]}"
    return nodes


def one_node(
    folder: Path,
    script: str,
    *args: str,
    stall_s: float = 3.0,
    module: str = MODULE,
    rdzv_id: str | None = None,
    master_port: int | None = None,
) -> Node:
    """`torchrun --standalone --nproc-per-node 2 -m MODULE script ARGS`, in `folder`; with
    `rdzv_id`, a c10d rendezvous of that id on loopback instead (a run id the user fixed, as
    `--rdzv-id` does, where --standalone makes a new one every run); with `master_port`,
    torchrun's default (static) rendezvous, its store on that port (its run id: "none")."""
    flags = ["--standalone"]
    if rdzv_id is not None:
        flags = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-id", rdzv_id,
                 "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]  # fmt: skip
    if master_port is not None:
        flags = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    (node,) = _launch(folder, [[*flags, "--nproc-per-node", "2"]], [module, script, *args], stall_s)
    return node


def _launch(
    folder: Path, agents: list[list[str]], job: list[str], stall_s: float, port: int = 0
) -> list[Node]:
    """One torchrun agent per entry of `agents` (its own flags), each running `-m job`; with
    `port`, the first hosts the job's store there and the others start once it listens."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), DDP_VERIFY_STALL_TIMEOUT=str(stall_s), OMP_NUM_THREADS="1")
    procs, readers, left = [], [], []
    try:
        for node, flags in enumerate(agents):
            if node and port and not _hosts(procs[0], port, time.monotonic() + STARTUP_S):
                break  # node 0 could not bind (or died): the others would join another job
            cwd = folder / f"node{node}"
            cwd.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", *flags, "-m", *job]
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
            readers.append(_Reader(procs[-1]))
        killed = _wait(procs, readers, time.monotonic())
        for reader in readers:
            reader.join()
        left = [_left_of(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its ranks too, should any be left
    return [
        Node(proc.returncode, reader.text("stdout"), reader.text("stderr"),
             folder / f"node{node}", tuple(gone), tuple(reader.lines), proc in killed)
        for node, (proc, reader, gone) in enumerate(zip(procs, readers, left))
    ]  # fmt: skip


def _hosts(proc: subprocess.Popen, port: int, until: float) -> bool:
    """Whether `proc` (node 0's agent) or a process below it came to listen on `port` before
    `until`; False when it exited first (another process holds the port: EADDRINUSE)."""
    while time.monotonic() < until and proc.poll() is None:
        if any(x.port == port for x in listeners({proc.pid, *descendants(proc.pid)})):
            return True
        time.sleep(0.2)  # (each look reads /proc: every process's stat and these fds)
    return False


def _wait(procs: list[subprocess.Popen], readers: list[_Reader], started: float) -> set:
    """Wait for every agent: each may take `STARTUP_S` from `started` (when the last began)
    to print its first line and `RUN_S` from that line, the job the latest of these; kill the
    sessions of those still running then (its ranks with the agent), and return them."""
    while any(proc.poll() is None for proc in procs):
        ends = [r.lines[0][0] + RUN_S if r.lines else started + STARTUP_S for r in readers]
        if time.monotonic() > max(ends):
            late = {proc for proc in procs if proc.poll() is None}
            for proc in late:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return late
        time.sleep(0.1)
    return set()


class _Reader:
    """Reads a process's stdout and stderr line by line as they come, timing each line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._by_pipe: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._threads = [
            threading.Thread(target=self._read, args=(name, getattr(proc, name)), daemon=True)
            for name in self._by_pipe
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, name: str, pipe) -> None:
        for line in pipe:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._by_pipe[name].append(line)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=10)

    def text(self, name: str) -> str:
        return "".join(self._by_pipe[name])


def _left_of(sid: int, wait_s: float = 5.0) -> list[int]:
    """Live processes of session `sid` (each agent leads its own), after a short wait for
    ranks being torn down."""
    end = time.monotonic() + wait_s
    while (members := session_members(sid)) and time.monotonic() < end:
        time.sleep(0.1)
    return members
