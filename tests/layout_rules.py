"""The layout rules of ``tests/test_layout.py``, as functions of a source root (so the tests
can also run them on a made-up package and see them fail).

Run as a script, it prints the count of private names that cross a module boundary in src/
and each crossing: ``python tests/layout_rules.py [SRC]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# namedtuple's public API has a leading underscore
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(src: Path, top: str) -> dict[str, Path]:
    """Every module under ``src/top`` by dotted name (a package by its ``__init__``)."""
    return {module_name(src, p): p for p in sorted((src / top).rglob("*.py"))}


def package_of(name: str, path: Path) -> str:
    """The package a module belongs to: itself for a package's ``__init__``."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an ``ImportFrom`` names."""
    base = node.module or ""
    if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
    return base


def owner(target: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``target`` (a module or a name in one) lives in."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


# ---------------------------------------------------------------------------- classes
def oversized_classes(src: Path, top: str, limit: int) -> list[str]:
    """``module:Class (n lines)`` for every class longer than ``limit`` lines."""
    over = []
    for name, path in modules(src, top).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    over.append(f"{name}:{node.name} ({n} lines)")
    return over


def classes_patched_from_outside(src: Path, top: str) -> list[str]:
    """``module:line Class.attr`` for every assignment to a flexdemo class's attribute made
    outside that class's body (``Class.method = function``): a class is defined in one place."""
    known = modules(src, top)
    trees = {name: ast.parse(path.read_text()) for name, path in known.items()}
    classes = {node.name for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)}
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id in classes:
                    found.append(f"{name}:{node.lineno} {t.value.id}.{t.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and node.args \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in classes:
                found.append(f"{name}:{node.lineno} setattr({node.args[0].id}, ...)")
    return found


# ---------------------------------------------------------------------------- packages
def faceless_packages(src: Path, top: str) -> list[str]:
    """Packages whose ``__init__`` lacks a literal ``__all__``, lists a private name, or
    lists a name it does not bind (by import, definition, assignment or a module
    ``__getattr__`` that names it)."""
    bad = []
    for name, path in modules(src, top).items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        listed: list[str] | None = None
        bound: set[str] = set()
        lazy = ""
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        bound.add(t.id)
                        if t.id == "__all__" and node.value is not None:
                            listed = list(ast.literal_eval(node.value))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound.add(node.name)
                if node.name == "__getattr__":
                    lazy = ast.unparse(node)
            elif isinstance(node, ast.If):  # TYPE_CHECKING imports of the lazy names
                bound |= {(a.asname or a.name) for sub in ast.walk(node)
                          if isinstance(sub, (ast.Import, ast.ImportFrom)) for a in sub.names}
        if listed is None:
            bad.append(f"{name}: no __all__")
            continue
        bad += [f"{name}: __all__ lists private {n}" for n in listed if is_private(n)]
        bad += [f"{name}: __all__ lists {n}, which it does not bind" for n in listed
                if n not in bound and repr(n) not in lazy and f'"{n}"' not in lazy]
    return bad


def private_imports_across_packages(src: Path, top: str) -> list[str]:
    """``module:line name`` for every import of a private name (or from a private module)
    of another package: what a package keeps to itself stays inside it."""
    known = modules(src, top)
    found = []
    for name, path in known.items():
        package = package_of(name, path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = resolve(node, package)
            src_mod = owner(base, known)
            if src_mod is None:
                continue
            src_pkg = package_of(src_mod, known[src_mod])
            if src_pkg == package:
                continue
            for a in node.names:
                parts = f"{base}.{a.name}"[len(top) + 1:].split(".")
                if any(is_private(p) for p in parts):
                    found.append(f"{name}:{node.lineno} {base}.{a.name}")
    return found


def imports_past_the_face(src: Path, top: str, faced: set[str]) -> list[str]:
    """``module:line target`` for every import, from outside a package of ``faced``, of one
    of its modules instead of its public face (its ``__init__``)."""
    known = modules(src, top)
    found = []
    for name, path in known.items():
        package = package_of(name, path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                targets = [owner(resolve(node, package), known)]  # `from face import mod`: ok
            elif isinstance(node, ast.Import):
                targets = [owner(a.name, known) for a in node.names]
            else:
                continue
            for t in targets:
                for face in faced:
                    if t and t.startswith(face + ".") and not (name == face
                                                               or name.startswith(face + ".")):
                        found.append(f"{name}:{node.lineno} {t}")
    return found


# ---------------------------------------------------------------------------- the count
def private_crossings(src: Path, top: str) -> list[str]:
    """Every private name used across a module boundary: an import of ``_name`` from another
    module, and ``x._name`` where ``x`` is not ``self``, ``cls`` or ``super()`` and not a
    third-party module (``torch._foreach_add_`` is torch's API, not a crossing of ours).
    Attributes of third-party objects count (``manager._client``, ``t._local_tensor``)."""
    found = []
    for name, path in modules(src, top).items():
        package = package_of(name, path)
        tree = ast.parse(path.read_text())
        foreign: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                foreign |= {(a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.split(".")[0] != top}
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node, package)
                if base.split(".")[0] == top:
                    found += [f"{name}:{node.lineno} import {base}.{a.name}"
                              for a in node.names if is_private(a.name)]
                elif base != "__future__":
                    foreign |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)
                    and node.attr not in NAMEDTUPLE_API):
                continue
            v = node.value
            if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in foreign):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "src"
    crossings = private_crossings(root, "flexdemo")
    print("\n".join(crossings))
    print(f"{len(crossings)} private names cross a module boundary "
          f"({sum(' import ' in c for c in crossings)} imports)")
