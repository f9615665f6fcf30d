"""Imports run one way: no module of `verify/`, `impls/` or `benchmarks/` imports, directly or
through others, a module that imports it back, also from inside a function (a circle there
only waits for the call that closes it); `impls/` imports nothing of `verify/`, and neither
imports the maintainer's scripts of `benchmarks/`.

Read from the source (`ast`), not by importing: every import that can run counts, wherever it
sits, except those under `if TYPE_CHECKING:` (annotations only, never executed). A string
`"package.module:name"` counts as an import of that module: it is how the CLI's table names
what it imports on dispatch (`verify/cli/command.py`).

Beside the imports, the shape the product keeps: no function of `verify/` or `impls/` over 60
lines (but the known long ones, which may only shrink), and at most 8 places in `verify/`
that repeat six or more lines.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verify", "impls", "benchmarks")
REFERENCE = re.compile(r"([A-Za-z_][\w.]*):\w+")  # "package.module:name"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours `path` can import when it runs."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if match := REFERENCE.fullmatch(node.value):
                out.add(match.group(1))
    return {m for m in out if m in known}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    # A package's __init__ importing its own modules is how a package is built, not a circle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    assert circles(graph) == []


def package_circles() -> list[list[str]]:
    """The circles among `verify/`'s packages: a module of one importing a module of another
    is an edge between the two (a top-level module, `verify/runs.py`, is a package of its own)."""
    known = modules()

    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if name.startswith("verify."):
            out = {package(m) for m in imports(path, known) if m.startswith("verify.")}
            graph.setdefault(package(name), set()).update(out - {package(name)})
    return circles({p: {m for m in out if m in graph} for p, out in graph.items()})


def test_the_packages_import_one_way():
    """No circle of packages (the runtime's was one circle of ten: checks, launching, oncpu,
    options, recording, runs, sanitize, script_audit, training, watching; then one of four,
    through the finding kinds and phases the checks and the plug-ins shared, now `hints`)."""
    assert package_circles() == []


def test_the_hints_are_a_leaf_below_the_checks_and_the_plug_ins():
    """The kinds, phases and hint table import only the audit engine's `Finding` and measure:
    the checks and the plug-ins both name their findings' kinds there."""
    known = modules()
    out = {m for n, p in known.items() if n.startswith("verify.hints") for m in imports(p, known)}
    assert {".".join(m.split(".")[:2]) for m in out} <= {"verify.hints", "verify.replica_audit"}, (
        out
    )


# The plug-ins and the front ends above the runtime (docs/design.md: "the runtime imports no
# plug-in; plug-ins import the runtime").
PLUG_INS = ("checks", "cli", "hints", "oncpu", "recording", "replica_audit", "sanitize",
            "script_audit", "plugins")  # fmt: skip


def test_the_runtime_imports_no_plug_in():
    """No module of `verify/launching/` (its bootstrap too) imports a plug-in or a front end,
    at the top or inside a function: the plug-ins' set-ups are named by the front ends
    (`verify/plugins.py`) and made in the rank (`launching/setups.py`)."""
    known = modules()
    plug_ins = tuple(f"verify.{p}." for p in PLUG_INS)
    runtime = {n: p for n, p in known.items() if n.startswith("verify.launching")}
    assert "verify.launching.bootstrap.sitecustomize" in runtime and len(runtime) > 30
    leaks = {
        name: sorted(m for m in imports(path, known) if (m + ".").startswith(plug_ins))
        for name, path in runtime.items()
    }
    assert {n: m for n, m in leaks.items() if m} == {}


@pytest.mark.parametrize("package, above", [("impls", ("verify", "benchmarks")),
                                            ("verify", ("benchmarks",))])  # fmt: skip
def test_imports_run_down_the_layers(package, above):
    known = modules()
    leaks = {
        name: sorted(m for m in imports(path, known) if m.startswith(above))
        for name, path in known.items()
        if name.split(".")[0] == package
    }
    assert {n: m for n, m in leaks.items() if m} == {}


def test_the_cli_table_names_modules_that_exist():
    """A row's strings are its imports: each names a module of ours and a name it holds
    (read from the source, so a renamed function fails here, not on a user's command)."""
    known = modules()
    named = 0
    for path in [ROOT / "verify/cli/commands.py", *(ROOT / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if REFERENCE.fullmatch(node.value):
                    module, name = node.value.split(":")
                    assert module in known, (path.name, node.value)
                    tree = ast.parse(known[module].read_text())
                    defined = {
                        getattr(n, "name", None) for n in tree.body
                    } | {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                         if isinstance(t, ast.Name)}  # fmt: skip
                    assert name in defined, (path.name, node.value)
                    named += 1
    assert named >= 40, named  # 13 commands' options, runners and printers; 3 scripts' rows


MAX_FUNCTION_LINES = 60  # a function a reader holds at once (../shared/STYLE.md)


def function_lengths() -> dict[str, int]:
    """`path:name` -> lines, of every function of `verify/` and `impls/` (nested ones too)."""
    found = {}
    for name, path in modules().items():
        if name.split(".")[0] not in ("verify", "impls"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = f"{path.relative_to(ROOT)}:{node.name}"
                found[key] = max(found.get(key, 0), node.end_lineno - node.lineno + 1)
    return found


def test_no_function_over_60_lines():
    """No function of `verify/` or `impls/` is over 60 lines (issue 51: the 14 there were are
    split along their steps)."""
    over = {k: n for k, n in function_lengths().items() if n > MAX_FUNCTION_LINES}
    assert over == {}, f"over {MAX_FUNCTION_LINES} lines"


MAX_REPEATS = 8  # pairs of places in verify/ sharing six or more lines (issue 29's goal)


def test_verify_repeats_itself_in_at_most_8_places():
    """Code written twice drifts apart: at most 8 pairs of places in `verify/` share six or
    more lines, by the `duplicates` tool where the machine has it (it reads the tree as text,
    writes nothing); without it, nothing measures this."""
    tool = shutil.which("duplicates")
    if tool is None:
        pytest.skip("the duplicates tool is not installed here")
    out = subprocess.run(
        [tool, "--repo", str(ROOT / "verify"), "--most", "40", "--seconds", "120"],
        capture_output=True, text=True, timeout=300,
    ).stdout  # fmt: skip
    first = out.splitlines()[0] if out else ""
    assert "incomplete" not in out, out
    pairs = 0 if first.startswith("no duplicates") else int(first.split()[0])
    assert pairs <= MAX_REPEATS, out
