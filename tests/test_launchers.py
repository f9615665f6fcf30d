"""`audit -- COMMAND` and `hang -- COMMAND`: a job run as its owner launches it, by the real
launchers (torchrun, `accelerate launch`, a Lightning Trainer that starts its own ranks, a
script calling `mp.spawn`), each with a correct script and a buggy one written the way that
launcher's users write them (tests/fixtures/launchers/), a hang through torchrun diagnosed,
Ctrl-C ending workers that live in sessions of their own, and bad input.

Lean in CPU: two ranks, two or three steps of a layer or two; the tool runs in the test's
process (`run_cli`), so only the launcher and its ranks start interpreters. Lightning and
accelerate cost seconds of imports per process: one clean and one buggy launch each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.processes import alive, descendants, free_port
from verify.checks.verdict import EXIT_CODES
from verify.launching.env import LAUNCHED_ENV
from verify.launching.tree import carries

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = "tests/fixtures/launchers"


def torchrun(script: str) -> list[str]:
    # --standalone: a rendezvous on a free port, so that runs at once never collide
    return ["torchrun", "--standalone", "--nproc-per-node", "2", f"{FIXTURES}/{script}"]


def accelerate(script: str) -> list[str]:
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), f"{FIXTURES}/{script}"]  # fmt: skip


def python(script: str) -> list[str]:
    return [sys.executable, f"{FIXTURES}/{script}"]


def audited(run_cli, tmp_path, monkeypatch, command: list[str]) -> tuple[int, dict]:
    monkeypatch.setenv("SPAWN_PORT", str(free_port()))  # the mp.spawn scripts' MASTER_PORT
    ran = run_cli("audit", "--json", "--out", str(tmp_path), "--", *command)
    assert ran.stdout, ran.stderr
    return ran.returncode, json.loads(ran.stdout)


CASES = {
    # launcher: (clean script's command, buggy script's command, what the bug is)
    "torchrun": (torchrun("torchrun_clean.py"), torchrun("torchrun_buggy.py"),
                 ("gradients before step {step}", "2.bias", 0)),
    "accelerate": (accelerate("accelerate_clean.py"), accelerate("accelerate_buggy.py"),
                   ("parameters before step {step} (the first audited)", "2.bias", 0)),
    "lightning": (python("lightning_clean.py"), python("lightning_buggy.py"),
                  ("parameters after step {step}", "layer.weight", 1)),
    "mp.spawn": (python("spawn_clean.py"), python("spawn_buggy.py"),
                 ("optimizer settings before step {step}", "param_groups[0].lr", 0)),
}  # fmt: skip


# torchrun's and mp.spawn's cases, and the hang through torchrun, are the hog window's too
# (tests/test_load.py: `launch_problems`): their idle run is a test marked under_load.
IN_THE_WINDOW = ("torchrun", "mp.spawn")


def case_problems(launcher: str, clean: tuple[int, dict], buggy: tuple[int, dict]) -> list[str]:
    """What is wrong with a launcher's clean and buggy runs, each (exit code, JSON report):
    every rank the launcher starts is audited, the clean script passes with both ranks
    audited at every step, the buggy one fails at the step, phase and tensor of its bug, on
    rank 1; no rank left running."""
    (code, report), (bug_code, bug) = clean, buggy
    audit = report.get("audit") or {}
    problems = []
    if (code, report["verdict"]) != (0, "pass") or sorted(report["pids"]) != ["0", "1"]:
        problems.append(f"{launcher} clean: exit {code}, {report['verdict']}, {report}")
    elif audit.get("audited_steps", 0) < 2 or audit.get("findings"):
        problems.append(f"{launcher} clean: {audit}")
    _, _, (phase, tensor, step) = CASES[launcher]
    findings = (bug.get("audit") or {}).get("findings") or [{}]
    first = findings[0]
    got = (bug_code, bug["verdict"], first.get("phase"), first.get("tensor"), first.get("step"))
    if got != (1, "fault", phase, tensor, step) or first.get("ranks") != [1]:
        problems.append(f"{launcher} buggy: {got}, ranks {first.get('ranks')}: {bug}")
    left = [p for r in (report, bug) for p in r["pids"].values() if alive(p)]
    return problems + ([f"{launcher}: left running: {left}"] if left else [])


def hang_problems(code: int, report: dict) -> list[str]:
    """What is wrong with the hang through torchrun (exit code, JSON report): rank 1 parks
    outside any collective, rank 0 waits in DDP's reducer (where the trace is blind): a HANG
    naming rank 1 and its line, and no worker left running (torchrun's live in sessions of
    their own)."""
    diag = report["diagnosis"]
    problems = []
    if (code, report["verdict"], diag["verdict"], diag["culprit"]) != (1, "fault", "hang", 1):
        problems.append(f"torchrun hang: exit {code}, {report['verdict']}: {diag}")
    elif (
        "torchrun_hang.py:20" not in diag["headline"]
        or "blocked inside torch" not in diag["headline"]
    ):
        problems.append(f"torchrun hang: the line or the blocked rank unnamed: {diag['headline']}")
    left = [p for p in report["pids"].values() if alive(p)]
    return problems + ([f"torchrun hang: left running: {left}"] if left else [])


def _reported(result) -> tuple[int, dict]:
    """A check's result as the CLI gives it: (exit code, the JSON report)."""
    return EXIT_CODES[result.verdict], json.loads(json.dumps(result.to_dict(), default=str))


