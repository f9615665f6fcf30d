"""A recording is checked whole before anything runs (verify/recording/store.py): every way
it can be bad is one line, exit 2, naming the folder and the file, never a traceback, a hang,
nor a misleading message ("a different model") after the whole script ran.

One small recording is made once, in-process, by the recorder itself (one rank, three
steps of a tiny SGD loop); each case damages a copy of it the way a disk, a copy or a hand
does. Then one CLI run: `audit --against BAD -- script` refuses before the script starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from verify.cli import main
from verify.hints.phases import GRADS, PARAMS_AFTER, PARAMS_FIRST, SETTINGS
from verify.recording import store
from verify.recording.recorder import Recorder
from verify.replica_audit.compare import Entry

BEFORE, AFTER = 0, 1


class _Alone:
    """The audit's group at world size 1: nothing to compare with, the recorder keeps all."""

    rank, size = 0, 1

    def ready(self) -> bool:
        return False


def _record(folder: Path, steps: int = 3) -> None:
    """What `audit --record` keeps of a tiny SGD loop, through the recorder's own calls (and
    the batch its model's forward was given at each step)."""
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    recorder, group = Recorder(str(folder)), _Alone()
    model = torch.nn.Linear(3, 1)
    recorder.batches.install()
    for step in range(steps):
        model(torch.full((2, 3), float(step)))
        grad = torch.full_like(w, 0.5 + step)
        before = [Entry(SETTINGS, "param_groups[0].lr", setting=0.1), Entry(GRADS, "w", grad)]
        if step == 0:
            before.insert(0, Entry(PARAMS_FIRST, "w", w.clone()))
        recorder.add(group, (), 0, "SGD", step, BEFORE, before)
        recorder.settle(group, agreed=True)
        w -= 0.1 * grad
        recorder.add(group, (), 0, "SGD", step, AFTER, [Entry(PARAMS_AFTER, "w", w.clone())])
        recorder.settle(group, agreed=True)
    recorder.batches.remove()
    recorder.finish()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recording") / "good"
    _record(folder)
    assert store.read(str(folder)).steps == 3
    return folder


def _manifest(folder: Path, change) -> None:
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def _rows(folder: Path, name: str, column: str, value) -> None:
    path = folder / name
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays[column] = arrays[column].copy()
    arrays[column][-1] = value
    np.savez_compressed(path, **arrays)


def _truncate(folder: Path) -> None:
    data = (folder / "tensors.npz").read_bytes()
    (folder / "tensors.npz").write_bytes(data[: len(data) // 2])


def _damaged_member(folder: Path) -> None:
    """A whole zip whose member's compressed bytes were flipped (its CRC then fails)."""
    path = folder / "values.npz"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.infolist()[0]
    at = info.header_offset  # the local header's own name and extra lengths, then the data
    start = (
        at
        + 30
        + int.from_bytes(data[at + 26 : at + 28], "little")
        + int.from_bytes(data[at + 28 : at + 30], "little")
    )
    for i in range(start, start + min(info.compress_size, 16)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _fifo(folder: Path) -> None:
    (folder / "values.npz").unlink()
    os.mkfifo(folder / "values.npz")


# case -> (how the copy is damaged, the file the message names, what it says)
CASES = {
    "truncated npz": (_truncate, "tensors.npz", "is not a readable .npz"),
    "damaged member": (_damaged_member, "values.npz", "is not a readable .npz"),
    "no keys": (lambda f: _manifest(f, lambda m: m.pop("keys")), "manifest.json", "no 'keys'"),
    "negative world size": (lambda f: _manifest(f, lambda m: m.update(world_size=-2)),
                            "manifest.json", "'world_size' = -2"),
    "key out of range": (lambda f: _rows(f, "tensors.npz", "key", 99), "tensors.npz",
                         "has key 99"),
    "optimizer out of range": (lambda f: _rows(f, "values.npz", "optimizer", 5), "values.npz",
                               "has optimizer 5"),
    "step past the count": (lambda f: _rows(f, "tensors.npz", "step", 7), "tensors.npz",
                            "of step 7"),
    "missing column": (lambda f: np.savez_compressed(f / "values.npz", step=np.zeros(2)),
                       "values.npz", "no column"),
    "fifo": (_fifo, "values.npz", "is not a regular file"),
    "zero steps": (lambda f: _manifest(f, lambda m: m.update(steps=[0])), "manifest.json",
                   "holds no optimizer step"),
    "batches said, no file": (lambda f: (f / "batches.npz").unlink(), "batches.npz",
                              "cannot be opened"),
    "batches not a dict": (lambda f: _manifest(f, lambda m: m.update(batches=[])),
                           "manifest.json", "'batches' = []"),
    "batch key out of range": (lambda f: _rows(f, "batches.npz", "key", 99), "batches.npz",
                               "has key 99"),
    "batch step past the count": (lambda f: _rows(f, "batches.npz", "step", 7), "batches.npz",
                                  "of step 7"),
}  # fmt: skip


def _within(fn, seconds: float = 30.0):
    """`fn()`'s result or exception; a failure of the test, not a hang, if it blocks."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # handed to the test
            out.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"blocked for {seconds:g}s"
    return out[0]


def _cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_recording_is_one_line_naming_the_folder_and_the_file(good, tmp_path, case):
    damage, name, says = CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    damage(bad)
    how, got = _within(lambda: store.read(str(bad)))
    assert how == "raised" and isinstance(got, store.NotARecording), (how, got)
    message = str(got)
    assert "\n" not in message and str(bad) in message and name in message, message
    assert says in message, message
    how, (code, out, err) = _within(lambda: _cli("compare", str(good), str(bad)))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert str(bad) in err and name in err and "Traceback" not in err, err


def test_against_a_bad_recording_refuses_before_the_script_starts(good, tmp_path):
    """A truncated table behind a valid manifest: the check before the run reads it whole,
    so the script never starts (it would leave its marker) and the verdict is not lost to a
    crash after the run."""
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    _truncate(bad)
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, out, err = _cli("audit", "--nproc", "2", "--out", str(tmp_path / "runs"), "--against",
                          str(bad), "--", str(script))  # fmt: skip
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert str(bad) in err and "tensors.npz" in err and "Traceback" not in err, err
    assert not marker.exists() and not list((tmp_path / "runs").glob("*")), "the run started"


def test_a_recording_of_an_earlier_version_without_batches_reads_and_compares_as_before(
    good, tmp_path
):
    """No `batches` in its manifest and no batches.npz (as written before batches were
    recorded): read whole, and compared with a new one without a word about batches."""
    old = tmp_path / "old"
    shutil.copytree(good, old)
    (old / "batches.npz").unlink()
    _manifest(old, lambda m: m.pop("batches"))
    assert store.read(str(old)).batches is None
    assert len(store.read(str(good)).batches["step"]) == 3
    for pair in ((old, good), (good, old)):
        code, out, err = _cli("compare", *map(str, pair))
        assert code == 0 and "AGREE bitwise" in out and "batches" not in out, (code, out, err)
    code, out, _ = _cli("compare", str(good), str(good))
    assert code == 0 and "batches: the same batches at every compared step" in out, out
