"""The package's import structure, read from the source with ``ast`` (nothing is imported).

- An rredcot module is imported at the top of the module that uses it. A function-level import
  of one is allowed only with a ``# lazy: <reason>`` comment on the import (any of its lines) or
  on the line above it: the reason is the CLI's start-up (tests/cli/test_cli_startup.py) or a
  process that must not load what it does not use. Optional third-party extras are not checked
  here (their imports are guarded where they are used).
- No module reaches into another's private names: no ``from rredcot.x import _name`` and no
  ``x._name`` on an imported rredcot module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rredcot

PACKAGE = Path(rredcot.__file__).resolve().parent
MARKER = "# lazy:"


def _modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The rredcot modules (or names' modules) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "rredcot"]
    if node.level:  # relative: resolve against the importing module's package
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return [".".join([*base, *([node.module] if node.module else [])])]
    return [node.module] if node.module and node.module.split(".")[0] == "rredcot" else []


def _function_level_imports(tree: ast.AST):
    """Import statements inside a function (a method included), with the function."""

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                inner = getattr(child, "name", "<lambda>")
            if isinstance(child, ast.Import | ast.ImportFrom) and function is not None:
                yield child, function
            yield from visit(child, inner)

    yield from visit(tree, None)


def unmarked_lazy_imports(path: Path, package: Path = PACKAGE) -> list[str]:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    module = _module_name(path, package)
    found = []
    for node, function in _function_level_imports(ast.parse(source)):
        if not _imported(node, module, path.name == "__init__.py"):
            continue
        span = lines[node.lineno - 2 : node.end_lineno]  # the line above, and the statement
        if not any(MARKER in line for line in span):
            rel = path.relative_to(package.parent)
            found.append(f"{rel}:{node.lineno} in {function}(): {ast.unparse(node)}")
    return found


def private_name_uses(path: Path, package: Path = PACKAGE) -> list[str]:
    """``from rredcot.x import _name`` and ``x._name`` on an rredcot module, across modules."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    module = _module_name(path, package)
    is_package = path.name == "__init__.py"
    rel = path.relative_to(package.parent)
    found, aliases = [], set()
    modules = {_module_name(p, package) for p in _modules(package)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets = _imported(node, module, is_package)
        if not targets:
            continue
        for alias in node.names:
            bound = alias.asname or alias.name.split(".")[0]
            if isinstance(node, ast.Import):
                if alias.asname:
                    aliases.add(bound)
                continue
            if f"{targets[0]}.{alias.name}" in modules:  # `from rredcot import runio`
                aliases.add(bound)
                continue
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private and targets[0] != module:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_rredcot_imports_are_at_module_top_unless_marked_lazy():
    found = [line for path in _modules() for line in unmarked_lazy_imports(path)]
    assert found == [], (
        "function-level imports of rredcot modules: move them to the module's top, or say why "
        f"they must stay with a '{MARKER} <reason>' comment:\n" + "\n".join(found)
    )


def test_no_module_imports_another_modules_private_names():
    found = [line for path in _modules() for line in private_name_uses(path)]
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    """The two checks on a small package of their own: each finds its case and passes the
    allowed forms."""
    pkg = tmp_path / "rredcot"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from rredcot import b\n"
        "from rredcot.b import _hidden\n"
        "def f():\n"
        "    from rredcot.b import g\n"
        "    # lazy: a reason\n"
        "    from rredcot.b import h\n"
        "    from rredcot.b import (  # lazy: another\n"
        "        k,\n"
        "    )\n"
        "    import json\n"
        "    return b._secret, b.__name__\n"
    )
    (pkg / "b.py").write_text("def _own():\n    from rredcot.b import _own\n")
    lazy = unmarked_lazy_imports(pkg / "a.py", pkg)
    assert lazy == ["rredcot/a.py:4 in f(): from rredcot.b import g"]
    private = private_name_uses(pkg / "a.py", pkg)
    assert private == [
        "rredcot/a.py:2: from rredcot.b import _hidden",
        "rredcot/a.py:11: b._secret",
    ]
    assert private_name_uses(pkg / "b.py", pkg) == []  # its own name
    assert unmarked_lazy_imports(pkg / "b.py", pkg) == [
        "rredcot/b.py:2 in _own(): from rredcot.b import _own"
    ]


MAX_FUNCTION_LINES = 80


def long_functions(package: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (methods too) longer than ``limit`` lines, decorators included."""
    found = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - start + 1
                if lines > limit:
                    found.append(f"{path.relative_to(package.parent)}:{start} {node.name} {lines}")
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the rredcot modules it imports (at any level, function bodies included)."""
    paths = _modules(package)
    names = {_module_name(p, package) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        module = _module_name(path, package)
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(node, module, path.name == "__init__.py"):
                if isinstance(node, ast.ImportFrom):  # `from pkg import module` names a module
                    subs = {f"{target}.{a.name}" for a in node.names} & names
                    edges |= subs or ({target} & names)
                elif target in names:
                    edges.add(target)
        edges.discard(module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` (one path per strongly connected set of two or more modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _is_package_face(module: str, package: Path = PACKAGE) -> bool:
    """A package's ``__init__`` re-exports its modules: the package and its modules import each
    other only through it (``rredcot.methods`` and ``rredcot.methods.base``)."""
    path = package.parent.joinpath(*module.split("."), "__init__.py")
    return path.exists()


def test_no_function_is_longer_than_80_lines():
    assert long_functions() == []


def test_no_import_loop_between_modules():
    graph = {
        m: {t for t in targets if not _is_package_face(t)}
        for m, targets in import_graph().items()
        if not _is_package_face(m)
    }
    assert import_cycles(graph) == []


def test_the_length_and_loop_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "rredcot"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rredcot.b import g\n" + "    x = 1\n" * 80)
    (pkg / "b.py").write_text("from rredcot import a\n\ndef g():\n    pass\n")
    assert [line.split()[1:] for line in long_functions(pkg)] == [["f", "82"]]
    assert import_cycles(import_graph(pkg)) == [["rredcot.a", "rredcot.b"]]


def test_every_moved_module_imports_at_its_old_path_as_the_same_module():
    """``rredcot._MOVED``: an import of a module's path before a move gives the module at its new
    place (the same object), for every entry."""
    import importlib

    import rredcot

    assert "integrations.trl.gather" in rredcot._MOVED
    for old, new in rredcot._MOVED.items():
        assert importlib.import_module(f"rredcot.{old}") is importlib.import_module(
            f"rredcot.{new}"
        ), old
