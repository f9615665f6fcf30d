"""Start-up code of every Python process a launcher command starts under the tool
(`audit -- torchrun ...`, `verify/launching/command.py` puts this folder first on PYTHONPATH).

It does nothing to a process that never calls `init_process_group`: the launcher itself
(torchrun's agent, `accelerate launch`, the parent of `mp.spawn`), a DataLoader worker, a
compiler subprocess. It only arms a hook on the import of `torch.distributed` that wraps
`init_process_group`; once that returns in a process, the process is a rank, and gets the
set-up of a rank of the tool (`verify/launching/launched.py`). Nothing of `verify` (nor
torch) is imported here: start-up must stay as cheap for every other process as it was.

Another `sitecustomize` further down the path (a distribution's, a virtualenv's) is
imported after this one, as it would have been without it.
"""

import os
import sys

_ENV = "DDP_VERIFY_LAUNCHED"  # the run's report folder (verify/launching/env.py: LAUNCHED_ENV)


class _Hook:
    """A meta-path finder for `torch.distributed` only: the module is found and loaded as
    usual, and its `init_process_group` wrapped once it has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # once: and never in the way of another import
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap(module)

        loader.exec_module = exec_and_wrap  # this spec's own loader instance
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
    sys.meta_path.insert(0, _Hook())
_chain()
