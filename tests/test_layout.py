"""The package's three parts: the library imports nothing from the application or the tools,
no module imports itself through a circle, and no module is over about 500 lines."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
PKG = SRC / "flexdemo"
# `python -m flexdemo`: the command line's entry, part of the application
ENTRY = {"flexdemo.__main__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def library_modules() -> list[str]:
    return [m for m in _modules() if m not in ENTRY
            and not m.startswith(("flexdemo.app", "flexdemo.tools"))]


@pytest.mark.multiprocess
def test_the_library_imports_nothing_from_app_or_tools():
    mods = library_modules()
    assert {"flexdemo", "flexdemo.checkpoint", "flexdemo.optim", "flexdemo.mesh"} <= set(mods)
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    leaked = [m for m in loaded if m.startswith(("flexdemo.app", "flexdemo.tools"))
              or m in ENTRY]
    assert not leaked, f"the library imported {leaked}"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """flexdemo modules that ``name`` imports at module level (TYPE_CHECKING blocks too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a parent package is fine
                found.add(t)
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = trail[trail.index(n):] + [n] if n in trail else [m, n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, trail + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


MAX_LINES = 500


def test_every_module_is_small():
    """Modules of one job each: none under src/flexdemo over about 500 lines."""
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines())
             for p in sorted(PKG.rglob("*.py"))}
    assert len(sizes) > 50, sorted(sizes)  # the walk found the package
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, (f"modules over {MAX_LINES} lines (split them by job): "
                      + ", ".join(f"{name} ({n})" for name, n in sorted(over.items())))


def test_demo_is_a_package_of_small_modules():
    """DeMo is a package of modules of one job each, none over about 500 lines."""
    demo = PKG / "replicate" / "demo"
    assert not (PKG / "replicate" / "demo.py").exists()
    sizes = {p.name: len(p.read_text().splitlines()) for p in demo.glob("*.py")}
    assert {"layout.py", "staging.py", "graphs.py", "checks.py", "replicator.py"} <= set(sizes)
    assert max(sizes.values()) <= MAX_LINES, sizes


DOOR = PKG / "ft" / "torchft_api.py"


def _torchft_private_names() -> set[str]:
    """Every private attribute and method torchft defines (``self._x``, ``def _x``), read
    from the installed torchft's sources and stubs."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or spec.origin is None:
        pytest.skip("torchft is not installed")
    root = Path(spec.origin).parent
    names: set[str] = set()
    for path in [*root.rglob("*.py"), *root.rglob("*.pyi")]:
        if "test" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                name = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    assert {"_quorum", "_server", "_pg", "_healing"} <= names, "torchft's sources not read"
    return names


def _private_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str, str]]:
    """``x._name`` (``x`` not ``self``/``cls``) and ``getattr(x, "_name")`` for ``names``:
    (line, code, name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node), node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in names:
            found.append((node.lineno, ast.unparse(node), str(node.args[1].value)))
    return found


def test_torchft_stays_behind_one_door():
    """Only flexdemo/ft/torchft_api.py imports torchft or touches a torchft internal (a name
    torchft defines with a leading underscore), and every internal it touches is one that its
    version check looks for (torchft_api.INTERNALS)."""
    private = _torchft_private_names()
    outside = []
    for path in sorted(PKG.rglob("*.py")):
        if path == DOOR:
            continue
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(SRC))
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            outside += [(f"{where}:{node.lineno}", f"import {m}") for m in mods
                        if m == "torchft" or m.startswith("torchft.")]
        outside += [(f"{where}:{line}", text) for line, text, _ in _private_uses(tree, private)]
    assert not outside, ("torchft used outside flexdemo/ft/torchft_api.py: "
                         + "; ".join(f"{w} {t}" for w, t in outside))
    from flexdemo.ft.torchft_api import INTERNALS

    checked = {name for names in INTERNALS.values() for name in names}
    used = {name for _, _, name in _private_uses(ast.parse(DOOR.read_text()), private)}
    assert used and used <= checked, f"internals not in the version check: {used - checked}"
