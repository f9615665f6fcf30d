"""Loading a user's class named on the command line: `package.module:Class` or
`path/to/file.py:Class`.

Every failure is an `ImplError` with one line (exit code 2): the module or file not found, an
exception while importing it (its type and message, not a traceback; `sys.exit()` too), no
such class, a class the file only imports. The import runs in the tool's process, contained
(`containment.py`): its prints go to stderr, a fork's child ends at once, its threads do not
hold the tool's exit.

A class is the file's when the file defines it (its `__module__` is the file's module):
`file.py:DDP` where the file does `from torch.nn.parallel import DistributedDataParallel as
DDP` would certify PyTorch's class under the file's name, so it is refused, naming the class
and the ones the file defines. A module path may name a class its package re-exports
(`mypkg:MyDDP`, defined in `mypkg/ddp.py`, as packages commonly do), but not one from
another package (`mypkg:DDP` for torch's): that is named by its own module.

A file inside a package (its directory has `__init__.py`) is imported as a member of that
package, by its dotted name, with the package root's parent on `sys.path`: its absolute
(`from mypkg.util import x`) and relative (`from .util import x`) imports then work as they do
when the user runs their own code. A file outside any package is executed under a private
module name, with its own directory on `sys.path` so that its sibling imports work.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import zlib
from pathlib import Path
from types import ModuleType

from .containment import contained
from .recipes import ImplError


def load_class(spec: str) -> type:
    """Import `package.module:Class` or `path/to/file.py:Class` and return the class."""
    module_part, _, class_name = spec.rpartition(":")
    if not module_part or not class_name:
        raise ImplError(f"--impl {spec!r}: expected package.module:Class or path/to/file.py:Class")
    in_file = module_part.endswith(".py") or "/" in module_part  # a path, not a dotted name
    if in_file:
        path = Path(module_part)
        if not path.is_file():
            raise ImplError(f"--impl {spec!r}: file {module_part} does not exist")
        module = _import_file(path)
    else:
        module = _import_module(spec, module_part)
    own = sorted(n for n, v in vars(module).items() if _is_own(v, module, in_file))
    there = f" (classes there: {', '.join(own)})" if own else ""
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ImplError(
            f"--impl {spec!r}: module {module_part!r} has no class {class_name!r}{there}"
        )
    if not inspect.isclass(cls):
        raise ImplError(f"--impl {spec!r}: {class_name!r} is not a class")
    if not _is_own(cls, module, in_file):
        raise ImplError(_not_own(spec, cls, own, in_file))
    return cls


def _not_own(spec: str, cls: type, own: list[str], in_file: bool) -> str:
    """The one line for a class `spec` names that its module only imports: what it is, and
    the classes that may be named there (`own`)."""
    module_part, _, class_name = spec.rpartition(":")
    home = f"{cls.__module__}.{cls.__qualname__}"
    if in_file:
        defines = f"classes it defines: {', '.join(own)}" if own else "it defines no class"
        return (
            f"--impl {spec!r}: {class_name} is {home}, imported, not defined in {module_part} "
            f"({defines}): name a class the file defines"
        )
    return (
        f"--impl {spec!r}: {class_name} is {home}, imported from another package, not "
        f"{module_part.split('.')[0]}'s: name it as {cls.__module__}:{cls.__qualname__}"
        + (f", or one of {module_part}'s ({', '.join(own)})" if own else "")
    )


def _is_own(value: object, module: ModuleType, in_file: bool) -> bool:
    """Whether `value` is a class of `module`'s: defined in it (a file), or in its top-level
    package (a module path, where re-exports are common)."""
    if not inspect.isclass(value):
        return False
    home = getattr(value, "__module__", None) or ""
    if in_file:
        return home == module.__name__
    return home.split(".")[0] == module.__name__.split(".")[0]


def name_the_class(spec: str) -> str:
    """The one-line error for `--impl path/to/file.py` with no `:Class`: the classes defined
    there, read from the source (not imported: nothing of the file runs for an error)."""
    path = Path(spec)
    if not path.is_file():
        return f"--impl {spec!r}: file {spec} does not exist"
    try:
        tree = ast.parse(path.read_text(), filename=spec)
    except (SyntaxError, UnicodeDecodeError, OSError) as e:
        return f"--impl {spec!r}: name the class as {spec}:Class ({spec} cannot be read: {e})"
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    if not classes:
        return f"--impl {spec!r}: name the class as {spec}:Class ({spec} defines no class)"
    return (
        f"--impl {spec!r}: name the class, e.g. {spec}:{classes[0]} (classes there: "
        f"{', '.join(classes)})"
    )


def _import_module(spec: str, dotted: str) -> ModuleType:
    try:
        with contained(dotted):
            return importlib.import_module(dotted)
    except KeyboardInterrupt:
        raise
    except ModuleNotFoundError as e:
        if e.name and dotted.startswith(e.name):  # the module named, not one it imports
            raise ImplError(f"--impl {spec!r}: module {e.name!r} not found") from None
        raise ImplError(f"--impl {spec!r}: importing {dotted} failed: {e}") from None
    except BaseException as e:  # SyntaxError, ImportError, SystemExit: anything at import
        raise ImplError(f"--impl {spec!r}: importing {dotted} failed: {_what(e)}") from None


def _what(e: BaseException) -> str:
    """What an import raised, in a few words: its type and message; an exit as the call."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}) (a class's file must not exit when imported)"
    return f"{type(e).__name__}: {e}"


def _import_file(path: Path) -> ModuleType:
    path = path.resolve()
    if (path.parent / "__init__.py").is_file():
        return _import_package_member(path)
    # Keyed by the resolved path: two submissions both called ddp.py must not share a module.
    name = f"ddp_verify_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # so the file's sibling imports work
    sys.modules[name] = module
    try:
        with contained(str(path)):
            spec.loader.exec_module(module)
    except KeyboardInterrupt:
        del sys.modules[name]
        raise
    except BaseException as e:
        del sys.modules[name]
        raise ImplError(f"--impl {path}: importing the file failed: {_what(e)}") from None
    return module


def _import_package_member(path: Path) -> ModuleType:
    """Import a file that lives in a package by its dotted name (see the module docstring)."""
    top = path.parent
    while (top.parent / "__init__.py").is_file() and top.parent != top:
        top = top.parent
    root = top.parent
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    dotted = ".".join(parts)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        with contained(str(path)):
            module = importlib.import_module(dotted)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise ImplError(
            f"--impl {path}: importing it as {dotted} (from {root}) failed: {_what(e)}"
        ) from None
    found = Path(module.__file__).resolve() if getattr(module, "__file__", None) else None
    if found != path:
        # A package of the same name was importable first (already imported, or earlier on
        # sys.path): importing by name would silently run someone else's code.
        raise ImplError(
            f"--impl {path}: {dotted} imports {found or 'a namespace package'}, not this file: "
            f"another package named {parts[0]!r} comes first; rename yours, or name the class "
            "as package.module:Class"
        )
    return module
