"""A run folder only this user can write, the messages the tool and its ranks leave there, and
the seal that ends a run's writing.

Who is trusted: this user. Another local user must not be able to plant a message, swap the
folder for one of their own (a shared `--out` lets them rename ours), or run code in the tool.

- A run folder is made 0700 whatever the umask (`make_dir`).
- Every message is read and written through the folder opened without following a link and
  checked on that descriptor (`_opened`): owned by this user and writable by no one else. A
  folder renamed away and replaced after the check cannot matter: the file is opened relative
  to the descriptor, which names the folder that was checked.
- A message is data, never code: JSON or plain text, written 0600 under a fresh temporary
  name (O_EXCL, O_NOFOLLOW) and renamed into place, and checked again on read: a regular file
  of this user's that no one else can write. The evidence a verdict rests on is read the same
  way (`read`, `read_path`): a rank's collective trace and its stack dumps, which a rank
  writes in place (`create`: 0600, whatever the umask).
- Anything else is `Untrusted`, a ValueError of one line: the run is refused, and nothing of
  the file is read.

The seal: once the tool has its verdict it seals the folder (`seal`), and from then on no
process of the run leaves a message there (`write` returns False): a rank that ends after the
verdict, or a launcher's next attempt, cannot mix its reports into the run's. Writers hold a
shared `flock` of the folder from the check to the rename (`unsealed`, `write`), the seal an
exclusive one, so no message lands after it, however slow the machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator

SEALED = "job.diagnosed"  # the seal's mark (`env.DIAGNOSED`: a failing rank waits for it)
SEAL_WAIT_S = 10.0  # the longest the seal waits for a writer to finish (one frozen by SIGSTOP)


class Untrusted(ValueError):
    """A run folder or a message in it that another principal could have written."""


def make_dir(path: str | os.PathLike) -> None:
    """Make the folder `path` (FileExistsError if it exists), mode 0700 whatever the umask."""
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # a umask may take bits even from the owner


def check_dir(folder: str | os.PathLike) -> None:
    """Raise Untrusted unless `folder` is a folder of this user's that no one else can write."""
    with _opened(folder):
        pass


def read(
    folder: str | os.PathLike, name: str, *, after: int = 0, most: int | None = None
) -> bytes | None:
    """The message `name` in `folder` (None: there is none, nor a folder), from byte `after`
    on, `most` bytes at most; Untrusted if the folder or the file is not this user's alone."""
    if not os.path.lexists(folder):
        return None
    with _opened(folder) as dir_fd:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a link in a message's place
            raise Untrusted(f"{os.path.join(folder, name)}: {exc.strerror}: refused") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise Untrusted(f"{os.path.join(folder, name)} is not a regular file: refused")
            _check(info, os.path.join(folder, name), "file")
            f.seek(after)
            return f.read() if most is None else f.read(most)


def read_path(path: str, *, after: int = 0, most: int | None = None) -> bytes | None:
    """`read` of the file at `path`, in the folder that holds it."""
    return read(os.path.dirname(path) or ".", os.path.basename(path), after=after, most=most)


def create(path: str) -> int:
    """A descriptor of the file at `path` for writing, made (or emptied) for this user alone:
    0600 whatever the umask, a link in its place refused (ELOOP). For a file a rank writes
    in place while the tool reads it (a stack dump): a message is `write`n whole instead."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
    return fd


def names(folder: str | os.PathLike) -> list[str]:
    """The names of the messages in `folder`, listed through its checked descriptor (none: no
    folder); Untrusted if the folder is not this user's alone. A name says only that a file is
    there: its content is trusted once `read` has checked it."""
    if not os.path.lexists(folder):
        return []
    with _opened(folder) as dir_fd:
        return os.listdir(dir_fd)


def write(folder: str | os.PathLike, name: str, data: bytes, *, asked: bool = False) -> bool:
    """Leave the message `name` in `folder`, 0600, whole or not at all; False (nothing
    written) once the folder is sealed, unless the message is one the tool `asked` for, which
    it reads after its verdict too (the flight recorder's dump: `watching/capture.py`; that
    the launcher started its workers again: `launched.started_again`)."""
    with unsealed(folder, asked=asked) as dir_fd:
        if dir_fd is None:
            return False
        tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True


def mark(folder: str | os.PathLike, name: str) -> bool:
    """Leave the empty message `name`, 0600, whose name is all it says (a rank that ended
    well): a full disk still takes it, as it needs no data block. False once sealed."""
    with unsealed(folder) as dir_fd:
        if dir_fd is None:
            return False
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(name, flags, 0o600, dir_fd=dir_fd))
        return True


@contextlib.contextmanager
def unsealed(folder: str | os.PathLike, *, asked: bool = False) -> Iterator[int | None]:
    """While it lasts the folder stays unsealed: yields its checked descriptor, or None when
    it is sealed already (`asked`: the descriptor all the same). What a writer does inside
    lands before any seal."""
    with _opened(folder) as dir_fd:
        fcntl.flock(dir_fd, fcntl.LOCK_SH)
        try:
            yield dir_fd if asked or not _present(dir_fd, SEALED) else None
        finally:
            fcntl.flock(dir_fd, fcntl.LOCK_UN)


def sealed(folder: str | os.PathLike) -> bool:
    with _opened(folder) as dir_fd:
        return _present(dir_fd, SEALED)


def seal(folder: str | os.PathLike) -> None:
    """Seal `folder` (module docstring): waits for the writers inside (`SEAL_WAIT_S` at most)."""
    with _opened(folder) as dir_fd:
        end = time.monotonic() + SEAL_WAIT_S
        while True:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    break  # sealed without the lock: a writer frozen inside must not hold the run
                time.sleep(0.01)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(SEALED, flags, 0o600, dir_fd=dir_fd))


@contextlib.contextmanager
def _opened(folder: str | os.PathLike) -> Iterator[int]:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(folder, flags)
    except OSError as exc:
        if exc.errno in (20, 40):  # ENOTDIR, ELOOP: a file or a link in the folder's place
            raise Untrusted(f"run folder {folder} is not a folder: refused") from None
        raise
    try:
        _check(os.fstat(dir_fd), str(folder), "run folder")
        yield dir_fd
    finally:
        os.close(dir_fd)


def _check(info: os.stat_result, path: str, what: str) -> None:
    me = os.geteuid()
    if info.st_uid != me:
        raise Untrusted(
            f"{what} {path} is owned by uid {info.st_uid}, not by this user (uid {me}): refused "
            "(a run's files are its own user's alone; another user may have planted or swapped it)"
        )
    if info.st_mode & 0o022:
        raise Untrusted(
            f"{what} {path} can be written by others (mode {stat.S_IMODE(info.st_mode):o}): "
            "refused (a run's files are its own user's alone)"
        )


def _present(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
