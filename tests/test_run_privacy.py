"""Who is trusted (docs/design.md): a run folder and the messages in it are this user's alone
(verify/private.py). A folder made under any umask is 0700; a message another user
planted, or a folder swapped for another user's, is refused in one line and never read, let
alone unpickled; a rank's job (a pickle) is never a file in a folder; no message lands after
the seal.

The suite runs as root here, so another owner is made with os.chown (uid 65534, nobody); those
tests are skipped elsewhere. In-process, but for one launch of one rank and one launcher
command of one process.
"""

from __future__ import annotations

import os
import pickle
import stat
import sys
from pathlib import Path

import pytest

from verify import private, runs
from verify.launching import launch, launched, node_ranks, supervisor
from verify.launching.node_ranks import NodeRanks
from verify.launching.zygote import NO_ZYGOTE_ENV
from verify.watching import trace_file

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")


class _Touch:
    """A pickle that, unpickled, creates `path`: what a planted one could run instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _plant(folder: Path, name: str, ran: Path, owner: int = NOBODY) -> None:
    (folder / name).write_bytes(pickle.dumps(_Touch(ran)))
    os.chown(folder / name, owner, owner)


def test_a_run_folder_is_the_users_alone_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a shared group's umask: a plain mkdir would give the group write
    try:
        run = runs.new_run_dir(tmp_path, "audit", 2, "cpu")
    finally:
        os.umask(old)
    assert stat.S_IMODE(run.stat().st_mode) == 0o700


@as_root
def test_a_failure_planted_by_another_user_is_refused_and_never_unpickled(tmp_path):
    run = runs.new_run_dir(tmp_path, "audit", "N", "cpu")
    ran = tmp_path / "ran"
    _plant(run, "rank1.failed", ran)
    ranks = NodeRanks(str(run), [0, 1], 10.0)
    with pytest.raises(ValueError) as refused:
        if ranks.failed():
            ranks.report("crash", 0, "host")
    assert not ran.exists()
    assert str(refused.value) == (
        f"file {run}/rank1.failed is owned by uid {NOBODY}, not by this user (uid 0): refused "
        "(a run's files are its own user's alone; another user may have planted or swapped it)"
    )


@as_root
def test_a_run_folder_swapped_for_another_users_is_refused(tmp_path):
    """Another user who can write `--out` renames the run folder and puts their own in its
    place: neither the tool nor a rank reads or writes anything there."""
    run = runs.new_run_dir(tmp_path, "audit", "N", "cpu")
    ranks = NodeRanks(str(run), [0], 10.0)
    assert not ranks.failed()
    os.rename(run, tmp_path / "moved")
    run.mkdir(mode=0o777)
    (run / "rank0.joined").write_text(f"1 {os.getpid()}\n")
    os.chown(run / "rank0.joined", NOBODY, NOBODY)
    ran = tmp_path / "ran"
    _plant(run, "rank0.failed", ran, owner=0)  # even a file of ours, in their folder
    os.chown(run, NOBODY, NOBODY)
    for read in (ranks.failed, lambda: launched.read_joined(str(run), 0)):
        with pytest.raises(private.Untrusted, match=f"run folder {run} is owned by uid {NOBODY}"):
            read()
    with pytest.raises(private.Untrusted):
        private.write(run, "rank0.ended", b"null")
    assert not ran.exists() and not (run / "rank0.ended").exists()


def test_a_link_or_a_fifo_in_a_messages_place_is_refused_without_blocking(tmp_path):
    run = runs.new_run_dir(tmp_path, "audit", "N", "cpu")
    (tmp_path / "elsewhere").write_text("null")
    os.symlink(tmp_path / "elsewhere", run / "rank0.ended")
    os.mkfifo(run / "rank1.ended")
    for name in ("rank0.ended", "rank1.ended"):
        with pytest.raises(private.Untrusted, match=f"{run}/{name}"):
            private.read(run, name)


def _traced_rank(folder: Path) -> tuple[Path, Path]:
    """A rank's evidence as the tool reads it: a trace with one collective, its names and a
    stack dump."""
    trace = folder / "rank0.trace"
    writer = trace_file.Writer(str(trace), rank=0, capacity=8)
    fields = (0, 3, writer.intern("all_reduce"), writer.intern("float32"), writer.intern("(3,)"))
    fields += (writer.intern("default"), writer.intern("train.py:12"), 0, -1, 0)
    writer.issue(fields)
    with os.fdopen(private.create(f"{trace}.names"), "w") as f:
        f.write(trace_file.names_line("float32", "(3,)", "fc.bias"))
    stack = folder / "rank0.stack"
    with os.fdopen(private.create(str(stack)), "w") as f:
        f.write('Thread 0x1 (most recent call first):\n  File "train.py", line 12 in step\n')
    return trace, stack


def _stack_read(stack: Path) -> list[str | None]:
    return [supervisor._read(str(stack)), node_ranks._text(str(stack))]


@as_root
def test_a_ranks_trace_or_stack_that_another_user_could_write_is_never_read(tmp_path):
    """Where the ranks were decides a hang's verdict: a trace, its sidecars or a stack dump
    another user owns, or found in a folder swapped for theirs, is refused (the watchdog's
    polls see no header), never read as the rank's."""
    run = runs.new_run_dir(tmp_path, "audit", "N", "cpu")
    trace, stack = _traced_rank(run)
    (record,) = trace_file.read_trace(str(trace)).records
    assert (record.op, record.site, record.like, record.state) == (
        "all_reduce", "train.py:12", "fc.bias", "issued")  # fmt: skip
    assert trace_file.read_header(str(trace)).pending == 1
    assert all("train.py" in text for text in _stack_read(stack))
    for planted in (trace, Path(f"{trace}.strings"), Path(f"{trace}.names")):
        os.chown(planted, NOBODY, NOBODY)
        with pytest.raises(private.Untrusted, match=f"file {planted} is owned by uid {NOBODY}"):
            trace_file.read_trace(str(trace))
        os.chown(planted, 0, 0)
    os.chown(trace, NOBODY, NOBODY)
    assert trace_file.read_header(str(trace)) is None
    os.chown(stack, NOBODY, NOBODY)
    for read in (supervisor._read, node_ranks._text):
        with pytest.raises(private.Untrusted, match=f"file {stack} is owned by uid {NOBODY}"):
            read(str(stack))
    os.rename(run, tmp_path / "moved")  # theirs in our folder's place, holding files of ours
    run.mkdir(mode=0o777)
    _traced_rank(run)
    os.chown(run, NOBODY, NOBODY)
    assert trace_file.read_header(str(trace)) is None
    for read in (trace_file.read_trace, supervisor._read, node_ranks._text):
        with pytest.raises(private.Untrusted, match=f"run folder {run} is owned by uid {NOBODY}"):
            read(str(trace if read is trace_file.read_trace else stack))


