"""verify.launching with real spawned gloo ranks: values, errors, crashes, hangs, torchrun.

Each spawn costs ~1 s of CPU per rank (importing torch), so the file keeps launches few and
small. The rank functions below are module-level because spawned ranks unpickle them by
reference: the child imports this module by the name pytest gave it (sys.path is passed on).
Every failure test also checks that no rank process outlives the launch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.processes import alive
from verify.launching import LaunchResult, Raised, RankContext, launch, thread_budget
from verify.launching.supervisor import Interrupted, interrupt, reset_interrupt
from verify.launching.zygote import _PRELOAD, Zygote

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- rank functions


def _write_pid(pid_dir: str, ctx: RankContext) -> None:
    """rank<r>.pid, whole when it appears: a test polling for it read one empty once (CI)."""
    Path(pid_dir, f"rank{ctx.rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(pid_dir, f"rank{ctx.rank}.tmp"), Path(pid_dir, f"rank{ctx.rank}.pid"))


def _sum_of_ranks(ctx: RankContext, tag: str) -> dict:
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)  # proves the process group is initialized and all ranks are in it
    return {
        "rank": ctx.rank,
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "tag": tag,
        "tensor": torch.arange(3) * ctx.rank,
        "ctx": ctx,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "extra": os.environ.get("DDP_VERIFY_TEST_VAR"),
    }


def _parent_pid(ctx: RankContext) -> int:
    return os.getppid()


def _raise_on_rank_1(ctx: RankContext, pid_dir: str, returned: bool = False) -> Raised | None:
    _write_pid(pid_dir, ctx)
    if ctx.rank == 1:
        try:
            raise ValueError("rank one is broken")
        except ValueError as exc:  # as a check does: what it had found goes with the failure
            if returned:
                return Raised(exc, {"found before": "rank one broke"})
            raise
    dist.barrier()  # rank 0 waits for a peer that has already failed
    return None


def _stuck_in_all_reduce() -> None:
    dist.all_reduce(torch.ones(1))


def _stuck_in_recv() -> None:
    dist.recv(torch.ones(1), src=0)


def _hang(ctx: RankContext, pid_dir: str) -> None:
    """Rank 1 skips the all_reduce and waits for a message rank 0 never sends."""
    _write_pid(pid_dir, ctx)
    _stuck_in_recv() if ctx.rank == 1 else _stuck_in_all_reduce()


def _die(ctx: RankContext, pid_dir: str) -> None:
    """Rank 1 exits with code 3, rank 2 is SIGKILLed, rank 0 waits in a barrier."""
    _write_pid(pid_dir, ctx)
    # Leave no rank inside gloo's connection setup when the others die (it would fail there
    # with an error, not die): meet in a barrier, then wait until all are past it.
    dist.barrier()
    Path(pid_dir, f"rank{ctx.rank}.past_barrier").touch()
    while len(list(Path(pid_dir).glob("*.past_barrier"))) < ctx.world_size:
        time.sleep(0.01)
    if ctx.rank == 1:
        # What a C++ abort in the backend looks like: a message on fd 2, then death.
        os.write(2, b"terminate called: collective mismatch on rank 1\n")
        os._exit(3)
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


# ---------------------------------------------------------------- helpers


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def _assert_none_alive(pids: list[int]) -> None:
    assert pids, "the ranks never started"
    assert [p for p in pids if alive(p)] == []


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 3])
def test_values_come_back_per_rank(world_size: int) -> None:
    result = launch(
        _sum_of_ranks, world_size=world_size, args=("t",), env={"DDP_VERIFY_TEST_VAR": "x"}
    )
    assert result.ok, result.summary()
    assert result.first_failure is None and not result.timed_out
    values = result.values
    expected_sum = world_size * (world_size + 1) / 2
    for rank, v in enumerate(values):
        assert (v["rank"], v["world_size"], v["sum"], v["tag"]) == (
            rank,
            world_size,
            expected_sum,
            "t",
        )
        assert torch.equal(v["tensor"], torch.arange(3) * rank)  # returned as fn returned it
        budget = thread_budget(world_size)  # the machine's share, as torchrun gives it
        assert v["ctx"] == RankContext(
            rank, world_size, rank, torch.device("cpu"), "gloo", True, budget.per_rank
        )
        assert v["pid"] != os.getpid()  # world size 1 is spawned too
        assert v["extra"] == "x" and v["ifname"]
        assert v["threads"] == budget.per_rank
    assert [o.exitcode for o in result.outcomes] == [0] * world_size
    _assert_none_alive([v["pid"] for v in values])


@pytest.mark.parametrize("returned", [False, True], ids=["raised", "returned-as-Raised"])
def test_raising_rank_is_the_root_cause(tmp_path: Path, returned: bool) -> None:
    """A rank that raises, or returns its exception in a `Raised` with what it had found
    (which comes back as the failed outcome's value), fails the launch alike."""
    result = launch(_raise_on_rank_1, world_size=2, args=(str(tmp_path), returned), timeout_s=60)
    print(result.outcomes)  # shown by pytest if an assertion below fails
    bad, other = result.outcomes[1], result.outcomes[0]
    assert bad.status == "error" and bad.error == "ValueError: rank one is broken"
    assert bad.value == ({"found before": "rank one broke"} if returned else None)
    assert "rank one is broken" in bad.traceback and "_raise_on_rank_1" in bad.traceback
    # Rank 0's barrier errors out once rank 1 leaves the group, or it is killed after the grace.
    assert other.status in ("error", "killed")
    assert result.first_failure == bad and not result.ok and not result.timed_out
    assert result.elapsed_s < 60  # decided by the failure, not by the deadline
    summary = result.summary()
    assert "rank 1" in summary and "ValueError: rank one is broken" in summary
    assert "_raise_on_rank_1" in summary
    with pytest.raises(RuntimeError, match="rank one is broken"):
        _ = result.values
    _assert_none_alive(_pids(tmp_path))


def test_a_raised_outside_the_launcher_raises_its_exception_again():
    """A caller of a rank function outside the launcher (a test, the user's own launched
    code) gets the exception, traceback kept, not a value to overlook."""
    try:
        raise KeyError("lost")
    except KeyError as exc:
        caught = exc
    with pytest.raises(KeyError, match="lost") as info:
        Raised.unwrap(Raised(caught, found={"steps": 2}))
    assert info.value is caught and "test_a_raised_outside" in str(
        info.traceback[-1].frame.code.name
    )
    assert Raised.unwrap({"steps": 2}) == {"steps": 2}


def test_hang_times_out_with_every_ranks_stack(tmp_path: Path) -> None:
    # timeout_s counts from the moment both ranks are up, so a loaded machine (slow spawns)
    # cannot make the deadline fire before they reach their collectives.
    result = launch(_hang, world_size=2, args=(str(tmp_path),), timeout_s=3)
    assert result.timed_out and not result.ok
    assert result.elapsed_s >= 3
    assert result.outcomes[0].error == "still running 3s after all ranks were up"
    assert [o.status for o in result.outcomes] == ["timeout", "timeout"]
    assert "_stuck_in_all_reduce" in result.outcomes[0].stack
    assert "_stuck_in_recv" in result.outcomes[1].stack
    summary = result.summary()
    assert "_stuck_in_all_reduce" in summary and "_stuck_in_recv" in summary
    _assert_none_alive(_pids(tmp_path))


def test_ranks_that_die_are_crashed_with_their_exit_code(tmp_path: Path) -> None:
    result = launch(_die, world_size=3, args=(str(tmp_path),), timeout_s=60)
    survivor, exited, killed = result.outcomes
    print(result.outcomes)  # shown by pytest if an assertion below fails
    assert (exited.status, exited.exitcode) == ("crashed", 3)
    assert "collective mismatch on rank 1" in exited.stderr  # the backend's last words kept
    if result.first_failure.rank == 1:
        assert "collective mismatch on rank 1" in result.summary()
    assert (killed.status, killed.exitcode) == ("crashed", -signal.SIGKILL)
    assert "SIGKILL" in killed.error
    assert survivor.status in ("error", "killed")
    assert result.first_failure.rank in (1, 2)  # never the survivor that saw them go
    assert result.elapsed_s < 60 and not result.timed_out
    _assert_none_alive(_pids(tmp_path))


def test_concurrent_launches_do_not_collide() -> None:
    results: dict[str, LaunchResult] = {}

    def run(tag: str) -> None:
        results[tag] = launch(_sum_of_ranks, world_size=2, args=(tag,), timeout_s=60)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tag, result in results.items():
        assert result.ok, result.summary()
        assert [(v["tag"], v["sum"]) for v in result.values] == [(tag, 3.0)] * 2


def test_invalid_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="world_size"):
        launch(_sum_of_ranks, world_size=0)
    with pytest.raises(ValueError, match="backend"):
        launch(_sum_of_ranks, world_size=1, backend="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        launch(_sum_of_ranks, world_size=1, timeout_s=0)
    with pytest.raises(ValueError, match="picklable"):
        launch(lambda ctx: None, world_size=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            launch(_sum_of_ranks, world_size=1, backend="nccl")


def _clean_env() -> dict[str, str]:
    """This environment minus anything that would make the child think it is a rank."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDP_VERIFY_SPAWNED")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent)])
    return env


def test_ranks_die_with_their_parent(tmp_path: Path) -> None:
    """SIGKILL the launching process: PR_SET_PDEATHSIG must take its hung ranks down too.

    The script first runs a launch in which a rank is SIGKILLed, and the test checks that
    the resource tracker has nothing to warn about (no leaked semaphores or shared memory).
    """
    script = textwrap.dedent(f"""
        import test_launch as t
        from verify.launching import launch
        r = launch(t._die, world_size=2, args=({str(tmp_path / "first")!r},), timeout_s=60)
        print(r.summary(), flush=True)
        launch(t._hang, world_size=2, args=({str(tmp_path)!r},), timeout_s=120)
    """)
    (tmp_path / "first").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_pids(tmp_path)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = _pids(tmp_path)
        assert len(pids) == 2, proc.communicate(timeout=30)
        time.sleep(0.5)  # let them enter the collective
        proc.kill()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    _assert_none_alive(pids)
    assert "rank 1 failed (crashed): exited with code 3" in out, out + err
    assert "leaked" not in err and "resource_tracker" not in err, err


def test_joins_a_torchrun_job(tmp_path: Path) -> None:
    """launch() in torchrun's ranks runs fn in each rank itself, and every rank holds the whole
    result. Four launches in one job: a world size torchrun does not have (a ValueError), a rank
    that raises after an all_reduce, a rank that raises while its peer waits for it in one (the
    results travel through the job's store and the failed rank closes its group after a grace,
    so its peer's all_reduce fails in seconds, not at the 60 s timeout), then a clean launch: a
    process group of its own again after a group torn down mid-collective. Then rank 1 exits
    with an error and torchrun (`--max-restarts 1`) restarts both: the new attempt's first
    launch must not meet the last attempt's first launch's keys (the agent keeps its store).
    Rank 0 comes late to it and reports late: with those keys rank 1 connected to a dead
    address (refused, or a hang) or, where gloo had it wait for the connection instead, took
    rank 0's old report for this one."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, time
        import torch, torch.distributed as dist
        from verify.launching import launch

        def fn(ctx, offset, fail=True):
            t = torch.tensor([float(ctx.rank + offset)])
            dist.all_reduce(t)
            if fail and ctx.rank == 1:
                raise ValueError("rank 1 fails after the all_reduce")
            return {"sum": t.item(), "spawned": ctx.spawned, "pid": os.getpid()}

        def fails_first(ctx):
            if ctx.rank == 1:
                raise ValueError("rank 1 fails before the all_reduce")
            dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
            return "unreachable"

        def late(ctx, offset):
            value = fn(ctx, offset, fail=False)
            if ctx.rank == 0:  # rank 1 asks for rank 0's report first
                time.sleep(2)
            return value

        def restarted():
            if os.environ["RANK"] == "0":  # rank 1 connects first, past gloo's retries
                time.sleep(4)
            r = launch(late, world_size=2, args=(100,), timeout_s=60)
            with open(f"{__file__}.rank{os.environ['RANK']}.restarted.json", "w") as f:
                json.dump({"statuses": [o.status for o in r.outcomes],
                           "sums": [o.value and o.value["sum"] for o in r.outcomes],
                           "pid": os.getpid(), "pids": [o.value and o.value["pid"] for o in r.outcomes]}, f)

        if __name__ == "__main__" and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
            restarted()
        elif __name__ == "__main__":
            try:
                launch(fn, world_size=3)
                mismatch = False
            except ValueError:
                mismatch = True
            r = launch(fn, world_size=2, args=(1,), timeout_s=60)
            start = time.monotonic()
            waited = launch(fails_first, world_size=2, timeout_s=60)
            elapsed = time.monotonic() - start
            again = launch(fn, world_size=2, args=(10, False), timeout_s=60)
            # One file a rank: the ranks' shared stdout may interleave their lines. Written
            # aside, then renamed: rank 1 ends the attempt once it sees rank 0's.
            mine = f"{__file__}.rank{os.environ['RANK']}.json"
            with open(mine + ".tmp", "w") as f:
                json.dump({
                    "pid": os.getpid(), "mismatch": mismatch,
                    "statuses": [o.status for o in r.outcomes], "value0": r.outcomes[0].value,
                    "error1": r.outcomes[1].error, "first": r.first_failure.rank,
                    "waited": [o.status for o in waited.outcomes],
                    "waited_first": waited.first_failure.rank, "fast": elapsed < 30,
                    "again": [o.status for o in again.outcomes],
                    "sum": again.outcomes[1].value["sum"],
                }, f)
            os.replace(mine + ".tmp", mine)
            if os.environ["RANK"] == "1":  # once rank 0 has written: torchrun ends it then
                for _ in range(600):
                    if os.path.exists(f"{__file__}.rank0.json"):
                        break
                    time.sleep(0.1)
                os._exit(1)  # torchrun restarts every rank
    """)
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1"]  # fmt: skip
    proc = subprocess.run(
        [*cmd, str(script)], env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_rank = {r: json.loads(Path(f"{script}.rank{r}.json").read_text()) for r in (0, 1)}
    rank0_pid = by_rank[0]["pid"]
    expected = {
        "mismatch": True,  # world_size=3 under WORLD_SIZE=2 was a ValueError
        "statuses": ["ok", "error"],
        "value0": {"sum": 3.0, "spawned": False, "pid": rank0_pid},  # fn ran in the rank itself
        "error1": "ValueError: rank 1 fails after the all_reduce",
        "first": 1,
        "waited": ["error", "error"],  # rank 0's all_reduce failed once rank 1 closed its group
        "waited_first": 1,
        "fast": True,  # the grace (1.5 s) and a teardown, not the 60 s timeout
        "again": ["ok", "ok"],
        "sum": 21.0,  # (0 + 10) + (1 + 10)
    }
    for r in by_rank.values():  # every rank holds the whole result
        r.pop("pid")
        assert r == expected
    restarted = [json.loads(Path(f"{script}.rank{r}.restarted.json").read_text()) for r in (0, 1)]
    for r in restarted:  # this attempt's ranks and values, not the last attempt's
        assert r["statuses"] == ["ok", "ok"] and r["sums"] == [201.0, 201.0], restarted
        assert r["pids"] == [restarted[0]["pid"], restarted[1]["pid"]], restarted
    assert rank0_pid not in restarted[0]["pids"], restarted


def _start_a_child_then_fail(ctx: RankContext, pid_dir: str) -> None:
    """Each rank starts a long-running child process; then rank 1 raises."""
    child = subprocess.Popen(["sleep", "120"])
    Path(pid_dir, f"child{ctx.rank}.pid").write_text(str(child.pid))
    dist.barrier()
    if ctx.rank == 1:
        raise RuntimeError("rank 1 fails with a child running")
    dist.barrier()


def test_processes_started_by_a_rank_do_not_outlive_the_launch(tmp_path: Path) -> None:
    result = launch(_start_a_child_then_fail, world_size=2, args=(str(tmp_path),), timeout_s=60)
    assert result.first_failure.rank == 1
    children = [int(p.read_text()) for p in tmp_path.glob("child*.pid")]
    assert len(children) == 2
    # SIGKILL is delivered asynchronously: give the kernel a moment to end them.
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    _assert_none_alive(children)


@pytest.fixture
def own_env():
    """A variable torch reads at import, the test's own: it gives the test zygotes of its
    own, closed after it (each would hold ~300 MB for the rest of the worker)."""
    env = {"TORCH_DDP_VERIFY_TEST": f"{os.getpid()}-{time.monotonic_ns()}"}
    yield env
    with Zygote._class_lock:
        for key in [k for k in Zygote._instances if k[0] == frozenset(env.items())]:
            if (zygote := Zygote._instances.pop(key)) is not None:
                zygote.close()


def test_the_zygote_outlives_the_thread_that_started_it_and_is_replaced_when_killed(own_env):
    """PR_SET_PDEATHSIG fires when the thread that started a process exits: a zygote started
    by a launch run in a pool thread must not die with that thread (every later launch would
    start fresh interpreters, silently, at ~3 s of CPU a rank). And one that was killed (the
    OOM killer) is replaced, not given up on. `own_env` gives this test zygotes of its
    own."""
    env = own_env

    def forked_by() -> list[int]:
        result = launch(_parent_pid, world_size=2, env=env, timeout_s=60)
        assert result.ok, result.summary()
        return result.values

    with ThreadPoolExecutor(max_workers=1) as pool:
        zygotes = pool.submit(forked_by).result()
    # the ranks were forked, each by its rank's zygote
    assert os.getpid() not in zygotes and len(set(zygotes)) == 2, zygotes
    assert all(alive(z) for z in zygotes)
    time.sleep(0.5)  # the pool's thread has exited: PDEATHSIG would have fired by now
    assert forked_by() == zygotes and all(alive(z) for z in zygotes)
    os.kill(zygotes[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(zygotes[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    replacement, same = forked_by()
    assert replacement not in (*zygotes, os.getpid()) and same == zygotes[1]


def test_a_request_the_launcher_gave_up_on_never_becomes_a_rank(monkeypatch, own_env):
    """A zygote still importing torch when the launch stops waiting (a crowded machine: here a
    wait of 0.3 s a rank, so that rank 1's zygote, given up on 0.6 s after it started, is still
    importing on a fast machine): the launch starts those ranks as fresh interpreters, and the
    zygotes, once up, must not fork them too (a second rank 0 on the same report pipe and
    rendezvous: the launch fails, or worse). `own_env` gives this test fresh zygotes."""
    monkeypatch.setattr(Zygote, "REPLY_S", 0.3)
    monkeypatch.setattr(Zygote, "MARGIN_S", 0.15)
    env = own_env
    result = launch(_parent_pid, world_size=2, env=env, timeout_s=60)
    assert result.ok, result.summary()
    assert set(result.values) == {os.getpid()}  # fresh interpreters, started by this process
    for rank in (0, 1):
        _forked_nothing_late(_zygote(env, rank))


def test_ctrl_c_while_the_zygote_is_still_starting_ends_the_launch_at_once(own_env):
    """Ctrl-C while a fresh zygote is still importing torch (seconds on a crowded machine, and
    the launch waits up to 30 s for its answer): the launch stops waiting at once, starts no
    fresh interpreter in its place, and the zygotes, once up, fork nothing for it. `own_env`
    gives this test fresh zygotes."""
    if os.environ.get("DDP_VERIFY_NO_ZYGOTE") == "1":
        pytest.skip("no zygote (DDP_VERIFY_NO_ZYGOTE=1)")
    env = own_env
    ended: list = []

    def go():
        try:
            ended.append(launch(_parent_pid, world_size=2, env=env, timeout_s=60))
        except Interrupted:
            ended.append(time.monotonic())

    thread = threading.Thread(target=go)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the first rank is asked of the zygote
            zygote = Zygote._instances.get(_key(env, 0))  # rank 0's, asked first
            if zygote is not None and zygote._next >= 1:
                break
            time.sleep(0.01)
        assert zygote is not None, "no zygote was started here"
        assert not zygote.forked, "the zygote answered first: nothing was waited on"
        interrupt()
        at = time.monotonic()
        thread.join(60)
    finally:
        reset_interrupt()
    assert ended and isinstance(ended[0], float), ended
    assert ended[0] - at < 1.0, ended[0] - at
    _forked_nothing_late(zygote)
    _forked_nothing_late(_zygote(env, 1))  # made for the launch, never asked


def test_a_keyboard_interrupt_inside_the_wait_for_the_zygote_abandons_the_request(
    tmp_path, own_env
):
    """Ctrl-C on the main thread of a caller with Python's own SIGINT handler: the
    KeyboardInterrupt rises inside the wait for the zygote's answer (here raised by the
    `cancelled` poll, where the signal would land). The request is given up on all the same:
    the zygote, once up, forks nothing for it."""
    if os.environ.get("DDP_VERIFY_NO_ZYGOTE") == "1":
        pytest.skip("no zygote (DDP_VERIFY_NO_ZYGOTE=1)")
    env = own_env
    zygote = Zygote.get(env)
    assert zygote is not None, "no zygote was started here"

    def signal_lands():
        raise KeyboardInterrupt

    read_end, write_end = os.pipe()
    try:
        with pytest.raises(KeyboardInterrupt):
            zygote.spawn(read_end, dict(os.environ), write_end,
                         out=str(tmp_path / "log"), cancelled=signal_lands)  # fmt: skip
        assert zygote.abandoned and not zygote.forked
    finally:
        os.close(read_end)
        os.close(write_end)
    _forked_nothing_late(zygote)


def _key(env: dict[str, str], rank: int) -> tuple:
    """The key of rank `rank`'s function zygote for `env` (a variable of its own: `own_env`)."""
    return (frozenset(env.items()), _PRELOAD, rank)


def _zygote(env: dict[str, str], rank: int) -> Zygote:
    return Zygote._instances[_key(env, rank)]


def _forked_nothing_late(zygote: Zygote) -> None:
    """Once the zygote answered every request the launch gave up on, it has forked nothing
    for them: each late rank was killed on arrival, and reaped."""
    deadline = time.monotonic() + 60
    while zygote.abandoned and time.monotonic() < deadline:  # until it answered, late
        time.sleep(0.1)
    assert not zygote.abandoned and not zygote.forked
    deadline = time.monotonic() + 10
    while (children := _children(zygote.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children, children


def _children(pid: int) -> list[str]:
    return [d for d in os.listdir("/proc") if d.isdigit() and _ppid(d) == pid]


def _ppid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_launch_in_a_thread_runs_to_its_end_after_the_main_thread_returned(tmp_path):
    """The program's main thread returns while another (non-daemon) thread launches: Python
    waits for that thread, and its ranks must run to the end. (The zygote is started by a
    daemon thread that lasts until the process ends; a pool's worker would be shut down
    first, and the zygote and its ranks with it.)"""
    result = tmp_path / "result"
    script = textwrap.dedent(f"""
        import threading
        import test_launch as t
        from verify.launching import launch

        def go():
            run = launch(t._parent_pid, world_size=2, timeout_s=60)
            open({str(result)!r}, "w").write(run.summary())

        threading.Thread(target=go).start()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_clean_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result.read_text().startswith("ok: 2 rank(s) finished"), result.read_text()


def test_a_launcher_command_abandoned_before_its_watch_leaves_nothing(tmp_path):
    """`audit -- COMMAND` starts the command before the tool imports torch
    (`launching/launcher.py`); a Ctrl-C or a failure before the watch begins abandons it:
    the command and its children, one in a session of its own as torchrun's workers are,
    end with it."""
    from verify.launching import launcher

    pids = tmp_path / "pids"
    script = f"setsid sleep 60 & echo $! > {pids}; echo $$ >> {pids}; sleep 60"
    started = launcher.start(("bash", "-c", script), report_dir=str(tmp_path), stall_timeout_s=10.0)
    deadline = time.monotonic() + 30
    while len(pids.read_text().split() if pids.exists() else []) < 2:
        assert time.monotonic() < deadline, "the command never wrote its pids"
        time.sleep(0.05)
    both = [int(p) for p in pids.read_text().split()]
    assert all(alive(p) for p in both)
    started.abandon()
    assert not [p for p in both if alive(p)], f"left running: {both}"
    assert started.process.poll() is not None


PROBE = str(ROOT / "tests" / "fixtures" / "rank_probe.py")


@pytest.mark.parametrize("ending", ["0", "3", "a message", "none"])
def test_a_script_rank_forked_from_the_zygote_sees_what_a_fresh_interpreter_does(
    tmp_path: Path, monkeypatch, ending: str
) -> None:
    """A user's script rank on the CPU is forked from the zygote: the script must not tell
    the difference. The same probe (tests/fixtures/rank_probe.py: argv, __main__, sys.path,
    signal handlers, threads, stdin, its stdout and stderr apart, a hash seed and a torch seed
    of each rank's own, a thread that is not a daemon, an atexit function, an object freed
    when the modules are torn down, its exit: `sys.exit` with an int, nothing or a message)
    run both ways gives the same exit codes and prints the same, but for who started it, to
    its files and, line by line with the rank's prefix, to the console (two of the endings
    run with one, two without)."""
    from io import StringIO

    from verify.launching import gpus
    from verify.launching.script import run_script

    if gpus.visible():
        pytest.skip("a script's ranks start as fresh interpreters where a GPU is visible")
    seen = {}
    streamed = ending in ("0", "a message")
    seed = re.compile(r"torch seed \d+")  # another each launch, as in a fresh interpreter
    # fresh first: a process's first launch of a script is fresh whatever is asked (script.py)
    for how in ("fresh", "forked", "forked again")[: 3 if ending == "0" else 2]:
        monkeypatch.setenv("DDP_VERIFY_NO_ZYGOTE", "1" if how == "fresh" else "0")
        folder = tmp_path / how.replace(" ", "_")
        folder.mkdir()
        console = StringIO() if streamed else None
        argv = (PROBE, str(os.getpid()), "--exit", ending)
        # As for a tool started in the background (`cmd &`, nohup): SIGINT ignored, which a
        # fresh rank would inherit and a forked one not (rank.main gives both Python's handler).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            run = run_script(
                argv, nproc=2, report_dir=str(folder), stall_timeout_s=10, timeout_s=120,
                console=console,
            )  # fmt: skip
        finally:
            signal.signal(signal.SIGINT, previous)
        files = {p.name: p.read_text() for p in sorted(folder.glob("rank*.std*"))}
        drawn = seed.findall(str(files))
        files = {name: seed.sub("torch seed", text) for name, text in files.items()}
        lines = sorted(
            seed.sub("torch seed", line) for line in (console or StringIO()).getvalue().splitlines()
        )
        seen[how] = (run, files, lines, drawn)
    (forked, files, lines, drawn), (fresh, fresh_files, fresh_lines, _) = (
        seen["forked"], seen["fresh"]
    )  # fmt: skip
    if ending == "0":
        assert len(drawn) == 2 and not set(drawn) & set(seen["forked again"][3]), drawn
    assert forked.ok == fresh.ok == (ending in ("0", "none")), (forked.summary(), fresh.summary())
    codes = [[o.exitcode for o in run.outcomes] for run in (forked, fresh)]
    assert codes[0] == codes[1] == [0, {"0": 0, "3": 3, "none": 0}.get(ending, 1)], codes
    assert [o.error for o in forked.outcomes] == [o.error for o in fresh.outcomes]
    for name, text in files.items():
        assert "started by the tool itself False" in text or name.endswith("stderr"), text
        assert text.replace("itself False", "itself True") == fresh_files[name], name
    assert [line.replace("itself False", "itself True") for line in lines] == fresh_lines
    assert bool(lines) == streamed
    out = files["rank1.stdout"]
    for said in ("argv", "name __main__ file True", "path0 True", "default_int_handler",
                 "own seeds True", "stdin ''", "dynamo imported False", "not a daemon finished",
                 "atexit ran"):  # fmt: skip
        assert said in out, out
    message = "a message\n" if ending == "a message" else ""
    assert files["rank1.stderr"] == f"rank 1 to stderr\ntorch seed\n{message}torn down\n"


def test_a_rank_given_a_pid_an_earlier_rank_had_is_not_taken_for_that_one(tmp_path: Path) -> None:
    """The zygote tells the tool each rank's exit by pid, and the system gives pids again: a
    rank forked with the pid of a rank of an earlier launch must not be read as already
    exited (it was: "crashed: exited with code 0 before reporting", then killed). Three
    launches in one process, the third's rank given the second's pid inside a pid namespace
    of its own (tests/fixtures/pid_again.py); all must run to their end."""
    if os.environ.get("DDP_VERIFY_NO_ZYGOTE") == "1":
        pytest.skip("no zygote (DDP_VERIFY_NO_ZYGOTE=1)")
    for unshare in (["unshare", "-pf", "--mount-proc"], ["unshare", "-rpf", "--mount-proc"]):
        if not subprocess.run([*unshare, "true"], capture_output=True).returncode:
            break  # (-r: a user namespace of its own, where this user is root)
    else:
        pytest.skip("no pid namespace of our own here (unshare -pf needs root or user namespaces)")
    argv = [*unshare, sys.executable, str(ROOT / "tests" / "fixtures" / "pid_again.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*argv, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    pids = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("pid ")]
    assert len(pids) == 2 and pids[0] == pids[1], done.stdout + done.stderr  # the pid again
    for n in range(3):
        assert f"launch {n} [('ok', None)]" in done.stdout, done.stdout + done.stderr


# A student's DDP that averages every gradient once, tied weights included, by walking a set:
# the set's order is each process's own (by address for parameters, by hash seed for names).
_SET_ORDER = """
import torch.distributed as dist
from torch import nn


class OnceEachDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.named = dict(module.named_parameters())
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in {order}:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
"""
_ORDERS = {
    "set of parameters": "set(self.module.parameters())",
    "set of names": "[self.named[n] for n in set(self.named)]",
    "dict of parameters": "dict.fromkeys(self.module.parameters())",  # insertion order: right
}


@pytest.mark.under_load
def test_function_ranks_differ_as_fresh_interpreters_so_a_set_order_is_caught(tmp_path: Path):
    """Function ranks forked from one zygote shared its hash seed and its heap's layout, so a
    set iterated in one order on every rank, and a class that all-reduces in set order (a
    size mismatch as soon as two ranks launch with fresh interpreters) passed. Each rank index
    forks from a zygote of its own (`set_order_problems`; the hog window runs it too)."""
    problems = set_order_problems(tmp_path)
    assert not problems, "\n".join(problems)


def set_order_problems(folder: Path) -> list[str]:
    """Both orders by a set are a FAULT, again on a later launch of the same zygotes, whose
    hint names the set where the ranks' all-reduces did not match in size, and the twin that
    walks a dict passes. Four ranks: two ranks' orders of six parameters by address
    coincide now and then, as two fresh interpreters' may (in one launch of about forty under
    CPU hogs), and the bug shows where any two differ."""
    from verify.checks.consistency import ConsistencyOptions, check_consistency

    folder.mkdir(parents=True, exist_ok=True)
    cases = [*_ORDERS, "set of parameters"]  # the last: a later launch, the same zygotes
    if os.environ.get("PYTHONHASHSEED", "random") != "random":
        cases.remove("set of names")  # one seed for every interpreter: one order, as in a run
    problems = []
    for i, name in enumerate(cases):
        path = folder / f"once_each_{i}.py"
        path.write_text(_SET_ORDER.format(order=_ORDERS[name]))
        result = check_consistency(ConsistencyOptions(impl=f"{path}:OnceEachDDP", world_size=4))
        expected = "pass" if "dict" in name else "fault"
        if result.verdict != expected:
            problems.append(f"{name} ({i}): {result.verdict}, not {expected}: {result.headline}")
        hints = [f.hint or "" for f in result.failure_findings]
        if "size mismatch" in result.headline and not any("a loop over a set" in h for h in hints):
            problems.append(f"{name} ({i}): no hint names the set: {hints}")
    return problems
