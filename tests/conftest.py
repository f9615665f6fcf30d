"""Shared pytest configuration.

- Tests marked `gpu` need CUDA and NCCL and skip cleanly without them (every CPU-only machine,
  CI included).
- `run_cli(*args)` runs `python -m verify ARGS` as `main()` in the test's process, from the
  repository's root: the ranks are real (forked from this worker's zygotes), but no
  interpreter starts and imports torch per case (~6 s of CPU a case saved). Tests that need
  a terminal's view (no traceback on a real shell) or a signal start a real process instead.
- Under `pytest -n auto` several workers launch ranks at once: each worker tells the tool how
  many jobs share the machine (DDP_VERIFY_JOBS), so every rank's thread budget is its share of
  the cores among all of them (`verify/launching/threads.py`), not of one worker's ranks.
- Tests marked `alone` run while no other test does. Every test holds a shared lock on a file
  of the session; an `alone` test holds it exclusively. The load test is one (one test, one hog
  window for every loaded verdict, `tests/test_load.py`): its CPU hogs keep every core busy
  while it lasts, which would slow every test of the other workers
  three times over (a third of the suite's CPU went to the hogs). (Session- and module-scoped
  fixtures are set up outside it and may overlap it, which only adds load; and flock lets a
  new shared lock in while the exclusive one waits, so it may wait for a quiet moment.)
  Tests marked `gpu` run alone too where there are several GPUs: the ranks of one process are
  spread over them (`verify/launching/gpus.py`), but those of several workers would pile onto
  the first ones. On one GPU every rank shares it by design (`--device cuda --backend gloo`),
  so they run side by side like the CPU tests (one at a time, 32 of them overran a 5-minute
  window on one H200).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from tests.consoles import Ran
from tests.processes import AS_IN_THE_SUITE, machine_lock
from verify.cli import main
from verify.launching.threads import JOBS_ENV

ROOT = Path(__file__).resolve().parent.parent

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(JOBS_ENV, os.environ["PYTEST_XDIST_WORKER_COUNT"])


# The order xdist hands tests out in (each test is a unit of work, given in collection order
# to whichever worker is free): the load test first, since it holds the machine alone and the
# other workers meanwhile build the session launches their first tests need (a session
# fixture is set up before the lock is asked for); then the longest tests, so that none
# starts last while the other workers have nothing left to do.
FIRST = (
    "tests/test_load.py::",
    "tests/test_profile.py::test_every_rank_writes",
    "tests/test_script_audit.py::test_each_bug",
    "tests/test_hang.py::test_every_scenario",
    "tests/test_multinode.py::",
    "tests/test_script_verdicts.py::test_script_verdicts",  # a minute, mostly waiting
    "tests/test_impls.py::test_every_impl_on_every_hard_case",
    "tests/test_equivalence.py::test_every_correct",
)


def _first(item) -> int:
    return next((i for i, p in enumerate(FIRST) if item.nodeid.startswith(p)), len(FIRST))


WINDOW = "tests/test_load.py::test_verdicts_hold_with_every_core_busy"


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: the items that will run
def pytest_collection_modifyitems(config, items):
    items.sort(key=_first)  # stable: the rest keep their order
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and NCCL")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """A test marked `under_load` runs verdicts the hog window checks too, with the same
    assertions (its problems function is one of the window's jobs): where the window runs,
    it is skipped, its verdicts checked once, under load. Run alone (its file, its node id),
    it is the idle check that every change to a verdict gets: the launches the window
    repeats were a fifth of the suite's CPU, for checks it makes anyway. Decided here, from
    the session's final items (`--lf` narrows them after every collection hook of ours)."""
    if item.get_closest_marker("under_load") is None:
        return
    window = any(other.nodeid.startswith(WINDOW) for other in item.session.items)
    if window or os.environ.get(AS_IN_THE_SUITE) == "1":
        pytest.skip(f"checked under load by {WINDOW}; run alone for idle")


class _GroupsKept:
    """In an xdist worker under `--dist loadgroup`: every test marked `xdist_group` must carry
    its group in its node id, which is what sends a group to one worker. pytest 9.2 stopped
    reading what pytest-xdist 3.8 writes there, and the groups were silently ignored (a
    session fixture of tests/test_compare.py ran twice, a minute each): fail instead."""

    @pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook has marked the groups
    def pytest_collection_modifyitems(self, config, items) -> None:
        if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
            return
        grouped = [i for i in items if i.get_closest_marker("xdist_group") is not None]
        lost = [i.nodeid for i in grouped if "@" not in i.nodeid]
        if lost:  # (xdist shows a worker's error as an INTERNALERROR: said on stderr first)
            why = (
                f"--dist loadgroup: {len(lost)} tests marked xdist_group carry no group in "
                f"their node id ({lost[0]}): pytest {pytest.__version__} does not keep what "
                "pytest-xdist writes there (pyproject.toml's dev extra says which pytest works)"
            )
            print(why, file=sys.__stderr__, flush=True)
            raise pytest.UsageError(why)


def pytest_configure(config):
    config.pluginmanager.register(_GroupsKept(), "ddp-verify-groups-kept")


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """`python -m verify ARGS` from the repository's root, in this process (module docstring)."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> Ran:
        code = main(list(args))
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


@pytest.fixture(autouse=True)
def _share_the_machine(request, tmp_path_factory):
    """The session's lock: shared by every test, exclusive for one marked `alone`."""
    marked = {m for m in ("alone", "gpu") if request.node.get_closest_marker(m) is not None}
    alone = "alone" in marked or ("gpu" in marked and torch.cuda.device_count() > 1)
    with machine_lock(tmp_path_factory, alone):
        yield
