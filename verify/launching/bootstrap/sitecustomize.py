"""Start-up code of every Python process a launcher command starts under the tool
(`audit -- torchrun ...`, `verify/launching/launcher.py` puts this folder first on PYTHONPATH).

It does nothing to a process that never calls `init_process_group`: the launcher itself
(torchrun's agent, `accelerate launch`, the parent of `mp.spawn`), a DataLoader worker, a
compiler subprocess. It only arms a hook on the import of `torch.distributed` that wraps
`init_process_group`; once that returns in a process, the process is a rank, and gets the
set-up of a rank of the tool (`verify/launching/launched.py`). Nothing of `verify` (nor
torch) is imported here: start-up must stay as cheap for every other process as it was.

A process that ends without joining says why, for the tool's one line
(`verify/launching/unjoined.py`): a script file that is not there (checked here, a `stat`),
an exception that reaches its top (`sys.excepthook`, which imports `verify` only then), or
the one it was handling when it called `sys.exit` with an error code (mp.spawn's worker
wrapper). A Ctrl-C sends its stderr to the run folder from then on (`_on_ctrl_c`, installed
where SIGINT has Python's own handler; a script's or launcher's own handler replaces it, and
`signal.getsignal` shows it, so `asyncio.run` leaves SIGINT as it finds it, raising
KeyboardInterrupt, as before Python 3.11).

Under `--on-cpu` a second hook waits for the import of `torch` itself: once torch is loaded,
and before the importing line gets it back, the rehearsal is installed (`launched.start_early`,
`verify/oncpu/setup.py`), so a CUDA script's first `torch.cuda...` or `"cuda:0"` is already mapped,
and its `init_process_group("nccl")` is gloo by the time it is called. Every process of the
command that imports torch gets it, the launcher's too (torchrun's agent, the parent of
`mp.spawn`, which may ask `torch.cuda.device_count()`); a process that never imports torch
pays nothing.

Another `sitecustomize` further down the path (a distribution's, a virtualenv's) is
imported after this one, as it would have been without it.
"""

import os
import signal
import sys

_ENV = "DDP_VERIFY_LAUNCHED"  # the run's report folder (verify/launching/env.py: LAUNCHED_ENV)
_ON_CPU_ENV = "DDP_VERIFY_LAUNCHED_ON_CPU"  # set: --on-cpu (env.py: LAUNCHED_ON_CPU_ENV)


class _Hook:
    """A meta-path finder for one module only (`name`): the module is found and loaded as
    usual, and `then(module)` called once it has run."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once: and never in the way of another import
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_then(module):
            exec_module(module)
            self.then(module)

        loader.exec_module = exec_and_then  # this spec's own loader instance
        return spec


def _wrap(dist) -> None:
    c10d = getattr(dist, "distributed_c10d", None)
    original = getattr(c10d, "init_process_group", None)
    if original is None:  # a torch without distributed support: nothing to watch
        return

    def init_process_group(*args, **kwargs):
        from verify.launching import launched

        return launched.init_process_group(original, args, kwargs)

    init_process_group.__wrapped__ = original
    init_process_group.__doc__ = original.__doc__
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _rehearse(torch) -> None:
    from verify.launching import launched

    launched.start_early()


def _uncaught(kind, exc, tb, _previous=sys.excepthook):
    """An exception at the top of a process that never joined: noted for the tool's line
    (`verify/launching/unjoined.py`), its traceback printed unless that says otherwise; a
    Ctrl-C's in any process: the tool's to say."""
    try:
        from verify.launching import launched, unjoined

        if unjoined.interrupted(exc):
            return
        if not launched.joined() and unjoined.failed(exc):
            return
    except Exception:
        pass
    _previous(kind, exc, tb)


def _exiting(code=None, _previous=sys.exit):
    """`sys.exit` with a non-zero code inside an `except` of a process that never joined:
    what it was handling is why it ended, noted as an uncaught one is (mp.spawn's worker
    wrapper catches a worker's exception, hands its traceback to the parent and exits 1:
    the worker's excepthook never sees it)."""
    exc = sys.exc_info()[1]
    if code not in (None, 0) and exc is not None and not isinstance(exc, SystemExit):
        try:
            from verify.launching import launched, unjoined

            if not launched.joined():
                unjoined.failed(exc)
        except Exception:
            pass
    _previous(code)


def _on_ctrl_c(signum, frame):
    """A Ctrl-C, which the tool answers by ending every process of the command: from now
    on this process's stderr goes to `interrupted.<pid>.stderr` in the run folder, so that
    what the end of it prints (mp.spawn's workers, interrupted again by their parent's death
    in their exit handlers) does not bury "verify: interrupted"; then KeyboardInterrupt, as
    Python's own handler raises it."""
    try:
        path = os.path.join(os.environ[_ENV], f"interrupted.{os.getpid()}.stderr")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        sys.stderr.flush()
        os.dup2(fd, 2)
        os.close(fd)
    except Exception:
        pass
    signal.default_int_handler(signum, frame)


def _chain() -> None:
    """Import the `sitecustomize` this one hides, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if mine is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = mine


if os.environ.get(_ENV) and "torch.distributed" not in sys.modules:
    sys.meta_path.insert(0, _Hook("torch.distributed", _wrap))
    if os.environ.get(_ON_CPU_ENV) and "torch" not in sys.modules:
        sys.meta_path.insert(0, _Hook("torch", _rehearse))
    # A script file that is not there: Python says "can't open file" after this module.
    _script = sys.argv[0] if sys.argv else ""
    if _script.endswith(".py") and not os.path.exists(_script):
        from verify.launching import unjoined

        unjoined.no_script(os.environ[_ENV], sys.argv)
    sys.excepthook = _uncaught
    sys.exit = _exiting
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_ctrl_c)
_chain()