def launch_problems(folder: str, at_once: int = 5) -> list[str]:
    """`IN_THE_WINDOW`'s launchers, clean and buggy (`case_problems`), and the hang through
    torchrun (`hang_problems`), `at_once` launches at a time, through the check functions:
    what is wrong (none: the idle verdicts; under CPU hogs in tests/test_load.py too)."""
    from verify.checks.hang import HangOptions, check_hang
    from verify.checks.script_audit import AuditOptions, check_audit

    def audit(command, name):
        options = AuditOptions(script=tuple(command), out=f"{folder}/{name}", console="none",
                               timeout_s=600)  # fmt: skip
        return _reported(check_audit(options))

    def spawned():  # one after the other: the scripts take their port from the environment
        done = []
        for arm, command in zip(("clean", "buggy"), CASES["mp.spawn"][:2]):
            os.environ["SPAWN_PORT"] = str(free_port())
            done.append(audit(command, f"mp.spawn-{arm}"))
        return done

    def hang():
        options = HangOptions(script=tuple(torchrun("torchrun_hang.py")), stall_timeout_s=3.0,
                              out=f"{folder}/hang", console="none", timeout_s=600)  # fmt: skip
        return _reported(check_hang(options))

    clean, buggy = CASES["torchrun"][:2]
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        runs = {
            "torchrun": [pool.submit(audit, clean, "torchrun-clean"),
                         pool.submit(audit, buggy, "torchrun-buggy")],
            "mp.spawn": pool.submit(spawned),
            "hang": pool.submit(hang),
        }  # fmt: skip
        problems = case_problems("torchrun", *(f.result() for f in runs["torchrun"]))
        problems += case_problems("mp.spawn", *runs["mp.spawn"].result())
        problems += hang_problems(*runs["hang"].result())
    return problems


@pytest.mark.under_load
def test_torchrun_and_mp_spawn_scripts_are_audited_and_a_hang_is_named(tmp_path):
    problems = launch_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("launcher", [k for k in CASES if k not in IN_THE_WINDOW])
def test_a_clean_script_passes_and_a_buggy_one_is_named(launcher, run_cli, tmp_path, monkeypatch):
    """`case_problems`, for the launchers the hog window does not run (through the CLI)."""
    arms = zip(("clean", "buggy"), CASES[launcher][:2])
    ran = [audited(run_cli, tmp_path / arm, monkeypatch, command) for arm, command in arms]
    problems = case_problems(launcher, *ran)
    assert not problems, "\n".join(problems)


RETRIED = """\
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size, attempt):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1 + attempt]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step == 2 and rank == 1 and attempt == 0:
            if sys.argv[3] == "oom":  # as the kernel's OOM killer ends a process
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("flaky disk on rank 1")
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    for attempt in range(2):  # one retry, as torchrun --max-restarts 1 would
        try:
            mp.spawn(train, args=(2, attempt), nprocs=2)
            break
        except Exception as exc:
            print(f"attempt {attempt} failed: {exc}", file=sys.stderr)
"""