def test_a_file_a_rank_writes_in_place_is_its_users_alone_whatever_the_umask(tmp_path):
    """A stack dump or a trace's sidecar is written in place while the tool reads it: 0600
    under a group's umask, a wider file there before made 0600, a link in its place refused."""
    (tmp_path / "wide").write_text("x")
    os.chmod(tmp_path / "wide", 0o666)
    os.symlink(tmp_path / "target", tmp_path / "link")
    old = os.umask(0o002)
    try:
        for name in ("fresh", "wide"):
            os.close(private.create(str(tmp_path / name)))
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
        with pytest.raises(OSError, match="Too many levels of symbolic links"):
            private.create(str(tmp_path / "link"))
    finally:
        os.umask(old)
    assert not (tmp_path / "target").exists()


def _collective(ctx) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    return float(t.sum())


def test_a_traced_run_under_a_groups_umask_reads_its_own_evidence(tmp_path, monkeypatch):
    """Under umask 002 (a shared group's) the files a rank writes in place are its user's
    alone, so the tool reads its ranks' traces and stacks rather than refusing its own run.
    Fresh interpreters: a zygote started earlier in this process has the umask of then."""
    monkeypatch.setenv(NO_ZYGOTE_ENV, "1")
    folder = runs.new_run_dir(tmp_path, "run", 2, "cpu")
    old = os.umask(0o002)
    try:
        result = launch(_collective, world_size=2, report_dir=str(folder), stall_timeout_s=30.0)
    finally:
        os.umask(old)
    assert result.ok, result.outcomes
    assert [o.value for o in result.outcomes] == [4.0, 4.0]
    kept = [p for p in folder.iterdir() if p.suffix in (".trace", ".stack", ".strings")]
    assert {p.name for p in kept} >= {"rank0.stack", "rank1.stack", "rank0.trace"}, kept
    assert {stat.S_IMODE(p.stat().st_mode) for p in kept} == {0o600}


