"""The code's shape: no import cycles, a pure core, no class over 400 lines.

Read from the source (the AST), not by importing it: every `import` and `from ... import` counts, absolute or
relative, at module level or inside a function (or under `if TYPE_CHECKING:`), since each is an arrow between
modules whichever moment it runs at. The arrows must only point down (docs/architecture.md): nothing a server
or store imports may reach the launcher, the CLI or a benchmark, and a cycle is where that breaks first.

`ecrec.core` is the sans-IO protocol core (docs/architecture.md, /docs/style.md): it imports no module that
starts threads, opens sockets, files or processes, or talks HTTP/gRPC (`CORE_FORBIDDEN`), and no `ecrec`
module outside the core; importing it changes no process-wide state (the warnings filters, the threads).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ecrec": ROOT / "services" / "ecrec", "ecrec_operator": ROOT / "operator" / "ecrec_operator"}
CLASS_DIRS = (ROOT / "services", ROOT / "operator")
MAX_CLASS_LINES = 400
CORE = "ecrec.core"
# What the core may not import (the top-level name): concurrency, sockets and processes, files and the
# process's own state (os, signal), and the network stacks the adapters use.
CORE_FORBIDDEN = frozenset(
    {
        "threading",
        "_thread",
        "concurrent",
        "multiprocessing",
        "asyncio",
        "queue",
        "socket",
        "ssl",
        "select",
        "selectors",
        "subprocess",
        "signal",
        "os",
        "io",
        "shutil",
        "tempfile",
        "pathlib",
        "grpc",
        "httpx",
        "requests",
        "fastapi",
        "uvicorn",
        "starlette",
        "kopf",
        "kubernetes",
        "prometheus_client",
    }
)


@dataclass(frozen=True)
class Import:
    line: int
    names: tuple[
        str, ...
    ]  # what it names, absolute: "a.b" for `import a.b`, "a.b", "a.b.c" for `from a.b import c`


def _source_files(pkg_dir: Path) -> list[Path]:
    return sorted(f for f in pkg_dir.rglob("*.py") if "_pb2" not in f.name)


def module_name(pkg: str, pkg_dir: Path, f: Path) -> tuple[str, bool]:
    """The dotted name of file `f` in package `pkg`, and whether it is a package (__init__)."""
    parts = [pkg, *f.relative_to(pkg_dir).with_suffix("").parts]
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def imports(tree: ast.AST, module: str, is_pkg: bool) -> list[Import]:
    """Every import in `tree` (at any depth), relative ones resolved against `module`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.append(Import(node.lineno, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if is_pkg else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            out.append(Import(node.lineno, (base, *(f"{base}.{a.name}" for a in node.names))))
    return out


def import_graph(
    packages: dict[str, Path] = PACKAGES,
) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """module -> the project's modules it imports, and (importer, imported) -> the line of the first such
    import. An import of a module's own package (or an ancestor) is not an arrow: Python runs the package's
    __init__ first whatever the submodule says, and a package that re-exports its submodules is no cycle."""
    files: dict[str, tuple[Path, bool]] = {}
    for pkg, d in packages.items():
        for f in _source_files(d):
            name, is_pkg = module_name(pkg, d, f)
            files[name] = (f, is_pkg)
    edges: dict[str, set[str]] = {m: set() for m in files}
    lines: dict[tuple[str, str], int] = {}
    for m, (f, is_pkg) in files.items():
        for imp in imports(ast.parse(f.read_text(), str(f)), m, is_pkg):
            for name in imp.names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != m and not m.startswith(name + "."):
                    edges[m].add(name)
                    lines.setdefault((m, name), imp.line)
    return edges, lines


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each tangle (`tangles`), as a path back to its first module."""
    return [_one_cycle(edges, t) for t in tangles(edges)]


def tangles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): modules that all reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[set[str]] = []

    def visit(v: str) -> None:  # iterative: a deep chain of imports must not hit the recursion limit
        work = [(v, iter(sorted(edges[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        scc.add(w)
                        if w == node:
                            break
                    if len(scc) > 1:
                        sccs.append(scc)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sccs


def _one_cycle(edges: dict[str, set[str]], scc: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (by name), as a path back to it."""
    start = min(scc)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & scc):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(scc)}")


def describe(cycle: list[str], lines: dict[tuple[str, str], int]) -> str:
    return (
        " -> ".join(f"{a} (line {lines[(a, b)]})" for a, b in zip(cycle, cycle[1:], strict=False))
        + f" -> {cycle[-1]}"
    )