def retry_problems(folder: str) -> list[str]:
    """A script that retries `mp.spawn` once when a rank fails (as torchrun `--max-restarts
    1` restarts its workers), rank 1 raising in its first attempt, or killed by a signal
    there (the OOM killer's SIGKILL). The retry's ranks join after the verdict on a raise
    (while the tool gives the launcher ten seconds to end, cut short by their join), or
    before any verdict on a kill (a rank dead by a signal says nothing; its peers are killed
    by mp.spawn; the verdict comes at the retry's join, not its end). What is wrong: each
    verdict must be the first attempt's crash, with what that attempt audited (two steps, not
    the retry's four written over them; for the kill, not the retry's pass), and no process
    of either attempt left running. (Whether the retry joins before the tool ends its
    launcher is timing: `test_the_wait_for_a_launcher_ends_when_its_next_attempt_joins` tests
    the wait its join cuts short.)"""
    from verify.checks.script_audit import AuditOptions, check_audit

    os.makedirs(folder, exist_ok=True)
    script = os.path.join(folder, "train.py")
    with open(script, "w") as f:
        f.write(RETRIED)

    def audit(mode: str):
        command = (sys.executable, script, str(free_port()), str(free_port()), mode)
        out = os.path.join(folder, mode)
        return check_audit(AuditOptions(script=command, out=out, console="none", timeout_s=300))

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {mode: pool.submit(audit, mode) for mode in ("raise", "oom")}
        results = {mode: run.result() for mode, run in runs.items()}
    problems = []
    # (a rank dead by a signal leaves no report, and mp.spawn's end of its peers follows
    # within milliseconds: the CRASH names the rank seen dead first, which is asserted on
    # torchrun's wider gap, idle, in test_the_rank_killed_first_is_named_...)
    for mode, said in (("raise", "flaky disk on rank 1"), ("oom", "exited without a report")):
        r = results[mode]
        d = r.run.diagnosis
        if r.verdict != "fault" or d.verdict != "crash" or said not in d.headline:
            problems.append(f"{mode}: {r.verdict}: {d.text()}")
        elif r.audit is None or r.audit.audited_steps != 2:
            problems.append(f"{mode}: audited steps {r.audit and r.audit.audited_steps} (want 2)")
        if list(Path(r.run.report_dir).glob("rank*.ended")):
            problems.append(f"{mode}: the retry's ranks wrote into the run's report folder")
        # Whether the retry joined before the tool ended its launcher (END_WAIT_S after the
        # verdict) is the machine's timing, not asserted: the wait cut short by its join is
        # test_the_wait_for_a_launcher_ends_when_its_next_attempt_joins.
    # every process of a launch carries its report folder, the retry's unadopted ones too
    markers = [
        f"{LAUNCHED_ENV}={os.path.abspath(r.run.report_dir)}".encode() for r in results.values()
    ]
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    left = [p for p in pids if alive(p) and any(carries(p, m) for m in markers)]
    return problems + ([f"left running: {left}"] if left else [])


@pytest.mark.under_load
def test_a_crash_is_reported_with_its_own_attempts_audit_after_a_retry(tmp_path):
    problems = retry_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


def test_the_wait_for_a_launcher_ends_when_its_next_attempt_joins(tmp_path):
    """After a crash the tool gives the launcher END_WAIT_S to end by itself, and no longer
    than until a process of its next attempt joins: its mark (`again.<pid>`) is the one message
    a sealed run folder still takes from a process of the run."""
    from verify import private
    from verify.launching import command, launched

    folder = str(tmp_path / "run")
    private.make_dir(folder)
    private.seal(folder)
    assert not private.write(folder, "rank0.ended", b"") and not launched.started_again(folder)
    assert private.write(folder, "again.4242", b"", asked=True) and launched.started_again(folder)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        command._await_end(sleeper, folder)
        assert time.monotonic() - start < command.END_WAIT_S / 2 and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def killed_problems(folder: str) -> list[str]:
    """torchrun's rank 1 killed by a signal, then rank 0 ended by torchrun (tests/fixtures/
    launchers/torchrun_killed.py): neither reports, so the rank that died first is the root
    cause, as torchrun itself says (the CRASH had named rank 0, the first in rank order).
    What is wrong (none: the idle verdict; under CPU hogs in tests/test_load.py too)."""
    from verify.checks.hang import HangOptions, check_hang

    options = HangOptions(script=tuple(torchrun("torchrun_killed.py")), out=folder,
                          console="none", timeout_s=600)  # fmt: skip
    code, report = _reported(check_hang(options))
    diag = report["diagnosis"]
    problems = []
    if (code, diag["verdict"], diag["culprit"]) != (1, "crash", 1):
        problems.append(f"killed: exit {code}: {diag}")
    elif not diag["headline"].startswith("rank 1 exited without a report"):
        problems.append(f"killed: {diag['headline']}")
    left = [p for p in report["pids"].values() if alive(p)]
    return problems + ([f"killed: left running: {left}"] if left else [])


