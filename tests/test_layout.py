"""The package's layout: the library imports nothing from the application or the tools, no
module imports itself through a circle, every class is whole and at most 500 lines, every
package lists its public face, and private names stay inside their package (and rarely cross
a module). The rules themselves are in tests/layout_rules.py."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import layout_rules
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


# A class is the unit one reads whole: its job, its state and every method in one body of at
# most 500 lines (DeMoReplicator, the largest, hands its delayed exchange to delayed.InFlight
# to stay under). Modules may hold several classes; a package groups modules of one family.
MAX_CLASS_LINES = 500
# the packages whose public face the rest of flexdemo must use (their modules are theirs)
FACED = {"flexdemo.checkpoint", "flexdemo.transport"}
# private names used across a module boundary (tests/layout_rules.py counts them; 114 before
# issue 38's regroup): torchft's internals behind ft/torchft_api.py, torch's, and a few markers
MAX_PRIVATE_CROSSINGS = 20


def test_every_class_is_whole_and_small():
    """Every class is at most 500 lines, and none is patched from outside its body
    (``Class.method = function``): what a class does is read in one place."""
    assert "flexdemo.replicate.demo.replicator" in _modules()  # the walk found the package
    over = layout_rules.oversized_classes(SRC, "flexdemo", MAX_CLASS_LINES)
    assert not over, f"classes over {MAX_CLASS_LINES} lines (give a part its own class): {over}"
    patched = layout_rules.classes_patched_from_outside(SRC, "flexdemo")
    assert not patched, f"classes changed from outside their body: {patched}"


def test_every_package_lists_its_public_face():
    """Every package's ``__init__`` lists its public names in ``__all__`` (no private name,
    none it does not bind): what other packages may use is written down in one place."""
    bad = layout_rules.faceless_packages(SRC, "flexdemo")
    assert not bad, bad


def test_no_private_name_crosses_a_package():
    """No module imports a ``_private`` name (or from a ``_private`` module) of another
    package, and the faced packages (checkpoint, transport) are used through their
    ``__init__`` only: a package may change its insides without breaking another."""
    bad = layout_rules.private_imports_across_packages(SRC, "flexdemo")
    assert not bad, f"private names imported from another package: {bad}"
    past = layout_rules.imports_past_the_face(SRC, "flexdemo", FACED)
    assert not past, f"imports of a faced package's module instead of its __init__: {past}"


def test_private_names_rarely_cross_modules():
    """Private names used across a module boundary stay few (an import of ``_name`` from
    another module, ``obj._name`` on anything but self/cls/super()); see
    ``python tests/layout_rules.py`` for the list."""
    found = layout_rules.private_crossings(SRC, "flexdemo")
    assert found, "the count sees torchft's internals behind ft/torchft_api.py at least"
    assert len(found) <= MAX_PRIVATE_CROSSINGS, "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_rules_fail_on_a_made_up_violation(tmp_path):
    """Each rule reports a package built to break it (so none of them passes by seeing
    nothing)."""
    big = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    src = _write(tmp_path, {
        "pkg/__init__.py": '__all__ = ["missing", "_hidden"]\n',
        "pkg/a/__init__.py": "from .inner import thing\n",  # no __all__
        "pkg/a/inner.py": "thing = 1\n_secret = 2\n",
        "pkg/b/__init__.py": "__all__: list[str] = []\n",
        "pkg/b/user.py": ("from ..a.inner import _secret, thing\nfrom ..a import inner\n"
                          "from .big import Big\nBig.extra = len\nprint(inner._secret)\n"),
        "pkg/b/big.py": big,
    })
    assert layout_rules.oversized_classes(src, "pkg", MAX_CLASS_LINES) == [
        f"pkg.b.big:Big ({MAX_CLASS_LINES + 1} lines)"]
    assert layout_rules.classes_patched_from_outside(src, "pkg") == ["pkg.b.user:4 Big.extra"]
    assert sorted(layout_rules.faceless_packages(src, "pkg")) == [
        "pkg.a: no __all__", "pkg: __all__ lists _hidden, which it does not bind",
        "pkg: __all__ lists missing, which it does not bind", "pkg: __all__ lists private _hidden"]
    assert layout_rules.private_imports_across_packages(src, "pkg") == [
        "pkg.b.user:1 pkg.a.inner._secret"]
    assert layout_rules.imports_past_the_face(src, "pkg", {"pkg.a"}) == [
        "pkg.b.user:1 pkg.a.inner"]
    assert layout_rules.private_crossings(src, "pkg") == [
        "pkg.b.user:1 import pkg.a.inner._secret", "pkg.b.user:5 inner._secret"]


def test_the_transport_loads_torchft_s_group_on_first_use():
    """``import flexdemo`` loads neither torchft (optional) nor the transport over its
    Manager; ``flexdemo.transport.ManagerTransport`` loads the latter."""
    code = ("import sys, flexdemo\n"
            "assert 'torchft' not in sys.modules, 'torchft'\n"
            "assert 'flexdemo.transport.manager' not in sys.modules, 'manager'\n"
            "from flexdemo.transport import ManagerTransport\n"
            "assert ManagerTransport.__module__ == 'flexdemo.transport.manager'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_dcp_fsdp_and_dtensor_load_on_first_use():
    """``import flexdemo`` (and the CLI's) loads neither torch.distributed.checkpoint, FSDP
    nor DTensor (with sympy, about a second of CPU in every process); ``is_dtensor`` tells a
    plain tensor without loading DTensor, and a DTensor once it exists."""
    code = ("import sys, torch, flexdemo, flexdemo.app.cli\n"
            "from flexdemo.dtensor import is_dtensor\n"
            "heavy = ('torch.distributed.checkpoint', 'torch.distributed.fsdp',\n"
            "         'torch.distributed.tensor', 'sympy')\n"
            "assert not [m for m in heavy if m in sys.modules], heavy\n"
            "assert not is_dtensor(torch.zeros(1)) and 'torch.distributed.tensor' not in "
            "sys.modules\n"
            "from torch.distributed.tensor import DTensor, Replicate, init_device_mesh\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, "
            "world_size=1)\n"
            "d = DTensor.from_local(torch.zeros(2), init_device_mesh('cpu', (1,)), "
            "[Replicate()])\n"
            "assert is_dtensor(d) and not is_dtensor(torch.zeros(1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_demo_is_a_package_of_modules_of_one_job():
    """DeMo is a package of modules of one job each (the replicator, its layout, staging,
    graphs, checks, delayed mode, state), not one module."""
    demo = PKG / "replicate" / "demo"
    assert not (PKG / "replicate" / "demo.py").exists()
    names = {p.name for p in demo.glob("*.py")}
    assert {"layout.py", "staging.py", "graphs.py", "checks.py", "replicator.py",
            "delayed.py", "state.py"} <= names, names


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