def big_classes(dirs: tuple[Path, ...] = CLASS_DIRS, limit: int = MAX_CLASS_LINES) -> list[str]:
    out = []
    for d in dirs:
        for f in sorted(d.rglob("*.py")):
            if "_pb2" in f.name or ".venv" in f.parts:
                continue
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.ClassDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append(f"{f.relative_to(ROOT)}:{node.lineno} class {node.name}: {n} lines")
    return out


def core_violations(edges: dict[str, set[str]] | None = None) -> list[str]:
    """Imports of the core's modules that leave the core: a forbidden library or an `ecrec` module outside it."""
    out = []
    d = PACKAGES["ecrec"]
    for f in _source_files(d / "core"):
        m, is_pkg = module_name("ecrec", d, f)
        for imp in imports(ast.parse(f.read_text(), str(f)), m, is_pkg):
            for name in imp.names[:1]:  # the module itself; the names after it are what it takes from it
                top = name.split(".")[0]
                if top in CORE_FORBIDDEN:
                    out.append(f"{f.relative_to(ROOT)}:{imp.line} imports {name}")
                elif top in PACKAGES and name != CORE and not name.startswith(CORE + "."):
                    out.append(f"{f.relative_to(ROOT)}:{imp.line} imports {name}, outside {CORE}")
    return out


# -- the tests ---------------------------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    edges, lines = import_graph()
    found = tangles(edges)
    assert not found, "import cycles:\n" + "\n".join(
        f"{describe(_one_cycle(edges, t), lines)}   [{len(t)} modules tangled: {', '.join(sorted(t))}]"
        for t in found
    )


def test_core_imports_only_the_core_and_no_io() -> None:
    problems = core_violations()
    assert not problems, "ecrec.core must stay sans-IO:\n" + "\n".join(problems)


def test_importing_the_core_changes_no_process_wide_state() -> None:
    """Importing every core module leaves the warnings filters and the set of threads as they were (torch,
    which the core computes with, is imported first: its own import is not the core's doing)."""
    d = PACKAGES["ecrec"]
    names = [module_name("ecrec", d, f)[0] for f in _source_files(d / "core")]
    script = (
        "import threading, warnings, numpy, torch\n"
        "filters, threads = list(warnings.filters), threading.active_count()\n"
        f"for name in {names!r}:\n"
        "    __import__(name)\n"
        "    assert warnings.filters == filters, f'importing {name} changed the warnings filters'\n"
        "    assert threading.active_count() == threads, f'importing {name} started a thread'\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_no_class_over_400_lines() -> None:
    big = big_classes()
    assert not big, f"classes over {MAX_CLASS_LINES} lines (split them by concern):\n" + "\n".join(big)


# -- the checks themselves can fail ------------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.sub import b\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def f():\n    from .c import g\n",
            "pkg/sub/c.py": "def g():\n    from .. import a\n",
            "pkg/d.py": "import pkg.a\n",
        },
    )
    edges, lines = import_graph({"pkg": tmp_path / "pkg"})
    found = cycles(edges)
    assert found == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    assert describe(found[0], lines) == (
        "pkg.a (line 1) -> pkg.sub.b (line 2) -> pkg.sub.c (line 2) -> pkg.a"
    )


def test_a_cycle_added_to_a_copy_of_the_tree_is_found(tmp_path) -> None:
    """The real packages, copied, plus one arrow up: the core importing the launcher."""
    import shutil

    copies = {}
    for pkg, d in PACKAGES.items():
        copies[pkg] = tmp_path / pkg
        shutil.copytree(d, copies[pkg], ignore=shutil.ignore_patterns("__pycache__"))
    placement = copies["ecrec"] / "core" / "reconcile.py"
    placement.write_text(placement.read_text() + "\n\ndef _up():\n    from ecrec.local import run_local\n")
    edges, _ = import_graph(copies)
    assert any({"ecrec.core.reconcile", "ecrec.local"} <= t for t in tangles(edges))
    assert not any("ecrec.core.reconcile" in t for t in tangles(import_graph()[0]))


def test_a_package_importing_its_own_submodules_is_no_cycle(tmp_path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import A\nfrom pkg.b import B\n",
            "pkg/a.py": "from pkg import b\nA = 1\n",
            "pkg/b.py": "B = 2\n",
        },
    )
    edges, _ = import_graph({"pkg": tmp_path / "pkg"})
    assert edges["pkg"] == {"pkg.a", "pkg.b"} and edges["pkg.a"] == {"pkg.b"}
    assert cycles(edges) == []