@pytest.mark.under_load
def test_the_rank_killed_first_is_named_when_none_left_a_report(tmp_path):
    problems = killed_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


PREEMPTIBLE = """\
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def on_sigterm(signum, frame):  # preempted: leave cleanly, as a cluster job does
    sys.exit(0)


def worker(rank, port):
    signal.signal(signal.SIGTERM, on_sigterm)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 3))
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    for it in range(3):
        out = net(torch.full((4, 6), float(rank + it)))
        if it == 1 and rank == 1:
            raise ValueError("shard 7 is corrupt")
        out.square().sum().backward()
        sgd.step()
        sgd.zero_grad()


if __name__ == "__main__":
    for port in sys.argv[1:]:  # a second try on a fresh port
        try:
            mp.spawn(worker, args=(port,), nprocs=2)
            break
        except Exception as exc:
            print("retrying after:", exc, file=sys.stderr)
"""


def test_no_process_of_the_run_writes_its_report_after_the_verdict(tmp_path, monkeypatch):
    """Rank 1 raises while rank 0 waits for it in the gradients' all-reduce, and the verdict
    is taken on rank 1's failure. Only then does rank 0 end (mp.spawn stops it once rank 1 has
    gone: SIGTERM, which this script turns into a clean exit), and a retry starts, joins and
    runs to its end. Neither may leave anything of its end in the run's folder: the verdict's
    evidence is the folder as it stood (the hog window's retry check found `rank*.ended` there
    once). The tool waits for the launcher to end by itself, however long that takes, and
    not only until the retry joins (`started_again` says no here, in the tool), so the late
    ends surely happen before the launch is torn down."""
    from verify.checks.script_audit import AuditOptions, check_audit
    from verify.launching import command as launcher_form
    from verify.launching import launched

    monkeypatch.setattr(launcher_form, "END_WAIT_S", 600.0)
    monkeypatch.setattr(launched, "started_again", lambda folder: False)
    script = tmp_path / "preemptible.py"
    script.write_text(PREEMPTIBLE)
    command = (sys.executable, str(script), str(free_port()), str(free_port()))
    result = check_audit(AuditOptions(script=command, out=str(tmp_path / "out"), console="none",
                                      timeout_s=300))  # fmt: skip
    d = result.run.diagnosis
    assert (result.verdict, d.verdict) == ("fault", "crash") and "shard 7" in d.headline, d.text()
    folder = Path(result.run.report_dir)
    sealed = (folder / "job.diagnosed").stat().st_mtime
    ends = [folder / f"rank0.{end}" for end in ("ended", "failed", "failing")]
    assert [p.name for p in ends if p.exists()] == []
    assert (folder / "rank0.audit.json").stat().st_mtime <= sealed
    assert result.audit.audited_steps == 1


def _await_two_joined(tool: subprocess.Popen, out: Path) -> None:
    """Until both ranks of `hang --out OUT` joined (the tool still running, within 240 s)."""
    deadline = time.monotonic() + 240
    while len(list(out.glob("hang_*/rank*.joined"))) < 2:
        assert tool.poll() is None and time.monotonic() < deadline, tool.communicate()
        time.sleep(0.2)


