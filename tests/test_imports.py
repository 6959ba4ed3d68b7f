"""The package's import graph, read from the source with ``ast`` (nothing is imported): no
import circles, counting imports inside functions as well as at module level, and no module
importing another module's private names (``from .x import _y``)."""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "mlx_lazy"
# Private names these modules import from others; the lead moves them (issue 20 item 3).


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path) -> list[tuple[str, str, str | None, int]]:
    """Every import of a package module by a package module, wherever it is written:
    ``(importer, imported module, imported name or None, line)``. ``from .x import y`` is an
    import of module ``x.y`` when that is a module, else of name ``y`` from ``x``."""
    mods = modules(root)
    found = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(name, a.name, None, node.lineno) for a in node.names if a.name in mods]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        found.append((name, f"{base}.{a.name}", None, node.lineno))
                    elif base in mods:
                        found.append((name, base, a.name, node.lineno))
    return found


def circles(root: Path) -> list[list[str]]:
    """The package's import circles: each strongly connected component of more than one
    module (or a module importing itself), sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for importer, target, _, _ in imports(root):
        graph[importer].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1 or m in graph[m]:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(found)


def private_imports(root: Path) -> list[str]:
    """``importer: from module import _name (line)`` for each private name one module takes
    from another (private modules such as ``_blas`` are not names)."""
    return [f"{importer}: from {target} import {name} (line {line})"
            for importer, target, name, line in imports(root)
            if name and name.startswith("_") and not name.startswith("__") and target != importer]


def test_the_walker_sees_function_level_circles_and_private_names(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import run\n")
    (pkg / "a.py").write_text("from . import b\n\ndef run():\n    return b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import _hidden\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nfrom .. import _private_module\n"
                                      "_hidden = 1\n")
    (pkg / "_private_module.py").write_text("")
    (pkg / "leaf.py").write_text("from .a import run\n")
    assert circles(pkg) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert private_imports(pkg) == ["pkg.b: from pkg.sub.c import _hidden (line 2)"]


def test_the_package_has_no_import_circles():
    found = circles(PACKAGE)
    assert not found, f"import circles: {found}"


def test_no_module_imports_private_names_of_another():
    found = private_imports(PACKAGE)
    assert not found, found
