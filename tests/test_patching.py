"""`verify/patching.py`: how the plug-ins patch torch and put it back, in-process."""

from __future__ import annotations

import types

from verify.patching import Patches


class Base:
    def f(self):
        return "base"


class Child(Base):
    @staticmethod
    def s():
        return "static"


def test_restore_puts_back_exactly_what_was_there():
    """An inherited method is inherited again (not copied onto the class), a staticmethod is
    the staticmethod it was, and a name that was absent is absent again."""
    module = types.SimpleNamespace()
    patches = Patches()
    patches.apply(Child, "f", lambda self: "ours")
    patches.apply(Child, "s", staticmethod(lambda: "ours"))
    patches.apply(module, "new", 1)
    assert (Child().f(), Child.s(), module.new) == ("ours", "ours", 1)
    assert patches.replaced(Child, "f") and not patches.replaced(Base, "f")
    patches.restore()
    assert "f" not in vars(Child) and Child().f() == "base"
    assert isinstance(vars(Child)["s"], staticmethod) and Child.s() == "static"
    assert not hasattr(module, "new") and not patches


def test_a_wrapper_installed_over_ours_is_left_in_place():
    """Two tools patch one name; the first to restore is the one patched under the other: the
    newer wrapper stays. Restored in the reverse order, the original is back."""
    module = types.SimpleNamespace(g=lambda: "original")
    first, second = Patches(), Patches()
    ours = lambda: "first"  # noqa: E731
    first.apply(module, "g", ours)
    theirs = lambda: "second"  # noqa: E731
    second.apply(module, "g", theirs)
    first.restore()
    assert module.g is theirs
    module = types.SimpleNamespace(g=lambda: "original")
    first.apply(module, "g", ours)
    second.apply(module, "g", theirs)
    second.restore()
    first.restore()
    assert module.g() == "original"