@pytest.mark.parametrize("to", ["the tool", "the terminal's group"])
def test_ctrl_c_ends_every_process_the_launcher_started(tmp_path, to):
    """SIGINT to the tool alone, or a terminal's Ctrl-C to its foreground group (the tool and
    torchrun's agent, which passes it on to its workers, in sessions of their own): exit 130,
    the tool's line last with no rank's KeyboardInterrupt above it (they go to the run
    folder), and none of the launcher's processes left."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a hung job for the tool's own SIGINT; a training one, in Python between its steps when
    # the terminal's reaches it, where each worker raises KeyboardInterrupt
    command = torchrun("torchrun_hang.py" if to == "the tool" else "torchrun_forever.py")
    tool = subprocess.Popen(
        [sys.executable, "-m", "verify", "hang", "--stall-timeout", "300", "--out",
         str(tmp_path), "--", *command],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a group of its own, as a shell's foreground job
    )  # fmt: skip
    try:
        _await_two_joined(tool, tmp_path)
        below = descendants(tool.pid)
        assert len(below) >= 3  # the agent and its two workers
        if to == "the tool":
            tool.send_signal(signal.SIGINT)
        else:
            time.sleep(2)  # the ranks training, past their first steps
            os.killpg(tool.pid, signal.SIGINT)
        out, err = tool.communicate(timeout=60)
    finally:
        tool.kill()
    assert tool.returncode == 130, err
    assert err.strip().splitlines()[-1] == "verify: interrupted", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    time.sleep(0.5)
    assert [p for p in below if alive(p)] == []


SPAWN_FOREVER = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["SPAWN_PORT"]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while True:  # until Ctrl-C
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()


if __name__ == "__main__":
    mp.spawn(train, args=(2,), nprocs=2)
"""