def test_nothing_is_written_after_the_seal(tmp_path):
    run = runs.new_run_dir(tmp_path, "audit", "N", "cpu")
    assert private.write(run, "rank0.up", b"null")
    assert stat.S_IMODE((run / "rank0.up").stat().st_mode) == 0o600
    private.seal(run)
    assert not private.write(run, "rank0.ended", b"null")
    with private.unsealed(run) as open_:
        assert open_ is None
    assert sorted(p.name for p in run.iterdir()) == ["job.diagnosed", "rank0.up"]


def _files(ctx, folder: str) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_ranks_job_is_never_a_file_in_its_folder(tmp_path):
    """A rank's job is a pickle (its function and arguments: code), so it never lies where
    another user could plant or swap it: the rank inherits it in an anonymous file."""
    folder = runs.new_run_dir(tmp_path, "run", 1, "cpu")
    result = launch(_files, world_size=1, args=(str(folder),), report_dir=str(folder))
    assert result.ok, result.outcomes
    assert not [name for name in result.outcomes[0].value if name.endswith(".job")]


PLANTER = """\
import os, pickle, sys, time
from pathlib import Path
import torch.distributed as dist

class Touch:
    def __reduce__(self):
        return (Path.touch, (Path(sys.argv[1]),))

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
path = os.path.join(os.environ["DDP_VERIFY_LAUNCHED"], "rank0.failed")
with open(path + ".x", "wb") as f:
    pickle.dump(Touch(), f)
os.chown(path + ".x", 65534, 65534)
os.rename(path + ".x", path)
time.sleep(60)
"""


@as_root
def test_a_launcher_commands_planted_message_is_one_line_and_runs_nothing(run_cli, tmp_path):
    """The launcher form end to end: a message planted by another user while the command runs
    is refused in one line, exit 2, with nothing of it run and nothing left running."""
    script = tmp_path / "planter.py"
    script.write_text(PLANTER)
    ran = tmp_path / "ran"
    out = tmp_path / "out"
    command = [sys.executable, str(script), str(ran), str(tmp_path / "store")]
    done = run_cli("hang", "--json", "--out", str(out), "--", *command)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verify: error: file "), done.stderr
    assert f"rank0.failed is owned by uid {NOBODY}" in lines[0]
    assert not ran.exists()
    (run,) = out.iterdir()
    assert done.stdout == ""  # no verdict
    marker = f"DDP_VERIFY_LAUNCHED={run}".encode()
    from verify.launching.tree import carries

    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    assert not [p for p in pids if carries(p, marker)]


def test_a_set_up_named_in_the_environment_is_one_of_the_tools():
    """A launcher command's processes make their set-ups from the environment (JSON, never a
    pickle: `launching/setups.py`); a name outside the tool is refused, nothing imported."""
    from verify import plugins
    from verify.launching import setups

    wanted = plugins.script_setups(sanitize=True, audit_every=3, on_cpu=True)
    assert setups.from_env(setups.to_env(wanted)) == wanted
    assert [type(s.made()).__name__ for s in wanted] == ["Sanitize", "Audit", "Rehearse"]
    assert setups.from_env(None) == setups.from_env("") == ()
    with pytest.raises(ValueError, match="one of the tool's plug-ins"):
        setups.from_env(setups.to_env([setups.SetUp("os:system")]))[0].made()
