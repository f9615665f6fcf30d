"""Which modules the script built, and what each tensor is called in them.

A user's script never tells the tool where its model is. So, from before the script's first
line, global registration hooks (`torch.nn.modules.module.register_module_*_registration_hook`)
note every module that registers a parameter, a buffer or a submodule: every model, layer and
wrapper the script builds, a plain `nn.Sequential` included, held weakly. At an optimizer step
the *roots* among them (modules that are nobody's child) give each parameter its qualified
name, as `named_parameters()` spells it, with a wrapper's own prefix dropped: `module.` of
`DistributedDataParallel` (or of a hand-written wrapper that holds the model as `module`) and
`_orig_mod.` of `torch.compile`. A parameter no module owns is named by its place in the
optimizer (`param_groups[0][3]`). The roots' `named_parameters()` order is also each
parameter's *place* (`place_of`): the one order every rank agrees on, whatever order its
optimizer lists them in (an optimizer built over a Python set lists them in each process's
own hash order).

`DistributedDataParallel` is also noted as it wraps a model: with `broadcast_buffers=True` it
broadcasts the model's buffers at the start of a forward (each one after a synced backward was
prepared: `broadcasts_now`), so the buffers are comparable right then (before BatchNorm updates
them with this rank's batch), not at the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

_WRAPPER_PREFIXES = ("module", "_orig_mod")


class Modules:
    """The modules the script built (module docstring); `install()` before the script runs."""

    def __init__(self) -> None:
        self._seen: dict[int, weakref.ref] = {}  # id -> module, in the order first seen
        self._version = 0  # bumped on every registration: the name map is rebuilt lazily
        self._names: dict[int, str] = {}
        self._places: dict[int, int] = {}  # id -> position in the roots' named_parameters()
        self._names_version = -1
        self._may_rebuild = True  # one rebuild on a miss per audit point (`refresh`)
        self._handles: list = []
        self.on_wrap: Callable[[nn.Module, nn.Module], None] | None = None  # (wrapper, model)

    def install(self) -> None:
        self._handles = [
            module_hooks.register_module_parameter_registration_hook(self._owner),
            module_hooks.register_module_buffer_registration_hook(self._owner),
            module_hooks.register_module_module_registration_hook(self._child),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _owner(self, module: nn.Module, name: str, value) -> None:
        self._note(module)

    def _child(self, module: nn.Module, name: str, child) -> None:
        self._note(module)
        if name == "module" and child is not None and self.on_wrap is not None:
            self.on_wrap(module, child)

    def _note(self, module: nn.Module) -> None:
        ref = self._seen.get(id(module))
        if ref is None or ref() is not module:  # new, or a dead module's id reused
            self._seen[id(module)] = weakref.ref(module)
        self._version += 1

    def roots(self) -> list[nn.Module]:
        """The modules that are no other module's child, in the order they were first seen."""
        seen = [m for m in (ref() for ref in list(self._seen.values())) if m is not None]
        if len(seen) < len(self._seen):  # forget modules the script has dropped
            self._seen = {id(m): weakref.ref(m) for m in seen}
        children = {id(c) for m in seen for c in m.children()}
        return [m for m in seen if id(m) not in children]

    def refresh(self) -> None:
        """A new audit point: a parameter missing from the names may be looked up once more
        (a wrapper such as FSDP2 may swap a module's parameters without registering them)."""
        self._may_rebuild = True

    def name_of(self, param: torch.Tensor) -> str | None:
        """The qualified name of `param` in its root module, or None if no module owns it."""
        miss = id(param) not in self._names
        if self._names_version != self._version or (miss and self._may_rebuild):
            self._rebuild()
            self._may_rebuild = False
        return self._names.get(id(param))

    def module_names(self) -> dict[int, str]:
        """Every module of the roots, by id, named as its parameters are (a wrapper's prefix
        dropped: `0`, `encoder.layers.1.attn`); a root, and a wrapper's module, is ""."""
        names: dict[int, str] = {}
        for root in self.roots():
            for name, m in root.named_modules(remove_duplicate=False):
                names.setdefault(id(m), strip(root, f"{name}.").rstrip("."))
        return names

    def place_of(self, param: torch.Tensor) -> int | None:
        """Where `param` comes in the roots' `named_parameters()` (module docstring), or None
        if no module owns it; valid after `name_of(param)`."""
        return self._places.get(id(param))

    def owners_of(self, params: list[torch.Tensor]) -> list[nn.Module]:
        """The root modules that hold any of `params`."""
        wanted = {id(p) for p in params}
        return [r for r in self.roots() if any(id(p) in wanted for p in r.parameters())]

    def _rebuild(self) -> None:
        names: dict[int, str] = {}
        for root in self.roots():
            for name, p in root.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), strip(root, name))
        self._places = {key: place for place, key in enumerate(names)}
        self._names, self._names_version = names, self._version


def strip(root: nn.Module, name: str) -> str:
    """`name` without the wrapper's prefix: a root whose only child is `module` (DDP, a
    hand-written wrapper) or `_orig_mod` (torch.compile) adds nothing a user would call it."""
    children = list(root._modules)
    if len(children) == 1 and children[0] in _WRAPPER_PREFIXES:
        prefix = children[0] + "."
        if name.startswith(prefix):
            return strip(root._modules[children[0]], name[len(prefix) :])
    return name


def syncs_buffers(root: nn.Module) -> bool:
    """True when `root` broadcasts its buffers at every forward (DDP, broadcast_buffers)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(root, DistributedDataParallel) and bool(
        getattr(root, "broadcast_buffers", False)
    )


def broadcasts_now(ddp: nn.Module) -> bool:
    """Inside `ddp`'s forward, before the model's: did DDP broadcast the buffers at this forward?
    Not after a forward that did not prepare a backward sync (under `no_sync()`, or with
    `require_backward_grad_sync` off, as Lightning's manual optimization runs its forward):
    DDP then skips the broadcast until a synced backward was prepared. PyTorch's own test
    (`_check_sync_bufs_pre_fwd`), where it has one; else `syncs_buffers`."""
    check = getattr(ddp, "_check_sync_bufs_pre_fwd", None)
    return bool(check()) if callable(check) else syncs_buffers(ddp)