def test_ctrl_c_at_a_terminal_of_an_mp_spawn_script(tmp_path):
    """A terminal's Ctrl-C reaches every process of its foreground group: the tool, the
    script and its mp.spawn workers. The console then has the tool's line alone, exit 130,
    and nothing of the command is left."""
    (tmp_path / "train.py").write_text(SPAWN_FOREVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPAWN_PORT": str(free_port())}
    tool = subprocess.Popen(
        [sys.executable, "-m", "verify", "hang", "--out", str(tmp_path), "--", sys.executable,
         str(tmp_path / "train.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a group of its own, as a shell's foreground job
    )  # fmt: skip
    try:
        _await_two_joined(tool, tmp_path)
        below = descendants(tool.pid)
        os.killpg(tool.pid, signal.SIGINT)
        _, err = tool.communicate(timeout=60)
    finally:
        tool.kill()
    assert (tool.returncode, err.splitlines()) == (130, ["verify: interrupted"]), err
    time.sleep(0.5)
    assert [p for p in below if alive(p)] == []


def test_a_command_that_is_not_there(run_cli, tmp_path):
    ran = run_cli("audit", "--out", str(tmp_path), "--", "torchrunn", "train.py")
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines() == [ran.stderr.strip()]
    assert "command 'torchrunn' not found" in ran.stderr
    assert list(tmp_path.iterdir()) == []  # nothing ran: no run folder


def test_a_command_whose_processes_never_join_a_group(run_cli, tmp_path):
    """It ran and ended without a process group: nothing was audited, nothing joined."""
    ran = run_cli("hang", "--out", str(tmp_path), "--", sys.executable, "-c", "print('hi')")
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().startswith("verify: error: nothing joined a process group")
    assert len(ran.stderr.strip().splitlines()) == 1
    # The launch is over: this process no longer adopts orphans (it would never reap them,
    # and their zombies would keep a session alive: a TensorBoard test failed on that).
    assert _subreaper() == 0


def test_a_command_that_never_joins_a_group_runs_to_the_timeout(run_cli, tmp_path):
    """Still running without a group at --timeout: ended, and said so (it had said "exited
    with code None")."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ran = run_cli("hang", "--timeout", "2", "--out", str(tmp_path), "--", *sleeper)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        f"verify: error: nothing joined a process group: {' '.join(sleeper)} ran to the 2 s "
        "timeout before any of its processes returned from init_process_group (the audit and "
        "the watchdog follow processes that do)"
    ]
    (run,) = tmp_path.iterdir()  # every process of the launch carries its run folder
    marker = f"{LAUNCHED_ENV}={os.path.abspath(run)}".encode()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    assert not [p for p in pids if alive(p) and carries(p, marker)]


WRAPPER = [*python("clean_env_wrapper.py")]
WRAPPED = f"{FIXTURES}/wrapper_train.py"
SHORT_ROLL_CALL = str(ROOT / "tests" / "fixtures" / "short_roll_call")


def unaudited_problems(folder: str) -> list[str]:
    """A scheduler's wrapper (tests/fixtures/launchers/clean_env_wrapper.py) that starts rank 1
    with a clean environment: it trains, but runs nothing of the tool. The audited rank 0
    must not wait for it in the audit's group (it did, for the group's 30-minute timeout, and
    the tool's verdict at its own timeout was "TIMEOUT: ... no rank was hung"): rank 1 named
    in one line, the training run to its end, and no pass (nothing audited: exit 2); and the
    same wrapper keeping the environment: the correct script passes, the buggy one's drift
    is found (`roll_call.py`). Each run in a process of its own: the launcher's output is on
    the tool's console. The cleaned runs' ranks wait 3 s, not 30, for the roll call's answers
    (tests/fixtures/short_roll_call/, chained by the bootstrap as a site's own sitecustomize):
    their rank 1 never answers, so only the wait's length differs, and the kept runs, whose
    ranks all answer, keep the product's bound. What is wrong (none; under CPU hogs in
    tests/test_load.py too)."""
    runs = {
        "cleaned": [*WRAPPER, f"{FIXTURES}/torchrun_clean.py"],
        "cleaned-fresh": [*WRAPPER, WRAPPED],
        "kept": [*WRAPPER, "--keep-env", WRAPPED],
        "kept-buggy": [*WRAPPER, "--keep-env", WRAPPED, "bug"],
    }

    def audit(name: str) -> subprocess.CompletedProcess:
        path = [str(ROOT), *([SHORT_ROLL_CALL] if name.startswith("cleaned") else [])]
        return subprocess.run(
            [sys.executable, "-m", "verify", "audit", "--timeout", "600", "--out",
             f"{folder}/{name}", "--", *runs[name]],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        done = dict(zip(runs, pool.map(audit, runs)))
    problems = []
    for name in ("cleaned", "cleaned-fresh"):
        ran, trained = done[name], ("step 2 loss", "rank 0 epoch 2")[name == "cleaned-fresh"]
        said = [ln for ln in ran.stdout.splitlines() if "did not inherit" in ln]
        if ran.returncode != 2 or len(said) != 1 or trained not in ran.stdout:
            problems.append(
                f"{name}: exit {ran.returncode}: {ran.stdout[-2000:]}{ran.stderr[-2000:]}"
            )
        elif (
            not said[0].startswith(
                "note: the audit stopped early: NotAudited: rank 1 did not "
                "inherit the tool's environment"
            )
            or "not audited" not in said[0]
        ):
            problems.append(f"{name}: {said[0]}")  # fmt: skip
        if "TIMEOUT" in ran.stdout + ran.stderr:
            problems.append(f"{name}: a TIMEOUT")
    kept, buggy = done["kept"], done["kept-buggy"]
    if (
        kept.returncode != 0
        or "replicas bitwise identical at every audited step" not in kept.stdout
    ):
        problems.append(f"kept: exit {kept.returncode}: {kept.stdout[-2000:]}{kept.stderr[-2000:]}")
    if buggy.returncode != 1 or "REPLICAS DIVERGED" not in buggy.stdout:
        problems.append(f"kept-buggy: exit {buggy.returncode}: {buggy.stdout[-2000:]}")
    for name in runs:
        (run,) = Path(folder, name).iterdir()
        marker = f"{LAUNCHED_ENV}={os.path.abspath(run)}".encode()
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        left = [p for p in pids if alive(p) and carries(p, marker)]
        problems += [f"{name}: left running: {left}"] if left else []
    return problems


@pytest.mark.under_load
def test_a_worker_that_did_not_inherit_the_tools_environment_is_named(tmp_path):
    """`unaudited_problems`: none."""
    problems = unaudited_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


def _subreaper() -> int:
    """This process's PR_GET_CHILD_SUBREAPER (37): 1 while it adopts its descendants' orphans."""
    import ctypes

    flag = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)
    return flag.value


@pytest.mark.parametrize("command", ["hang", "audit"])
def test_nproc_is_for_a_script_not_a_command(command, run_cli):
    ran = run_cli(command, "--nproc", "2", "--", "torchrun", "train.py")
    assert ran.returncode == 2
    assert ran.stderr.startswith("verify: error: --nproc applies to a script"), ran.stderr
    assert "drop --nproc" in ran.stderr and len(ran.stderr.splitlines()) == 1


# Trains until it is ended, under torchrun (LOCAL_RANK set) or its own mp.spawn.
TRAINS_ON = """\
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank=None, world_size=None, port=None):
    if rank is None:
        dist.init_process_group("gloo")
    else:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = port
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while True:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.1)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        train()
    else:
        mp.spawn(train, args=(2, sys.argv[1]), nprocs=2)
"""


def _run_processes(run: Path) -> list[int]:
    """Every live process carrying the run folder `run` (every process of its launch)."""
    marker = f"{LAUNCHED_ENV}={os.path.abspath(run)}".encode()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if alive(p) and carries(p, marker)]


def sigkill_problems(folder, launcher: str) -> list[str]:
    """`kill -9` of `audit -- LAUNCHER` while its ranks train: the tool can end nothing, yet
    nothing of the run is left (torchrun's workers lead sessions of their own, mp.spawn's
    children outlive their parent): its guardian ends them (verify/launching/guardian.py).
    What is wrong (none: the idle verdict; under CPU hogs in tests/test_load.py too)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "train_on.py"
    script.write_text(TRAINS_ON)
    command = (
        ["torchrun", "--standalone", "--nproc-per-node", "2", str(script)]
        if launcher == "torchrun"
        else [sys.executable, str(script), str(free_port())]
    )
    out, said = folder / "out", folder / "stderr.txt"
    with open(said, "w") as stderr:
        tool = subprocess.Popen(
            [sys.executable, "-m", "verify", "audit", "--stall-timeout", "300", "--out",
             str(out), "--", *command],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    run = None
    try:
        deadline = time.monotonic() + 240
        while len(list(out.glob("audit_*/rank*.joined"))) < 2:
            if tool.poll() is not None or time.monotonic() >= deadline:
                return [f"sigkill {launcher}: the ranks never both joined: {said.read_text()}"]
            time.sleep(0.2)
        (run,) = out.glob("audit_*")
        if len(_run_processes(run)) < 3:  # the launcher (and agent) and two ranks
            return [f"sigkill {launcher}: not running: {_run_processes(run)}"]
        tool.kill()
        tool.wait()
        deadline = time.monotonic() + 60  # SIGKILLed processes go when they are scheduled
        while _run_processes(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _run_processes(run)
        return [f"sigkill {launcher}: left running after the tool's SIGKILL: {left}"] * bool(left)
    finally:
        tool.kill()
        for pid in _run_processes(run) if run else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.under_load
@pytest.mark.parametrize("launcher", ["torchrun", "mp.spawn"])
def test_sigkill_of_the_tool_ends_every_process_of_the_run(launcher, tmp_path):
    problems = sigkill_problems(tmp_path, launcher)
    assert not problems, "\n".join(problems)


# A launcher command whose processes never join says why in the --nproc form's one line
# (verify/launching/unjoined.py, bootstrap/sitecustomize.py): what they died of, where, and
# what to do; their tracebacks of a usage error and of a Ctrl-C go to the run folder.
BOOTSTRAP = ROOT / "verify" / "launching" / "bootstrap"
NEEDS_GPU = """
import torch

local_rank = 0
torch.cuda.set_device(local_rank)
"""


def _bootstrapped(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python ARGV` as a launcher command's process: the bootstrap first on its path."""
    env = {**os.environ, "PYTHONPATH": f"{BOOTSTRAP}:{ROOT}", LAUNCHED_ENV: str(folder),
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          cwd=folder, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "source, argv, note, quiet",
    [
        (None, ["nothere.py"], {"missing": "nothere.py"}, True),  # python's own line only
        ("x = 1\nraise ValueError('bad config')\n", ["train.py"],
         {"error": "ValueError: bad config", "where": "train.py:2", "needs_cuda": None}, False),
        (NEEDS_GPU, ["train.py"], {"where": "train.py:5", "call": "torch.cuda.set_device(local_rank)"},
         True),
        ("import time\nraise KeyboardInterrupt\n", ["train.py"], None, True),
        # mp.spawn's worker wrapper: the exception caught, exit 1 inside the `except`
        ("import sys\ntry:\n    raise ValueError('bad shard')\nexcept Exception:\n    sys.exit(1)\n",
         ["train.py"], {"error": "ValueError: bad shard", "where": "train.py:3", "needs_cuda": None},
         True),
    ],
)  # fmt: skip
def test_a_process_that_never_joins_leaves_why(tmp_path, source, argv, note, quiet):
    from verify.launching import unjoined

    if source is not None:
        (tmp_path / "train.py").write_text(source)
    ran = _bootstrapped(tmp_path, *argv)
    notes = unjoined.read(str(tmp_path))
    if note is None:
        assert notes == [] and list(tmp_path.glob("interrupted.*.stderr")), ran.stderr
    elif "call" in note:  # needs CUDA: the --nproc form's NeedsCuda
        assert notes[0]["where"] == note["where"] and notes[0]["needs_cuda"]["call"] == note["call"]
    else:
        assert notes == [note], (notes, ran.stderr)
    assert ("Traceback" in ran.stderr) is not quiet, ran.stderr


SLOW_EXIT = """
import atexit
import time


@atexit.register
def flush_logs():  # an exit handler that takes a moment, as torch's own do
    print("exiting", flush=True)
    time.sleep(30)


try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:  # as mp.spawn's worker wrapper: its parent says it was interrupted
    pass
"""


def _sigint_at_its_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_ctrl_c_leaves_the_console_to_the_tool(tmp_path):
    """A process of the command interrupted twice, the second time in its exit handlers (an
    mp.spawn worker: the terminal's SIGINT, then its parent's death signal): what it prints
    after the first goes to `interrupted.<pid>.stderr`, the console keeps the tool's line."""
    (tmp_path / "train.py").write_text(SLOW_EXIT)
    env = {**os.environ, "PYTHONPATH": f"{BOOTSTRAP}:{ROOT}", LAUNCHED_ENV: str(tmp_path)}
    # SIGINT at its default, as in a terminal's job: started in the background (`cmd &`, as
    # CI may be), a process inherits it ignored and Python then installs no handler of its own.
    worker = subprocess.Popen([sys.executable, "train.py"], env=env, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=_sigint_at_its_default)  # fmt: skip
    try:
        assert worker.stdout.readline() == "ready\n"
        worker.send_signal(signal.SIGINT)
        assert worker.stdout.readline() == "exiting\n"  # in its exit handler now
        worker.send_signal(signal.SIGINT)
        _, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert err == ""
    kept = (tmp_path / f"interrupted.{worker.pid}.stderr").read_text()
    assert "atexit" in kept and "KeyboardInterrupt" in kept, kept


def launcher_says_why_problems(tmp: Path) -> list[str]:
    """`audit -- torchrun ... SCRIPT` for a CUDA-only script and for a misspelled one, and
    `audit -- python SCRIPT` of a CUDA-only one that starts its ranks with mp.spawn (whose
    wrapper catches a worker's exception: no excepthook sees it): exit 2 and one line of the
    tool's, no traceback (the launchers' own log lines stay)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "SPAWN_PORT": str(free_port())}  # fmt: skip
    spawned = "tests/fixtures/launchers/spawn_needs_cuda.py"
    cases = {
        "needs-cuda": ([*torchrun("x")[:-1], "tests/fixtures/audit_needs_cuda.py"],
                       "the script cannot run on this machine: tests/fixtures/audit_needs_cuda.py:"
                       "21: `torch.cuda.set_device(local_rank)` needs CUDA"),
        "misspelled": ([*torchrun("x")[:-1], "tests/fixtures/audit_needs_cudaa.py"], "script "
                       "tests/fixtures/audit_needs_cudaa.py does not exist"),
        "spawn-needs-cuda": ([sys.executable, spawned], "the script cannot run on this machine: "
                             f"{spawned}:17: `torch.cuda.set_device(rank)` needs CUDA"),
    }  # fmt: skip

    def run(name: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "verify", "audit", "--out", str(tmp / name), "--",
                *cases[name][0]]  # fmt: skip
        return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(cases, pool.map(run, cases), strict=True))
    problems = []
    for name, p in done.items():
        said = [line for line in p.stderr.splitlines() if line.startswith("verify: error: ")]
        others = [
            line for line in p.stderr.splitlines() if not line.startswith(("W", "E", "verify"))
        ]
        if (
            p.returncode != 2
            or len(said) != 1
            or not said[0].startswith(f"verify: error: {cases[name][1]}")
        ):
            problems.append(f"{name}: exit {p.returncode}: {said}\n{p.stderr[-2000:]}")
        if "Traceback" in p.stderr or len(others) > 2:  # python's "can't open file", once a rank
            problems.append(f"{name}: more than the tool's line:\n{p.stderr[-3000:]}")
    return problems


@pytest.mark.under_load
def test_the_launcher_form_says_what_the_ranks_died_of(tmp_path):
    problems = launcher_says_why_problems(tmp_path)
    assert not problems, "\n\n".join(problems)
