"""The registry: built once, read-only, every name with its kind; imports that run
one way; `resolve` accepting or refusing by kind with one-line messages.

Single-process and fast; the import-order checks each start a fresh interpreter, since an
import circle only shows on a cold start. The interfaces a user's class may have are tested in
`test_user_interface.py`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from impls.faulty import FAULTS
from impls.faulty.hang_scenarios import SCENARIOS
from impls.registry import (
    REGISTERED_KINDS,
    REGISTRY,
    ImplError,
    interface_problem,
    names,
    resolve,
)

ROOT = Path(__file__).resolve().parent.parent
BUILTINS = ["naive", "flat", "overlap", "bucketed", "zero1", "zero2", "zero3"]
REFERENCES = ["torch-ddp", "torch-zero", "torch-fsdp"]
TAIL = ", or give package.module:Class or path/to/file.py:Class"

# --- the registry --------------------------------------------------------------------------


def test_the_registry_is_read_only_and_holds_every_name_with_its_kind():
    assert isinstance(REGISTRY, types.MappingProxyType)
    with pytest.raises(TypeError):
        REGISTRY["mine"] = REGISTRY["naive"]  # type: ignore[index]
    import impls.registry

    assert not hasattr(impls.registry, "register")

    kinds = {name: impl.kind for name, impl in REGISTRY.items()}
    expected = {
        **dict.fromkeys(BUILTINS, "builtin"),
        **dict.fromkeys(REFERENCES, "reference"),
        **dict.fromkeys(FAULTS, "faulty"),
        **dict.fromkeys(SCENARIOS, "hang"),
    }
    assert kinds == expected
    assert list(REGISTRY) == list(expected)  # built-ins first, then references, catalogues
    assert all(name == impl.name for name, impl in REGISTRY.items())
    assert len(FAULTS) >= 15 and len(SCENARIOS) >= 10
    assert all(n.startswith("faulty:") for n in FAULTS)
    assert all(n.startswith("hang:") for n in SCENARIOS)
    # A faulty one is built exactly as a user's class would be, from the recorded class.
    for name, fault in FAULTS.items():
        assert REGISTRY[name].cls is fault.cls
    assert REGISTRY["zero1"].sharded and REGISTRY["torch-zero"].sharded


def test_names_by_kind():
    assert names({"builtin"}) == BUILTINS
    assert names({"builtin", "reference"}) == BUILTINS + REFERENCES
    assert names({"faulty"}) == list(FAULTS)
    assert names({"hang"}) == list(SCENARIOS)
    assert names() == list(REGISTRY)
    assert names(REGISTERED_KINDS) == list(REGISTRY)
    assert names({"user"}) == []  # user classes have no registered names
    with pytest.raises(ValueError, match="unknown kinds"):
        names({"nope"})


def test_every_registered_class_passes_the_interface_check():
    """The faulty catalogue is built by `from_class`, as a user's class is: it must satisfy
    the same pre-flight check, or the check would refuse correct user classes too."""
    assert [n for n, impl in REGISTRY.items() if interface_problem(impl)] == []


@pytest.mark.parametrize(
    "first, second",
    [("impls.faulty", "impls.registry"), ("impls.registry", "impls.faulty")],
)
def test_no_import_circle_in_either_order(first, second):
    code = textwrap.dedent(
        f"""
        import sys
        import {first}
        import {second}
        import impls.faulty.hang_scenarios
        from impls.registry import REGISTRY
        assert len(REGISTRY) > 30
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_imports_run_one_way():
    """Recipes know no catalogue; catalogues know no registry."""
    code = textwrap.dedent(
        """
        import sys
        import impls.recipes, impls.loading
        assert "impls.faulty" not in sys.modules, "recipes imported a catalogue"
        import impls.faulty, impls.faulty.hang_scenarios
        assert "impls.registry" not in sys.modules, "a catalogue imported the registry"
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- resolve -------------------------------------------------------------------------------


def test_resolve_accepts_the_kinds_a_command_runs():
    assert resolve("naive") is REGISTRY["naive"]
    assert resolve("naive", kinds={"builtin"}) is REGISTRY["naive"]
    assert resolve("faulty:no-divide", kinds={"faulty"}).kind == "faulty"
    assert resolve("hang:raise", kinds={"hang"}).kind == "hang"


def test_resolve_refuses_other_kinds_with_one_line_listing_what_the_command_accepts():
    kinds = {"builtin", "reference", "faulty"}
    with pytest.raises(ImplError) as refused:
        resolve("hang:raise", kinds=kinds, command="consistency")
    accepted = ", ".join(BUILTINS + REFERENCES + list(FAULTS))
    assert str(refused.value) == (
        f"unknown implementation 'hang:raise' for consistency; choose one of {accepted}{TAIL}"
    )
    with pytest.raises(ImplError) as unknown:
        resolve("nope", kinds={"builtin"})
    assert (
        str(unknown.value)
        == f"unknown implementation 'nope'; choose one of {', '.join(BUILTINS)}{TAIL}"
    )
    # A catalogue prefix is a name, not a module `faulty` with a class `nope`.
    with pytest.raises(
        ImplError, match="^unknown implementation 'faulty:nope'; choose one of naive"
    ):
        resolve("faulty:nope")
    with pytest.raises(ValueError, match="unknown kinds"):
        resolve("naive", kinds={"builtins"})


def test_user_classes_are_accepted_whatever_the_kinds(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the file's directory
    impl = resolve(f"{ROOT}/docs/examples/student_ddp.py:StudentDDP", kinds={"hang"})
    assert impl.kind == "user" and impl.cls.__name__ == "StudentDDP"
    fixture = ROOT / "tests" / "fixtures" / "user_classes.py"
    assert resolve(f"{fixture}:TakesBucketSize", kinds=set()).kind == "user"
