"""The channel between a rank's helper and the tool (`verify/watching/capture.py`), in one
process: the helper's threads answer about this process's main thread, as they would in a rank.
What a user relies on: the watchdog's "where is the rank" gets its answer, a flight-recorder
dump lands in the report, and nobody without the run's key can ask or answer."""

import contextlib
import json
import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from verify import private
from verify.watching import capture


def _folder(tmp_path) -> str:
    folder = str(tmp_path / "run")
    private.make_dir(folder)
    return folder


def _until(answer, timeout_s: float = 10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = answer()
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError("no answer from the helper")


def test_the_watchdog_is_told_the_line_the_main_thread_is_at(tmp_path):
    folder = _folder(tmp_path)
    helpers = capture.helpers(folder)
    assert helpers.where(0, ask_first=True) is None  # asked before the rank is up: kept
    capture.start_rank_helper(folder, 0)
    here = f"{os.path.relpath(__file__)}:"  # a line of `_until`, where the main thread waits
    assert _until(lambda: helpers.where(0, ask_first=False)).startswith(here)
    assert helpers.in_torch(0, ask_first=False) is False
    assert helpers.where(0, ask_first=True) is None  # a new question: the old answer is gone
    assert _until(lambda: helpers.where(0, ask_first=False)).startswith(here)
    assert capture.helpers(folder) is helpers  # the supervisor shares the watchdog's connections


def test_the_flight_recorder_dump_is_written_into_the_report(tmp_path):
    folder = _folder(tmp_path)
    capture.start_rank_helper(folder, 1)
    written = capture.helpers(folder).flight_recorder([1])
    assert written == [capture.fr_path(folder, 1)]
    with open(written[0]) as f:
        json.loads(f.read())  # a dump, or the error that says why there is none


def test_nobody_without_the_key_can_ask_and_a_silent_peer_blocks_no_one(tmp_path):
    folder = _folder(tmp_path)
    capture.start_rank_helper(folder, 0)
    address = json.loads(private.read(folder, f"rank0.{capture.ADDRESS}"))
    assert oct(os.stat(os.path.join(folder, f"rank0.{capture.ADDRESS}")).st_mode & 0o777) == "0o600"
    with pytest.raises(AuthenticationError):
        Client(("127.0.0.1", address["port"]), family="AF_INET", authkey=os.urandom(32))
    silent = socket.create_connection(("127.0.0.1", address["port"]))  # never answers the challenge
    helpers = capture.RankHelpers(folder)
    helpers.where(0, ask_first=True)
    assert _until(lambda: helpers.where(0, ask_first=False))
    silent.close()


def test_a_forged_helper_is_never_believed(tmp_path):
    """An address whose listener does not hold the key (another user's port, a stale file):
    no answer, and no traceback in the tool."""
    from multiprocessing.connection import Listener

    folder = _folder(tmp_path)
    impostor = Listener(("127.0.0.1", 0), family="AF_INET", authkey=b"not the key")
    forged = {"port": impostor.address[1], "key": os.urandom(32).hex()}
    private.write(folder, f"rank0.{capture.ADDRESS}", json.dumps(forged).encode())

    def accept() -> None:
        with contextlib.suppress(AuthenticationError, EOFError, OSError):
            impostor.accept()

    threading.Thread(target=accept, daemon=True).start()
    helpers = capture.RankHelpers(folder)
    helpers.where(0, ask_first=True)
    time.sleep(0.5)
    assert helpers.where(0, ask_first=False) is None
    impostor.close()
